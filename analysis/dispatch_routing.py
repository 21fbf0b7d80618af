"""Per-step dispatch routing (paper B.4), Llama-3.1-8B shape on the synthetic grid: the share of
decode steps GraniKV's dispatcher sent to each backend (``dispatch_counts`` of metrics.json)
against Meff = B x Hq/Hkv, and the TPOT of the forced backends (granikv_dense_only /
granikv_cascade_only) at each Meff beside GraniKV's own (``granikv_over_best``: GraniKV's TPOT p50
over the faster forced backend's; above 1 = the dispatcher lost time against a fixed choice).

Writes tables/dispatch_routing.{csv,md} and figures/dispatch_routing.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (GRID_B, LPS, NOT_MEASURED, aggregate, placeholder_figure, plt, save_figure, show,
                             select, sort_rows, with_derived, write_table)
from analysis.load import Results

NAME = "dispatch_routing"
FIGURES = (NAME,)
SELECT = {"workload.kind": "=synthetic", "workload.num_prefixes": "=1", "instrumented": "=False"}
PAPER_THRESHOLD = 1024  # A100 Msat (Sec. 3); hardware-specific


def with_dispatch(cells: pd.DataFrame) -> pd.DataFrame:
    """Cells plus ``dense_fraction`` / ``cascade_fraction`` / ``paged_fraction`` of dispatch_counts."""
    df = with_derived(cells)
    cnt = [c for c in df.columns if c.startswith("dispatch_counts.")]
    if df.empty or not cnt:
        return df.assign(dense_fraction=np.nan, cascade_fraction=np.nan, paged_fraction=np.nan) if not df.empty else df
    total = df[cnt].fillna(0).sum(axis=1).replace(0, np.nan)
    for b in ("dense", "cascade", "paged"):
        col = f"dispatch_counts.{b}"
        df[f"{b}_fraction"] = (df[col].fillna(0) if col in df.columns else 0) / total
    return df


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    df = with_dispatch(res.cells)
    df = select(df, SELECT) if not df.empty else df
    keys = ["config", "workload.prefix_len", "workload.batch", "meff"]
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
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for (cfg, lp), g in m.groupby(["config", "workload.prefix_len"], sort=True):
        g = g.sort_values("meff")
        if g["dense_fraction"].notna().any():
            a1.plot(g["meff"], g["dense_fraction"], marker="o", label=f"{cfg}, Lp={show(lp)}")
        if g["tpot_dense_over_cascade"].notna().any():
            a2.plot(g["meff"], g["tpot_dense_over_cascade"], marker="o", label=f"{cfg}, Lp={show(lp)}")
    for ax, yl in ((a1, "share of steps routed to dense"), (a2, "TPOT dense-only / cascade-only")):
        ax.axvline(PAPER_THRESHOLD, color="grey", ls="--", lw=0.8, label="paper's A100 threshold")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("Meff = B x Hq/Hkv")
        ax.set_ylabel(yl)
        ax.legend(fontsize=6)
    a2.axhline(1.0, color="k", lw=0.6)
    fig.tight_layout()
    save_figure(fig, NAME, out)
    return t
