"""Which repetitions the analysis uses: a repetition whose measured run captured CUDA graphs is set
aside when the same configuration has a repetition that did not; and a superseded sweep's cells are
set aside where the rerun that supersedes it has the same configuration (:func:`prefer_rerun`).

SGLang captures every CUDA graph before it serves; our engine captures a graph the first time a
batch shape needs it. Before the graph-key fix and the capture-at-second-use policy,
some runs captured graphs inside the measured window (``cuda_graph_capture_s`` in metrics.json),
which lengthens their steps: the REPORT lists that time by system and code version. Such a run is
still a measurement and stays in ``results/raw``; but where a later repetition of the same
configuration ran without it, averaging the two would mix the artefact into the number. So
:func:`prefer_clean` keeps, per configuration (every identity column, the system included), the
repetitions whose capture share of the run is below ``CAPTURE_LIMIT`` whenever there is at least
one, and moves the others to ``Results.set_aside``. A configuration measured only with capture keeps
its repetitions (there is nothing better to use; the REPORT names the share). An instrumented cell
(profiler or nsys on, ``with_derived``'s ``instrumented``) is a different measurement from a plain one
of the same configuration: neither ever stands in for the other.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from analysis.common import NULL, identity, with_derived
from analysis.load import Results
from runners.campaign import expand, load_campaign



CAPTURE_LIMIT = 0.01   # capture time / run time at which a repetition counts as affected (REPORT's capture_check too)


def capture_share(cells: pd.DataFrame) -> pd.Series:
    """cuda_graph_capture_s / duration_s per cell (NaN where either is missing: unknown, not affected)."""
    if cells.empty or not {"cuda_graph_capture_s", "duration_s"} <= set(cells.columns):
        return pd.Series(float("nan"), index=cells.index)
    return pd.to_numeric(cells["cuda_graph_capture_s"], errors="coerce") / pd.to_numeric(cells["duration_s"], errors="coerce")


def prefer_clean(res: Results, limit: float = CAPTURE_LIMIT) -> Results:
    """``res`` with the affected repetitions of partly clean configurations moved from ``cells`` to
    ``set_aside`` (which gains ``capture_share`` and ``set_aside_for``: the path of a clean repetition)."""
    c = res.cells
    if c.empty or "kind" not in c.columns:
        return res
    share = capture_share(c)
    serving = c["kind"] == "serving"
    keys = config_keys(c, res.config_columns)
    affected = serving & (share >= limit)
    clean = serving & ~(share >= limit)
    clean_path = c.loc[clean].groupby(keys[clean])["path"].first()
    drop = affected & keys.isin(clean_path.index)
    if not drop.any():
        return res
    aside = c[drop].assign(capture_share=share[drop], set_aside_for=keys[drop].map(clean_path))
    return replace(res, cells=c[~drop].reset_index(drop=True),
                   set_aside=pd.concat([res.set_aside, aside], ignore_index=True) if not res.set_aside.empty else
                   aside.reset_index(drop=True))


def config_keys(c: pd.DataFrame, config_columns) -> pd.Series:
    """One string per cell naming its configuration (every identity column; instrumented apart)."""
    ids = identity(c, config_columns)
    keys = c[ids].astype(object).where(c[ids].notna(), NULL).astype(str).agg("\x1f".join, axis=1) if ids else \
        pd.Series("", index=c.index)
    return keys + with_derived(c)["instrumented"].map({True: "\x1finstrumented", False: ""})


def supersessions(campaign=None) -> dict[str, list[str]]:
    """Sweep folder -> the older sweep folders whose cells it replaces (conf/campaign.yaml ``supersedes``)."""

    out: dict[str, list[str]] = {}
    for item in load_campaign() if campaign is None else campaign:
        if item.supersedes:
            cells = expand(item)
            if cells:
                out.setdefault(cells[0].sweep_name, []).extend(item.supersedes)
    return out


def prefer_rerun(res: Results, campaign=None) -> Results:
    """``res`` with the cells of a superseded sweep moved to ``set_aside`` wherever the sweep that
    supersedes it (a campaign item's ``supersedes``) has a finished cell of the same configuration
    (``set_aside_for``: that cell's path; ``superseded_by``: its sweep). A configuration the rerun has
    not reached keeps its older cells. The cells stay in results/raw; the REPORT lists them."""
    c = res.cells
    pairs = supersessions(campaign) if not c.empty and "sweep" in c.columns else {}
    if not pairs:
        return res
    keys = config_keys(c, res.config_columns)
    drop = pd.Series(False, index=c.index)
    by = pd.Series(None, index=c.index, dtype=object)
    to = pd.Series(None, index=c.index, dtype=object)
    for new, olds in pairs.items():
        fresh = c["sweep"] == new
        if not fresh.any():
            continue
        first = c.loc[fresh].groupby(keys[fresh])["path"].first()
        hit = c["sweep"].isin(olds) & keys.isin(first.index) & ~drop
        drop |= hit
        by[hit] = new
        to[hit] = keys[hit].map(first)
    if not drop.any():
        return res
    aside = c[drop].assign(superseded_by=by[drop], set_aside_for=to[drop])
    return replace(res, cells=c[~drop].reset_index(drop=True),
                   set_aside=pd.concat([res.set_aside, aside], ignore_index=True) if not res.set_aside.empty else
                   aside.reset_index(drop=True))


ASIDE_COLUMNS = ["capture_share", "set_aside_for", "superseded_by"]


def all_cells(res: Results) -> pd.DataFrame:
    """Every finished cell, set aside or not (for bookkeeping: coverage, counts, the capture summary)."""
    if res.set_aside.empty:
        return res.cells
    return pd.concat([res.cells, res.set_aside.drop(columns=ASIDE_COLUMNS, errors="ignore")],
                     ignore_index=True).sort_values(["sweep", "cell_id"], kind="stable").reset_index(drop=True)


def set_aside_line(res: Results) -> str:
    """One REPORT line: how many repetitions were set aside, by sweep and system, and the rule."""
    a = res.set_aside
    if a.empty:
        return ""
    out = []
    sup = a["superseded_by"].notna() if "superseded_by" in a.columns else pd.Series(False, index=a.index)
    cap = a[~sup]
    if not cap.empty:
        g = cap.groupby(["sweep", "system.name"]).agg(n=("path", "size"), lo=("capture_share", "min"),
                                                      hi=("capture_share", "max"))
        parts = [f"{sw} {sy}: {int(r['n'])} ({r['lo']:.1%}-{r['hi']:.1%} of the run)" for (sw, sy), r in g.iterrows()]
        out.append(f"Repetitions set aside ({len(cap)}): a repetition whose measured run spent {CAPTURE_LIMIT:.0%} or more "
                   "of its time capturing CUDA graphs is left out of every table and claim when the same configuration "
                   "has a repetition that did not (analysis/clean.py; the cells stay in results/raw): "
                   + "; ".join(parts) + ".")
    if sup.any():
        g = a[sup].groupby(["superseded_by", "sweep"]).size()
        parts = [f"{n} of {sw} by {by}" for (by, sw), n in g.items()]
        out.append(f"Cells superseded ({int(sup.sum())}): where a rerun sweep that supersedes an older one "
                   "(conf/campaign.yaml `supersedes`) has a cell of the same configuration, the older sweep's cells of "
                   "that configuration are left out of every table and claim (analysis/clean.py prefer_rerun; they "
                   "stay in results/raw): " + "; ".join(parts) + ".")
    return " ".join(out)
