"""Which versions of the code under test a claim's cells were measured at.

The code under test is ours: the engine's four systems and the plugin inside SGLang. Each cell records
the commit it ran (``provenance.git_commit``, "+" when the tree had uncommitted changes). A claim whose
selected cells, numerator and baseline together, span two or more commits compares or pools measurements
of different code; the claims table and the REPORT name those versions (:func:`claim_versions`), so such a
number is never read as one code's. Real SGLang's own cells (a baseline served by SGLang itself, not by our
code) do not count: their version is SGLang's, recorded apart (``provenance.sglang``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd

from analysis.common import code_version, select
from analysis.verdict.context import Context
from analysis.measures.sglang import BASE, SYSTEMS

LISTED = 3                # versions named before "and N more"
REAL_SGLANG = SYSTEMS[BASE][0]   # SGLang itself served: its version is SGLang's, not our code's


def ours(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells of our code: every cell but real SGLang's own."""
    if cells.empty or "system.name" not in cells.columns:
        return cells
    return cells[cells["system.name"].astype(str) != REAL_SGLANG]


@dataclass
class Versions:
    """A claim's code versions: ``shown`` (one version, or per system the versions its cells span),
    ``counted`` (the same without the commits, for prose: "granikv 1 commit; sglang_default 2 commits") and
    ``spans`` (True when the claim's cells of our code span two or more versions)."""

    shown: str = ""
    spans: bool = False
    counted: str = ""


def _listed(vs: list[str]) -> str:
    head = ", ".join(vs[:LISTED])
    return head + (f" and {len(vs) - LISTED} more" if len(vs) > LISTED else "")


def claim_cells(frame: pd.DataFrame, sel: dict, base: dict) -> pd.DataFrame:
    """The cells of our code (:func:`ours`) a claim selects (``sel``) and its baseline's (``sel`` updated by
    ``base``), each once."""
    if frame.empty:
        return frame
    cells = ours(pd.concat([select(frame, sel)] + ([select(frame, {**sel, **base})] if base else [])))
    return cells[~cells.index.duplicated()] if not cells.empty else cells


def claim_versions(frame: pd.DataFrame, sel: dict, base: dict) -> Versions:
    """The code versions of a claim's cells (:func:`claim_cells`). Empty when no such cell has provenance."""
    cells = claim_cells(frame, sel, base)
    if cells.empty:
        return Versions()
    v = code_version(cells)
    every = sorted(set(v))
    if len(every) == 1:
        return Versions(every[0], False, "one commit")
    system = cells["system.name"].astype(str) if "system.name" in cells.columns else pd.Series("?", index=cells.index)
    names = sorted(set(system))
    per = [f"{s} {_listed(sorted(set(v[system == s])))}" for s in names]
    counts = [(s, len(set(v[system == s]))) for s in names]
    counted = "; ".join(f"{s} {k} commit{'s' if k != 1 else ''}" for s, k in counts)
    return Versions(f"{len(every)} versions: " + "; ".join(per), True, f"{len(every)} commits: {counted}")


def newest_first(frame: pd.DataFrame, sel: dict, base: dict) -> list[str]:
    """The code versions of a claim's cells (:func:`claim_cells`), the one
    measured last first (by each version's latest cell start, ``provenance.started_at``)."""
    cells = claim_cells(frame, sel, base)
    if cells.empty:
        return []
    when = cells["provenance.started_at"].astype(str) if "provenance.started_at" in cells.columns \
        else pd.Series("", index=cells.index)
    last = when.groupby(code_version(cells)).max()
    return sorted(last.index, key=lambda v: (last[v], v), reverse=True)


def _ours_at(cells: pd.DataFrame, version: str) -> pd.Series:
    """Per cell: of our code at ``version``, or real SGLang's own (whatever its commit)."""
    keep = code_version(cells) == version
    if "system.name" in cells.columns:
        keep |= cells["system.name"].astype(str) == REAL_SGLANG
    return keep


def at_version(ctx: Context, version: str) -> Context:
    """``ctx`` with only the cells of our code at ``version`` (:func:`analysis.common.code_version`) and real
    SGLang's own cells: its cells frame cut (not built again), its Results' cells likewise (frames derived
    from them, e.g. the Amdahl frame, are built from those)."""
    res, cells = ctx.res, ctx.frame("cells")
    sub = replace(res, cells=res.cells[_ours_at(res.cells, version)]) if not res.cells.empty else res
    return Context.over(sub, cells[_ours_at(cells, version)] if not cells.empty else cells)
