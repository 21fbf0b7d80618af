"""Multi-prefix sensitivity (paper B.8), Lp=8K, B=256: uniform k in {1, 4, 16, 64} and
heterogeneous lengths k in {4, 8}; output tok/s per system, ratios to sglang_default and
sglang_cascade, and (uniform) each system's throughput relative to its own k=1.

Writes tables/multiprefix.{csv,md} and figures/multiprefix.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.common import NOT_MEASURED, placeholder_figure, plt, rename_short, save_figure, system_table, with_derived, write_table
from analysis.headline import DIGITS
from analysis.load import Results

NAME = "multiprefix"
FIGURES = (NAME,)
SELECT = {"workload.kind": "=multiprefix"}


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
        t = system_table(cells, cfg_cols, {**SELECT, "mode": f"={mode}"}, ["mode", "config", "workload.num_prefixes"],
                         expected={"mode": (mode,), "config": ("llama3_8b TP=1",), "workload.num_prefixes": ks})
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
    panels = sorted(m.groupby(["mode", "config"] + [c for c in keys if c not in ("mode", "config", "system")]).groups)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        g = m.groupby(["mode", "config"] + [c for c in keys if c not in ("mode", "config", "system")]).get_group(key)
        sns.barplot(data=g.assign(k=g["workload.num_prefixes"].astype(int)), x="k", y="mean", hue="system", ax=ax)
        ax.set_ylabel("output tok/s")
        ax.set_title(", ".join(map(str, key if isinstance(key, tuple) else (key,))), fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, NAME, out)
    return t
