"""Run-to-run noise: the interval our number may lie in."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import aggregate, identity






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
