"""Multi-prefix sensitivity (paper B.8), Lp=8K, B=256: uniform k in {1, 4, 16, 64} and
heterogeneous lengths k in {4, 8}; output tok/s per system, ratios to sglang_default and
sglang_cascade, and (uniform) each system's throughput relative to its own k=1.

Writes tables/multiprefix.{csv,md} and figures/multiprefix.{png,pdf,csv} (tok/s per k on a log axis where it
spans a decade, and the ratio to sglang_default with the paper's values).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (NOT_MEASURED, THROUGHPUT_DIGITS, placeholder_figure, plt, rename_short, save_figure,
                             select, system_table, with_derived, write_table)
from analysis.load import Results
from analysis.paper import paper_claims
from analysis.plots import PAPER_LABEL, gpu_names, mark_paper, system_colors, system_order, title_of
from analysis.registry import register_exhibit



NAME = "multiprefix"
FIGURES = (NAME,)
SELECT = {"workload.kind": "=multiprefix"}
BUDGETS = ("a100_40gb", "h200")     # KV-budget presets (hardware.name): the paper's A100-40GB, the H200's own


def _bars(ax, g: pd.DataFrame, value: str, systems: list[str], colors: dict, ks: list[int]) -> dict:
    """Grouped bars of ``value`` per k (groups) and system (bars); returns {(system, k): x position}."""
    width = 0.8 / max(len(systems), 1)
    pos = {}
    for j, s in enumerate(systems):
        gs = g[g["system"] == s]
        xs, ys = [], []
        for i, k in enumerate(ks):
            v = gs.loc[gs["workload.num_prefixes"] == k, value]
            x = i - 0.4 + width * (j + 0.5)
            pos[(s, k)] = x
            if len(v) and np.isfinite(float(v.iloc[0])):
                xs.append(x)
                ys.append(float(v.iloc[0]))
        ax.bar(xs, ys, width, label=s, color=colors[s])
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("k (distinct shared prefixes)")
    return pos


def draw(res: Results, m: pd.DataFrame, keys: list[str], out: Path) -> None:
    """Per (mode, config, KV-budget preset): output tok/s per k and system on a log axis (the k=64 cells
    are 10-30x below k=1), and each system's throughput over SGLang default, with the paper's values."""
    by = ["mode", "config"] + [c for c in keys if c not in ("mode", "config", "system", "workload.prefix_lens")]
    panels = list(m.groupby(by, dropna=False, sort=True))
    paper = paper_claims()
    paper = paper[paper["id"].str.startswith("multiprefix")]
    n = len(panels)
    fig, axes = plt.subplots(2, n, figsize=(4.3 * n, 6.4), squeeze=False)
    colors = system_colors(m["system"].unique())
    drawn = []
    for col, (key, g) in enumerate(panels):
        key = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        ks = sorted(int(k) for k in g["workload.num_prefixes"].unique())
        systems = system_order(g["system"].unique())
        g = g.assign(**{"workload.num_prefixes": g["workload.num_prefixes"].astype(int)})
        top, bot = axes[0, col], axes[1, col]
        pos = _bars(top, g, "mean", systems, colors, ks)
        v = pd.to_numeric(g["mean"], errors="coerce").dropna()
        if len(v) and v.max() / max(v.min(), 1e-9) >= 10:       # spans a decade or more (k=64): log axis
            top.set_yscale("log")
            top.set_ylim(10 ** np.floor(np.log10(v.min() / 2)), v.max() * 2)
            top.set_ylabel("output tok/s (log scale)")
        else:
            top.set_ylabel("output tok/s")
        budget = key.get("hardware.name")
        top.set_title(f"{key['mode']}, {key['config']}, KV budget {budget}", fontsize=9)
        others = [s for s in systems if s != "sglang_default"]
        pos2 = _bars(bot, g, "ratio_vs_sglang_default", others, colors, ks)
        bot.axhline(1.0, color="grey", lw=0.8, ls="--")
        bot.set_ylabel("output throughput / sglang_default")
        # the paper's values (its A100-40GB KV budget: hardware=a100_40gb cells), where it gives one
        mine = paper[(paper["hardware"] == budget) & (paper["config"] == key["config"])]
        mode_ok = mine["id"].str.contains("uniform" if key["mode"] == "uniform" else "hetero")
        first_t = first_b = True
        for _, p in mine[mode_ok].iterrows():
            if not np.isfinite(p["k"]) or int(p["k"]) not in ks:
                continue
            if p["unit"] == "tok/s":
                top.hlines(p["value"], ks.index(int(p["k"])) - 0.45, ks.index(int(p["k"])) + 0.45, color="black",
                           lw=1.6, ls=":", label=f"{PAPER_LABEL}, every system" if first_t else None)
                first_t = False
            elif p["base_system"] == "sglang_default" and (p["system"], int(p["k"])) in pos2:
                mark_paper(bot, pos2[(p["system"], int(p["k"]))], p["value"], label=first_b)
                first_b = False
        drawn.append(g.assign(panel=f"{key['mode']}, {budget}")[
            ["panel", "workload.num_prefixes", "system", "mean", "ratio_vs_sglang_default", "vs_own_k1", "n"]])
    fig.suptitle(title_of("Multi-prefix, Lp=8K, B=256", gpu_names(select(res.cells, SELECT) if not res.cells.empty
                                                                  else res.cells),
                          [k[1] for k, _ in panels]), fontsize=10)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    save_figure(fig, NAME, out, data=pd.concat(drawn, ignore_index=True))


@register_exhibit(NAME, figures=FIGURES)
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
                                              "tpot_p50_ms", "ttft_p50_ms", "code", "status")]
    t = t.merge(k1[keys + ["mean"]].rename(columns={"mean": "_k1"}), on=keys, how="left")
    t["vs_own_k1"] = np.where(t["mode"] == "uniform", t["mean"] / t["_k1"], np.nan)
    t = t.drop(columns=["_k1"])
    write_table(rename_short(t), NAME, out, {**THROUGHPUT_DIGITS, "vs_own_k1": 2},
                title="Multi-prefix (B.8): Lp=8K, B=256, uniform and heterogeneous k")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, f"{NOT_MEASURED}: no multiprefix cells")
        return t
    draw(res, m, keys, out)
    return t
