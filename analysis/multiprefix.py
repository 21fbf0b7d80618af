"""Multi-prefix sensitivity (paper B.8), Lp=8K, B=256: uniform k in {1, 4, 16, 64} and
heterogeneous lengths k in {4, 8}; output tok/s per system, ratios to sglang_default and
sglang_cascade, and (uniform) each system's throughput relative to its own k=1.

Writes tables/multiprefix.{csv,md} and figures/multiprefix.{png,pdf}.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.common import NOT_MEASURED, placeholder_figure, plt, rename_short, save_figure, system_table, with_derived, write_table
from analysis.headline import DIGITS
from analysis.load import Results
from analysis.plots import system_colors, system_order

NAME = "multiprefix"
FIGURES = (NAME,)
SELECT = {"workload.kind": "=multiprefix"}
BUDGETS = ("a100_40gb", "h200")     # KV-budget presets (hardware.name): the paper's A100-40GB, the H200's own


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    cells = with_derived(res.cells)
    if not cells.empty and "workload.prefix_lens" in cells.columns:
        cells["mode"] = np.where(cells["workload.prefix_lens"].isna(), "uniform", "heterogeneous")
    elif not cells.empty:
        cells["mode"] = "uniform"
    cfg_cols = res.config_columns + ["mode"]
    parts = []
    for mode, ks in (("uniform", (1, 4, 16, 64)), ("heterogeneous", (4, 8))):
        # the KV-budget preset is always a column: the issue runs every cell with both (h200, a100_40gb)
        t = system_table(cells, cfg_cols, {**SELECT, "mode": f"={mode}"},
                         ["mode", "config", "hardware.name", "workload.num_prefixes"],
                         expected={"mode": (mode,), "config": ("llama3_8b TP=1",), "hardware.name": BUDGETS,
                                   "workload.num_prefixes": ks})
        parts.append(t)
    t = pd.concat(parts, ignore_index=True)
    # uniform: throughput relative to the same system's k=1 (paper: k=64 is -87%)
    k1 = t[(t["mode"] == "uniform") & (t["workload.num_prefixes"] == 1) & (t["status"] == "measured")]
    keys = [c for c in t.columns if c not in ("workload.num_prefixes", "n", "mean", "sd", "min", "max",
                                              "ratio_vs_sglang_default", "ratio_vs_sglang_cascade",
                                              "tpot_p50_ms", "ttft_p50_ms", "status")]
    t = t.merge(k1[keys + ["mean"]].rename(columns={"mean": "_k1"}), on=keys, how="left")
    t["vs_own_k1"] = np.where(t["mode"] == "uniform", t["mean"] / t["_k1"], np.nan)
    t = t.drop(columns=["_k1"])
    write_table(rename_short(t), NAME, out, {**DIGITS, "vs_own_k1": 2},
                title="Multi-prefix (B.8): Lp=8K, B=256, uniform and heterogeneous k")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, f"{NOT_MEASURED}: no multiprefix cells")
        return t
    # one panel per (mode, config, KV-budget preset, ...): heterogeneous k=4 and k=8 share a panel (their
    # length lists differ); a key column empty for one kind of cell (NaN) must not drop its panel
    by = ["mode", "config"] + [c for c in keys if c not in ("mode", "config", "system", "workload.prefix_lens")]
    panels = list(m.groupby(by, dropna=False, sort=True))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    colors = system_colors(m["system"].unique())
    for ax, (key, g) in zip(axes.flat, panels):
        sns.barplot(data=g.assign(k=g["workload.num_prefixes"].astype(int)), x="k", y="mean", hue="system", ax=ax,
                    hue_order=system_order(g["system"].unique()), palette=colors)
        ax.set_ylabel("output tok/s")
        ax.set_title(", ".join(map(str, key if isinstance(key, tuple) else (key,))), fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, NAME, out)
    return t


def _count(r: pd.Series, key: str) -> int:
    """A count metric of one cell; absent in metrics.json (no such admission in that run) = 0."""
    v = r.get(key)
    return 0 if v is None or pd.isna(v) else int(v)


def storage_line(res: Results, claim: pd.Series) -> str:
    """For a multi-prefix claim: where GraniKV put the prefixes and which path served them, from the
    claim's GraniKV cells (HOT capacity and peak, first admissions to HOT / COLD, class-steps per path),
    with TTFT / TPOT p50 against sglang_default in the same configuration. Empty without such a cell."""
    from analysis.common import parse_selectors, select
    from analysis.headline_steps import baseline_cell, steps_vs
    cells = with_derived(res.cells)
    if cells.empty:
        return ""
    sel = parse_selectors(claim["selectors"])
    g = select(cells, {**sel, "system.name": "=granikv", "instrumented": "=False"})
    if g.empty:
        return ""
    parts = []
    for _, r in g.iterrows():
        paths = {c.split(".", 1)[1]: int(r[c]) for c in r.index if c.startswith("dispatch_counts.") and r[c] > 0}
        vs = ""
        b = baseline_cell(res, r)
        if b is not None:
            vs = (f"; TTFT p50 {r['ttft_p50_ms'] / 1e3:.1f} s vs {b['ttft_p50_ms'] / 1e3:.1f} s, TPOT p50 "
                  f"{r['tpot_p50_ms']:.1f} vs {b['tpot_p50_ms']:.1f} ms (sglang_default); " + steps_vs(res, r, b))
        lens = r.get("workload.prefix_lens")        # a list written as text ("[2048, 4096]") or null
        if isinstance(lens, str):
            lens = json.loads(lens)
        k = int(r["workload.num_prefixes"])
        total = sum(lens) if isinstance(lens, (list, tuple)) else k * int(r["workload.prefix_len"])
        parts.append(f"k={k}, {total / 1e3:.1f}K prefix tokens against a HOT pool of "
                     f"{r['hot_capacity_tokens'] / 1e3:.1f}K (peak {r['hot_peak_tokens'] / 1e3:.1f}K used; first "
                     f"admissions: {_count(r, 'admissions.hot')} HOT, {_count(r, 'admissions.cold')} COLD), "
                     f"class-steps by path {paths}{vs}")
    return "GraniKV's storage and paths (metrics.json): " + "; ".join(parts) + "."
