"""The statistics a claim's number is computed with (claims.csv column ``statistic``)."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import aggregate, config_label, geomean, identity, paired, select, show
from analysis.measures.amdahl import PROFILED
from analysis.measures.dispatch import with_dispatch
from analysis.measures.kernels import describe_columns, kernel_speedup
from analysis.verdict.context import Context, Outcome, WHAT, gpus_of, pair_label, why_empty
from analysis.verdict.noise import claim_noise, side_interval, spread_note
from analysis.verdict.rule import EPS, is_missing






# a "grows monotonically with Lp (512..16K)" claim is confirmed only over its span: both ends and
# at least 4 Lp values (a decrease anywhere refutes it at once)
MONOTONE_LP_SPAN = (512, 16384)


MONOTONE_MIN_LPS = 4


def _ratio_stat(ctx: Context, c: pd.Series, sel: dict, base: dict, reduce: str) -> Outcome:
    df, what = ctx.frame(c["frame"]), WHAT[c["frame"]]
    num = select(df, sel) if not df.empty else df
    if num.empty:
        return Outcome(why=why_empty(df, sel, what))
    p = paired(df, ctx.res.config_columns, sel, base, c["metric"])
    basesel = {**sel, **base}
    if p.empty:
        return Outcome(why="no baseline twin: " + why_empty(df, basesel, what), gpus=gpus_of(num))
    bcells = select(df, basesel)
    gpus = gpus_of(num, bcells)
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
        return Outcome(why=f"the matching cells have no `{metric}`", gpus=gpus_of(d))
    agg = aggregate(d, identity(d, ctx.res.config_columns), metric)
    agg = agg[agg["n"] > 0]
    a = agg["mean"].astype(float)
    f = {"value": np.mean, "min": np.min, "max": np.max}[reduce]
    v = float(f(a))
    noise, noise_from = claim_noise(ctx, c["frame"], metric, d)
    lo, hi, w = side_interval(agg["mean"], agg["min"], agg["max"], agg["n"], noise)
    known = bool(np.isfinite(lo).all() and np.isfinite(hi).all())
    return Outcome(v, f"{v:.3g}" if reduce == "value" else f"{v:.3f} (over {len(a)} configs)", len(a),
                   gpus=gpus_of(d), reps=int(agg["n"].min()), lo=float(f(lo)) if known else np.nan,
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
                           f"(measured: {bkey}={', '.join(show(x) for x in swept)})", gpus=gpus_of(d))
    if not shares:
        return Outcome(why=f"needs {bkey}{bcond} and every other measured {bkey} "
                           f"({', '.join(show(x) for x in swept)}) in one configuration{tail}", gpus=gpus_of(d))
    known = all(np.isfinite(x) for e in ends for x in e)
    return Outcome(min(shares), f"{min(shares):.3f} min; " + "; ".join(parts) + tail, len(shares), gpus=gpus_of(d),
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
    k = ctx.frame("kernels")
    d = select(k, sel) if not k.empty else k
    if d.empty:
        return Outcome(why=why_empty(k, sel, "kernel row"))
    keys = describe_columns(ctx.res, k)
    v, n = kernel_speedup(k, keys, sel, base)
    if n == 0:
        return Outcome(why="no baseline twin: " + why_empty(k, {**sel, **base}, "kernel row"), gpus=gpus_of(d))
    return Outcome(v, f"{v:.2f}", n, gpus=gpus_of(d), reps=_kernel_reps(k, keys, sel, base),
                   spread_from=NO_KERNEL_NOISE)


def stat_roofline_shift(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    k = ctx.frame("kernels")
    num = select(k, sel) if not k.empty else k
    if num.empty:
        return Outcome(why=why_empty(k, sel, "kernel row"))
    b = select(k, {**sel, **base})
    nb, bb = set(num["bound"].dropna()), set(b["bound"].dropna()) if not b.empty else set()
    if not nb or not bb:
        return Outcome(why="kernel rows lack flops/bytes or the measured peaks (no roofline class)", gpus=gpus_of(num))
    ok = nb == {"memory"} and bb == {"compute"}
    return Outcome(ok, f"paged-equivalent: {'/'.join(sorted(nb))}-bound; HOT: {'/'.join(sorted(bb))}-bound",
                   len(num), gpus=gpus_of(num, b), reps=_kernel_reps(k, describe_columns(ctx.res, k), sel, base),
                   spread_from=NO_KERNEL_NOISE)


def stat_amdahl(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    t = ctx.amdahl()
    label = config_label(c["model"], int(c["tp"]))
    row = t[t["config"] == label] if not t.empty else t
    if row.empty:
        return Outcome(why=f"no profiled sglang_default cell (B=256, Lp=8K) for {label}")
    r = row.iloc[0]
    if is_missing(r["measured"]):
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
                       f"{r['measured']:.2f} ({r['measured_from']})", 1, gpus=gpus_of(mine), reps=reps,
                   spread_from=NOT_PROPAGATED)


def stat_trace_speedup(ctx: Context, c: pd.Series, sel: dict, base: dict) -> Outcome:
    return _ratio_stat(ctx, c, sel, base, "inverse")


def stat_overhead(ctx: Context, c: pd.Series, sel: dict, col: str) -> Outcome:
    df = ctx.frame("steps")
    d = select(df, sel) if not df.empty else df
    if d.empty:
        return Outcome(why=why_empty(df, sel, WHAT["steps"]))
    if col not in d.columns or d[col].isna().all():
        return Outcome(why="steps.jsonl carries no dispatcher time (dispatch_us)", gpus=gpus_of(d))
    v = float(d[col].max())
    a = aggregate(d, identity(d, ctx.res.config_columns), col)
    return Outcome(v, f"{v:.4g} (max over {d[col].notna().sum()} cells)", int(d[col].notna().sum()), gpus=gpus_of(d),
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
