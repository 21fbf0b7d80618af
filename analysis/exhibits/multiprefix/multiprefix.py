"""Multi-prefix sensitivity (paper B.8), Lp=8K, B=256: uniform k in {1, 4, 16, 64} and
heterogeneous lengths k in {4, 8}; output tok/s per system, ratios to sglang_default and
sglang_cascade, and (uniform) each system's throughput relative to its own k=1.

Writes tables/multiprefix.{csv,md} and figures/multiprefix.{png,pdf,csv} (tok/s per k as lines on log axes,
and the ratio to sglang_default as bars, with the paper's values).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (NOT_MEASURED, SHORT, THROUGHPUT_DIGITS, json_digest, placeholder_figure, plt, rename_short,
                             save_figure, select, system_table, with_derived, write_table)
from analysis.load import Results
from analysis.paper import paper_claims
from analysis.plots import PAPER_LABEL, gpu_names, legend_below, mark_paper, suptitle, system_colors, system_order, title_of
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


def _lines(ax, g: pd.DataFrame, systems: list[str], colors: dict, ks: list[int]) -> None:
    """Output tok/s per k, one line per system, on log axes (k = 1 ... 64; the k=64 cells are 10-30x below k=1)."""
    for s in systems:
        gs = g[(g["system"] == s) & pd.to_numeric(g["mean"], errors="coerce").notna()].sort_values("workload.num_prefixes")
        base = s == "sglang_default"      # dashed, on top: where a system runs at SGLang default's speed both show
        ax.plot(gs["workload.num_prefixes"], gs["mean"].astype(float), marker="o", ms=4, label=s, color=colors[s],
                ls="--" if base else "-", zorder=3 if base else 2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    if len(ks) == 1:
        ax.set_xlim(ks[0] / 1.5, ks[0] * 1.5)
    ax.set_yscale("log")
    ax.set_xlabel("k (distinct shared prefixes)")


def _panels(m: pd.DataFrame, keys: list[str]) -> tuple[list, list[str]]:
    """(title, config, budget, rows) per configuration with a system to compare with SGLang default; the
    titles name what else tells two configurations apart (e.g. a decision table, by digest); and the
    configurations left out (SGLang default alone: no ratio to draw, in the table)."""
    by = ["mode", "config"] + [c for c in keys if c not in ("mode", "config", "system", "workload.prefix_lens")]
    groups = []
    for key, g in m.groupby(by, dropna=False, sort=True):
        key = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        groups.append((f"{key['mode']}, {key['config']}, KV budget {key.get('hardware.name')}", key, g))
    def titled(base: str, key: dict, among: list) -> str:
        twins = [k for b, k, _ in among if b == base]
        extra = [c for c in by[2:] if c != "hardware.name" and len({str(k[c]) for k in twins}) > 1]
        return base + "".join(f", {SHORT.get(c, c)} {json_digest(key[c])}" for c in extra)
    compared = [(b, k, g) for b, k, g in groups if not set(g["system"]) <= {"sglang_default"}]
    alone = [titled(b, k, groups) for b, k, g in groups if set(g["system"]) <= {"sglang_default"}]
    drawn = [(titled(b, k, compared), k["config"], k.get("hardware.name"), k["mode"], g) for b, k, g in compared]
    return drawn, alone


def draw(res: Results, m: pd.DataFrame, keys: list[str], out: Path) -> None:
    """Per (mode, config, KV-budget preset): output tok/s per k and system (lines on log axes, one y axis for
    the row), and each system's throughput over SGLang default (bars on a linear axis, one y axis for the
    row), with the paper's values; a configuration with SGLang default alone is named below the figure."""
    panels, alone = _panels(m, keys)
    if not panels:
        placeholder_figure(NAME, out, "no multiprefix configuration with a system beside SGLang default")
        return
    paper = paper_claims()
    paper = paper[paper["id"].str.startswith("multiprefix")]
    n = len(panels)
    fig, axes = plt.subplots(2, n, figsize=(4.3 * n, 7.0), squeeze=False, sharey="row")
    colors = system_colors(m["system"].unique())
    drawn = []
    for col, (title, config, budget, mode, g) in enumerate(panels):
        ks = sorted(int(k) for k in g["workload.num_prefixes"].unique())
        systems = system_order(g["system"].unique())
        g = g.assign(**{"workload.num_prefixes": g["workload.num_prefixes"].astype(int)})
        top, bot = axes[0, col], axes[1, col]
        _lines(top, g, systems, colors, ks)
        top.set_ylabel("output tok/s (log)")
        top.set_title("\n".join(textwrap.wrap(title, 48)), fontsize=9)
        others = [s for s in systems if s != "sglang_default"]
        pos2 = _bars(bot, g, "ratio_vs_sglang_default", others, colors, ks)
        bot.axhline(1.0, color="grey", lw=0.8, ls="--")
        bot.set_ylabel("output throughput / sglang_default")
        for ax in (top, bot):
            ax.yaxis.set_tick_params(labelleft=True)
        # the paper's values (its A100-40GB KV budget: hardware=a100_40gb cells), where it gives one
        mine = paper[(paper["hardware"] == budget) & (paper["config"] == config)]
        mode_ok = mine["id"].str.contains("uniform" if mode == "uniform" else "hetero")
        first_t = first_b = True
        for _, p in mine[mode_ok].iterrows():
            if not np.isfinite(p["k"]) or int(p["k"]) not in ks:
                continue
            if p["unit"] == "tok/s":
                top.hlines(p["value"], int(p["k"]) / 1.4, int(p["k"]) * 1.4, color="black", lw=1.6, ls=":",
                           label=f"{PAPER_LABEL}, every system" if first_t else None)
                first_t = False
            elif p["base_system"] == "sglang_default" and (p["system"], int(p["k"])) in pos2:
                mark_paper(bot, pos2[(p["system"], int(p["k"]))], p["value"], label=first_b)
                first_b = False
        drawn.append(g.assign(panel=title)[
            ["panel", "workload.num_prefixes", "system", "mean", "ratio_vs_sglang_default", "vs_own_k1", "n"]])
    suptitle(fig, title_of("Multi-prefix, Lp=8K, B=256", gpu_names(select(res.cells, SELECT) if not res.cells.empty
                                                                   else res.cells),
                           [p[1] for p in panels]))
    fig.tight_layout()
    legend_below(fig, axes.flat, ncol=6)
    if alone:
        fig.text(0.5, -0.5 / fig.get_figheight() - 0.02, "\n".join(textwrap.wrap(
            "SGLang default alone (no system to compare, in the table): " + "; ".join(alone), 170)),
            ha="center", va="top", fontsize=8)
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
