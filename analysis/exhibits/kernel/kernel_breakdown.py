"""Where an attention backend's time goes, kernel by kernel (``runners.kernel_bench profile_kernels=true``).

Reads the ``kernels`` list of every kernel.jsonl row that has one (one eager call under torch.profiler:
each kernel's device microseconds and launches per call; rows measured without the profile have
none; a graph_step row names its forced path as the backend). One row per (cell, backend, kernel) for the ``TOP`` longest kernels, the rest summed into
``(other kernels)``, plus a ``(busy)`` row: every kernel's time, next to the row's timed call
(``timed_us``: CUDA-graph replay where the bench captured one, else eager) so that what the timed
call adds over the kernels (launch gaps) shows. Repetitions of a configuration are not pooled: each
measured row stands alone with its sweep and code version. Writes tables/kernel_breakdown.{csv,md}.
No figure.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.kernels import row_kernels
from analysis.registry import register_exhibit



NAME = "kernel_breakdown"
FIGURES: tuple[str, ...] = ()
TOP = 6
KEYS = ["gpu", "kind", "shape", "Lp", "B", "backend", "sweep", "code"]
COLS = KEYS + ["kernel", "launches", "us_per_call", "share", "timed_us", "status"]


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without its return type, template arguments and parameters (C++), cut to ``width``."""
    s = re.sub(r"^void\s+", "", str(name).strip())
    s = s.split("<", 1)[0].split("(", 1)[0].strip() or str(name)
    return s if len(s) <= width else s[:width - 3] + "..."


def _lp(r: pd.Series):
    """The row's prefix length: the cell's Lp, else its classes' lengths joined (a graph_step case)."""
    lp = r.get("cell.prefix_len")
    if lp is not None and not (isinstance(lp, float) and lp != lp):     # NaN: the cell has no single Lp
        return lp
    lens = r.get("cell.prefix_lens")
    lens = json.loads(lens) if isinstance(lens, str) else lens
    return "/".join(str(x) for x in lens) if isinstance(lens, (list, tuple)) else lp


def frame(res: Results) -> pd.DataFrame:
    """The breakdown rows of every profiled kernel row (empty when none was profiled)."""
    k = res.kernels
    if k.empty or "k.kernels" not in k.columns:
        return pd.DataFrame(columns=COLS)
    rows = []
    for _, r in k[k["k.kernels"].notna()].iterrows():
        ks = row_kernels(r["k.kernels"], f"{r.get('path', '?')}/kernel.jsonl backend {r.get('k.backend')}")
        ks = sorted(ks, key=lambda x: -float(x["us_per_call"]))
        busy = sum(float(x["us_per_call"]) for x in ks)
        base = {"gpu": r.get("provenance.gpu_name") or "no GPU (CPU)", "kind": r.get("cell.kind"),
                "shape": r.get("cell.shape.name"), "Lp": _lp(r), "B": r.get("cell.batch"),
                "backend": r.get("k.backend") if isinstance(r.get("k.backend"), str) else r.get("k.path"),
                "sweep": r.get("sweep"),
                "code": str(r.get("provenance.git_commit") or "unknown")[:7], "status": "measured"}
        timed = float(r["k.time_ms"]) * 1e3 if pd.notna(r.get("k.time_ms")) else None
        for x in ks[:TOP]:
            us = float(x["us_per_call"])
            rows.append({**base, "kernel": short_name(x["name"]), "launches": float(x["launches_per_call"]),
                         "us_per_call": us, "share": us / busy if busy > 0 else None, "timed_us": None})
        rest = ks[TOP:]
        if rest:
            us = sum(float(x["us_per_call"]) for x in rest)
            rows.append({**base, "kernel": f"(other kernels: {len(rest)})",
                         "launches": sum(float(x["launches_per_call"]) for x in rest), "us_per_call": us,
                         "share": us / busy if busy > 0 else None, "timed_us": None})
        rows.append({**base, "kernel": "(busy)", "launches": sum(float(x["launches_per_call"]) for x in ks),
                     "us_per_call": busy, "share": 1.0, "timed_us": timed})
    return pd.DataFrame(rows, columns=COLS)


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/kernel_breakdown.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"kernel": "(none)", "status": f"{NOT_MEASURED}: no kernel-bench row carries a kernel "
                                                         "profile (runners.kernel_bench profile_kernels=true)"}],
                         columns=COLS)
    write_table(t, NAME, out, {"launches": 1, "us_per_call": 2, "share": 3, "timed_us": 2},
                title="Kernel breakdown: each backend's call, kernel by kernel (torch.profiler)",
                note=f"Per profiled kernel-bench row: its {TOP} longest kernels (device us per call, launches per "
                     "call, share of the row's kernel time), the rest as `(other kernels)`, and `(busy)`: all "
                     "kernels' time beside `timed_us`, the row's timed call (CUDA-graph replay where captured). "
                     "The profile runs eager calls with the L2 flush of the timing, the flush's own kernels left out.")
    return t
