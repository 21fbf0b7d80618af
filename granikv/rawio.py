"""Raw-result folders: atomic writes, provenance, and the schema every cell follows.

A cell is ``results/raw/<sweep>/<cell_id>/`` holding ``config.json`` (resolved config +
``provenance``) and either ``metrics.json`` (done) or ``failure.json`` (failed). Serving cells
add ``requests.jsonl`` and ``steps.jsonl``; kernel cells add ``kernel.jsonl``. Writes go to a
temp file in the same folder and are renamed into place, so a killed sweep never leaves a
half file that analysis would read as a result.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1
CELL_KINDS = ("serving", "kernel", "calibration")
REQUIRED_FILES = {
    "serving": ("config.json", "metrics.json", "requests.jsonl", "steps.jsonl"),
    "kernel": ("config.json", "metrics.json", "kernel.jsonl"),
    "calibration": ("config.json", "metrics.json", "kernel.jsonl"),
}
PROVENANCE_KEYS = ("git_commit", "git_dirty", "hostname", "gpu_name", "gpu_count", "driver",
                   "torch", "flashinfer", "granikv", "python", "started_at")
# metrics.json of a serving cell must carry these (units in the names)
SERVING_METRICS = (
    "num_requests", "num_input_tokens", "num_output_tokens", "duration_s",
    "output_throughput_tok_s", "total_throughput_tok_s", "request_throughput_req_s",
    *(f"{m}_{s}_ms" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")),
    "dispatch_counts",
)


class SchemaError(ValueError):
    """A raw-result file that does not match the schema; the message names file and field."""


def _default(o: Any):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temp file in the same folder, then rename)."""
    _atomic_write(Path(path), json.dumps(obj, indent=2, sort_keys=True, default=_default) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Write one JSON object per line, atomically."""
    _atomic_write(Path(path), "".join(json.dumps(r, sort_keys=True, default=_default) + "\n" for r in rows))


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: str | Path) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise SchemaError(f"{path}: not valid JSON ({e})") from e


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SchemaError(f"{path}:{i}: not valid JSON ({e})") from e
    return rows


def _git(*args: str) -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def provenance() -> dict:
    """Where and with what a result was produced: git commit, host, GPU, driver, versions, time."""
    import torch

    import granikv

    try:
        import flashinfer  # type: ignore

        fi_version = getattr(flashinfer, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent on CPU machines
        fi_version = None
    gpu_name, gpu_count, driver = None, 0, None
    if torch.cuda.is_available():
        gpu_count = torch.cuda.device_count()
        gpu_name = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:  # noqa: BLE001
            driver = None
    # On a host where .git does not travel (the GPU host), the launcher passes the commit in.
    head = _git("rev-parse", "HEAD")
    commit = head or os.environ.get("GRANIKV_GIT_COMMIT", "")
    # untracked files count (a new, uncommitted module may have been imported); results/ does not
    # (a sweep writes new cells there while it runs)
    dirty = bool(_git("status", "--porcelain", "--", ".", ":(exclude)results")) if head \
        else os.environ.get("GRANIKV_GIT_DIRTY", "unknown")
    return {
        "schema_version": SCHEMA_VERSION,
        "git_commit": commit or "unknown",
        "git_dirty": dirty,
        "hostname": socket.gethostname(),
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "flashinfer": fi_version,
        "granikv": granikv.__version__,
        "python": platform.python_version(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def cell_state(cell_dir: str | Path) -> str:
    """``done`` (metrics.json), ``failed`` (failure.json), ``partial`` or ``absent``."""
    d = Path(cell_dir)
    if (d / "metrics.json").exists():
        return "done"
    if (d / "failure.json").exists():
        return "failed"
    return "partial" if d.exists() else "absent"
