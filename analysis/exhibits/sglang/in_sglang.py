"""The paper's four systems inside real SGLang, beside the same four in our engine.

In SGLang: ``sglang_server`` (SGLang default, stock), and three systems served by the granikv plugin's
attention backends (``granikv.sglang_plugin``): ``sglang_server_cascade``
(SGLang-Cascade), ``sglang_server_hydragen`` (HydraGen) and ``sglang_server_granikv`` (GraniKV, with
its radix cache backend). In the engine: ``sglang_default``, ``sglang_cascade``, ``hydragen``,
``granikv``. Same request sets, same replay client.

Rows: per cell set, GPU model (column ``gpu``: every ratio is over the same GPU model's SGLang default, two
GPU models never pool) and system (the paper's name), Llama-3.1-8B TP=1, B=256:
- ``headline``: ShareGPT with one shared prefix, Lp 512 / 2K / 8K / 16K (every other Lp with an
  in-SGLang plugin cell too), the GPU model's own KV budget (its preset, h200 or h100);
- ``hetero k=4``: heterogeneous multi-prefix (2K, 4K, 8K, 16K), burst, the A100-40GB KV budget.

Columns: ``cascade_impl`` (the SGLang-Cascade row: the GPU path it ran inside SGLang; the engine's
baseline runs ``composed``), ``decode_plan`` (how the plugin re-planned FlashInfer's decode wrappers:
``fast`` or ``flashinfer``) and ``decode_graphs`` (``full``: the whole step in SGLang's full decode graphs;
``breakable``: the attention eager at graph breaks); a system has one row per combination it ran
(VARIANTS), never pooled. ``n`` and output tok/s (repetition mean) in SGLang and in the engine, each over its own
SGLang default (``sglang_x``: over real SGLang; ``engine_x``: over the engine's sglang_default), ITL
and TTFT p50 in SGLang, the requests a burst's server held back (``held_back``, mean per cell, and ``held_back_s``, the
seconds their tail added to the burst's makespan, mean per cell: analysis.measures.admission; NaN where the cells are
not one burst), and the plugin's own counters over the measured window: the share of decode
rows by path, and the host time per planned decode step, whole (``plan_us``: prefix read + KV index
list + step plan + FlashInfer's plan calls) and by stage, and the median (and p90) host time per replayed decode
step (``host_p50_us``; ``own_*``: less SGLang's own rest-decode plan). A counter the cell did not record (an
older cell without the stage split, or a run whose counter file was never rewritten) is NaN. A plugin row
holds the cells of ONE code version, the one its point measured last (``older_versions``: the cells of
earlier versions left out, never pooled with them). Its ``sglang_x`` divides by the SGLang-default cells of the
same run (measured at that code version, on the same machine; ``base_run`` ``same``, ``n_base`` of them) where
the point has them, else by every SGLang-default cell of the point (``pooled``); the SGLang-default row itself
pools every run.

Writes tables/in_sglang.{csv,md} and figures/in_sglang.{png,pdf,csv} (one GPU model, the others named).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (NOT_MEASURED, THROUGHPUT, aggregate, placeholder_figure, plt, save_figure, select,
                             sort_rows, with_derived, write_table)
from analysis.gpu import GPU, gpu_names, one_gpu, ordered, with_gpu
from analysis.load import Results
from analysis.measures.admission import COLUMNS as HELD, with_held_back
from analysis.measures.sglang import (BASE, COMMIT, HOST_QUANTILES, PATHS, STAGES, SYSTEMS, VARIANTS, latest_version,
                                     plugin_counters, variant_keys, with_graph_form, without_ablations)
from analysis.paper import paper_claims
from analysis.plots import legend_below, lp_axis, mark_paper, suptitle, system_colors, title_of
from analysis.registry import register_exhibit



NAME = "in_sglang"
FIGURES = (NAME,)
COMMON = {"model.name": "=llama3_8b", "tp": "=1", "workload.batch": "=256", "instrumented": "=False"}
SETS = {"headline": {"workload.kind": "=sharegpt", "workload.num_prefixes": "=1", "hardware.name": "=h200|h100"},
        "hetero k=4": {"workload.kind": "=multiprefix", "workload.prefix_lens": "=notnull",
                       "workload.num_prefixes": "=4", "hardware.name": "=a100_40gb|a100_40gb_on_h100"}}
HEADLINE_LPS = (512, 2048, 8192, 16384)      # the Lp every in-SGLang system is planned at
COLS = ["set", GPU, "workload.prefix_len", "system", "cascade_impl", "decode_plan", "decode_graphs", "n_sglang", "sglang_tok_s", "sglang_x", "n_base", "base_run", "n_engine", "engine_tok_s",
        "engine_x", "sglang_itl_p50_ms", "sglang_ttft_p50_ms", *HELD, *[f"rows_{p}" for p in PATHS], "plan_us",
        *[f"{s}_us" for s in STAGES], *HOST_QUANTILES, "older_versions", "status"]


def _mean(df: pd.DataFrame, system: str, metric: str) -> tuple[float, int]:
    a = aggregate(df[df["system"] == system], ["system"], metric)
    return (float(a["mean"].iloc[0]), int(a["n"].iloc[0])) if len(a) else (np.nan, 0)


def in_sglang_table(res: Results) -> pd.DataFrame:
    """One row per (cell set, GPU model, Lp, paper system); ``not measured`` rows for planned points without a
    cell (per GPU model with cells in the set; without a GPU model where the set has none)."""
    cells = with_graph_form(with_gpu(with_derived(without_ablations(res.cells)))) if not res.cells.empty else res.cells
    if "system.dispatch" in cells.columns:   # a forced path (dispatch=*_only, engine or plugin) is an ablation
        cells = cells[cells["system.dispatch"].fillna("table") == "table"]
    rows = []
    for name, sel in SETS.items():
        df = with_held_back(select(cells, {**COMMON, **sel}), res.root) if not cells.empty else cells
        for gpu in (ordered(df[GPU]) if not df.empty else [None]):
            rows += set_rows(name, df[df[GPU] == gpu] if gpu else df, gpu)
    t = pd.DataFrame(rows, columns=COLS)
    t["_earlier"] = [0 if is_current(r) else 1 for _, r in t.iterrows()] if len(t) else []   # today's settings first
    return sort_rows(t, ["set", GPU, "workload.prefix_len", "system", "_earlier", *VARIANTS]).drop(columns="_earlier")


def set_rows(name: str, df: pd.DataFrame, gpu: str | None) -> list[dict]:
    """The rows of cell set ``name`` from ``df``, its cells on one GPU model ``gpu`` (None: no cell)."""
    plugin = {s for s, _ in SYSTEMS.values()} - {SYSTEMS[BASE][0]}
    lps = set(HEADLINE_LPS) if name == "headline" else set()
    if not df.empty:
        lps |= {int(v) for v in df[df["system"].isin(plugin)]["workload.prefix_len"].dropna()}
    if not lps:
        return [{"set": name, GPU: gpu, "system": p, "n_sglang": 0, "status": NOT_MEASURED} for p in SYSTEMS]
    rows = []
    for lp in sorted(lps):
        at = df[df["workload.prefix_len"] == lp] if not df.empty else df
        base = at[at["system"] == SYSTEMS[BASE][0]] if not at.empty else at
        eng_base = _mean(at, SYSTEMS[BASE][1], THROUGHPUT)[0] if not at.empty else np.nan
        for paper, (in_sgl, eng) in SYSTEMS.items():
            e_tok, n_e = _mean(at, eng, THROUGHPUT) if not at.empty else (np.nan, 0)
            ours = at[at["system"] == in_sgl] if not at.empty else at
            for var, every in variants(ours, paper):
                mine = every[latest_version(every, pd.Series("", index=every.index))] if paper != BASE else every
                s_tok, n_s = _mean(mine, in_sgl, THROUGHPUT) if not mine.empty else (np.nan, 0)
                ref, run = same_run(base, mine) if paper != BASE else (base, "")
                real = _mean(ref, SYSTEMS[BASE][0], THROUGHPUT)[0] if not ref.empty else np.nan
                rows.append({"set": name, GPU: gpu, "workload.prefix_len": lp, "system": paper, **var,
                             "n_sglang": n_s, "sglang_tok_s": s_tok, "sglang_x": s_tok / real, "n_base": len(ref),
                             "base_run": run, "n_engine": n_e,
                             "engine_tok_s": e_tok, "engine_x": e_tok / eng_base,
                             "sglang_itl_p50_ms": _mean(mine, in_sgl, "itl_p50_ms")[0] if n_s else np.nan,
                             "sglang_ttft_p50_ms": _mean(mine, in_sgl, "ttft_p50_ms")[0] if n_s else np.nan,
                             **{c: float(mine[c].mean()) if n_s and c in mine.columns else np.nan for c in HELD},
                             **plugin_counters(mine), "older_versions": len(every) - len(mine),
                             "status": "measured" if n_s else NOT_MEASURED})
    return rows


def same_run(base: pd.DataFrame, mine: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The SGLang-default cells a plugin row is divided by: those of ``base`` measured at a code version of the
    row's cells ``mine`` (the same run, on the same machine: ``same``) where there are any, else all of
    ``base`` (``pooled``: SGLang was not measured beside that version); ``""`` for a row without cells."""
    if mine.empty or base.empty or COMMIT not in base.columns:
        return base, "" if mine.empty else "pooled"
    paired = base[base[COMMIT].astype(str).isin(set(mine[COMMIT].astype(str)))]
    return (paired, "same") if len(paired) else (base, "pooled")


def variants(ours: pd.DataFrame, paper: str) -> list[tuple[dict, pd.DataFrame]]:
    """``ours`` (one system's cells at one point) split by the plugin settings it ran with: one
    (values, cells) per distinct combination, today's first; ("", ...) for a key that does not
    apply. No cells: one empty group (the point's ``not measured`` row)."""
    blank = {k: "" for k in VARIANTS}
    keys = [k for k in variant_keys(paper) if f"system.{k}" in ours.columns]
    if ours.empty or not keys:
        return [(blank, ours)]
    vals = ours[[f"system.{k}" for k in keys]].astype(object).where(ours[[f"system.{k}" for k in keys]].notna(), "")
    combos = sorted({tuple(str(v) for v in r) for r in vals.itertuples(index=False)},
                    key=lambda c: (c != tuple(VARIANTS[k] for k in keys), c))
    out = []
    for combo in combos:
        mask = np.logical_and.reduce([vals[f"system.{k}"].astype(str) == v for k, v in zip(keys, combo)])
        out.append(({**blank, **dict(zip(keys, combo))}, ours[mask]))
    return out


def _value(row: pd.Series, k: str) -> str:
    v = row.get(k, "")
    return v if isinstance(v, str) else ""            # missing (a not-measured row): does not apply


def is_current(row: pd.Series) -> bool:
    """Whether a table row ran with today's plugin settings (VARIANTS; "" = does not apply)."""
    return all(_value(row, k) in ("", v) for k, v in VARIANTS.items())


def _setting(row: pd.Series) -> str:
    """A row's plugin settings where they are not today's ('' for today's): 'multilevel, flashinfer'."""
    return ", ".join(_value(row, k) for k, v in VARIANTS.items() if _value(row, k) not in ("", v))


def _series(h: pd.DataFrame) -> tuple[list, list]:
    """The headline rows as (label, system, rows) series: per system, its main series (today's settings, else
    the one it ran), then the rows of its other settings."""
    main, other = [], []
    h = h.assign(**{k: h[k].where(h[k].map(lambda v: isinstance(v, str)), "") for k in VARIANTS})
    for paper, g in h.groupby("system", sort=False):
        runs = [(_setting(r.iloc[0]), r.sort_values("workload.prefix_len"))
                for _, r in g.groupby(list(VARIANTS), sort=False)]
        runs.sort(key=lambda sr: (not is_current(sr[1].iloc[0]), sr[0]))
        for i, (setting, r) in enumerate(runs):
            (main if i == 0 else other).append((f"{paper} ({setting})" if setting else paper, paper, r))
    order = {s: i for i, s in enumerate(SYSTEMS)}
    return sorted(main, key=lambda x: order.get(x[1], 99)), sorted(other, key=lambda x: order.get(x[1], 99))


def _other_gpu_today(m: pd.DataFrame, gpu: str) -> tuple[str | None, list]:
    """The first GPU model other than ``gpu`` (analysis.gpu.ordered) with headline rows of the plugin's systems
    at today's settings (VARIANTS), and its series: (label, system, rows), SGLang default's included."""
    h = m[(m["set"] == "headline") & (gpu_names(m) != gpu)]
    for name in ordered(gpu_names(h)):
        series = [x for x in _series(h[gpu_names(h) == name])[0] if is_current(x[2].iloc[0])]
        if any(paper != BASE for _, paper, _ in series):
            return name, series
    return None, []


def draw(t: pd.DataFrame, out: Path) -> None:
    """Headline: output tok/s in SGLang and in the engine (one panel each, one y axis), each system over its
    own SGLang default in SGLang (today's plugin settings), in the engine, and in SGLang with other plugin
    settings (one y axis for the three); heterogeneous k=4 as horizontal bars (in SGLang / engine; the right
    column's GPU model's rows at today's settings among them, its name under their label). One GPU
    model's rows (analysis.gpu.one_gpu); where another GPU model ran the plugin with today's settings, a column of
    its own on the right (its tok/s in SGLang, and each system over its own SGLang default, with our engine's
    GraniKV over the engine's sglang_default on that GPU model, dashed grey, where measured; on the y axes of the
    first GPU's panels: beside, never pooled); any further GPU model is named in the title."""
    m = t[t["status"] == "measured"]
    h, gpu, other_gpus = one_gpu(m[m["set"] == "headline"])
    if h.empty:
        placeholder_figure(NAME, out, "no in-SGLang plugin cells on the headline workload")
        return
    second, drawn = _other_gpu_today(m, gpu)
    short = second.replace("NVIDIA ", "").split(" ")[0] if second else ""   # "H100": the second GPU in labels
    m = m[gpu_names(m) == gpu]
    col = system_colors(SYSTEMS)
    fig, axes = plt.subplots(2, 4 if second else 3, figsize=(18.5 if second else 14, 8.2))
    (a, e, c, *d), (b, f, o, *g) = axes
    e.sharey(a)
    f.sharey(b)
    o.sharey(b)
    main, other = _series(h)
    for lab, paper, rows in main:
        x = rows["workload.prefix_len"].astype(int)
        a.plot(x, rows["sglang_tok_s"], marker="o", color=col[paper], label=lab)
        e.plot(x, rows["engine_tok_s"], marker="s", ls="--", color=col[paper], label=paper)
        if paper != BASE:
            b.plot(x, rows["sglang_x"], marker="o", color=col[paper], label=lab)
            f.plot(x, rows["engine_x"], marker="s", ls="--", color=col[paper], label=paper)
    for lab, paper, rows in other:
        o.plot(rows["workload.prefix_len"].astype(int), rows["sglang_x"], marker="^", ls="-.", color=col[paper],
               label=lab)
    titles = {a: "output tok/s in SGLang", e: "output tok/s in the engine",
              b: "in SGLang, over real SGLang default", f: "in the engine, over the engine's sglang_default",
              o: "in SGLang, other plugin settings (in the table)"}
    if second:
        (d,), (g,) = d, g
        d.sharey(a)
        g.sharey(b)
        for lab, paper, rows in drawn:     # each over its own GPU model's SGLang default
            x = rows["workload.prefix_len"].astype(int)
            d.plot(x, rows["sglang_tok_s"], marker="D", color=col[paper], label=lab)
            if paper != BASE:
                g.plot(x, rows["sglang_x"], marker="D", color=col[paper], label=lab)
            if paper == "granikv" and rows["engine_x"].notna().any():   # the engine's own ratio on that GPU model
                e_rows = rows[rows["engine_x"].notna()]
                g.plot(e_rows["workload.prefix_len"].astype(int), e_rows["engine_x"], marker="s", ls="--", color="0.4",
                       label=f"{paper} in the engine, {short}")
        titles[d] = f"{second}: output tok/s in SGLang"
        titles[g] = f"{second}: in SGLang, over its real SGLang default"
    claim = paper_claims(["headline_llama8b_in_sglang"])
    if len(claim) and np.isfinite(claim["value"].iloc[0]):
        for ax in [b] + ([g] if second else []):
            mark_paper(ax, 16384, float(claim["value"].iloc[0]))
    lps = pd.concat([h["workload.prefix_len"]] + [rows["workload.prefix_len"] for _, _, rows in drawn]).astype(int)
    for ax, tt in titles.items():
        ax.set_xlabel("shared prefix Lp (tokens)")
        ax.set_ylabel("output tok/s" if "tok/s" in tt else "output throughput / own SGLang default")
        lp_axis(ax, lps)
        ax.set_title(tt, fontsize=9)
        if "over" in tt or ax is o:
            ax.axhline(1.0, color="0.5", lw=0.8)
    if not other:
        o.text(0.5, 0.5, "no cells with other settings", ha="center", va="center", transform=o.transAxes)
    k = m[(m["set"] == "hetero k=4") & (m["system"] != BASE)]
    if second:      # the right column's GPU model: its heterogeneous rows at today's settings, over its own default
        k2 = t[(t["status"] == "measured") & (t["set"] == "hetero k=4") & (t["system"] != BASE)
               & (gpu_names(t) == second)]
        k2 = k2[[is_current(r) for _, r in k2.iterrows()]]
        k = pd.concat([k.assign(_gpu=""), k2.assign(_gpu=short)])
    k = k.assign(_gpu=k["_gpu"] if "_gpu" in k.columns else "").iloc[::-1]
    if k.empty:
        c.axis("off")
        c.text(0.5, 0.5, f"hetero k=4: {NOT_MEASURED}", ha="center", va="center")
    else:
        ys = np.arange(len(k))
        c.barh(ys + 0.2, k["sglang_x"], 0.4, color=[col[s] for s in k["system"]])
        c.barh(ys - 0.2, k["engine_x"], 0.4, color=[col[s] for s in k["system"]], alpha=0.45, hatch="//")
        for key in (dict(label="in SGLang"), dict(alpha=0.45, hatch="//", label="in the engine")):
            c.add_patch(plt.Rectangle((0, 0), 0, 0, facecolor="0.35", **key))   # legend keys (the colours: systems)
        c.set_yticks(ys, [s + "\n" + ", ".join(v for v in var if isinstance(v, str) and v)
                          for s, *var in k[["system", *VARIANTS, "_gpu"]].itertuples(index=False)], fontsize=7)
        c.axvline(1.0, color="0.5", lw=0.8)
        c.set_xlabel("output throughput / own SGLang default")
        c.set_title("heterogeneous k=4, A100-40GB KV budget", fontsize=9)
    rest = [x for x in other_gpus if x != second]
    also = (f" (right column: today's plugin on {second}, over its own SGLang default)" if second else "") \
        + (f" (also measured on {', '.join(rest)}: in the table)" if rest else "")
    suptitle(fig, title_of("The four systems inside real SGLang (plugin) and in the engine, headline ShareGPT B=256",
                           gpu, ["Llama-3.1-8B TP=1"]) + also)
    fig.tight_layout(h_pad=2.0)
    legend_below(fig, [a, b, o] + ([d, g] if second else []), (0.36, 0.0), ncol=4)
    if not k.empty:
        legend_below(fig, [c], (0.86, 0.0), ncol=1)
    data = pd.concat([m] + [rows for _, _, rows in drawn])
    save_figure(fig, NAME, out, data=data[["set", GPU, "workload.prefix_len", "system", *VARIANTS, "sglang_tok_s",
                                        "sglang_x", "engine_tok_s", "engine_x"]])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figure); return the table."""
    t = in_sglang_table(res)
    write_table(t, NAME, out, {"sglang_tok_s": 0, "engine_tok_s": 0, "sglang_x": 2, "engine_x": 2,
                               "sglang_itl_p50_ms": 1, "sglang_ttft_p50_ms": 0, "held_back": 2, "held_back_s": 2,
                               **{f"rows_{p}": 2 for p in PATHS},
                               "plan_us": 0, **{f"{s}_us": 0 for s in STAGES}, **{c: 0 for c in HOST_QUANTILES}},
                title="The four systems inside real SGLang (granikv plugin) and in our engine, Llama-3.1-8B TP=1, B=256",
                note="sglang_x: output throughput over real SGLang default (sglang_server) on the same requests, "
                     "its cells of the same run (the same code version and machine session: base_run same, n_base "
                     "cells) where the point has them, else every run's (pooled); "
                     "engine_x: the engine's system over the engine's sglang_default. held_back: requests of a burst "
                     "admitted only after another request of it had finished (mean per cell), held_back_s: the seconds "
                     "their tail added to the makespan (mean per cell; NaN: not a burst). rows_*: share of the plugin's "
                     "decode rows by path; plan_us: host time per planned decode step (prefix read + KV index list + "
                     "step plan + FlashInfer's plan calls), then by stage (make includes the dispatcher, dispatch); "
                     "host_p50_us: median host time per replayed decode step (split or not), own_p50_us / own_p90_us: "
                     "its plugin part (less SGLang's own rest-decode plan), from the cells' pooled histograms "
                     "(a bin's upper edge, within 9%); "
                     "cascade_impl: the GPU path SGLang-Cascade ran inside SGLang (the engine's runs composed: "
                     "batch prefill + tensor-core decode + merge; multilevel: FlashInfer's MultiLevelCascadeAttentionWrapper, "
                     "slower in kernel and plan time); decode_plan: how the plugin re-planned FlashInfer's decode "
                     "wrappers each step (fast: FlashInfer's fast_decode_plan, as SGLang's own backend; flashinfer: "
                     "the wrapper's plan(), a Python max() over the batch included); one row per setting, never pooled; "
                     "a plugin row's cells are of one code version, the last its point was measured at "
                     "(older_versions: cells of earlier versions left out); "
                     "NaN: not recorded. headline: ShareGPT, one shared prefix, the GPU model's own KV budget (its preset); hetero k=4: prefixes "
                     "2K/4K/8K/16K, burst, A100-40GB KV budget (Lp column: the workload's nominal Lp).")
    if figures:
        draw(t, out)
    return t
