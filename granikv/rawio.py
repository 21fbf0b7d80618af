"""Raw-result folders: atomic writes, provenance, and the schema every cell follows.

A cell is ``results/raw/<sweep>/<cell_id>/`` holding ``config.json`` (resolved config +
``provenance``) and either ``metrics.json`` (done) or ``failure.json`` (failed). Serving cells
add ``requests.jsonl`` and ``steps.jsonl``; kernel cells add ``kernel.jsonl``. Writes go to a
temp file in the same folder and are renamed into place, so a killed sweep never leaves a
half file that analysis would read as a result.

A ``.jsonl`` file may be stored gzip-compressed as ``<name>.jsonl.gz`` (serving sweeps write
``requests.jsonl.gz`` / ``steps.jsonl.gz``: a ShareGPT cell's per-token times and output ids are
~6 MB as text, ~0.6 MB compressed, and the whole results tree travels to the GPU host, 64 MiB per
call). ``data_path``/``exists``/``read_jsonl`` take the logical name and find either form.
``python -m granikv.rawio compress CELL...`` gzips a cell's ``.jsonl`` files losslessly (the
decompressed bytes are checked equal to the original before it is removed).
"""
from __future__ import annotations

import gzip
import json
import os
import platform
import socket
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from granikv.attention.dispatch import rule_applies

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


def write_jsonl(path: str | Path, rows: Iterable[dict], compress: bool = False) -> Path:
    """Write one JSON object per line, atomically; ``compress`` (or a ``.gz`` name) -> ``<path>.gz``
    (gzip, mtime 0: the same rows give the same bytes). Returns the path written; the other form
    of the same logical file is removed, so a cell never holds two versions."""
    path = Path(path)
    text = "".join(json.dumps(r, sort_keys=True, default=_default) + "\n" for r in rows)
    plain = path.with_name(path.name[:-3]) if path.suffix == ".gz" else path
    gz = plain.with_name(plain.name + ".gz")
    if compress or path.suffix == ".gz":
        _atomic_write(gz, gzip.compress(text.encode(), mtime=0))
        out, other = gz, plain
    else:
        _atomic_write(plain, text)
        out, other = plain, gz
    if other.exists():
        other.unlink()
    return out


def data_path(path: str | Path) -> Path:
    """The stored form of a logical file: ``path`` if present, else ``path.gz`` if present, else ``path``."""
    path = Path(path)
    if not path.exists():
        gz = path.with_name(path.name + ".gz")
        if gz.exists():
            return gz
    return path


def exists(path: str | Path) -> bool:
    """Whether a logical file is stored, plain or as ``<name>.gz``."""
    return data_path(path).exists()


def _atomic_write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
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
    """Rows of a ``.jsonl`` file; the logical name also finds ``<name>.gz`` (see ``data_path``)."""
    path = data_path(path)
    rows = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SchemaError(f"{path}:{i}: not valid JSON ({e})") from e
    return rows


def flatten(obj: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one level with dotted keys; lists become JSON text (hashable, sortable)."""
    out: dict[str, Any] = {}
    for k in sorted(obj):
        v = obj[k]
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v, sort_keys=True)
        else:
            out[key] = v
    return out


PLUGIN_TABLE_SYSTEMS = ("sglang_server_granikv",)   # the systems whose dispatcher reads hardware.plugin_graph_table


def applicable_table(config: dict) -> dict:
    """``config`` with ``hardware.decision_table`` (and ``plugin_graph_table``) cut to the rules the cell's
    dispatcher could use (its GPU and per-rank attention shape, granikv.attention.dispatch.rule_applies): the
    preset's table gains rules for other shapes as they are calibrated, which never change a run, and must not
    tell two otherwise equal configurations apart. ``plugin_graph_table`` is left out of the config of every
    system but the SGLang plugin's GraniKV (PLUGIN_TABLE_SYSTEMS): no other reads it."""
    hw = config.get("hardware")
    system = config.get("system") if isinstance(config.get("system"), dict) else {}
    if isinstance(hw, dict) and "plugin_graph_table" in hw and system.get("name") not in PLUGIN_TABLE_SYSTEMS:
        config = {**config, "hardware": {k: v for k, v in hw.items() if k != "plugin_graph_table"}}
    hw, model, tp = config.get("hardware"), config.get("model"), config.get("tp")
    if not (isinstance(hw, dict) and isinstance(model, dict) and isinstance(hw.get("decision_table"), list)
            and isinstance(tp, int) and tp > 0
            and all(isinstance(model.get(k), int) for k in ("num_heads", "num_kv_heads", "head_dim"))):
        return config
    gpu = hw.get("gpu_name") or (config.get("provenance") or {}).get("gpu_name") or ""
    shape = (model["num_heads"] // tp, model["num_kv_heads"] // tp, model["head_dim"])
    rules = [r for r in hw["decision_table"] if isinstance(r, dict) and rule_applies(r, gpu, shape)]
    out = {**hw, "decision_table": rules}
    if isinstance(hw.get("plugin_graph_table"), list):
        out["plugin_graph_table"] = [r for r in hw["plugin_graph_table"]
                                     if isinstance(r, dict) and rule_applies(r, gpu, shape)]
    return {**config, "hardware": out}


REPO = Path(__file__).resolve().parents[1]
# the files that run in a measurement: a commit named for a cell must hold these as the tree has them
CODE_PATHS = ("granikv", "runners", "conf", "tests", "pyproject.toml")


class ProvenanceError(RuntimeError):
    """A cell's provenance would name a commit whose code is not the code that runs."""


def _git_run(*args: str) -> tuple[int, str]:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        return r.returncode, r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return -1, ""


def _git(*args: str) -> str:
    rc, out = _git_run(*args)
    return out if rc == 0 else ""


def code_check(commit: str) -> tuple[str, list[str]]:
    """Whether the tree's code (CODE_PATHS) is ``commit``'s: ``("same", [])``, ``("differs", files)`` (the
    tracked files that differ, at most 20), or ``("unverifiable", [])`` where git or the commit's object is
    not here (the GPU host's copy of .git can predate the commit)."""
    if not commit or commit == "unknown" or _git_run("cat-file", "-e", f"{commit}^{{commit}}")[0] != 0:
        return "unverifiable", []
    rc, out = _git_run("-c", "core.fileMode=false", "diff", "--name-only", commit, "--", *CODE_PATHS)
    if rc != 0:
        return "unverifiable", []
    files = out.splitlines()
    return ("differs", files[:20]) if files else ("same", [])


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _concurrent_sweeps() -> int:
    raw = os.environ.get("GRANIKV_CONCURRENT_SWEEPS", "1") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"GRANIKV_CONCURRENT_SWEEPS={raw!r}: must be a whole number >= 1 "
                         "(how many sweeps share this host; runners/gpu/sweep.sh sets it)")
    return int(raw)


def _nvml_gpus() -> tuple[str | None, int, str | None]:
    """(name of GPU 0, count, driver) from NVML, without a CUDA context; (None, 0, None) without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else None
        drv = pynvml.nvmlSystemGetDriverVersion()
        dec = (lambda x: x.decode() if isinstance(x, bytes) else x)
        return dec(name), int(n), dec(drv)
    except Exception:  # noqa: BLE001 - no NVML (CPU machines)
        return None, 0, None


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(dist)
    except PackageNotFoundError:
        return None


def provenance(cuda_probe: bool = True) -> dict:
    """Where and with what a result was produced: git commit, host, GPU, driver, versions, time.

    ``cuda_probe=False`` reads the GPUs through NVML instead of torch.cuda, so the calling process
    creates no CUDA context (a server cell's client: the server owns the GPU memory). ``sglang`` is
    the version importable here (a server cell's config.json adds the server's own)."""
    import torch

    import granikv

    try:
        import flashinfer  # type: ignore

        fi_version = getattr(flashinfer, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent on CPU machines
        fi_version = None
    gpu_name, gpu_count, driver = None, 0, None
    if not cuda_probe:
        gpu_name, gpu_count, driver = _nvml_gpus()
    elif torch.cuda.is_available():
        gpu_count = torch.cuda.device_count()
        gpu_name = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:  # noqa: BLE001
            driver = None
    # The launcher's word wins: on the GPU host the repository travels as a copy whose .git (when
    # there is one) can be a stale snapshot (it has named an older commit, "dirty", for a clean
    # tree). runners/gpu/*.sh pass GRANIKV_GIT_COMMIT / GRANIKV_GIT_DIRTY from the launching checkout.
    env_commit = os.environ.get("GRANIKV_GIT_COMMIT", "")
    head = _git("rev-parse", "HEAD")
    check, differs = "unverifiable", []
    if env_commit and env_commit != "unknown":
        commit, source = env_commit, "GRANIKV_GIT_COMMIT"
        dirty = os.environ.get("GRANIKV_GIT_DIRTY", "unknown")
        dirty = {"true": True, "false": False}.get(str(dirty).lower(), dirty)
        # the launcher's commit is checked against the code that runs wherever this copy's git holds it: a
        # commit said clean whose code differs (e.g. the branch's head exported while the tree is pinned to
        # an older commit) is refused, never recorded
        check, differs = code_check(commit)
        if check == "differs" and dirty is False:
            raise ProvenanceError(
                f"GRANIKV_GIT_COMMIT={commit[:12]} (GRANIKV_GIT_DIRTY=false) names a commit whose code differs from "
                f"the tree that runs ({', '.join(differs[:5])}{', ...' if len(differs) > 5 else ''}): export both "
                "with the line `bash runners/gpu/provenance_env.sh` prints in the launching checkout (after "
                "`runners/gpu/pin_commit.sh on` when pinned), never from git on the GPU host")
    else:
        commit, source = head, "git" if head else "none"
        # untracked files count (a new, uncommitted module may have been imported); results/ does not
        # (a sweep writes new cells there while it runs)
        dirty = bool(_git("status", "--porcelain", "--", ".", ":(exclude)results")) if head else "unknown"
    return {
        "schema_version": SCHEMA_VERSION,
        "git_commit": commit or "unknown",
        "git_dirty": dirty,
        "git_commit_source": source,
        "git_dirty_files": os.environ.get("GRANIKV_GIT_DIRTY_FILES", "").split(",") if source == "GRANIKV_GIT_COMMIT"
        and os.environ.get("GRANIKV_GIT_DIRTY_FILES") else None,
        "git_head_seen": head or None,
        # GRANIKV_GIT_COMMIT's commit against this tree's code (code_check): same / differs / unverifiable
        "git_code_check": check if source == "GRANIKV_GIT_COMMIT" else None,
        "git_code_differs": differs or None,
        "hostname": socket.gethostname(),
        "gpu_name": gpu_name,
        "gpu_count": gpu_count,
        # which of the host's GPUs this process saw, and how many sweeps shared the host at once
        # (runners/gpu/sweep.sh GRANIKV_GPU_SPLIT: one TP=1 sweep per GPU; 1 = this one alone)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        # the host CPU: eager prefill and the step loop are bound by it (the 1- and 2-GPU kinds differ)
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
        "concurrent_sweeps": _concurrent_sweeps(),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "flashinfer": fi_version,
        "apache_tvm_ffi": _version("apache-tvm-ffi"),   # FlashInfer's runtime (a carried wheel on the GPU host)
        "sglang": _version("sglang"),
        "granikv": granikv.__version__,
        "python": platform.python_version(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def gpu_count_nvml() -> int:
    """How many GPUs NVML sees (0 without NVML), without a CUDA context."""
    return _nvml_gpus()[1]


def remove_temp_files(cell_dir: str | Path) -> list[Path]:
    """Remove the temp files of atomic writes (``.<name>.<random>.tmp``) from a cell folder: what a write
    killed before its rename leaves. Call only while nothing writes the cell. Returns the files removed."""
    d = Path(cell_dir)
    gone = sorted(d.glob(".*.tmp")) if d.is_dir() else []
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def cell_state(cell_dir: str | Path) -> str:
    """``done`` (metrics.json), ``failed`` (failure.json), ``partial`` or ``absent``."""
    d = Path(cell_dir)
    if (d / "metrics.json").exists():
        return "done"
    if (d / "failure.json").exists():
        return "failed"
    return "partial" if d.exists() else "absent"


def refuse_other_gpu(root: str | Path, cell_ids: Iterable[str], gpu: str | None, where: str) -> None:
    """Refuse to resume a sweep folder whose finished cells (among ``cell_ids``) ran on another GPU model than
    ``gpu`` (``provenance.gpu_name``; None for a CPU run): their cell ids name no GPU, so resuming would skip
    them as this GPU's cells, and a rerun would put two GPU models in one folder. ``where``: the tool's name,
    for the error."""
    mine = gpu or None
    for cid in cell_ids:
        d = Path(root) / cid
        if cell_state(d) != "done" or not (d / "config.json").exists():
            continue
        theirs = (read_json(d / "config.json").get("provenance") or {}).get("gpu_name") or None
        if theirs != mine:
            raise ValueError(f"config error at `{where}.sweep_name`: {d} was measured on {theirs or 'a CPU'} and this "
                             f"run is on {mine or 'a CPU'}; give this GPU model a folder of its own, e.g. "
                             f"sweep_name={Path(root).name}_<gpu> (two GPU models' cells are never resumed as one)")


def compress_cell(cell: str | Path) -> list[Path]:
    """Gzip every plain ``*.jsonl`` of a cell folder, losslessly: the ``.gz`` is written atomically,
    decompressed and compared byte for byte with the original, and only then is the original
    removed. Returns the files compressed."""
    done = []
    for p in sorted(Path(cell).glob("*.jsonl")):
        raw = p.read_bytes()
        gz = p.with_name(p.name + ".gz")
        _atomic_write(gz, gzip.compress(raw, mtime=0))
        if gzip.decompress(gz.read_bytes()) != raw:
            gz.unlink()
            raise RuntimeError(f"{gz}: compressed copy does not decompress to {p}; original kept")
        p.unlink()
        done.append(gz)
    return done


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3 or sys.argv[1] != "compress":
        sys.exit("usage: python -m granikv.rawio compress CELL_DIR [CELL_DIR ...]")
    for c in sys.argv[2:]:
        for g in compress_cell(c):
            print(f"compressed {g}")
