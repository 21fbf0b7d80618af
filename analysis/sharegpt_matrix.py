"""ShareGPT Lp x B matrix (paper B.2, Tables 9-11): output tok/s per (config, Lp, B, system) at
the saturating Poisson rate, ratio to sglang_default; B=256 should be the peak or near it.

Writes tables/sharegpt_matrix.{csv,md} and figures/sharegpt_ratio_heatmap.{png,pdf} and
figures/sharegpt_throughput_heatmap.{png,pdf} (GraniKV tok/s over Lp x B).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns

from analysis.common import LPS, PAPER_CONFIG_LABELS, SHAREGPT_B, plt, rename_short, save_figure, system_table, write_table
from analysis.headline import DIGITS
from analysis.load import Results
from analysis.plots import _int_labels, ratio_heatmaps

NAME = "sharegpt_matrix"
FIGURES = ("sharegpt_ratio_heatmap", "sharegpt_throughput_heatmap")
SELECT = {"workload.kind": "=sharegpt", "workload.num_prefixes": "=1"}


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    dims = ["config", "workload.prefix_len", "workload.batch"]
    t = system_table(res.cells, res.config_columns, SELECT, dims,
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS, "workload.batch": SHAREGPT_B})
    write_table(rename_short(t), NAME, out, DIGITS, title="ShareGPT Lp x B matrix (Tables 9-11): output tok/s")
    if not figures:
        return t
    ratio_heatmaps(t, "sharegpt_ratio_heatmap", out, "workload.prefix_len", "workload.batch", ["config"],
                   systems=("granikv", "sglang_cascade", "hydragen"),
                   title="ShareGPT: output throughput / sglang_default (rows Lp, columns B)")
    g = t[(t["status"] == "measured") & (t["system"] == "granikv")] if not t.empty else t
    if g.empty:
        from analysis.common import placeholder_figure
        placeholder_figure("sharegpt_throughput_heatmap", out, "no measured GraniKV ShareGPT cells")
    else:
        cfgs = sorted(g["config"].unique())
        fig, axes = plt.subplots(1, len(cfgs), figsize=(4.2 * len(cfgs), 3.4), squeeze=False)
        for ax, c in zip(axes.flat, cfgs):
            grid = g[g["config"] == c].pivot_table(index="workload.prefix_len", columns="workload.batch",
                                                   values="mean", aggfunc="mean").sort_index(ascending=False)
            sns.heatmap(_int_labels(grid), annot=True, fmt=".0f", cmap="viridis", cbar=False, ax=ax)
            ax.set_ylabel("Lp")
            ax.set_xlabel("B")
            ax.set_title(f"{c}: GraniKV tok/s", fontsize=8)
        fig.tight_layout()
        save_figure(fig, "sharegpt_throughput_heatmap", out)
    return t
