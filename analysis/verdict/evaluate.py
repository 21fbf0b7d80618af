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

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, SHORT, aggregate, geomean, identity, paired, parse_selectors, select, show
from analysis.dispatch_routing import with_dispatch
from analysis.load import Results

REPRODUCED, EXCEEDED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "exceeded", "not reproduced", "inconclusive"
VERDICTS = (REPRODUCED, EXCEEDED, NOT_REPRODUCED, INCONCLUSIVE, NOT_MEASURED)
TOL = 0.25           # "within +-25%"
PARITY_BAND = 0.05   # a paper ratio within 5% of 1 claims parity: no direction to match
EPS = 1e-9
CLAIMS_CSV = Path(__file__).resolve().parents[1] / "results" / "paper" / "claims.csv"
CHECKS = ("point", "range", "bound_ge", "bound_le", "true")

VERDICT_RULE = """\
Each claim gets one of five verdicts, from our number (repetitions pooled by mean, configurations by geometric \
mean) and the interval it may lie in:

- **reproduced**: our number is within +-25% of the paper's value (for a range, from 25% below its low end to 25% \
above its high end) and, for a ratio, on the same side of 1 as the paper's (unless the paper reports parity, \
within 5% of 1); or the stated bound (>=, <=) holds as stated; or our measurement confirms the qualitative claim.
- **exceeded**: the effect points the same way as the paper's but lies more than 25% beyond it (a ratio further \
from 1 than the band; an absolute value past the band on the claim's better side). Counted apart from reproduced: \
a number this far beyond the paper's does not confirm the paper's number. It says the effect exists at another \
size, which a difference of hardware, baseline or workload has to explain; the claim's section gives what we \
measured.
- **not reproduced**: the effect falls more than 25% short of the paper's value, points the other way or \
vanishes, the bound fails, or the measurement contradicts the qualitative claim.
- **inconclusive**: the interval of our number straddles a threshold of this rule, so that the verdict differs \
at its two ends. With n >= 2 repetitions the interval is their min-max (for a ratio: the lowest numerator over \
the highest baseline, and the reverse). Where a configuration has n = 1, its value is widened by the run-to-run \
noise of its sweep, half on either side: the noise is the median relative spread (max - min) / mean over the \
sweep's configurations with >= 2 repetitions; a sweep without repetitions borrows the noisiest sweep of the same \
workload kind, else of any kind. So an n = 1 ratio whose margin to a threshold is below the noise is \
inconclusive. A qualitative claim is inconclusive when it holds at one end of the interval and fails at the \
other (a trend whose steps lie within the spread).
- **not measured**: no number, with the reason.

n counts repetitions: the fewest behind one configuration that the number rests on (for a ratio, on either \
side). Where no run-to-run noise of the metric is measured anywhere (kernel bench rows, profiler traces) or the \
statistic does not carry a spread, the number is taken as it is and the interval column says so."""


def _missing(x) -> bool:
    return x is None or (isinstance(x, (float, np.floating)) and not np.isfinite(x))


def point_verdict(check: str, paper: float | None, ours, *, paper_hi: float | None = None, better: str | None = None,
                  ratio: bool = False, tol: float = TOL) -> str:
    """reproduced | exceeded | not reproduced | not measured for one number (VERDICT_RULE, without the noise)."""
    if check not in CHECKS:
        raise ValueError(f"check `{check}` not in {CHECKS}")
    if _missing(ours):
        return NOT_MEASURED
    if check == "true":
        return REPRODUCED if bool(ours) else NOT_REPRODUCED
    ours = float(ours)
    if check == "bound_ge":
        return REPRODUCED if ours >= paper - EPS else NOT_REPRODUCED
    if check == "bound_le":
        return REPRODUCED if ours <= paper + EPS else NOT_REPRODUCED
    lo, hi = float(paper), float(paper if _missing(paper_hi) else paper_hi)
    band_lo, band_hi = lo * (1 - tol) - EPS * abs(lo), hi * (1 + tol) + EPS * abs(hi)
    mid = (lo + hi) / 2
    directed = ratio and abs(mid - 1.0) >= PARITY_BAND
    if directed and (ours - 1.0) * (mid - 1.0) <= 0:
        return NOT_REPRODUCED  # the effect points the other way (or vanished)
    if band_lo <= ours <= band_hi:
        return REPRODUCED
    if ratio:               # beyond the band away from 1: a larger effect (a parity claim has no "beyond")
        far = directed and (ours > band_hi if mid > 1 else ours < band_lo)
    else:
        far = (better == "higher" and ours > band_hi) or (better == "lower" and ours < band_lo)
    return EXCEEDED if far else NOT_REPRODUCED


def spread_classes(check: str, paper: float | None, spread, **kw) -> list[str]:
    """The verdicts :func:`point_verdict` gives over the interval ``spread`` = (low, high) of our number
    (for a ``true`` check: the claim's truth at the interval's two ends), in VERDICTS order."""
    lo, hi = spread
    if check == "true":
        got = {point_verdict(check, paper, bool(x), **kw) for x in (lo, hi)}
    else:
        lo, hi = sorted((float(lo), float(hi)))
        got = {point_verdict(check, paper, x, **kw) for x in (lo, hi)}
        for x in flip_points(check, paper, **kw):
            if lo < x < hi:
                d = max(abs(x), 1.0) * 1e-6
                got |= {point_verdict(check, paper, x - d, **kw), point_verdict(check, paper, x + d, **kw)}
    return [v for v in VERDICTS if v in got]


def verdict(check: str, paper: float | None, ours, *, paper_hi: float | None = None, better: str | None = None,
            ratio: bool = False, tol: float = TOL, spread: tuple | None = None) -> str:
    """One of VERDICTS (see VERDICT_RULE). ``spread``: the (low, high) our number may lie in given the
    run-to-run noise (None: taken as it is); a verdict that differs across it is ``inconclusive``."""
    kw = dict(paper_hi=paper_hi, better=better, ratio=ratio, tol=tol)
    v = point_verdict(check, paper, ours, **kw)
    if v == NOT_MEASURED or spread is None or any(_missing(x) for x in spread):
        return v
    return INCONCLUSIVE if len(spread_classes(check, paper, spread, **kw)) > 1 else v


CLOSE = 0.05         # a verdict within 5% of the value where it flips is a close call (REPORT lists them)


def flip_points(check: str, paper: float | None, *, paper_hi: float | None = None, better: str | None = None,
                ratio: bool = False, tol: float = TOL) -> list[float]:
    """The values of our number at which :func:`verdict` changes, ascending ([] for ``true`` checks).

    Candidates are the rule's edges (the bound; the band's ends lo (1 - tol) and hi (1 + tol), where a
    number turns from reproduced to not reproduced or exceeded; 1.0 for a ratio claim with a direction); a
    candidate is kept only where :func:`point_verdict` really differs just below and just above it, so the
    list follows the rule rather than restating it."""
    if check == "true" or _missing(paper):
        return []
    lo = float(paper)
    hi = lo if _missing(paper_hi) else float(paper_hi)
    cand = {lo, hi, lo * (1 - tol), hi * (1 + tol), 1.0} if check in ("point", "range") else {lo}
    out = []
    for x in sorted(cand):
        d = max(abs(x), 1.0) * 1e-6
        kw = dict(paper_hi=paper_hi, better=better, ratio=ratio, tol=tol)
        if point_verdict(check, paper, x - d, **kw) != point_verdict(check, paper, x + d, **kw):
            out.append(x)
    return out


def margin(ours, points: list[float]) -> tuple[float, float]:
    """(the nearest flip point, |ours - it| / |it|): how far our number would have to move, relative
    to the point, for the verdict to change. (NaN, NaN) when there is no number or no flip point."""
    if _missing(ours) or isinstance(ours, (bool, np.bool_)) or not points:
        return float("nan"), float("nan")
    x = min(points, key=lambda p: abs(float(ours) - p))
    return x, abs(float(ours) - x) / (abs(x) if x else 1.0)


@dataclass
class Outcome:
    """Our number for one claim: ``value`` (float or bool, NaN when not measured), how it is shown,
    how many configurations it pools, why it is missing, and the GPUs it was measured on."""

    value: object = float("nan")
    shown: str = ""
    n: int = 0           # configurations pooled
    why: str = ""
    gpus: list[str] = field(default_factory=list)
    reps: int = 0        # fewest repetitions behind one of its configurations (0 = not tracked by the statistic)
    margin: float = float("nan")   # qualitative claims: the relative change that would flip the verdict
    margin_note: str = ""          # ... and where it is
    decider: str = ""              # the configuration(s) the number turns on, with their repetitions
    lo: object = float("nan")      # the interval our number may lie in (repetitions' min-max, or the noise);
    hi: object = float("nan")      # for a qualitative claim: its truth at the pessimistic / optimistic end
    spread_from: str = ""          # how the interval was obtained (or why there is none)


def load_claims(path: str | Path = CLAIMS_CSV) -> pd.DataFrame:
    """claims.csv, checked: unique ids, known checks / frames / statistics, numbers where needed."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    need = ["id", "section", "claim", "model", "tp", "frame", "selectors", "metric", "statistic", "baseline", "check",
            "paper_value", "paper_value_hi", "unit", "better", "comparison", "source"]
    miss = [c for c in need if c not in df.columns]
    if miss:
        raise ValueError(f"{path}: missing columns {miss}")
    if df["id"].duplicated().any():
        raise ValueError(f"{path}: duplicate ids {sorted(df.loc[df['id'].duplicated(), 'id'])}")
    for _, r in df.iterrows():
        where = f"{path}: claim `{r['id']}`"
        if r["check"] not in CHECKS:
            raise ValueError(f"{where}: field `check` is '{r['check']}', not one of {CHECKS}")
        if r["statistic"] not in STATISTICS:
            raise ValueError(f"{where}: field `statistic` is '{r['statistic']}', not one of {sorted(STATISTICS)}")
        if r["frame"] not in ("cells", "kernels", "trace", "steps"):
            raise ValueError(f"{where}: field `frame` is '{r['frame']}', not cells | kernels | trace | steps")
        if r["check"] != "true":
            float(r["paper_value"])  # raises with the value in the message
        parse_selectors(r["selectors"]), parse_selectors(r["baseline"])
    return df


class Context:
    """The frames claims are measured in, built once from a Results (lazily)."""

    def __init__(self, res: Results):
        self.res = res
        self._frames: dict[str, pd.DataFrame] = {}
        self._derived: dict[str, pd.DataFrame] = {}

    def frame(self, name: str) -> pd.DataFrame:
        if name not in self._frames:
            if name == "cells":  # serving cells without profiler / nsys instrumentation; the plugin's
                # cells with today's settings where a configuration has them (in_sglang.prefer_current)
                from analysis.in_sglang import prefer_current
                df = with_dispatch(self.res.cells)
                df = select(df, {"kind": "=serving", "instrumented": "=False"}) if not df.empty else df
                df = prefer_current(df, self.res.config_columns)
            elif name == "kernels":
                from analysis.kernel import kernel_frame
                df = kernel_frame(self.res)
            elif name == "trace":
                from analysis.profiler import trace_frame
                df = trace_frame(self.res)
            else:
                from analysis.dispatch_overhead import overhead_frame
                df = overhead_frame(self.res)
            self._frames[name] = df
        return self._frames[name]

    def amdahl(self) -> pd.DataFrame:
        """analysis.amdahl.amdahl_frame of the Results (one per claim checked against it otherwise)."""
        if "amdahl" not in self._derived:
            from analysis.amdahl import amdahl_frame
            self._derived["amdahl"] = amdahl_frame(self.res)
        return self._derived["amdahl"]

    def noise(self, frame: str, metric: str, rows: pd.DataFrame) -> tuple[float, str]:
        """See :func:`claim_noise`."""
        return claim_noise(self, frame, metric, rows)


def claim_noise(ctx, frame: str, metric: str, rows: pd.DataFrame) -> tuple[float, str]:
    """(run-to-run noise of ``metric`` for the cells ``rows``, where it comes from): the noisiest of
    their own sweeps that has repetitions; else the noisiest sweep of the same workload kind; else of
    any kind; (NaN, why) where no sweep of the frame repeats a configuration. ``ctx``: anything with
    ``frame(name)`` and ``res.config_columns`` (the per-sweep noise is cached on it)."""
    cache = ctx.__dict__.setdefault("_noise_cache", {})
    if (frame, metric) not in cache:
        cache[(frame, metric)] = sweep_noise(ctx.frame(frame), ctx.res.config_columns, metric)
    t = cache[(frame, metric)]
    if t.empty:
        return float("nan"), f"no run-to-run noise of {metric} measured (no configuration with 2 repetitions)"
    sweeps = set(rows["sweep"].dropna()) if "sweep" in rows.columns else set()
    own = t[t["sweep"].isin(sweeps)]
    if not own.empty:
        r = own.loc[own["noise"].idxmax()]
        return float(r["noise"]), f"noise {r['noise']:.1%} of {r['sweep']} ({int(r['configs'])} configurations)"
    kinds = set(rows["workload.kind"].dropna()) if "workload.kind" in rows.columns else set()
    same = t[t["kind"].isin(kinds)]
    pool, how = (same, "same workload kind") if not same.empty else (t, "any workload kind")
    r = pool.loc[pool["noise"].idxmax()]
    return (float(r["noise"]), f"noise {r['noise']:.1%} borrowed from {r['sweep']} ({how}; "
                               f"{', '.join(sorted(map(str, sweeps))) or 'its sweep'} repeats no configuration)")


def sweep_noise(df: pd.DataFrame, config_cols: list[str], metric: str) -> pd.DataFrame:
    """Run-to-run noise of ``metric`` per sweep folder: over the sweep's configurations with >= 2
    repetitions, the median of (max - min) / mean. Columns sweep, noise, configs, kind."""
    cols = ["sweep", "noise", "configs", "kind"]
    if df.empty or metric not in df.columns or "sweep" not in df.columns:
        return pd.DataFrame(columns=cols)
    agg = aggregate(df, ["sweep"] + identity(df, config_cols), metric)     # one pass: configurations per sweep
    agg = agg[(agg["n"] >= 2) & (pd.to_numeric(agg["mean"], errors="coerce").abs() > 0)]
    kinds = df.groupby("sweep")["workload.kind"].agg(lambda v: v.mode().iloc[0] if v.notna().any() else "") \
        if "workload.kind" in df.columns else pd.Series(dtype=object)
    rows = []
    for sweep, a in agg.groupby("sweep", sort=True):
        rel = ((a["max"] - a["min"]) / a["mean"].abs()).astype(float)
        rows.append({"sweep": sweep, "noise": float(rel.median()), "configs": len(a), "kind": kinds.get(sweep, "")})
    return pd.DataFrame(rows, columns=cols)


def side_interval(mean, lo, hi, n, noise: float):
    """Per configuration, the interval of one side's value: its repetitions' [min, max] where n >= 2,
    else the mean widened by ``noise`` (half on either side). Arrays in, (low, high, widened) out."""
    mean, lo, hi, n = (np.asarray(x, dtype=float) for x in (mean, lo, hi, n))
    one = n < 2
    w = noise / 2 if np.isfinite(noise) else np.nan
    return np.where(one, mean * (1 - w), lo), np.where(one, mean * (1 + w), hi), one


def spread_note(widened, noise_from: str, *more) -> str:
    """How an interval was obtained: repetitions, noise, or both. ``widened`` (and ``more``, e.g. the
    baseline side's): per configuration, whether its value was widened by the noise (n=1)."""
    sides = [np.asarray(w, dtype=bool) for w in (widened, *more)]
    if not any(w.any() for w in sides):
        return "min-max over repetitions"
    if all(w.all() for w in sides):
        return f"n=1: {noise_from}"
    return f"min-max over repetitions; where n=1: {noise_from}"


def why_empty(df: pd.DataFrame, sel: dict[str, str], what: str) -> str:
    """Which selector leaves nothing, and which values exist for it instead."""
    if df.empty:
        return f"no {what} under the results folder"
    cur = df
    for key, cond in sel.items():
        if key not in cur.columns:
            return f"no {what} has `{key}`"
        nxt = select(cur, {key: cond})
        if nxt.empty:
            vals = sorted(cur[key].dropna().unique(), key=lambda v: (isinstance(v, str), v if not isinstance(v, str) else 0, str(v)))
            shown = ", ".join(show(v) for v in vals[:8]) + (" ..." if len(vals) > 8 else "")
            return f"no {what} with {key}{cond} (the {len(cur)} {what}s that pass the selectors before it have {key} in {{{shown}}})"
        cur = nxt
    return f"no {what} matched"


def _gpus(*dfs: pd.DataFrame) -> list[str]:
    out = set()
    for d in dfs:
        if d is not None and "provenance.gpu_name" in d.columns:
            out |= {str(g) if g is not None and g == g else "no GPU (CPU)" for g in d["provenance.gpu_name"]}
    return sorted(out)


# a "grows monotonically with Lp (512..16K)" claim is confirmed only over its span: both ends and
# at least 4 Lp values (a decrease anywhere refutes it at once)
MONOTONE_LP_SPAN = (512, 16384)
MONOTONE_MIN_LPS = 4

WHAT = {"cells": "cell", "kernels": "kernel row", "trace": "profiled cell",
        "steps": "serving cell of a dispatching system"}


LABEL_KEYS = ("model.name", "tp", "hardware.name", "workload.num_prefixes", "workload.prefix_len", "workload.batch",
              "system")


def pair_label(p: pd.DataFrame, i) -> str:
    """One row of :func:`analysis.common.paired` for prose: the keys that tell it from the other pairs
    (Lp, B and system always), and the repetitions behind it and behind its baseline."""
    row = p.loc[i]
    keys = [k for k in LABEL_KEYS if k in p.columns and
            (k in ("workload.prefix_len", "workload.batch", "system") or p[k].nunique(dropna=False) > 1)]
    keys = [k for k in keys if not pd.isna(row[k])]
    n, nb = int(row["n_num"]), int(row["n_base"])
    return (", ".join(f"{SHORT.get(k, k)}={show(row[k])}" for k in keys)
            + f" ({n} repetition{'s' if n != 1 else ''}; its baseline {nb})")


def _ratio_stat(ctx: Context, c: pd.Series, sel: dict, base: dict, reduce: str) -> Outcome:
    df, what = ctx.frame(c["frame"]), WHAT[c["frame"]]
    num = select(df, sel) if not df.empty else df
    if num.empty:
        return Outcome(why=why_empty(df, sel, what))
    p = paired(df, ctx.res.config_columns, sel, base, c["metric"])
    basesel = {**sel, **base}
    if p.empty:
        return Outcome(why="no baseline twin: " + why_empty(df, basesel, what), gpus=_gpus(num))
    bcells = select(df, basesel)
    gpus = _gpus(num, bcells)
    p = p[np.isfinite(p["ratio"].astype(float))]
    if p.empty:
        return Outcome(why=f"`{c['metric']}` is missing in every matching {what}", gpus=gpus)
    r = p["ratio"].astype(float)
    reps = int(min(p["n_num"].min(), p["n_base"].min()))
    only = pair_label(p, p.index[0]) if len(p) == 1 else ""
    # the interval of each pair's ratio: lowest numerator over highest baseline, and the reverse
    noise, noise_from = claim_noise(ctx, c["frame"], c["metric"], pd.concat([num, bcells]))
    nl, nh, w1 = side_interval(p["num"], p["num_min"], p["num_max"], p["n_num"], noise)
    bl, bh, w2 = side_interval(p["base"], p["base_min"], p["base_max"], p["n_base"], noise)
    r_lo, r_hi = pd.Series(nl / bh, index=p.index), pd.Series(nh / bl, index=p.index)
    how = spread_note(w1, noise_from, w2)
    known = bool(np.isfinite(r_lo).all() and np.isfinite(r_hi).all())
    if not known:
        how = noise_from
    if reduce == "geomean":
        v = geomean(r)
        lo, hi = (geomean(r_lo), geomean(r_hi)) if known else (np.nan, np.nan)
        return Outcome(v, f"{v:.2f}", len(p), gpus=gpus, reps=reps, decider=only, lo=lo, hi=hi, spread_from=how)
    if reduce == "inverse":
        v = 1.0 / geomean(r)
        lo, hi = (1.0 / geomean(r_hi), 1.0 / geomean(r_lo)) if known else (np.nan, np.nan)
        return Outcome(v, f"{v:.2f}", len(p), gpus=gpus, reps=reps, decider=only, lo=lo, hi=hi, spread_from=how)
    if reduce == "max_abs_dev":
        dev = (r - 1).abs()
        v = float(dev.max())
        # per pair: the smallest and largest |ratio - 1| over its interval (0 when it holds 1)
        d_lo = np.where((r_lo <= 1) & (r_hi >= 1), 0.0, np.minimum((r_lo - 1).abs(), (r_hi - 1).abs()))
        d_hi = np.maximum((r_lo - 1).abs(), (r_hi - 1).abs())
        lo, hi = (float(d_lo.max()), float(d_hi.max())) if known else (np.nan, np.nan)
        return Outcome(v, f"{v:.3f} (ratios {r.min():.3f}..{r.max():.3f})", len(p), gpus=gpus, reps=reps,
                       decider=pair_label(p, dev.idxmax()), lo=lo, hi=hi, spread_from=how)
    if reduce == "monotone":
        keys = [k for k in identity(p, ctx.res.config_columns) if k != "workload.prefix_len"]
        ok, parts, steps = True, [], []    # steps: (relative change, "a@lp -> b@lp", deciders, a interval, b interval)
        for _, g in p.groupby(keys, dropna=False, sort=True) if keys else [("", p)]:
            g = g.sort_values("workload.prefix_len")
            if len(g) < 2:
                continue
            ok &= bool((g["ratio"].diff().dropna() >= -EPS).all())
            pts = [(float(v), int(lp)) for lp, v in zip(g["workload.prefix_len"], g["ratio"])]
            parts.append(" -> ".join(f"{v:.2f}@{lp}" for v, lp in pts))
            idx = list(g.index)
            steps += [((b - a) / a, f"{a:.2f}@{la} -> {b:.2f}@{lb}",
                       f"{pair_label(p, i)} and {pair_label(p, j)}", (r_lo[i], r_hi[i]), (r_lo[j], r_hi[j]))
                      for (a, la), (b, lb), i, j in zip(pts, pts[1:], idx, idx[1:])]
        if not parts:
            return Outcome(why=f"fewer than two Lp values measured ({len(p)} pair)", gpus=gpus)
        # the truth of "non-decreasing" at the two ends of the intervals: every step rises even from the top of
        # one interval to the bottom of the next (pessimistic), or no step falls for certain (optimistic)
        pess = all(b[0] >= a[1] - EPS for *_, a, b in steps) if known else np.nan
        opt = all(b[1] >= a[0] - EPS for *_, a, b in steps) if known else np.nan
        within = [w for _, w, _, a, b in steps if known and not (b[0] >= a[1] - EPS or b[1] < a[0] - EPS)]
        how = (f"{how}; steps within the spread: {', '.join(within)}" if within else f"{how}; every step outside "
               "the spread") if known else how
        # the flip distance: a "not monotone" verdict needs its largest dip closed, a "monotone" one turns on
        # its smallest rise
        if not ok:       # a counterexample decides, however few Lp values were measured
            d, where, who = max(((-x, w, h) for x, w, h, *_ in steps), key=lambda t: t[0])
            return Outcome(ok, "not monotone: " + "; ".join(parts), len(p), gpus=gpus, reps=reps,
                           margin=d, margin_note=f"largest dip {where}", decider=who, lo=pess, hi=opt, spread_from=how)
        rise, rwhere, rwho, *_ = min(steps, key=lambda t: t[0])
        lps = set(int(x) for x in p["workload.prefix_len"])
        lo, hi = MONOTONE_LP_SPAN
        if not ({lo, hi} <= lps and len(lps) >= MONOTONE_MIN_LPS):
            return Outcome(why=f"only Lp {sorted(lps)} measured (non-decreasing so far: {'; '.join(parts)}); "
                               f"the claim spans Lp {lo}..{hi}: needs both ends and >= {MONOTONE_MIN_LPS} Lp values",
                           gpus=gpus)
        return Outcome(ok, "monotone: " + "; ".join(parts), len(p), gpus=gpus, reps=reps,
                       margin=rise, margin_note=f"smallest rise {rwhere}", decider=rwho, lo=pess, hi=opt,
                       spread_from=how)
    raise ValueError(reduce)


def _value_stat(ctx: Context, c: pd.Series, sel: dict, reduce: str) -> Outcome:
    df = ctx.frame(c["frame"])
    d = select(df, sel) if not df.empty else df
    if d.empty:
        return Outcome(why=why_empty(df, sel, WHAT[c["frame"]]))
    metric = c["metric"]
    if metric not in d.columns or d[metric].isna().all():
        return Outcome(why=f"the matching cells have no `{metric}`", gpus=_gpus(d))
    agg = aggregate(d, identity(d, ctx.res.config_columns), metric)
    agg = agg[agg["n"] > 0]
    a = agg["mean"].astype(float)
    f = {"value": np.mean, "min": np.min, "max": np.max}[reduce]
    v = float(f(a))
    noise, noise_from = claim_noise(ctx, c["frame"], metric, d)
    lo, hi, w = side_interval(agg["mean"], agg["min"], agg["max"], agg["n"], noise)
    known = bool(np.isfinite(lo).all() and np.isfinite(hi).all())
    return Outcome(v, f"{v:.3g}" if reduce == "value" else f"{v:.3f} (over {len(a)} configs)", len(a),
                   gpus=_gpus(d), reps=int(agg["n"].min()), lo=float(f(lo)) if known else np.nan,
                   hi=float(f(hi)) if known else np.nan, spread_from=spread_note(w, noise_from) if known else noise_from)


def follows(d: pd.DataFrame, col: str, key: str) -> bool:
    """``col`` equals ``key`` in every cell of ``d`` (a preset that writes ``warmup_requests:
    ${workload.batch}`` warms up with B requests at every B): it moves with ``key`` and tells no two
    configurations apart on its own when ``key`` is swept."""
    a, b = pd.to_numeric(d[col], errors="coerce"), pd.to_numeric(d[key], errors="coerce")
    return bool(a.notna().all() and (a == b).all())


def swept_groups(d: pd.DataFrame, config_cols: list[str], key: str):
    """``d`` split into configurations with ``key`` (and the keys that follow it) left free: yields
    ``(cells of one configuration, the values of key measured elsewhere in d but not in it)``."""
    rest = [k for k in identity(d, config_cols) if k != key and not follows(d, k, key)]
    swept = set(d[key].dropna())
    for _, g in d.groupby(rest, dropna=False, sort=True):
        yield g, sorted(swept - set(g[key]))


def stat_peak_share(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    """Throughput at the baseline's value of the swept key (e.g. B=256) over the best over that key,
    per configuration (e.g. per Lp), minimum over configurations. A configuration counts only when
    every value of the key measured anywhere in the selection was measured in it too (a row missing
    B=1024 cannot tell whether B=256 is its peak); incomplete ones are named and left out."""
    df = ctx.frame("cells")
    d = select(df, sel) if not df.empty else df
    if d.empty:
        return Outcome(why=why_empty(df, sel, "cell"))
    (bkey, bcond), = base.items()
    swept = sorted(set(d[bkey].dropna()))
    shares, parts, left, reps, ends = [], [], [], [], []
    noise, noise_from = claim_noise(ctx, "cells", c["metric"], d)
    widened = []
    for g, lack in swept_groups(d, ctx.res.config_columns, bkey):
        if select(g, {bkey: bcond}).empty:
            continue
        lp = show(g["workload.prefix_len"].iloc[0]) if "workload.prefix_len" in g.columns else "?"
        if lack:
            left.append(f"Lp={lp} (no {bkey}={', '.join(show(x) for x in lack)})")
            continue
        by = g.groupby(bkey)[c["metric"]].agg(["mean", "min", "max", "count"])   # repetitions averaged
        means = by["mean"]
        at = select(g, {bkey: bcond})[bkey].iloc[0]
        s = float(means[at] / means.max())
        shares.append(s)
        reps.append(int(by["count"].min()))
        lo, hi, w = side_interval(by["mean"], by["min"], by["max"], by["count"], noise)
        lo, hi = pd.Series(lo, index=by.index), pd.Series(hi, index=by.index)
        rest = [b for b in by.index if b != at]
        # the share at the two ends: B=256 at its lowest against the others at their highest, and the reverse
        ends.append((lo[at] / max([lo[at]] + [hi[b] for b in rest]), hi[at] / max([hi[at]] + [lo[b] for b in rest])))
        widened.append(bool(w.any()))
        parts.append(f"Lp={lp}: {s:.2f} (peak at B={show(means.idxmax())})")
    tail = f"; left out, incomplete: {'; '.join(left)}" if left else ""
    if len(swept) < 2:
        return Outcome(why=f"needs {bkey}{bcond} and at least one other {bkey} in the same configuration "
                           f"(measured: {bkey}={', '.join(show(x) for x in swept)})", gpus=_gpus(d))
    if not shares:
        return Outcome(why=f"needs {bkey}{bcond} and every other measured {bkey} "
                           f"({', '.join(show(x) for x in swept)}) in one configuration{tail}", gpus=_gpus(d))
    known = all(np.isfinite(x) for e in ends for x in e)
    return Outcome(min(shares), f"{min(shares):.3f} min; " + "; ".join(parts) + tail, len(shares), gpus=_gpus(d),
                   reps=min(reps), lo=min(e[0] for e in ends) if known else np.nan,
                   hi=min(e[1] for e in ends) if known else np.nan,
                   spread_from=spread_note(widened, noise_from) if known else noise_from)


NO_KERNEL_NOISE = "kernel bench rows: no run-to-run noise measured (one timing per row); taken as it is"
NOT_PROPAGATED = "spread not propagated through this statistic; taken as it is"


def _kernel_reps(k: pd.DataFrame, keys: list[str], sel: dict, base: dict) -> int:
    """Fewest kernel rows behind one timing of the numerator or the baseline."""
    n = [aggregate(select(k, s), keys, "time_ms")["n"] for s in (sel, {**sel, **base})]
    n = [x[x > 0] for x in n if len(x)]
    return int(min(x.min() for x in n)) if n and all(len(x) for x in n) else 0


def stat_kernel_speedup(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    from analysis.kernel import describe_columns, kernel_speedup
    k = ctx.frame("kernels")
    d = select(k, sel) if not k.empty else k
    if d.empty:
        return Outcome(why=why_empty(k, sel, "kernel row"))
    keys = describe_columns(ctx.res, k)
    v, n = kernel_speedup(k, keys, sel, base)
    if n == 0:
        return Outcome(why="no baseline twin: " + why_empty(k, {**sel, **base}, "kernel row"), gpus=_gpus(d))
    return Outcome(v, f"{v:.2f}", n, gpus=_gpus(d), reps=_kernel_reps(k, keys, sel, base),
                   spread_from=NO_KERNEL_NOISE)


def stat_roofline_shift(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    k = ctx.frame("kernels")
    num = select(k, sel) if not k.empty else k
    if num.empty:
        return Outcome(why=why_empty(k, sel, "kernel row"))
    b = select(k, {**sel, **base})
    nb, bb = set(num["bound"].dropna()), set(b["bound"].dropna()) if not b.empty else set()
    if not nb or not bb:
        return Outcome(why="kernel rows lack flops/bytes or the measured peaks (no roofline class)", gpus=_gpus(num))
    ok = nb == {"memory"} and bb == {"compute"}
    from analysis.kernel import describe_columns
    return Outcome(ok, f"paged-equivalent: {'/'.join(sorted(nb))}-bound; HOT: {'/'.join(sorted(bb))}-bound",
                   len(num), gpus=_gpus(num, b), reps=_kernel_reps(k, describe_columns(ctx.res, k), sel, base),
                   spread_from=NO_KERNEL_NOISE)


def stat_amdahl(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    from analysis.amdahl import PROFILED
    from analysis.common import config_label
    t = ctx.amdahl()
    label = config_label(c["model"], int(c["tp"]))
    row = t[t["config"] == label] if not t.empty else t
    if row.empty:
        return Outcome(why=f"no profiled sglang_default cell (B=256, Lp=8K) for {label}")
    r = row.iloc[0]
    if _missing(r["measured"]):
        return Outcome(why=f"no granikv/sglang_default throughput pair at B=256, Lp=8K for {label}")
    ok = bool(r["predicted_paper_s"] > r["measured"])
    # the GPUs of the cells the measured ratio came from (profiled ones where no plain pair exists)
    cells = with_dispatch(ctx.res.cells)
    inst = "=True" if r["measured_from"] == PROFILED else "=False"
    src = select(cells, {"kind": "=serving", "instrumented": inst}) if not cells.empty else cells
    mine = select(src, sel) if not src.empty else src
    if r["measured_from"] == PROFILED:
        reps = int(len(mine))
    else:
        pp = paired(src, ctx.res.config_columns, sel, base, c["metric"])
        reps = int(min(pp["n_num"].min(), pp["n_base"].min())) if not pp.empty else 0
    return Outcome(ok, f"f={r['f_attention_share']:.3f}: predicted {r['predicted_paper_s']:.2f} (s=15.6) vs measured "
                       f"{r['measured']:.2f} ({r['measured_from']})", 1, gpus=_gpus(mine), reps=reps,
                   spread_from=NOT_PROPAGATED)


def stat_trace_speedup(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    return _ratio_stat(ctx, c, sel, base, "inverse")


def stat_overhead(ctx: Context, c: pd.Series, sel: dict, col: str) -> Outcome:
    df = ctx.frame("steps")
    d = select(df, sel) if not df.empty else df
    if d.empty:
        return Outcome(why=why_empty(df, sel, WHAT["steps"]))
    if col not in d.columns or d[col].isna().all():
        return Outcome(why="steps.jsonl carries no dispatcher time (dispatch_us)", gpus=_gpus(d))
    v = float(d[col].max())
    a = aggregate(d, identity(d, ctx.res.config_columns), col)
    return Outcome(v, f"{v:.4g} (max over {d[col].notna().sum()} cells)", int(d[col].notna().sum()), gpus=_gpus(d),
                   reps=int(a.loc[a["n"] > 0, "n"].min()) if (a["n"] > 0).any() else 0, spread_from=NOT_PROPAGATED)


STATISTICS = {
    "ratio": lambda ctx, c, s, b: _ratio_stat(ctx, c, s, b, "geomean"),
    "inv_ratio": lambda ctx, c, s, b: _ratio_stat(ctx, c, s, b, "inverse"),
    "max_abs_dev": lambda ctx, c, s, b: _ratio_stat(ctx, c, s, b, "max_abs_dev"),
    "monotone_ratio": lambda ctx, c, s, b: _ratio_stat(ctx, c, s, b, "monotone"),
    "value": lambda ctx, c, s, b: _value_stat(ctx, c, s, "value"),
    "min": lambda ctx, c, s, b: _value_stat(ctx, c, s, "min"),
    "max": lambda ctx, c, s, b: _value_stat(ctx, c, s, "max"),
    "peak_share": stat_peak_share,
    "kernel_speedup": stat_kernel_speedup,
    "roofline_shift": stat_roofline_shift,
    "amdahl_overshoot": stat_amdahl,
    "trace_speedup": stat_trace_speedup,
    "overhead_share": lambda ctx, c, s, b: stat_overhead(ctx, c, s, "share_pct"),
    "overhead_cpu_us": lambda ctx, c, s, b: stat_overhead(ctx, c, s, "dispatch_us"),
}


def _num(x: str) -> float | None:
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
    if _missing(o.value):
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
    """One row per claim: the claim's columns plus ``ours``, ``ours_shown``, ``configs`` (configurations
    pooled), ``n`` (repetitions: the fewest behind one configuration; 0 = not tracked), ``our_hardware``,
    ``verdict`` (VERDICT_RULE), ``point_verdict`` (the same without the noise), ``spread_lo`` /
    ``spread_hi`` / ``spread_shown`` / ``spread_from`` (the interval our number may lie in and how it was
    obtained), ``between`` (the verdicts an inconclusive interval spans), ``why``, and how close the verdict
    is to flipping: ``flips_at`` (the nearest value of our number where it would change; NaN for
    qualitative claims), ``margin`` (the relative distance to it, or for a qualitative claim the step it
    turns on), ``margin_shown``, ``margin_note`` and ``decider`` (the deciding cells)."""
    claims = load_claims() if claims is None else claims
    ctx = Context(res)
    rows = []
    for _, c in claims.iterrows():
        sel, base = parse_selectors(c["selectors"]), parse_selectors(c["baseline"])
        o = STATISTICS[c["statistic"]](ctx, c, sel, base)
        kw = dict(paper_hi=_num(c["paper_value_hi"]), better=c["better"] or None, ratio=c["unit"] == "x")
        spread = None if _missing(o.lo) or _missing(o.hi) else (o.lo, o.hi)
        pv = point_verdict(c["check"], _num(c["paper_value"]), o.value, **kw)
        v = verdict(c["check"], _num(c["paper_value"]), o.value, spread=spread, **kw)
        between = " / ".join(spread_classes(c["check"], _num(c["paper_value"]), spread, **kw)) \
            if v == INCONCLUSIVE else ""
        why = o.why if v == NOT_MEASURED else ""
        if v == NOT_MEASURED and "tp" in sel and c["frame"] == "cells":
            why += other_tp_note(ctx, c, sel, base)
        if v == NOT_MEASURED and "hardware.name" in sel and c["frame"] == "cells":
            why += other_hardware_note(ctx, c, sel, base)
        at, rel = margin(o.value, flip_points(c["check"], _num(c["paper_value"]), **kw))
        shown = _margin_shown(at, rel)
        if c["check"] == "true" and v != NOT_MEASURED and np.isfinite(o.margin):
            rel, shown = o.margin, f"{o.margin:.1%} ({o.margin_note})"
        rows.append({**c.to_dict(), "ours": o.value, "ours_shown": o.shown if v != NOT_MEASURED else "",
                     "configs": o.n, "n": o.reps, "our_hardware": ", ".join(o.gpus), "verdict": v,
                     "point_verdict": pv, "spread_lo": o.lo if spread else np.nan,
                     "spread_hi": o.hi if spread else np.nan,
                     "spread_shown": _spread_shown(c, spread) if v != NOT_MEASURED else "",
                     "spread_from": o.spread_from if v != NOT_MEASURED else "", "between": between, "why": why,
                     "flips_at": at, "margin": rel, "margin_shown": shown, "margin_note": o.margin_note,
                     "decider": o.decider})
    return pd.DataFrame(rows)


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


def paper_shown(c: pd.Series) -> str:
    """The paper's value as the report prints it (``>= 0.97 x``, ``1.05-1.15 x``, ``yes``)."""
    if c["check"] == "true":
        return "yes"
    v, hi, u = c["paper_value"], c["paper_value_hi"], c["unit"]
    op = {"bound_ge": ">= ", "bound_le": "<= "}.get(c["check"], "")
    return f"{op}{v}{'-' + hi if hi else ''} {u}".strip()

