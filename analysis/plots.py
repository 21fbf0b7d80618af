"""Figure builders shared by the table modules: ratio heatmaps over Lp x B on one colour scale,
lines over Lp, and what every figure carries: a title naming the GPU and the model/TP configurations
drawn, Lp ticks 512 ... 16K, and the paper's values (results/paper/claims.csv) where it has one."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.colors import LogNorm, Normalize

from analysis.common import NOT_MEASURED, PAPER_HARDWARE, SHORT, placeholder_figure, plt, save_figure, show
from analysis.gpu import PRIMARY_GPU

sns.set_theme(style="whitegrid", context="paper")
PAPER_STYLE = dict(marker="*", s=140, color="black", zorder=5, edgecolor="white", linewidth=0.6)
PAPER_LABEL = f"paper ({PAPER_HARDWARE})"
MIN_HEATMAP_CELLS = 4   # a configuration with fewer measured cells gets no heatmap panel (named in a footnote)
MIN_FILL = 0.5          # ... and so does one whose measured cells fill less than this of its rows x columns


def heatmap_ok(grid: pd.DataFrame) -> bool:
    """A panel worth drawing as a heatmap: >= 2 rows and columns, MIN_HEATMAP_CELLS cells, mostly filled."""
    n = int(grid.notna().to_numpy().sum())
    return grid.shape[0] >= 2 and grid.shape[1] >= 2 and n >= MIN_HEATMAP_CELLS and n >= MIN_FILL * grid.size


def lp_label(v) -> str:
    """512 -> '512', 1024 -> '1K', 16384 -> '16K' (a prefix length as the paper writes it)."""
    v = int(float(v))
    return f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v)


def lp_axis(ax, values, axis: str = "x") -> None:
    """A log2 axis over the Lp values drawn, ticked at each of them as 512 ... 16K."""
    vals = sorted({int(float(v)) for v in values})
    if axis == "x":
        ax.set_xscale("log", base=2)
        ax.set_xticks(vals, [lp_label(v) for v in vals])
        ax.minorticks_off()
        if len(vals) == 1:
            ax.set_xlim(vals[0] / 1.5, vals[0] * 1.5)
    else:
        ax.set_yscale("log", base=2)
        ax.set_yticks(vals, [lp_label(v) for v in vals])
        ax.minorticks_off()


def gpu_names(cells: pd.DataFrame) -> str:
    """The GPU(s) the given cells ran on (provenance), for a figure's title."""
    if cells is None or cells.empty or "provenance.gpu_name" not in cells.columns:
        return "GPU ?"
    names = sorted({str(g) for g in cells["provenance.gpu_name"].dropna()})
    return ", ".join(names) if names else "no GPU (CPU)"


def title_of(what: str, gpu: str, configs) -> str:
    """``<what>: <GPU>, <model TP=n>[, ...]``: every figure's title names GPU, model and TP."""
    cf = [str(c) for c in dict.fromkeys(configs) if c is not None and c == c]
    return f"{what}: {gpu}" + (f", {'; '.join(cf)}" if cf else "")


def mark_paper(ax, x, y, label: bool = True, bound: str | None = None, **kw) -> None:
    """The paper's value at (x, y): a black star; a bound (``>=`` / ``<=``) as a triangle pointing the
    way it allows."""
    style = {**PAPER_STYLE, **kw}
    if bound:
        style["marker"] = "^" if bound == "bound_ge" else "v"
        style["s"] = 70
    op = {"bound_ge": " (>= bound)", "bound_le": " (<= bound)"}.get(bound or "", "")
    ax.scatter([x], [y], label=(PAPER_LABEL + op) if label else None, **style)

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
MEASURE_COLS = ("system", "n", "mean", "sd", "min", "max", "tpot_p50_ms", "ttft_p50_ms", "code", "status", "vs_own_k1")


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


def heatmap_grid(g: pd.DataFrame, rows: str, cols: str, value: str) -> pd.DataFrame:
    """``value`` pivoted over ``rows`` (descending, as Lp reads upwards) x ``cols``, trimmed to the rows and
    columns that hold a measured value."""
    g = g.assign(_v=pd.to_numeric(g[value], errors="coerce"))
    grid = g.pivot_table(index=rows, columns=cols, values="_v", aggfunc="first", dropna=False)
    grid = grid.loc[grid.notna().any(axis=1), grid.notna().any(axis=0)]
    return _int_labels(grid.sort_index(ascending=False))


def draw_heatmaps(panels: list[tuple[str, pd.DataFrame]], name: str, out: Path, *, title: str, cbar_label: str,
                  fmt: str = ".2f", center: float | None = 1.0, cmap: str = "RdBu", labels=("Lp", "B"),
                  footnote: str = "", outline_col=None, outline_label: str = "", data: pd.DataFrame | None = None,
                  lp_rows: bool = True) -> None:
    """Heatmaps on one shared colour scale (centred on ``center`` when given) with one colour bar;
    ``outline_col``: a column value outlined in every panel (e.g. the paper's B=256)."""
    vals = np.concatenate([p.to_numpy(dtype=float).ravel() for _, p in panels])
    vals = vals[np.isfinite(vals)]
    vmin, vmax = float(vals.min()), float(vals.max())
    ticks = None
    if center is not None:   # ratios: a log scale symmetric about the centre (0.5x and 2x equally far from 1x)
        m = max(vmax / center, center / vmin, 1.05)
        norm = LogNorm(vmin=center / m, vmax=center * m)
        ticks = [t for t in (0.25, 0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0) if center / m <= t <= center * m]
    else:
        norm = Normalize(vmin=vmin, vmax=vmax)
    n = len(panels)
    ncol = min(n, 3)
    nrow = int(np.ceil(n / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.0 * ncol + 1.0, 3.3 * nrow + 0.4), squeeze=False)
    for ax, (lab, grid) in zip(axes.flat, panels):
        shown = grid.copy()
        if lp_rows:
            shown.index = [lp_label(v) for v in shown.index]
        sns.heatmap(shown, annot=True, fmt=fmt, cmap=cmap, norm=norm, cbar=False, ax=ax, annot_kws={"fontsize": 8},
                    linewidths=0.5, linecolor="white")
        if outline_col is not None and outline_col in list(grid.columns):
            j = list(grid.columns).index(outline_col)
            ax.add_patch(plt.Rectangle((j, 0), 1, len(grid), fill=False, edgecolor="black", lw=1.6, clip_on=False))
        ax.set_title(lab, fontsize=9)
        ax.set_ylabel(labels[0] if ax in axes[:, 0] else "")
        ax.set_xlabel(labels[1])
        ax.grid(False)
        ax.tick_params(axis="y", rotation=0)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    cb = fig.colorbar(sm, ax=axes.ravel().tolist(), shrink=0.85, pad=0.02, label=cbar_label)
    if ticks:
        cb.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
        cb.minorticks_off()
    fig.suptitle(title, fontsize=10)
    notes = [x for x in (outline_label, footnote) if x]
    if notes:
        fig.text(0.45, -0.01, "\n".join(textwrap.wrap("; ".join(notes), 150)), ha="center", va="top", fontsize=7)
    save_figure(fig, name, out, data=data)


def ratio_heatmaps(table: pd.DataFrame, name: str, out: Path, rows: str, cols: str, facet: list[str],
                   value: str = "ratio_vs_sglang_default", systems=("granikv",), title: str = "",
                   labels: tuple[str, str] = ("Lp", "B"), gpu: str = "GPU ?", cbar_label: str = "") -> None:
    """One heatmap per (facet, system) of ``value`` over ``rows`` x ``cols``, all on one colour scale
    centred on 1 with one colour bar. A panel shows the rows and columns that hold a measured value
    (never interpolated); a configuration with fewer than MIN_HEATMAP_CELLS measured cells gets no
    panel and is named below the figure (its cells are in the table)."""
    df = table[table["system"].isin(systems)] if not table.empty else table
    measured = df[(df["status"] == "measured") & pd.to_numeric(df[value], errors="coerce").notna()] \
        if value in df.columns else df.iloc[0:0]
    panels, left, dropped, drawn = [], 0, [], []
    for lab, g in _facets(measured, facet):
        for s in systems:
            gs = g[g["system"] == s]
            if gs.empty:
                continue
            kept, k = one_per_point(gs, [rows, cols])
            left += k
            grid = heatmap_grid(kept, rows, cols, value)
            if not heatmap_ok(grid):
                dropped.append(f"{lab.split('=', 1)[-1]} {s} ({len(kept)} cell{'s' if len(kept) != 1 else ''})")
                continue
            panels.append((f"{lab.split('=', 1)[-1]}: {s}", grid))
            drawn.append(kept.assign(panel=f"{lab}, {s}"))
    if not panels:
        placeholder_figure(name, out, f"no configuration whose measured cells of {value} make a heatmap")
        return
    configs = [lab.split(":")[0] for lab, _ in panels]
    note = f"blank: {NOT_MEASURED}" + _left_out_note(left)
    if dropped:
        note += "; no heatmap (a single row or column, or few cells; in the table): " + ", ".join(dict.fromkeys(dropped))
    data = pd.concat(drawn, ignore_index=True)[["panel", rows, cols, "system", value]]
    draw_heatmaps(panels, name, out, title=title_of(title or value, gpu, configs), footnote=note,
                  cbar_label=cbar_label or value, labels=labels, data=data)


GPU = "gpu"              # the column a figure's frame names the GPU in (per_gpu): one row of panels per GPU
LEGEND_PT = 8            # every legend's font size (figures are read at print size)
MAX_SERIES = 5           # the most series one panel draws


def per_gpu(cells: pd.DataFrame, build) -> pd.DataFrame:
    """``build(cells of one GPU)`` for every GPU the cells ran on (``provenance.gpu_name``), each result
    with the GPU in column ``gpu``, concatenated: a figure's frame where cells of two GPU models are
    never pooled, and each GPU's ratios pair it with its own baseline cells."""
    if cells is None or cells.empty or "provenance.gpu_name" not in cells.columns:
        return build(cells).assign(**{GPU: gpu_names(cells)})
    parts = [build(g).assign(**{GPU: str(name)}) for name, g in cells.groupby("provenance.gpu_name", sort=True)]
    return pd.concat(parts, ignore_index=True) if parts else build(cells).assign(**{GPU: gpu_names(cells)})


def suptitle(fig, text: str, fontsize: int = 10) -> None:
    """The figure's title, wrapped to the figure's width (never cut off at its edges)."""
    width = max(int(fig.get_figwidth() * 72 / (0.6 * fontsize)), 40)
    fig.suptitle("\n".join(textwrap.wrap(text, width)), fontsize=fontsize)


def legend_below(fig, axes, at: tuple[float, float] = (0.5, 0.0), ncol: int | None = None) -> None:
    """One legend below the panels (never over data), centred at ``at`` (figure fraction): every label drawn
    in ``axes``, once, the systems in SYSTEM_ORDER and the paper's markers last. Their axes legends are removed."""
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if handles:    # the paper's markers after the series
        rank = {s: i for i, s in enumerate(SYSTEM_ORDER)}
        handles = dict(sorted(handles.items(), key=lambda kv: (kv[0].startswith("paper"), rank.get(kv[0].split(" (")[0], len(rank)))))
        fig.legend(list(handles.values()), list(handles.keys()), loc="upper center", bbox_to_anchor=at,
                   ncol=ncol or min(len(handles), 4), fontsize=LEGEND_PT, frameon=False)


def _span(xs, x: str, every) -> str:
    """x values as runs of the axis' values: '512-4K, 16K'."""
    every, vals = sorted({float(v) for v in every}), {float(v) for v in xs}
    lab = (lambda v: lp_label(v)) if x == "workload.prefix_len" else show
    runs, cur = [], []
    for v in every:
        if v in vals:
            cur.append(v)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    return ", ".join(lab(r[0]) if len(r) == 1 else f"{lab(r[0])}-{lab(r[-1])}" for r in runs)


def missing_note(drawn: dict, xs_all, x: str, systems) -> str:
    """What a panel lacks: 'Lp 512-4K: not measured; hydragen: not measured; sglang_cascade: not measured at
    Lp 512-8K'; ``drawn``: {system: x values drawn in the panel}, ``xs_all``: the figure's x values."""
    name = SHORT.get(x, x)
    seen = set().union(*drawn.values()) if drawn else set()
    gap = sorted(set(xs_all) - seen)
    parts = [f"{name} {_span(gap, x, xs_all)}: {NOT_MEASURED}"] if gap and seen else []
    absent = [s for s in systems if not drawn.get(s)]
    if absent:
        parts.append(f"{', '.join(absent)}: {NOT_MEASURED}")
    for s in systems:
        miss = seen - set(drawn.get(s, ()))
        if drawn.get(s) and miss:
            parts.append(f"{s}: {NOT_MEASURED} at {name} {_span(miss, x, xs_all)}")
    return "; ".join(parts)


def lines_vs(table: pd.DataFrame, name: str, out: Path, x: str, facet: list[str], value: str = "mean",
             ylabel: str = "output tok/s", title: str = "", logy: bool = False, gpu: str = "GPU ?",
             skip_systems=(), paper: pd.DataFrame | None = None, hline: float | None = None) -> None:
    """One panel per facet (the configurations that have data), one row of panels per GPU where the table
    has a ``gpu`` column (per_gpu) with two or more GPUs: ``value`` vs ``x`` per system (error bars: rep
    min-max when present) on one y axis shared by every panel, Lp ticks 512 ... 16K, one legend below the
    panels; each panel's title names the systems it lacks and where (``not measured``) and says where the
    paper has no value for it; ``paper``: rows (config, x, value, check) drawn as the paper's values in
    their panel; ``hline``: a reference line (e.g. 1.0 for a ratio)."""
    df = table[(table["status"] == "measured")]
    df = df[df[value].notna()] if value in df.columns else df.iloc[0:0]
    df = df[~df["system"].isin(skip_systems)] if not df.empty else df
    gpus = sorted(df[GPU].astype(str).unique(), key=lambda g: (g != PRIMARY_GPU, g)) \
        if GPU in df.columns and not df.empty else []      # the primary GPU model's row of panels first
    rows = [(gname, df[df[GPU].astype(str) == gname]) for gname in gpus] if len(gpus) > 1 else [("", df)]
    panels = [(gname, lab, g) for gname, d in rows for lab, g in _facets(d, facet)]
    # a configuration measured at a single x is a point, not a curve: named below the figure, in the table
    single = [(gname, lab) for gname, lab, g in panels if g[x].nunique() < 2]
    if len(single) < len(panels):
        panels = [p for p in panels if (p[0], p[1]) not in single]
    else:
        single = []
    if not panels:
        placeholder_figure(name, out, f"no measured cells with {value}")
        return
    labs = list(dict.fromkeys(lab for _, lab, _ in panels))
    grows = list(dict.fromkeys(gname for gname, _, _ in panels))
    fig, axes = plt.subplots(len(grows), len(labs), figsize=(3.9 * len(labs), 3.6 * len(grows) + 0.4), squeeze=False,
                             sharey=True)
    colors = system_colors(df["system"].unique())
    systems = system_order(df["system"].unique())
    left_out, drawn = 0, []
    xs_table = table[x].dropna().astype(float) if x in table.columns else df[x].astype(float)
    for gname, lab, g in panels:
        ax = axes[grows.index(gname), labs.index(lab)]
        got = {}
        for s in system_order(g["system"].unique()):
            gs, k = one_per_point(g[g["system"] == s], [x])
            left_out += k
            gs = gs.sort_values(x)
            got[s] = set(gs[x].astype(float))
            yerr = None
            if value == "mean" and {"min", "max"} <= set(gs.columns):
                yerr = np.vstack([(gs["mean"] - gs["min"]).fillna(0), (gs["max"] - gs["mean"]).fillna(0)]).astype(float)
            ax.errorbar(gs[x].astype(float), gs[value].astype(float), yerr=yerr, marker="o", ms=4, label=s, capsize=2,
                        color=colors[s])
            drawn.append(gs.assign(panel=f"{gname}, {lab}" if gname else lab))
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls="--")
        cfg = lab.split("=", 1)[-1]
        notes = [missing_note(got, set(xs_table), x, systems)]
        if paper is not None:
            mine = paper[paper["config"] == cfg] if not paper.empty else paper
            labelled = set()
            for _, p in mine.iterrows():
                if np.isfinite(p["x"]) and np.isfinite(p["value"]):
                    bound = p["check"] if p["check"] in ("bound_ge", "bound_le") else None
                    mark_paper(ax, p["x"], p["value"], label=bound not in labelled, bound=bound)
                    labelled.add(bound)
            if not labelled:
                notes.append(f"no paper value for {cfg}")
        xs = g[x].astype(float)
        if x == "workload.prefix_len":
            lp_axis(ax, xs_table if len(xs_table) else xs)
        else:
            ax.set_xscale("log", base=2)
            vals = sorted(set(xs))
            ax.set_xticks(vals, [show(v) for v in vals])
            ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(SHORT.get(x, x))
        ax.set_ylabel(ylabel if labs.index(lab) == 0 else "")
        ax.yaxis.set_tick_params(labelleft=True)
        head = f"{gname}: {cfg}" if gname else cfg
        ax.set_title("\n".join([head] + textwrap.wrap("; ".join(n for n in notes if n), 52)), fontsize=8.5)
    for r, gname in enumerate(grows):
        for c, lab in enumerate(labs):
            if not any(p[0] == gname and p[1] == lab for p in panels):
                axes[r, c].axis("off")
                axes[r, c].text(0.5, 0.5, f"{gname}: {lab.split('=', 1)[-1]}\n{NOT_MEASURED}", ha="center",
                                va="center", fontsize=9, transform=axes[r, c].transAxes)
    # the GPUs of the drawn rows (a per_gpu frame), not of every cell passed in: a GPU whose cells built no
    # measured row is not drawn, so not named
    suptitle(fig, title_of(title, ", ".join(gpus) if gpus else gpu, [lab.split("=", 1)[-1] for lab in labs]))
    fig.tight_layout()
    legend_below(fig, axes.flat, ncol=min(len(systems) + 2, 6))
    notes = ([_left_out_note(left_out).lstrip("; ")] if left_out else []) + (
        [f"measured at one {SHORT.get(x, x)} only (in the table): "
         + ", ".join(f"{g + ': ' if g else ''}{lab.split('=', 1)[-1]}" for g, lab in single)] if single else [])
    if notes:
        fig.text(0.5, -0.3 / fig.get_figheight() - 0.02, "\n".join(textwrap.wrap("; ".join(notes), 160)),
                 ha="center", va="top", fontsize=8)
    keep = [c for c in ["panel", x, "system", value, "min", "max", "n"] if c in drawn[0].columns] if drawn else []
    save_figure(fig, name, out, data=pd.concat(drawn, ignore_index=True)[keep] if drawn else None)


def _left_out_note(n: int) -> str:
    return f"; {n} point(s) of another configuration at the same coordinates: in the table, not drawn" if n else ""
