"""The verdict rule."""
from __future__ import annotations
import numpy as np

from analysis.common import NOT_MEASURED
from analysis.paper import CHECKS






REPRODUCED, EXCEEDED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "exceeded", "not reproduced", "inconclusive"


VERDICTS = (REPRODUCED, EXCEEDED, NOT_REPRODUCED, INCONCLUSIVE, NOT_MEASURED)


TOL = 0.25           # "within +-25%"


PARITY_BAND = 0.05   # a paper ratio within 5% of 1 claims parity: no direction to match


PARITY_RATIO = 0.97  # parity, the paper's own bound (Sec. 1, Limitations: ratio >= 0.97x): within 0.97x-1/0.97x


EPS = 1e-9


VERDICT_RULE = """\
Each claim gets one of five verdicts, from our number (repetitions pooled by mean, configurations by geometric \
mean) and the interval it may lie in:

- **reproduced**: our number is within +-25% of the paper's value (for a range, from 25% below its low end to 25% \
above its high end) and, for a ratio, on the same side of 1 as the paper's (unless the paper reports parity, \
within 5% of 1); or the stated bound (>=, <=) holds as stated; or our measurement confirms the qualitative claim. \
Parity is one rule: a ratio the paper reports at parity (within 5% of 1) is reproduced only within 0.97x-1.03x \
(0.97 = the paper's own parity bound, >= 0.97x, which its Lp=512 parity claims state as a bound), not within +-25%.
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


def is_missing(x) -> bool:
    return x is None or (isinstance(x, (float, np.floating)) and not np.isfinite(x))


def point_verdict(check: str, paper: float | None, ours, *, paper_hi: float | None = None, better: str | None = None,
                  ratio: bool = False, tol: float = TOL) -> str:
    """reproduced | exceeded | not reproduced | not measured for one number (VERDICT_RULE, without the noise)."""
    if check not in CHECKS:
        raise ValueError(f"check `{check}` not in {CHECKS}")
    if is_missing(ours):
        return NOT_MEASURED
    if check == "true":
        return REPRODUCED if bool(ours) else NOT_REPRODUCED
    ours = float(ours)
    if check == "bound_ge":
        return REPRODUCED if ours >= paper - EPS else NOT_REPRODUCED
    if check == "bound_le":
        return REPRODUCED if ours <= paper + EPS else NOT_REPRODUCED
    lo, hi = float(paper), float(paper if is_missing(paper_hi) else paper_hi)
    band_lo, band_hi = lo * (1 - tol) - EPS * abs(lo), hi * (1 + tol) + EPS * abs(hi)
    mid = (lo + hi) / 2
    directed = ratio and abs(mid - 1.0) >= PARITY_BAND
    if ratio and not directed:   # parity: the paper's parity band, on both sides of 1
        band_lo, band_hi = PARITY_RATIO - EPS, 1 / PARITY_RATIO + EPS
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
    if v == NOT_MEASURED or spread is None or any(is_missing(x) for x in spread):
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
    if check == "true" or is_missing(paper):
        return []
    lo = float(paper)
    hi = lo if is_missing(paper_hi) else float(paper_hi)
    cand = {lo, hi, lo * (1 - tol), hi * (1 + tol), 1.0, PARITY_RATIO, 1 / PARITY_RATIO} \
        if check in ("point", "range") else {lo}
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
    if is_missing(ours) or isinstance(ours, (bool, np.bool_)) or not points:
        return float("nan"), float("nan")
    x = min(points, key=lambda p: abs(float(ours) - p))
    return x, abs(float(ours) - x) / (abs(x) if x else 1.0)
