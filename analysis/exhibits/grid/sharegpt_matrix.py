"""ShareGPT Lp x B matrix (paper B.2, Tables 9-11): output tok/s per (config, Lp, B, system) at
the saturating Poisson rate, ratio to sglang_default; B=256 should be the peak or near it.

Writes tables/sharegpt_matrix.{csv,md} and figures/sharegpt_ratio_heatmap.{png,pdf} and
figures/sharegpt_throughput_heatmap.{png,pdf} (GraniKV tok/s over Lp x B).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import (LPS, PAPER_CONFIG_LABELS, PAPER_HARDWARE, SHAREGPT_B, THROUGHPUT_DIGITS,
                             placeholder_figure, rename_short, select, system_table, write_table)
from analysis.load import Results
from analysis.paper import paper_claims
from analysis.plots import draw_heatmaps, gpu_names, heatmap_grid, heatmap_ok, one_per_point, ratio_heatmaps, title_of
from analysis.registry import register_exhibit



NAME = "sharegpt_matrix"
FIGURES = ("sharegpt_ratio_heatmap", "sharegpt_throughput_heatmap")
SELECT = {"workload.kind": "=sharegpt", "workload.num_prefixes": "=1"}


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    dims = ["config", "workload.prefix_len", "workload.batch"]
    t = system_table(res.cells, res.config_columns, SELECT, dims,
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS, "workload.batch": SHAREGPT_B})
    write_table(rename_short(t), NAME, out, THROUGHPUT_DIGITS, title="ShareGPT Lp x B matrix (Tables 9-11): output tok/s")
    if not figures:
        return t
    gpu = gpu_names(select(res.cells, SELECT) if not res.cells.empty else res.cells)
    ratio_heatmaps(t, "sharegpt_ratio_heatmap", out, "workload.prefix_len", "workload.batch", ["config"],
                   systems=("granikv", "sglang_cascade", "hydragen"), gpu=gpu,
                   cbar_label="output throughput / sglang_default",
                   title="ShareGPT Lp x B: output throughput over SGLang default (rows Lp, columns B)")
    g = t[(t["status"] == "measured") & (t["system"] == "granikv")] if not t.empty else t
    panels, dropped, drawn = [], [], []
    for c in (sorted(g["config"].unique()) if not g.empty else []):
        one, _ = one_per_point(g[g["config"] == c], ["workload.prefix_len", "workload.batch"])
        grid = heatmap_grid(one, "workload.prefix_len", "workload.batch", "mean")
        if not heatmap_ok(grid):
            dropped.append(f"{c} ({len(one)} cell{'s' if len(one) != 1 else ''})")
            continue
        panels.append((f"{c}: GraniKV", grid))
        drawn.append(one.assign(panel=c)[["panel", "workload.prefix_len", "workload.batch", "system", "mean", "n"]])
    if not panels:
        placeholder_figure("sharegpt_throughput_heatmap", out, "no configuration with enough measured GraniKV ShareGPT cells")
    else:
        peak = paper_claims([f"b256_peak_{m}" for m in ("llama8b", "qwen14b", "qwen32b")])
        bound = f"{peak['value'].iloc[0]:g}" if not peak.empty else "?"
        draw_heatmaps(panels, "sharegpt_throughput_heatmap", out, center=None, cmap="viridis", fmt=".0f",
                      title=title_of("ShareGPT Lp x B: GraniKV output tok/s", gpu, [c.split(":")[0] for c, _ in panels]),
                      cbar_label="GraniKV output tok/s", outline_col=256,
                      outline_label=f"outlined: B=256, where the paper ({PAPER_HARDWARE}) finds the peak "
                                    f"(>= {bound} of the best B at every Lp)",
                      footnote=("no heatmap (a single row or column, or few cells; in the table): " + ", ".join(dropped))
                      if dropped else "",
                      data=pd.concat(drawn, ignore_index=True))
    return t
