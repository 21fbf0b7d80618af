"""The GEMM floor of one decode step (``python -m runners.kernel_bench_gemm_floor``), per model, TP shard
and batch size M: every weight GEMM of the step timed as one CUDA graph (``step``), and each GEMM kind
over all layers as a graph of its own (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``).

One row per (GPU, model, tp, M, part): ``time_ms`` (mean over the cells measuring it, ``n``),
``tflops`` / ``tbps`` (the runner's FLOP and byte counts over that time), their shares of the peaks the
bench measured on that GPU (``tflops_frac_peak``, ``tbps_frac_peak``), and for the step row
``parts_sum_ms`` (the parts' times summed, beside the step's own). CPU cells (``hardware=cpu``) exercise the code only, and a
row timed without its CUDA graph is no floor: both are left out. analysis.distance_to_limit reads the step rows as ``gemm_floor_ms``.

Writes tables/gemm_floor.{csv,md}.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.gemm import COLUMNS, floor_frame
from analysis.registry import register_exhibit



NAME = "gemm_floor"
FIGURES: tuple[str, ...] = ()
CMD = "python -m runners.kernel_bench_gemm_floor hardware=h200"


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/gemm_floor.{csv,md}; return the table."""
    t = floor_frame(res)
    text = t if not t.empty else pd.DataFrame([{"status": f"{NOT_MEASURED}: no GPU gemm_floor cell ({CMD})"}],
                                               columns=COLUMNS)
    shown = text.copy()
    for c in ("parts_sum_ms", "tflops", "tbps", "tflops_frac_peak", "tbps_frac_peak"):
        shown[c] = shown[c].astype(object).where(shown[c].notna(), "-")
    write_table(shown, NAME, out, {"time_ms": 3, "tflops": 1, "tbps": 3, "tflops_frac_peak": 3, "tbps_frac_peak": 3,
                                   "parts_sum_ms": 3, "tp": 0, "m": 0, "n": 0},
                title="GEMM floor: the weight GEMMs of one decode step, one CUDA graph",
                note="step: every weight GEMM of one decode step of one TP shard at M tokens (QKV, O, gate+up, down x "
                     "layers, LM head), one CUDA graph, L2 flushed before each replay; the other parts: each GEMM kind "
                     "over all layers, a graph of its own; parts_sum_ms: the parts summed (step rows). *_frac_peak: "
                     f"over the peaks the bench measured on the GPU. Rerun: {CMD}.")
    return t
