"""The exhibits: every table and figure module declares itself once, with ``@register_exhibit``.

An exhibit names its table (``tables/<name>.{csv,md}``, more where it writes several), its figures, and,
where the REPORT carries a paragraph of it, the chapter that paragraph goes in and its rank there.
``analysis.reproduce`` and ``analysis.report`` walk :data:`EXHIBITS` instead of lists written by hand.
Registration follows import order, and ``analysis.exhibits`` imports its modules in one fixed order, so
tables, figures and the REPORT come out in the same order every run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pandas as pd

from analysis.load import Results


KINDS = ("paper", "bookkeeping", "claims")   # paper tables / figures; the campaign's books; tables of the verdicts


@dataclass(frozen=True)
class Exhibit:
    """One table or figure module: ``build(res, out, ...)`` writes it and returns its table.
    ``kind``: ``paper`` (built with or without figures), ``bookkeeping`` (built after them, never drawn) or
    ``claims`` (built after the REPORT, from its evaluated claims: ``build(res, out, ev=...)``).
    ``section(res)``: its lines in the REPORT chapter ``chapter``, at ``rank`` there."""

    name: str
    build: Callable[..., pd.DataFrame]
    tables: tuple[str, ...]
    figures: tuple[str, ...] = ()
    kind: str = "paper"
    chapter: str | None = None
    rank: int = 0
    section: Callable[[Results], list[str]] | None = None


EXHIBITS: list[Exhibit] = []


def register_exhibit(name: str, *, figures: tuple[str, ...] = (), tables: tuple[str, ...] | None = None,
                     kind: str = "paper", chapter: str | None = None, rank: int = 0,
                     section: Callable[[Results], list[str]] | None = None):
    """Decorate an exhibit's ``build`` to register it under ``name`` (see :class:`Exhibit`)."""
    if kind not in KINDS:
        raise ValueError(f"exhibit {name}: kind {kind!r} is not one of {KINDS}")
    if (chapter is None) != (section is None):
        raise ValueError(f"exhibit {name}: a REPORT section needs both its chapter and its lines")

    def register(build: Callable[..., pd.DataFrame]) -> Callable[..., pd.DataFrame]:
        if any(e.name == name for e in EXHIBITS):
            raise ValueError(f"exhibit {name} registered twice")
        EXHIBITS.append(Exhibit(name, build, tuple(tables) if tables else (name,), tuple(figures), kind, chapter,
                                rank, section))
        return build
    return register


def exhibits(kind: str) -> list[Exhibit]:
    """The registered exhibits of one kind, in registration order."""
    return [e for e in EXHIBITS if e.kind == kind]


def chapter_lines(chapter: str, res: Results) -> list[str]:
    """The REPORT lines of every exhibit in ``chapter``, by rank."""
    return [x for e in sorted((e for e in EXHIBITS if e.chapter == chapter), key=lambda e: e.rank)
            for x in e.section(res)]
