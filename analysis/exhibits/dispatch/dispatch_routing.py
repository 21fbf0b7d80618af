"""Per-step dispatch routing (paper B.4), Llama-3.1-8B shape on the synthetic grid: the share of
decode steps GraniKV's dispatcher sent to each backend (``dispatch_counts`` of metrics.json)
against Meff = B x Hq/Hkv, and the TPOT of the forced backends (granikv_dense_only /
granikv_cascade_only) at each Meff beside GraniKV's own (``granikv_over_best``: GraniKV's TPOT p50
over the faster forced backend's; above 1 = the dispatcher lost time against a fixed choice).

A row is one GPU model's cells (column ``gpu``): its own table's routing and its own forced backends.

Writes tables/dispatch_routing.{csv,md} and figures/dispatch_routing.{png,pdf,csv} (the dense share over
Lp x Meff with the paper's A100 rule, and the forced backends' TPOT ratio with the paper's values; one GPU
model, the others named under it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.common import (GRID_B, LPS, NOT_MEASURED, aggregate, placeholder_figure, plt, save_figure, select,
                             sort_rows, write_table)
from analysis.gpu import GPU, one_gpu, with_gpu
from analysis.load import Results
from analysis.measures.dispatch import with_dispatch
from analysis.paper import paper_claims
from analysis.plots import PAPER_LABEL, legend_below, lp_label, mark_paper, title_of
from analysis.registry import register_exhibit



NAME = "dispatch_routing"
FIGURES = (NAME,)
SELECT = {"workload.kind": "=synthetic", "workload.num_prefixes": "=1", "instrumented": "=False"}
PAPER_THRESHOLD = 1024  # A100 Msat (Sec. 3); hardware-specific


def draw(m: pd.DataFrame, out: Path) -> None:
    """Left: the share of GraniKV's steps routed to dense over Lp x Meff (a heatmap; the paper's A100 rule
    marked); right: TPOT of the forced backends, dense-only over cascade-only, vs Meff, with the paper's
    values. The first GPU model's (analysis.gpu.one_gpu) configuration with the most cells is drawn (the
    others are in the table)."""
    m, gpu, other_gpus = one_gpu(m)
    cfg = m["config"].value_counts().idxmax()
    others = sorted(set(m["config"]) - {cfg}) + [f"on {g}" for g in other_gpus]
    m = m[m["config"] == cfg]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11.5, 4.2), gridspec_kw={"width_ratios": [1, 1.1]})
    grid = m.pivot_table(index="workload.prefix_len", columns="meff", values="dense_fraction", aggfunc="first")
    grid = grid.sort_index(ascending=False)
    meffs = [int(v) for v in grid.columns]
    sns.heatmap(grid.set_axis([lp_label(v) for v in grid.index], axis=0).set_axis([str(v) for v in meffs], axis=1),
                annot=True, fmt=".2f", cmap="Greens", vmin=0, vmax=1, ax=a1, annot_kws={"fontsize": 8},
                linewidths=0.5, linecolor="white", cbar_kws={"label": "share of steps routed to dense"})
    pc = paper_claims(["dispatch_routing_above", "dispatch_routing_below", "dispatch_dense_vs_cascade_1024",
                       "dispatch_dense_vs_cascade_below"]).set_index("id")
    if any(v >= PAPER_THRESHOLD for v in meffs):
        j = next(i for i, v in enumerate(meffs) if v >= PAPER_THRESHOLD)
        a1.axvline(j, color="black", lw=2)
    rule = []
    if "dispatch_routing_below" in pc.index:
        rule.append(f"<= {pc.loc['dispatch_routing_below', 'value']:g} left of the line")
    if "dispatch_routing_above" in pc.index:
        rule.append(f">= {pc.loc['dispatch_routing_above', 'value']:g} right of it")
    a1.set_title(f"GraniKV's routing (table fitted on this GPU); {PAPER_LABEL}: " + ", ".join(rule)
                 + f" (Meff {PAPER_THRESHOLD})", fontsize=8)
    a1.set_xlabel("Meff = B x Hq/Hkv")
    a1.set_ylabel("Lp")
    a1.tick_params(axis="y", rotation=0)
    a1.grid(False)
    for lp, g in m[m["tpot_dense_over_cascade"].notna()].groupby("workload.prefix_len", sort=True):
        g = g.sort_values("meff")
        a2.plot(g["meff"], g["tpot_dense_over_cascade"], marker="o", ms=4, label=f"Lp={lp_label(lp)}")
    lo, hi = min(meffs) / 1.5, max(meffs) * 1.5
    if "dispatch_dense_vs_cascade_below" in pc.index:
        w = pc.loc["dispatch_dense_vs_cascade_below", "value"]
        a2.fill_between([lo, PAPER_THRESHOLD], 1 - w, 1 + w, color="grey", alpha=0.25, lw=0,
                        label=f"{PAPER_LABEL}: within {w:.0%} below Meff {PAPER_THRESHOLD}")
    if "dispatch_dense_vs_cascade_1024" in pc.index:
        mark_paper(a2, PAPER_THRESHOLD, pc.loc["dispatch_dense_vs_cascade_1024", "value"])
    a2.axvline(PAPER_THRESHOLD, color="grey", ls="--", lw=0.8)
    a2.axhline(1.0, color="k", lw=0.6)
    a2.set_xscale("log", base=2)
    a2.set_xticks(meffs, [str(v) for v in meffs], fontsize=7)
    a2.minorticks_off()
    a2.set_xlim(lo, hi)
    a2.set_xlabel("Meff = B x Hq/Hkv (dashed: the paper's A100 threshold)")
    a2.set_ylabel("TPOT p50, dense-only / cascade-only")
    a2.set_title("forced backends", fontsize=9)
    fig.suptitle(title_of("Per-step dispatch, synthetic grid", gpu, [cfg]), fontsize=10)
    if others:
        fig.text(0.5, -0.2, "also measured (in the table): " + ", ".join(others), ha="center", va="top", fontsize=8)
    fig.tight_layout()
    legend_below(fig, [a2], (0.75, 0.0), ncol=2)
    save_figure(fig, NAME, out, data=m[["config", GPU, "workload.prefix_len", "workload.batch", "meff",
                                        "dense_fraction", "tpot_dense_over_cascade"]])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    df = with_dispatch(res.cells)
    df = with_gpu(select(df, SELECT)) if not df.empty else df
    keys = ["config", "workload.prefix_len", "workload.batch", "meff", GPU]
    rows = []
    if not df.empty:
        g = select(df, {"system": "=granikv"})
        t = aggregate(g, keys, "dense_fraction").rename(columns={"mean": "dense_fraction", "n": "n_granikv"})
        t = t[keys + ["dense_fraction", "n_granikv"]]
        a = aggregate(g, keys, "tpot_p50_ms")[keys + ["mean"]]
        t = t.merge(a.rename(columns={"mean": "tpot_p50_ms_granikv"}), on=keys, how="outer")
        for s in ("granikv_dense_only", "granikv_cascade_only"):
            a = aggregate(select(df, {"system": f"={s}"}), keys, "tpot_p50_ms")[keys + ["mean"]]
            t = t.merge(a.rename(columns={"mean": f"tpot_p50_ms_{s.split('_')[1]}"}), on=keys, how="outer")
        for c in ("tpot_p50_ms_dense", "tpot_p50_ms_cascade", "dense_fraction"):
            if c not in t.columns:
                t[c] = np.nan
        t["tpot_dense_over_cascade"] = t["tpot_p50_ms_dense"] / t["tpot_p50_ms_cascade"]
        t["granikv_over_best"] = t["tpot_p50_ms_granikv"] / t[["tpot_p50_ms_dense", "tpot_p50_ms_cascade"]].min(axis=1, skipna=False)
        t["status"] = "measured"
        rows = t.to_dict("records")
    have = {(r["config"], r["workload.prefix_len"], r["workload.batch"]) for r in rows}
    for lp in LPS[:-1]:
        for b in GRID_B:
            if ("llama3_8b TP=1", lp, b) not in have:
                rows.append({"config": "llama3_8b TP=1", "workload.prefix_len": lp, "workload.batch": b,
                             "meff": 4 * b, "status": NOT_MEASURED})
    cols = keys + ["n_granikv", "dense_fraction", "tpot_p50_ms_granikv", "tpot_p50_ms_dense", "tpot_p50_ms_cascade",
                   "tpot_dense_over_cascade", "granikv_over_best", "status"]
    t = sort_rows(pd.DataFrame(rows, columns=cols), keys)
    write_table(t, NAME, out, {"dense_fraction": 3, "tpot_p50_ms_granikv": 2, "tpot_p50_ms_dense": 2,
                               "tpot_p50_ms_cascade": 2, "tpot_dense_over_cascade": 3, "granikv_over_best": 3},
                title="Dispatch routing vs Meff (synthetic grid)",
                note="dense_fraction: share of GraniKV's dispatch decisions that chose dense (paper: ~all at Meff >= 1024 on A100, "
                     "<= 13% below). granikv_over_best: GraniKV's TPOT p50 over the faster forced backend's (above 1: "
                     "the dispatcher lost time against a fixed choice).")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, "no synthetic-grid GraniKV / forced-backend cells")
        return t
    draw(m, out)
    return t
