"""Small-Lp / large-B limitation cells (paper Limitations, B.2): Lp=512 at B in {256, 512, 1024},
ShareGPT and synthetic workloads; GraniKV's ratio to sglang_default (paper: 0.70x for Qwen-14B
TP=2 at B=512, 0.97x for Llama-8B TP=1 at B=256).

Writes tables/limitation.{csv,md} and figures/limitation.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import (PAPER_CONFIG_LABELS, THROUGHPUT_DIGITS, placeholder_figure, plt, rename_short, save_figure,
                             select, show, system_table, write_table)
from analysis.load import Results
from analysis.paper import paper_claims
from analysis.plots import gpu_names, legend_below, mark_paper, title_of
from analysis.registry import register_exhibit



NAME = "limitation"
FIGURES = (NAME,)
SELECT = {"workload.prefix_len": "=512", "workload.batch": ">=256", "workload.num_prefixes": "=1"}


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = system_table(res.cells, res.config_columns, SELECT, ["workload.kind", "config", "workload.batch"],
                     expected={"workload.kind": ("sharegpt",), "config": PAPER_CONFIG_LABELS,
                               "workload.batch": (256, 512, 1024)})
    write_table(rename_short(t), NAME, out, THROUGHPUT_DIGITS, title="Limitation cells: Lp=512, B >= 256")
    if not figures:
        return t
    g = t[(t["status"] == "measured") & (t["system"] == "granikv")] if not t.empty else t
    g = g[g["ratio_vs_sglang_default"].notna()] if not g.empty else g
    if g.empty:
        placeholder_figure(NAME, out, "no GraniKV cell at Lp=512, B>=256 with a sglang_default twin")
        return t
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (kind, cfg), gs in g.groupby(["workload.kind", "config"], sort=True):
        gs = gs.sort_values("workload.batch")
        ax.plot(gs["workload.batch"].astype(float), gs["ratio_vs_sglang_default"], marker="o", label=f"{cfg} ({kind})")
    pc = paper_claims()
    pc = pc[(pc["lp"] == 512) & (pc["system"] == "granikv") & (pc["base_system"] == "sglang_default")
            & pc["batch"].notna() & pc["config"].isin(set(g["config"]))]
    labelled = set()
    for _, p in pc.iterrows():
        bound = p["check"] if p["check"] in ("bound_ge", "bound_le") else None
        mark_paper(ax, p["batch"], p["value"], label=bound not in labelled, bound=bound)
        if not bound:    # the parity bounds (one per config at B=256) share one point: the legend names them
            ax.annotate(p["config"], (p["batch"], p["value"]), textcoords="offset points", xytext=(6, -3), fontsize=8)
        labelled.add(bound)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    bs = sorted(set(g["workload.batch"].astype(float)) | set(pc["batch"]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [show(b) for b in bs])
    ax.minorticks_off()
    ax.set_xlabel("B")
    ax.set_ylabel("GraniKV / sglang_default output throughput")
    cells = select(res.cells, SELECT) if not res.cells.empty else res.cells
    ax.set_title(title_of("Limitation cells, Lp=512", gpu_names(cells), sorted(g["config"].unique())), fontsize=9)
    fig.tight_layout()
    legend_below(fig, [ax], ncol=2)
    save_figure(fig, NAME, out, data=g[["workload.kind", "config", "workload.batch", "system", "n", "mean",
                                        "ratio_vs_sglang_default"]])
    return t
