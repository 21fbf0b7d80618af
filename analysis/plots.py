"""Figure builders shared by the table modules: ratio heatmaps over Lp x B, lines over Lp."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.common import NOT_MEASURED, SHORT, placeholder_figure, plt, save_figure, show

sns.set_theme(style="whitegrid", context="paper")

# One colour per system in every figure (a system keeps its colour whichever systems a panel has)
SYSTEM_ORDER = ("sglang_default", "sglang_cascade", "hydragen", "granikv", "granikv_dense_only",
                "granikv_cascade_only")


def system_colors(systems) -> dict:
    """{system: colour}: the known systems in SYSTEM_ORDER take fixed palette slots, others the next ones."""
    pal = sns.color_palette("tab10", 10)
    names = list(SYSTEM_ORDER) + sorted(set(map(str, systems)) - set(SYSTEM_ORDER))
    return {s: pal[i % len(pal)] for i, s in enumerate(names)}


def system_order(systems) -> list[str]:
    """The systems present, in SYSTEM_ORDER (unknown ones after, sorted)."""
    present = set(map(str, systems))
    return [s for s in SYSTEM_ORDER if s in present] + sorted(present - set(SYSTEM_ORDER))


def _facets(df: pd.DataFrame, facet: list[str]) -> list[tuple[str, pd.DataFrame]]:
    if df.empty:
        return []
    if not facet:
        return [("", df)]
    return [(", ".join(f"{SHORT.get(k, k)}={show(v)}" for k, v in zip(facet, key if isinstance(key, tuple) else (key,))), g)
            for key, g in df.groupby(facet, sort=True)]


# table columns that hold measurements, not configuration (system_table's and the modules' own)
MEASURE_COLS = ("system", "n", "mean", "sd", "min", "max", "tpot_p50_ms", "ttft_p50_ms", "status", "vs_own_k1")


def one_per_point(g: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, int]:
    """(rows of ``g`` with one row per ``keys`` value, how many were left out). Where two configurations
    share a point (e.g. the grid's cell and the engine bench's cell at Lp=8K, B=256: other warm-up and
    runner), the row of the configuration that has the most rows in ``g`` is drawn, so a figure never
    averages or joins two configurations; the table keeps both rows."""
    if g.empty or not g.duplicated(keys).any():
        return g, 0
    conf = [c for c in g.columns if c not in keys and c not in MEASURE_COLS and not str(c).startswith("ratio_vs_")]
    variant = g[conf].astype(str).agg("\x1f".join, axis=1) if conf else pd.Series("", index=g.index)
    rank = variant.map(variant.value_counts())
    kept = g.assign(_rank=rank.to_numpy()).sort_values("_rank", ascending=False, kind="stable")
    kept = kept[~kept.duplicated(keys)].drop(columns="_rank").sort_index()
    return kept, len(g) - len(kept)


def _int_labels(grid: pd.DataFrame) -> pd.DataFrame:
    fix = lambda v: int(v) if isinstance(v, (float, np.floating)) and float(v).is_integer() else v  # noqa: E731
    grid.index = [fix(v) for v in grid.index]
    grid.columns = [fix(v) for v in grid.columns]
    return grid


def ratio_heatmaps(table: pd.DataFrame, name: str, out: Path, rows: str, cols: str, facet: list[str],
                   value: str = "ratio_vs_sglang_default", systems=("granikv",), title: str = "",
                   labels: tuple[str, str] = ("Lp", "B")) -> None:
    """One heatmap per (facet, system) of ``value`` over ``rows`` x ``cols``, drawn over the whole
    expected grid: cells not measured stay blank (never interpolated)."""
    df = table[table["system"].isin(systems)] if not table.empty else table
    measured = df[(df["status"] == "measured") & df[value].notna()] if value in df.columns else df.iloc[0:0]
    panels = [(f"{lab}{', ' if lab else ''}{s}", g[g["system"] == s]) for lab, g in _facets(df, facet)
              for s in systems if ((measured["system"] == s) & measured.index.isin(g.index)).any()]
    if not panels:
        placeholder_figure(name, out, f"no measured cells with {value}")
        return
    n = len(panels)
    ncol = min(n, 3)
    nrow = int(np.ceil(n / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    left_out = 0
    for ax, (lab, g) in zip(axes.flat, panels):
        m = g["status"] == "measured"
        kept, k = one_per_point(g[m], [rows, cols])
        planned = g[~m]                              # expected cells not measured: they stay, blank
        g, left_out = pd.concat([kept, planned]), left_out + k
        g = g.assign(_v=pd.to_numeric(g[value], errors="coerce"))
        grid = g.pivot_table(index=rows, columns=cols, values="_v", aggfunc="first", dropna=False)
        grid = grid.loc[grid.notna().any(axis=1) | grid.index.isin(planned[rows]),
                        grid.notna().any(axis=0) | grid.columns.isin(planned[cols])]
        grid = _int_labels(grid.sort_index(ascending=False))
        sns.heatmap(grid, annot=True, fmt=".2f", cmap="RdBu", center=1.0, cbar=False, ax=ax)
        ax.set_title(lab, fontsize=8)
        ax.set_ylabel(labels[0])
        ax.set_xlabel(labels[1])
        ax.grid(False)
        ax.tick_params(axis="y", rotation=0)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title or value)
    fig.text(0.5, -0.02, f"blank: {NOT_MEASURED}" + _left_out_note(left_out), ha="center", fontsize=7)
    fig.tight_layout()
    save_figure(fig, name, out)


def lines_vs(table: pd.DataFrame, name: str, out: Path, x: str, facet: list[str], value: str = "mean",
             ylabel: str = "output tok/s", title: str = "", logy: bool = False) -> None:
    """One panel per facet: ``value`` vs ``x`` per system (error bars: rep min-max when present)."""
    df = table[(table["status"] == "measured")]
    df = df[df[value].notna()] if value in df.columns else df.iloc[0:0]
    panels = _facets(df, facet)
    if not panels:
        placeholder_figure(name, out, f"no measured cells with {value}")
        return
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.4), squeeze=False)
    colors = system_colors(df["system"].unique())
    left_out = 0
    for ax, (lab, g) in zip(axes.flat, panels):
        for s in system_order(g["system"].unique()):
            gs, k = one_per_point(g[g["system"] == s], [x])
            left_out += k
            gs = gs.sort_values(x)
            yerr = None
            if value == "mean" and {"min", "max"} <= set(gs.columns):
                yerr = np.vstack([(gs["mean"] - gs["min"]).fillna(0), (gs["max"] - gs["mean"]).fillna(0)]).astype(float)
            ax.errorbar(gs[x].astype(float), gs[value].astype(float), yerr=yerr, marker="o", label=s, capsize=2,
                        color=colors[s])
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(SHORT.get(x, x))
        ax.set_ylabel(ylabel)
        ax.set_title(lab, fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    if left_out:
        fig.text(0.5, -0.02, _left_out_note(left_out).lstrip("; "), ha="center", fontsize=7)
    fig.tight_layout()
    save_figure(fig, name, out)


def _left_out_note(n: int) -> str:
    return f"; {n} point(s) of another configuration at the same coordinates: in the table, not drawn" if n else ""
