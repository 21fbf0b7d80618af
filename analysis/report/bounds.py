"""Why a bound claim failed, from the measurements: the configurations on the wrong side of the
bound, and, for the dispatcher's routing claims, the calibration kernel times behind its choice.

A bound claim's number is an extreme over configurations (``min``/``max`` of a per-configuration
value, or the largest deviation of a ratio from 1): one configuration decides it. The REPORT's
"Where our verdict differs" section names every configuration that breaks the bound (and, for a
deviation, which side of 1 it lies on), so a reader sees whether one cell or the whole grid
contradicts the paper.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.common import aggregate, identity, paired, parse_selectors, select, show
from analysis.load import Results
from analysis.verdict.context import Context
from analysis.verdict.statistics import swept_groups






# prose names of the configuration keys that vary inside one claim's cells
SHORT_KEYS = {"workload.prefix_len": "Lp", "workload.batch": "B", "meff": "Meff", "system": "system",
              "workload.num_prefixes": "k"}
MAX_LISTED = 8   # configurations listed by name; the rest are counted


def _label(row: pd.Series, keys: list[str]) -> str:
    return ", ".join(f"{SHORT_KEYS[k]}={show(row[k])}" for k in keys if k in SHORT_KEYS and k in row.index)


def _varying(df: pd.DataFrame, keys: list[str]) -> list[str]:
    out = [k for k in keys if k in df.columns and df[k].astype(str).nunique() > 1]
    if "meff" in df.columns and "workload.batch" in out:
        out.append("meff")
    return out


def _listed(parts: list[str]) -> str:
    more = len(parts) - MAX_LISTED
    return "; ".join(parts[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def violators(res, claim: pd.Series) -> tuple[pd.DataFrame, list[str]]:
    """Per-configuration values of a ``min``/``max`` bound claim that break its bound, with the keys
    that tell them apart. Empty when the claim is not such a claim or nothing breaks it."""
    if claim.get("statistic") not in ("min", "max") or claim.get("check") not in ("bound_ge", "bound_le"):
        return pd.DataFrame(), []
    df = Context(res).frame(claim["frame"])
    d = select(df, parse_selectors(claim["selectors"])) if not df.empty else df
    metric = claim["metric"]
    if d.empty or metric not in d.columns:
        return pd.DataFrame(), []
    ids = identity(d, res.config_columns)
    a = aggregate(d, ids, metric).rename(columns={"mean": "value"})
    if "meff" in d.columns and d["meff"].notna().any():
        a["meff"] = aggregate(d, ids, "meff")["mean"].to_numpy()   # same keys, same row order
    bound = float(claim["paper_value"])
    bad = a[a["value"] < bound] if claim["check"] == "bound_ge" else a[a["value"] > bound]
    return bad.reset_index(drop=True), _varying(a, ids)


def bound_line(res, claim: pd.Series) -> str:
    """The configurations that break a bound claim, each with its value (empty if none apply)."""
    if claim.get("statistic") == "max_abs_dev":
        return deviation_line(res, claim)
    bad, keys = violators(res, claim)
    if bad.empty:
        return ""
    op = "below" if claim["check"] == "bound_ge" else "above"
    parts = [f"{_label(r, keys)}: {r['value']:.3f}" for _, r in bad.iterrows()]
    return (f"{len(bad)} configuration(s) lie {op} the bound {claim['paper_value']} ({claim['metric']}, "
            f"repetitions averaged): {_listed(parts)}.")


def deviation_line(res, claim: pd.Series) -> str:
    """For a 'within x of the baseline' claim: the pairs outside the band, split by side of 1."""
    df = Context(res).frame(claim["frame"])
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    p = paired(df, res.config_columns, sel, base, claim["metric"]) if not df.empty else pd.DataFrame()
    if p.empty:
        return ""
    p = p[np.isfinite(p["ratio"].astype(float))]
    band = float(claim["paper_value"])
    keys = _varying(p, identity(p, res.config_columns) + ["system"])
    out = []
    for side, m in (("lower than the baseline's", p["ratio"] < 1 - band), ("higher than the baseline's", p["ratio"] > 1 + band)):
        s = p[m].sort_values("ratio")
        if not s.empty:
            out.append(f"{len(s)} pair(s) {side} by more than {band:.0%}: "
                       + _listed([f"{_label(r, keys)}: {r['ratio']:.4f}" for _, r in s.iterrows()]))
    inside = int(((p["ratio"] - 1).abs() <= band).sum())
    if not out:
        return ""
    return (f"{claim['metric']} over the baseline's ({len(p)} pairs, {inside} within {band:.0%}): "
            + "; ".join(out) + ".")


def _calibration_at(res, claim: pd.Series, points: pd.DataFrame) -> tuple[str, list[tuple[pd.Series, pd.Series | None]]]:
    """The claim's model and, per row of ``points`` (workload.prefix_len, meff), the calibration kernel row
    measured there for that model's shape (None where the calibration has no such point)."""
    k = res.kernels
    model = parse_selectors(claim["selectors"]).get("model.name", "").lstrip("=")
    fit = k[k["k.meff"].notna() & (k["cell.shape.name"] == model)]
    if "k.classes" in fit.columns:        # one-class points: the claims' cells are steps of one prefix class
        fit = fit[pd.to_numeric(fit["k.classes"], errors="coerce").fillna(1) == 1]
    out = []
    for _, r in points.iterrows():
        at = fit[(fit["k.prefix_len"] == r["workload.prefix_len"]) & (fit["k.meff"] == r["meff"])]
        out.append((r, None if at.empty else at.iloc[0]))
    return model, out


def calibration_line(res, claim: pd.Series) -> str:
    """For the routing claims: what the H200 calibration measured at the violating (Lp, Meff)
    points (one layer's prefix attention, ms), i.e. why the fitted decision table chose as it did."""
    bad, _ = violators(res, claim)
    k = res.kernels
    need = {"k.prefix_len", "k.meff", "k.times.dense", "k.times.cascade", "k.times.paged", "cell.shape.name"}
    if bad.empty or k.empty or not need <= set(k.columns) or "meff" not in bad.columns:
        return ""
    model, rows = _calibration_at(res, claim, bad)
    parts, missing = [], sum(t is None for _, t in rows)
    for r, t in rows:
        if t is None:
            continue
        best = min(("dense", "cascade", "paged"), key=lambda b: t[f"k.times.{b}"])
        parts.append(f"Lp={show(r['workload.prefix_len'])}, Meff={show(r['meff'])}: dense "
                     f"{t['k.times.dense'] * 1e3:.0f} us, cascade {t['k.times.cascade'] * 1e3:.0f} us, paged "
                     f"{t['k.times.paged'] * 1e3:.0f} us (fastest: {best})")
    if not parts:
        return ""
    return (f"The dispatcher follows the decision table fitted on this GPU (runners.calibrate, "
            f"results/raw/calibration/fit-{model}*): at these points the calibration measured, per layer, "
            + _listed(parts) + (f"; {missing} point(s) lie between calibration Lp values" if missing else "") + ".")


def kernel_pair_line(res, claim: pd.Series, a: str = "dense", b: str = "cascade") -> str:
    """For the dense-only vs cascade-only TPOT claims: what the H200 calibration measured for one layer's
    prefix attention on path ``a`` against path ``b`` at the (Lp, Meff) points of the claim's cells, so
    the end-to-end TPOT ratio can be read against the kernel ratio behind it."""
    df = Context(res).frame(claim.get("frame", "cells"))
    cells = select(df, parse_selectors(claim["selectors"])) if not df.empty else df
    k = res.kernels
    need = {"k.prefix_len", "k.meff", f"k.times.{a}", f"k.times.{b}", "cell.shape.name"}
    if cells.empty or "meff" not in cells.columns or k.empty or not need <= set(k.columns):
        return ""
    points = cells[["workload.prefix_len", "meff"]].drop_duplicates().sort_values(["meff", "workload.prefix_len"])
    model, rows = _calibration_at(res, claim, points)
    parts, missing = [], sum(t is None for _, t in rows)
    for r, t in rows:
        if t is None:
            continue
        ta, tb = t[f"k.times.{a}"] * 1e3, t[f"k.times.{b}"] * 1e3
        parts.append(f"Lp={show(r['workload.prefix_len'])}, Meff={show(r['meff'])}: {a} {ta:.0f} us vs {b} "
                     f"{tb:.0f} us ({ta / tb:.2f}x)")
    if not parts:
        return ""
    return (f"One layer's prefix attention in the calibration (runners.calibrate, results/raw/calibration/"
            f"fit-{model}*), {a} vs {b}: " + _listed(parts)
            + (f"; {missing} point(s) have no calibration measurement" if missing else "")
            + ". The rest of a decode step (weights, the other attention part, the merge) is common to both, "
              "which pulls the end-to-end ratio towards 1.")


def peak_line(res: Results, claim: pd.Series) -> str:
    """For a "B=256 is the peak" claim that fails: per Lp below the bound, the peak B beside B=256 with
    what each run recorded (output tok/s, TPOT p50, KV in use at its peak over the KV budget, decode
    steps run eagerly above the CUDA-graph batch limit), and the KV budget of the paper's A100-40GB
    (hardware=a100_40gb) where a run of the same model recorded one. Empty when nothing applies."""
    d = Context(res).frame("cells")
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    d = select(d, sel) if not d.empty else d
    (bkey, bcond), = base.items()
    if d.empty or "kv_budget_tokens" not in d.columns:
        return ""
    d = d.assign(_kv=(d["cold_peak_tokens"] + d["hot_peak_tokens"]) / d["kv_budget_tokens"],
                 _eager=d.get("eager_decode_reasons.above_cuda_graph_max_bs", pd.Series(0, index=d.index)).fillna(0)
                 / d["num_decode_steps"])
    bound = float(claim["paper_value"])
    parts, peaks, fullest = [], [], 0.0
    for g, lack in swept_groups(d, res.config_columns, bkey):
        if lack or select(g, {bkey: bcond}).empty:
            continue
        by = g.groupby(bkey).agg(thr=(claim["metric"], "mean"), tpot=("tpot_p50_ms", "mean"), kv=("_kv", "max"),
                                 eager=("_eager", "mean"))
        at, best = by.loc[select(g, {bkey: bcond})[bkey].iloc[0]], by["thr"].idxmax()
        if at["thr"] / by.loc[best, "thr"] >= bound:
            continue

        def one(b, r) -> str:
            return (f"B={show(b)} {r['thr']:.0f} tok/s, TPOT p50 {r['tpot']:.1f} ms, KV peak {r['kv']:.0%} of the budget, "
                    f"{r['eager']:.0%} of decode steps eager above the graph limit")
        parts.append(f"Lp={show(g['workload.prefix_len'].iloc[0])}: {one(best, by.loc[best])}; "
                     f"{one(at.name, at)}")
        peaks.append(best)
        fullest = max(fullest, float(by.loc[best, "kv"]))
    if not parts:
        return ""
    peak_b = [show(b) for b in sorted(set(peaks))]
    names = sorted(set(d["provenance.gpu_name"].dropna())) if "provenance.gpu_name" in d.columns else []
    gpus = ", ".join(names) or "our hardware"
    txt = (f"Per Lp below the bound, the peak beside B={bcond.lstrip('=')} (repetitions averaged): " + " | ".join(parts)
           + f". On {gpus} the KV budget ({d['kv_budget_tokens'].min() / 1e3:.0f}K-{d['kv_budget_tokens'].max() / 1e3:.0f}K tokens) "
           f"held B={', '.join(peak_b)} " + ("without filling" if fullest < 0.95 else f"at up to {fullest:.0%}")
           + f", and throughput kept rising past B={bcond.lstrip('=')}, though "
           f"the decode steps above the CUDA-graph batch limit ran eagerly.")
    model = sel.get("model.name", "").lstrip("=")
    a100 = res.cells[(res.cells.get("hardware.name") == "a100_40gb") & (res.cells.get("model.name") == model)] \
        if {"hardware.name", "model.name", "kv_budget_tokens"} <= set(res.cells.columns) else pd.DataFrame()
    if not a100.empty:
        at_peak = d[d[bkey].isin(peaks)]
        used = float((at_peak["cold_peak_tokens"] + at_peak["hot_peak_tokens"]).max())
        budget = float(a100["kv_budget_tokens"].median())
        txt += (f" The paper's A100-40GB KV budget for {model} (hardware=a100_40gb, as recorded by {len(a100)} "
                f"run(s)) is {budget / 1e3:.0f}K tokens; our peak-B runs held up to {used / 1e3:.0f}K at once"
                + (", which would not fit there." if used > budget else "."))
    return txt
