"""Host operations of one eager prefill forward, per rank (``runners/prefill_bench.py
--profile-tokens``): which torch ops take the host's time, so a host-bound prefill step (see
tables/prefill_host) can be explained op by op, and TP=2 compared with TP=1.

Reads ``host_profile`` of every ``prefill_host.json`` (files written before the profile existed
have none). One row per (file, rank, op) for the ops the bench kept (top by self CPU time), plus a
``(total)`` row per rank: all ops' self CPU time and the forward's wall time under the profiler.
Writes tables/prefill_host_ops.{csv,md}. No figure.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.prefill import FILE, need_field
from analysis.registry import register_exhibit
from granikv.rawio import read_json

NAME = "prefill_host_ops"
FIGURES: tuple[str, ...] = ()
COLS = ["model", "tp", "allreduce", "gpu", "commit", "rank", "tokens", "op", "calls", "self_cpu_ms", "share",
        "wall_ms", "status"]


def load(root: str | Path, ignored=()) -> pd.DataFrame:
    """One row per (file, rank, op), checked; files without ``host_profile`` add nothing, and so do files under
    the ``ignored`` folders (Results.ignored)."""
    rows, root = [], Path(root)
    for path in sorted(root.rglob(FILE)) if root.exists() else []:
        parts = path.relative_to(root).parts
        if any(p.startswith(".") for p in parts) or str(root / parts[0]) in ignored:
            continue
        d = read_json(path)
        profiles = d.get("host_profile") or []
        need_field(isinstance(profiles, list), path, "host_profile", "must be a list (one entry per rank)")
        cfg, prov = d.get("config", {}), d.get("provenance", {})
        base = {"model": cfg.get("model", {}).get("name", "?"), "tp": int(cfg.get("tp", 1)),
                "allreduce": cfg.get("hardware", {}).get("allreduce", "nccl"),
                "gpu": prov.get("gpu_name") or "no GPU (CPU)", "commit": str(prov.get("git_commit", "unknown"))[:7]}
        for i, p in enumerate(profiles):
            need_field(isinstance(p, dict) and "rank" in p, path, f"host_profile[{i}].rank", "is missing")
            if "error" in p:
                rows.append({**base, "rank": p["rank"], "op": "(profile failed)", "status": str(p["error"])[:120]})
                continue
            for k in ("tokens", "wall_ms", "self_cpu_ms_total", "top"):
                need_field(k in p, path, f"host_profile[{i}].{k}", "is missing")
            total = float(p["self_cpu_ms_total"])
            rows.append({**base, "rank": p["rank"], "tokens": p["tokens"], "op": "(total)", "calls": None,
                         "self_cpu_ms": total, "share": 1.0, "wall_ms": float(p["wall_ms"]), "status": "measured"})
            for j, op in enumerate(p["top"]):
                for k in ("name", "calls", "self_cpu_ms"):
                    need_field(k in op, path, f"host_profile[{i}].top[{j}].{k}", "is missing")
                rows.append({**base, "rank": p["rank"], "tokens": p["tokens"], "op": op["name"], "calls": op["calls"],
                             "self_cpu_ms": float(op["self_cpu_ms"]),
                             "share": float(op["self_cpu_ms"]) / total if total > 0 else None,
                             "wall_ms": None, "status": "measured"})
    return pd.DataFrame(rows, columns=COLS)


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/prefill_host_ops.{csv,md}; return the table."""
    t = load(res.root, res.ignored)
    if t.empty:
        t = pd.DataFrame([{"op": "(none)", "status": f"{NOT_MEASURED}: run runners/gpu/prefill.sh (files written "
                                                     "before --profile-tokens existed have no host profile)"}],
                         columns=COLS)
    write_table(t, NAME, out, {"self_cpu_ms": 3, "share": 3, "wall_ms": 2},
                title="Host ops of one prefill forward, per rank (torch.profiler, CPU)",
                note="Top ops by self CPU time in one eager prefill forward of `tokens` new tokens (after one "
                     "untimed run); `(total)`: all ops' self CPU time and the forward's wall time under the "
                     "profiler, which adds its own overhead. Compare TP=2 ranks with TP=1 op by op.")
    return t
