"""Amdahl prediction vs measured end-to-end speed-up (paper Sec. 4, kernel mechanism).

For each model/TP config with a profiled SGLang-default cell (B=256, Lp=8K): f = its
prefix-attention share of GPU kernel time (profiler.trace_frame), s = the kernel-isolated
storage-layout speed-up (the paper's 15.6, and ours from kernel.layout_speedup), predicted =
1 / ((1 - f) + f / s), measured = GraniKV / SGLang default output throughput in the same
configuration, from plain (uninstrumented) cells. Where no plain pair exists, from the profiled
cells' summed step time (decode + prefill steps; the same tokens in both): a profiled run's wall
time also holds the profiler's start (CUPTI initialisation, up to 6.4 s on the H200, 2026-11-30)
and trace export (0.5-0.9 s), which fall between steps and differ by cell, so its throughput is
not an end-to-end measurement. ``measured_profiled_steps`` gives that step-time ratio for every
config, next to the plain-cell one where both exist (a cross-check of the substitute). The paper:
the prediction overshoots the measurement in all three configs.

One row per config and GPU model (column ``gpu``), each from that GPU model's cells and kernel rows alone;
the figure draws a panel per GPU model.

Writes tables/amdahl.{csv,md} and figures/amdahl.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (NOT_MEASURED, PAPER_CONFIG_LABELS, placeholder_figure, plt, save_figure, select, sort_rows,
                             with_derived, write_table)
from analysis.gpu import GPU, ordered
from analysis.load import Results
from analysis.measures.amdahl import CELL, amdahl_frame
from analysis.plots import gpu_names, legend_below, title_of
from analysis.registry import register_exhibit



NAME = "amdahl"
FIGURES = (NAME,)


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = amdahl_frame(res)
    have = set(t["config"]) if not t.empty else set()
    missing = pd.DataFrame([{"config": c, "status": f"{NOT_MEASURED}: no profiled sglang_default cell at B=256, Lp=8K"}
                            for c in PAPER_CONFIG_LABELS if c not in have])
    t = sort_rows(pd.concat([t, missing], ignore_index=True) if not missing.empty else t, ["config", GPU])
    write_table(t, NAME, out, {"f_attention_share": 3, "s_paper": 1, "s_ours": 2, "predicted_paper_s": 2,
                               "predicted_our_s": 2, "measured": 2, "measured_profiled_steps": 2},
                title="Amdahl prediction vs measured end-to-end speed-up (B=256, Lp=8K)")
    if not figures:
        return t
    m = t[t["status"] == "measured"] if "status" in t.columns else t.iloc[0:0]
    if m.empty:
        placeholder_figure(NAME, out, "needs a profiled sglang_default cell and a granikv/sglang_default pair")
        return t
    gpus = ordered(m[GPU])
    fig, axes = plt.subplots(len(gpus), 1, figsize=(6.4, 0.4 + 3.4 * len(gpus)), sharey=True, squeeze=False)
    bars = [("predicted_paper_s", "Amdahl, s=15.6 (the paper's kernel speed-up)", -0.27),
            ("predicted_our_s", "Amdahl, our kernel speed-up s", 0.0), ("measured", "measured end to end", 0.27)]
    for ax, gpu in zip(axes[:, 0], gpus):       # a panel per GPU model, each from its own cells
        g = m[m[GPU] == gpu]
        x = np.arange(len(g))
        for col, lab, dx in bars:
            v = pd.to_numeric(g[col], errors="coerce")
            ax.bar(x + dx, v.fillna(0), 0.27, label=lab)
            for xi, vi in zip(x + dx, v):
                if np.isfinite(vi):
                    ax.text(xi, vi, f"{vi:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(x, [f"{c}\n({src})" for c, src in zip(g["config"], g["measured_from"])], fontsize=7)
        ax.set_ylabel("GraniKV speed-up over sglang_default")
        ax.set_title(gpu, fontsize=9)
    cells = with_derived(res.cells)
    cells = select(cells, CELL) if not cells.empty else cells
    fig.suptitle(title_of("Amdahl vs measured (B=256, Lp=8K; f = profiled prefix-attention share)", gpu_names(cells),
                          list(dict.fromkeys(m["config"]))), fontsize=9)
    fig.tight_layout()
    legend_below(fig, list(axes[:, 0]), ncol=3)
    save_figure(fig, NAME, out, data=m[["config", GPU, "f_attention_share", "s_paper", "s_ours", "predicted_paper_s",
                                        "predicted_our_s", "measured", "measured_from"]])
    return t
