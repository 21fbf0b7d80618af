"""Campaign coverage: every cell that ``conf/campaign.yaml`` plans, against the raw results.

``runners.campaign.expand`` lists the cells each campaign item's sweep runs (the preset's sweeper params x
the item's overrides, composed as ``runners.run`` composes them). A planned cell is

- ``measured``: a finished cell in its sweep folder agrees with it on the identity keys
  (``runners.campaign.IDENTITY`` and the keys its overrides set) and on every setting of today's preset;
- ``measured, other settings``: a finished cell agrees on the identity keys but ran with settings the
  preset has since changed (named in ``settings_then_now``); the tables use it, and ``force=true``
  reruns it with today's settings;
- ``failed``: only a ``failure.json`` or unfinished folder;
- ``missing``: nothing.

Matching is by config values, not folder names, so a cell launched with extra overrides (say
``hardware=h200`` spelt out) still counts. Writes ``tables/coverage.{csv,md}`` (one row per item: counts,
what is missing, the command that runs it) and ``tables/coverage_cells.{csv,md}`` (one row per planned cell,
with the command that runs that cell alone).

    python -m analysis.coverage [--results results/raw] [ITEM ...]   # the same, printed per item
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.clean import all_cells
from analysis.common import norm_value, write_table
from analysis.load import ADDED_CONFIG_DEFAULTS, ADDED_SERVER_DEFAULTS, Results, load_results
from analysis.registry import register_exhibit
from runners.campaign import CampaignItem, PlannedCell, expand, load_campaign

NAME = "coverage"
TABLES = (NAME, f"{NAME}_cells")
FIGURES: tuple[str, ...] = ()
MEASURED, OTHER, FAILED, MISSING = "measured", "measured, other settings", "failed", "missing"
SHOWN_MAX = 24    # a setting's value longer than this is named, not shown (decision tables)


class _Columns:
    """A frame's columns as lists of Python scalars (what iterating a column gives), each read once: the
    frames are wide (every config key and metric), and a campaign item matches many planned cells."""

    def __init__(self, frame: pd.DataFrame):
        self.frame, self._lists = frame, {}

    def __contains__(self, key: str) -> bool:
        return key in self.frame.columns

    def __getitem__(self, key: str) -> list:
        if key not in self._lists:
            self._lists[key] = self.frame[key].tolist()
        return self._lists[key]


def _matching(frame: _Columns, cell: PlannedCell) -> list[int]:
    """Positions (``iloc``) of the rows of ``frame`` (cells or failures) in the planned cell's sweep folder
    with its identity."""
    if frame.frame.empty or "sweep" not in frame:
        return []
    rows = [i for i, s in enumerate(frame["sweep"]) if s == cell.sweep_name]
    for k, v in cell.identity.items():
        if not rows:
            break
        want = norm_value(v)
        col = frame[k] if k in frame else None
        rows = [i for i in rows if norm_value(None if col is None else col[i]) == want]
    return rows


def _shown(v) -> str:
    s = "-" if norm_value(v) is None else (f"{v:g}" if isinstance(v, (float, np.floating)) else str(v))
    return s if len(s) <= SHOWN_MAX else "(changed)"


def settings_diff(row: pd.Series | dict, cell: PlannedCell) -> dict[str, str]:
    """The settings a finished cell ran with that differ from today's preset: key -> "then -> now".
    ``row``: the cell's values by column (a row of ``Results.cells``, or a dict of its columns)."""
    out = {}
    for k, now in cell.settings.items():
        # a key no finished cell has yet was added after them: they ran its default
        then = row[k] if k in row.keys() else {**ADDED_CONFIG_DEFAULTS, **ADDED_SERVER_DEFAULTS}.get(k)
        if norm_value(then) != norm_value(now):
            out[k] = f"{_shown(then)} -> {_shown(now)}"
    return out


def cell_rows(res: Results, item: CampaignItem) -> list[dict]:
    """One row per planned cell of ``item``: status, finished cells found, their commits, settings changed."""
    rows = []
    cells, failures = _Columns(res.cells), _Columns(res.failures)
    for cell in expand(item):
        done = _matching(cells, cell)
        present = [k for k in cell.settings if k in cells]
        diffs = [settings_diff({k: cells[k][i] for k in present}, cell) for i in done]
        if any(not d for d in diffs):
            status, diff = MEASURED, {}
        elif diffs:
            status, diff = OTHER, min(diffs, key=len)
        else:
            status, diff = (FAILED if _matching(failures, cell) else MISSING), {}
        found = [cells["provenance.git_commit"][i] for i in done] if "provenance.git_commit" in cells else []
        commits = sorted({str(c)[:7] for c in found if not pd.isna(c)})
        own = [o for o in cell.overrides if not o.startswith("sweep=")] + (["force=true"] if len(done) else [])
        rows.append({"item": item.id, "sweep": cell.sweep_name, "cell_id": cell.cell_id, "status": status,
                     "cells": len(done), "commits": " ".join(commits),
                     "settings_then_now": "; ".join(f"{k}: {v}" for k, v in sorted(diff.items())),
                     "command": item.local_command(own), "_overrides": cell.overrides})
    return rows


def _axes(item: CampaignItem, cells: list[dict]) -> dict[str, list[str]]:
    """The swept keys (not the item's fixed overrides) and the values the given cells take, in launch order."""
    fixed = {o.split("=", 1)[0] for o in item.overrides} | {"sweep"}
    axes: dict[str, list[str]] = {}
    for c in cells:
        for o in c["_overrides"]:
            k, v = o.split("=", 1)
            if k not in fixed and v not in axes.setdefault(k, []):
                axes[k].append(v)
    return axes


def missing_command(item: CampaignItem, rows: list[dict]) -> tuple[str, str]:
    """(the missing cells as swept values, the device command for them). The sweep's axes are cut to the
    values the missing cells take; cells of that product already measured are skipped when it runs."""
    miss = [r for r in rows if r["status"] in (MISSING, FAILED)]
    if not miss:
        return "", ""
    full, cut = _axes(item, rows), _axes(item, miss)
    cut = {k: [x for x in full[k] if x in v] for k, v in cut.items()}   # in the sweep's own order
    restrict = [f"{k}={','.join(v)}" for k, v in cut.items() if v != full.get(k)]
    covered = math.prod(len(v) for v in cut.values()) if cut else 1
    what = "; ".join(restrict) or "every swept value"
    if covered > len(miss):
        what += f" ({covered} cells, {covered - len(miss)} of them measured and skipped)"
    return what, item.device_command(item.overrides + restrict)


_LAST: dict = {}


def tables(res: Results, campaign: list[CampaignItem] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per campaign item, one row per planned cell) for ``campaign`` (default conf/campaign.yaml);
    the module's table and the report's section share one computation per Results."""
    if campaign is not None:
        return _tables(res, campaign)
    if _LAST.get("res") is not res:
        _LAST.update(res=res, out=_tables(res, load_campaign()))
    return _LAST["out"]


def _tables(res: Results, campaign: list[CampaignItem]) -> tuple[pd.DataFrame, pd.DataFrame]:
    if not res.set_aside.empty:    # a repetition set aside by analysis.clean was still measured
        res = replace(res, cells=all_cells(res), set_aside=pd.DataFrame())
    items, all_rows = [], []
    for item in campaign:
        rows = cell_rows(res, item)
        all_rows += rows
        n = pd.Series([r["status"] for r in rows], dtype=object).value_counts()
        changed = sorted({kv for r in rows for kv in r["settings_then_now"].split("; ") if kv})
        what, cmd = missing_command(item, rows)
        sweeps = {r["sweep"] for r in rows}
        in_folder = 0 if res.cells.empty else int(res.cells["sweep"].isin(sweeps).sum())
        items.append({"item": item.id, "issue": item.issue, "gpus": item.gpus, "what": item.what,
                      "planned": len(rows), "measured": int(n.get(MEASURED, 0)), "other_settings": int(n.get(OTHER, 0)),
                      "failed": int(n.get(FAILED, 0)), "missing": int(n.get(MISSING, 0)),
                      "unplanned_cells": max(in_folder - sum(r["cells"] for r in rows), 0),
                      "settings_then_now": "; ".join(changed), "missing_cells": what, "command": cmd})
    cells = pd.DataFrame(all_rows).drop(columns="_overrides") if all_rows else pd.DataFrame()
    return pd.DataFrame(items), cells


def lines(t: pd.DataFrame) -> list[str]:
    """One line per item for REPORT.md and the CLI."""
    out = []
    for _, r in t.iterrows():
        s = (f"`{r['item']}` ({r['gpus']} GPU{'s' if r['gpus'] > 1 else ''}; {r['what']}): "
             f"{r['measured'] + r['other_settings']} of {r['planned']} cells measured")
        if r["other_settings"]:
            s += f" ({r['other_settings']} with settings since changed: {r['settings_then_now']})"
        if r["failed"]:
            s += f", {r['failed']} failed"
        if r["missing"] or r["failed"]:
            s += f", {r['missing']} missing: {r['missing_cells']}; run `{r['command']}`"
        if r["unplanned_cells"]:
            s += f"; {r['unplanned_cells']} more finished cells in its folder outside the plan"
        out.append(s + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.coverage",
                                 description="What each campaign item (conf/campaign.yaml) has measured and misses.")
    ap.add_argument("--results", default="results/raw", help="raw results folder (default results/raw)")
    ap.add_argument("--out", default=None, help="also write tables/coverage* under this folder")
    ap.add_argument("items", nargs="*", help="item ids (default: all)")
    a = ap.parse_args(argv)
    known = [it.id for it in load_campaign()]
    if bad := [i for i in a.items if i not in known]:
        ap.error(f"unknown item(s) {bad}; conf/campaign.yaml has: {', '.join(known)}")
    res = load_results(a.results)
    t = build(res, Path(a.out)) if a.out else tables(res)[0]
    if a.items:
        t = t[t["item"].isin(a.items)]
    print("\n".join(f"- {s}" for s in lines(t)))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return [f"- {x}" for x in lines(tables(res)[0])]


@register_exhibit(NAME, figures=FIGURES, tables=TABLES, kind="bookkeeping", chapter="coverage", rank=1, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/coverage and tables/coverage_cells; return the per-item table."""
    t, cells = tables(res)
    note = ("Planned cells: conf/campaign.yaml expanded by runners.campaign (each sweep preset's params x the item's "
            "overrides). other_settings: measured with settings the preset has since changed (then -> now); "
            "unplanned_cells: finished cells in the item's sweep folder that match no planned cell (e.g. extra "
            "repetitions). command: runs the missing cells on the GPU host (runners/gpu/sweep.sh, resumable); "
            "locally: python -m runners.run -m sweep=<preset> <the same overrides> (torchrun at tp > 1). The command "
            "leaves cells measured with other settings as they are; add force=true to rerun them with today's.")
    write_table(t, NAME, out, title="Campaign coverage (conf/campaign.yaml)", note=note)
    write_table(cells, f"{NAME}_cells", out, title="Campaign coverage, cell by cell",
                note="One row per planned cell; see tables/coverage.md for the rules. command: runs this one cell on "
                     "a machine of your own (into results/raw/<sweep>/<cell_id>; force=true where a cell exists already).")
    return t
