"""Synthetic shared-prefix grid (paper B.1, Tables 6-8, plus Lp=16K which the paper could not
measure): one shared prefix, burst of B requests; per (config, Lp, B, system): output tok/s
(rep mean, sd, min, max), ratio to sglang_default, TPOT p50, TTFT p50.

Writes tables/grid.{csv,md}, figures/grid_ratio_heatmap.{png,pdf} (ratio to sglang_default over
Lp x B for every non-baseline system) and figures/grid_throughput.{png,pdf} (tok/s vs Lp at B=256).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import (GRID_B, GRID_CELLS, LPS, PAPER_CONFIG_LABELS, THROUGHPUT_DIGITS, rename_short, select,
                             system_table, write_table)
from analysis.load import Results
from analysis.plots import gpu_names, lines_vs, ratio_heatmaps
from analysis.registry import register_exhibit



NAME = "grid"
FIGURES = ("grid_ratio_heatmap", "grid_throughput")


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    dims = ["config", "workload.prefix_len", "workload.batch"]
    t = system_table(res.cells, res.config_columns, GRID_CELLS, dims,
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS, "workload.batch": GRID_B})
    write_table(rename_short(t), NAME, out, THROUGHPUT_DIGITS, title="Synthetic grid (Tables 6-8 + Lp=16K): output tok/s",
                note="mean/sd/min/max over repetitions (n); ratios of rep means; TPOT/TTFT p50 in ms (rep means).")
    if not figures:
        return t
    gpu = gpu_names(select(res.cells, GRID_CELLS) if not res.cells.empty else res.cells)
    ratio_heatmaps(t, "grid_ratio_heatmap", out, "workload.prefix_len", "workload.batch", ["config"],
                   systems=("granikv", "sglang_cascade", "hydragen"), gpu=gpu,
                   cbar_label="output throughput / sglang_default",
                   title="Synthetic grid: output throughput over SGLang default (rows Lp, columns B)")
    lines_vs(t[t["workload.batch"] == 256] if not t.empty else t, "grid_throughput", out, "workload.prefix_len",
             ["config"], gpu=gpu, title="Synthetic grid, B=256: output tok/s vs Lp")
    return t
