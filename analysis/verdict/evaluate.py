"""Paper claims (results/paper/claims.csv) against our measurements: one verdict per claim.

Each claim row names the frame it is measured in (``cells``, ``kernels``, ``trace``, ``steps``),
config selectors (``analysis.common.parse_selectors``), a metric, a ``statistic`` (how our number
is computed, see STATISTICS) with an optional ``baseline`` (selectors overriding the claim's, e.g.
``system.name=sglang_default``), and a ``check`` against the paper's value (``point``, ``range``,
``bound_ge``, ``bound_le``, ``true``).

:func:`point_verdict` classifies one number (reproduced | exceeded | not reproduced | not measured);
:func:`verdict` adds the noise: given the interval our number may lie in (its repetitions' min-max,
or the sweep's run-to-run noise where a configuration has one repetition), a verdict that differs
across the interval is ``inconclusive``. The rule in words is :data:`VERDICT_RULE`, which the REPORT
prints and analysis/README.md quotes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, parse_selectors, select
from analysis.gpu import gpus_of_results, only_gpu, primary_gpu
from analysis.load import Results
from analysis.paper import CLAIMS_CSV, read_claims
from analysis.verdict.context import Context
from analysis.verdict.rule import INCONCLUSIVE, flip_points, is_missing, margin, point_verdict, spread_classes, verdict
from analysis.verdict.statistics import STATISTICS
from analysis.verdict.versions import Versions, at_version, claim_versions, newest_first







def load_claims(path: str | Path = CLAIMS_CSV) -> pd.DataFrame:
    """claims.csv (analysis.paper.read_claims), each claim's ``statistic`` one of STATISTICS."""
    df = read_claims(path)
    for _, r in df.iterrows():
        if r["statistic"] not in STATISTICS:
            raise ValueError(f"{path}: claim `{r['id']}`: field `statistic` is '{r['statistic']}', "
                             f"not one of {sorted(STATISTICS)}")
    return df


def number(x: str) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _relaxed_note(ctx: Context, c: pd.Series, sel: dict, base: dict, key: str, label) -> str:
    """Where the claim's ``key`` value was not measured but others were: our number with ``key``
    dropped from the selectors, as information (no verdict: another TP or KV budget is another
    measurement). ``label(values)`` names what was measured."""
    relaxed = {k: v for k, v in sel.items() if k != key}
    df = ctx.frame("cells")
    there = select(df, relaxed) if not df.empty else df
    if there.empty or key not in there.columns:
        return ""
    o = STATISTICS[c["statistic"]](ctx, c, relaxed, base)
    if is_missing(o.value):
        return ""
    return (f"; for information only, measured {label(sorted(there[key].dropna().unique()))}: {o.shown} "
            f"on {', '.join(o.gpus)} (no verdict)")


def other_tp_note(ctx: Context, c: pd.Series, sel: dict, base: dict) -> str:
    """The claim's TP not measured, another TP was: our number there (no verdict)."""
    return _relaxed_note(ctx, c, sel, base, "tp", lambda v: "at TP=" + ", ".join(str(int(t)) for t in v))


def other_hardware_note(ctx: Context, c: pd.Series, sel: dict, base: dict) -> str:
    """The claim's hardware preset (a KV budget: hardware=a100_40gb) not run, another was: our number there."""
    return _relaxed_note(ctx, c, sel, base, "hardware.name",
                         lambda v: "with hardware=" + ", ".join(str(h) for h in v) + " (that preset's KV budget)")


def evaluate(res: Results, claims: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per claim and GPU model: each claim's row on the primary GPU model (analysis.gpu.primary_gpu,
    measured or not) first, in claims.csv order, then its rows on every other GPU model whose cells give it
    a number (a claim those cells cannot measure has no row there: tables/coverage names what is missing); each measured in that GPU model's cells alone (analysis.gpu.only_gpu): no number, repetition or
    noise pools two GPU models. Columns: the claim's columns plus ``gpu``, ``primary`` (the primary GPU
    model's row: the verdict counts are over these), ``ours``, ``ours_shown``, ``configs`` (configurations
    pooled), ``n`` (repetitions: the fewest behind one configuration; 0 = not tracked), ``our_hardware``,
    ``verdict`` (VERDICT_RULE), ``point_verdict`` (the same without the noise), ``spread_lo`` /
    ``spread_hi`` / ``spread_shown`` / ``spread_from`` (the interval our number may lie in and how it was
    obtained), ``between`` (the verdicts an inconclusive interval spans), ``why``, and how close the verdict
    is to flipping: ``flips_at`` (the nearest value of our number where it would change; NaN for
    qualitative claims), ``margin`` (the relative distance to it, or for a qualitative claim the step it
    turns on), ``margin_shown``, ``margin_note`` and ``decider`` (the deciding cells); ``code_versions`` / ``code_versions_counted`` / ``spans_versions``: the
    versions of our code its cells ran (analysis.verdict.versions), with and without the commits, and whether they
    are more than one; ``one_version``: for such a claim, its number and verdict on the cells of one version
    alone (:func:`one_version`)."""
    claims = load_claims() if claims is None else claims
    first = primary_gpu(res)
    rows = _evaluate_on(only_gpu(res, first), claims, first, primary=True)
    for gpu in gpus_of_results(res):
        if gpu != first:
            rows += _evaluate_on(only_gpu(res, gpu), claims, gpu, primary=False)
    return pd.DataFrame(rows)


def _evaluate_on(res: Results, claims: pd.DataFrame, gpu: str, primary: bool) -> list[dict]:
    """The claims' rows measured in ``res`` (one GPU model's cells); off the primary GPU model, only the
    claims those cells measure."""
    ctx = Context(res)
    per_version: dict[str, Context] = {}
    rows = []
    for _, c in claims.iterrows():
        sel, base = parse_selectors(c["selectors"]), parse_selectors(c["baseline"])
        o = STATISTICS[c["statistic"]](ctx, c, sel, base)
        if not primary and not o.gpus:
            continue
        kw = dict(paper_hi=number(c["paper_value_hi"]), better=c["better"] or None, ratio=c["unit"] == "x")
        spread = None if is_missing(o.lo) or is_missing(o.hi) else (o.lo, o.hi)
        pv = point_verdict(c["check"], number(c["paper_value"]), o.value, **kw)
        v = verdict(c["check"], number(c["paper_value"]), o.value, spread=spread, **kw)
        if not primary and v == NOT_MEASURED:
            continue
        between = " / ".join(spread_classes(c["check"], number(c["paper_value"]), spread, **kw)) \
            if v == INCONCLUSIVE else ""
        why = o.why if v == NOT_MEASURED else ""
        if v == NOT_MEASURED and "tp" in sel and c["frame"] == "cells":
            why += other_tp_note(ctx, c, sel, base)
        if v == NOT_MEASURED and "hardware.name" in sel and c["frame"] == "cells":
            why += other_hardware_note(ctx, c, sel, base)
        ver = claim_versions(ctx.frame("cells"), sel, base) if c["frame"] == "cells" and v != NOT_MEASURED \
            else Versions()
        one = one_version(ctx, per_version, c, sel, base, kw) if ver.spans else ""
        at, rel = margin(o.value, flip_points(c["check"], number(c["paper_value"]), **kw))
        shown = _margin_shown(at, rel)
        if c["check"] == "true" and v != NOT_MEASURED and np.isfinite(o.margin):
            rel, shown = o.margin, f"{o.margin:.1%} ({o.margin_note})"
        rows.append({**c.to_dict(), "gpu": gpu, "primary": primary, "ours": o.value,
                     "ours_shown": o.shown if v != NOT_MEASURED else "",
                     "configs": o.n, "n": o.reps, "our_hardware": ", ".join(o.gpus), "verdict": v,
                     "point_verdict": pv, "spread_lo": o.lo if spread else np.nan,
                     "spread_hi": o.hi if spread else np.nan,
                     "spread_shown": _spread_shown(c, spread) if v != NOT_MEASURED else "",
                     "spread_from": o.spread_from if v != NOT_MEASURED else "", "between": between, "why": why,
                     "flips_at": at, "margin": rel, "margin_shown": shown, "margin_note": o.margin_note,
                     "decider": o.decider, "code_versions": ver.shown, "code_versions_counted": ver.counted,
                     "spans_versions": ver.spans, "one_version": one})
    return rows


def one_version(ctx: Context, per_version: dict, c: pd.Series, sel: dict, base: dict, kw: dict) -> str:
    """A claim whose cells span several versions of our code, measured again on the cells of one version alone
    (with real SGLang's own), the version measured last that holds the whole claim: ``"<ours> (<verdict>) at
    <version>"``, or ``"no one version holds it"``. Information beside the verdict, which stands as computed."""
    for v in newest_first(ctx.frame("cells"), sel, base):
        if v not in per_version:
            per_version[v] = at_version(ctx, v)
        o = STATISTICS[c["statistic"]](per_version[v], c, sel, base)
        if is_missing(o.value):
            continue
        spread = None if is_missing(o.lo) or is_missing(o.hi) else (o.lo, o.hi)
        return f"{o.shown} ({verdict(c['check'], number(c['paper_value']), o.value, spread=spread, **kw)}) at {v}"
    return "no one version holds it"


def _spread_shown(c: pd.Series, spread) -> str:
    """The interval as the tables print it: ``1.98-2.35``; for a qualitative claim its truth at both ends."""
    if spread is None:
        return "-"
    lo, hi = spread
    if c["check"] == "true":
        word = {True: "holds", False: "fails"}
        return f"{word[bool(lo)]} at the low end, {word[bool(hi)]} at the high end" if bool(lo) != bool(hi) \
            else f"{word[bool(lo)]} at both ends"
    big = max(abs(float(lo)), abs(float(hi)))
    digits = 3 if c["unit"] in ("fraction", "fraction of max") else 0 if big >= 100 else 1 if big >= 10 else 2
    while digits < 4 and f"{float(lo):.{digits}f}" == f"{float(hi):.{digits}f}" and float(lo) != float(hi):
        digits += 1
    return f"{float(lo):.{digits}f}-{float(hi):.{digits}f}"


def _margin_shown(at: float, rel: float) -> str:
    return "" if not np.isfinite(rel) else f"{rel:.1%} (flips at {at:.4g})"


