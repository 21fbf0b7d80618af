"""Host time of one decode step's plan, per attention backend, in the kernel benchmark
(``runners.kernel_bench plan_reps=N [profile_plan=n] [plan_busy_ms=m]``).

Reads every kernel.jsonl row that carries ``plan_us_eager`` (rows measured without ``plan_reps`` have
none). One row per (cell, backend, step kind): the median host time of make_plan + load on the eager
set (``eager``) or on the CUDA-graph-mode set the engine replays (``graph``), the same while the GPU is
busy (``busy_us``: planned as the engine's overlap schedule plans, behind a running step; a plan that
waits for the device costs up to ``busy_ms`` more there), and each against the paged backend (SGLang
default's path) of the same cell and kind. ``top``: the plan's costliest functions under cProfile, own
time per plan (indicative: cProfile slows Python calls). Repetitions are not pooled: each measured row
stands alone with its sweep and code version. Writes tables/plan_host.{csv,md}. No figure.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.registry import register_exhibit



NAME = "plan_host"
FIGURES: tuple[str, ...] = ()
BASE = "paged"
TOP = 4
KEYS = ["gpu", "shape", "Lp", "B", "k", "class_rows", "batch_form", "step_kind", "backend"]
COLS = KEYS + ["paths", "plan_us", "base_plan_us", "plan_ratio", "busy_us", "base_busy_us", "busy_ratio", "busy_ms",
               "top", "sweep", "code", "status"]


def _paths(decisions) -> str:
    """'8x dense' / '1x cascade, 1x paged': the backend's path per class in the cell."""
    if isinstance(decisions, str):
        decisions = json.loads(decisions)
    if not isinstance(decisions, list) or not decisions:
        return ""
    n: dict[str, int] = {}
    for d in decisions:
        if isinstance(d, dict) and "backend" in d:
            n[d["backend"]] = n.get(d["backend"], 0) + 1
    return ", ".join(f"{v}x {k}" for k, v in sorted(n.items()))


def _or(v, default: str) -> str:
    """``v``, or ``default`` where the row has none (absent, None or NaN: rows from before the key)."""
    return default if v is None or (isinstance(v, float) and pd.isna(v)) else str(v)


def _top(profile, where: str) -> str:
    if profile is None or (isinstance(profile, float) and pd.isna(profile)):
        return ""
    if isinstance(profile, str):
        profile = json.loads(profile)
    if not isinstance(profile, list) or not all(isinstance(f, dict) and {"fn", "us_per_plan"} <= set(f) for f in profile):
        raise ValueError(f"{where}: plan_profile must be a list of {{fn, us_per_plan, calls_per_plan}} "
                         "(runners.kernel_bench profile_plan=n writes it); rerun the cell")
    own = [f for f in profile if "_lsprof" not in f["fn"]]       # the profiler's own bookkeeping
    return "; ".join(f"{f['fn'].split(':')[-1]} {float(f['us_per_plan']):.0f}" for f in own[:TOP])


def frame(res: Results) -> pd.DataFrame:
    """One row per (kernel row with a plan time, step kind), with the paged backend's time beside it."""
    k = res.kernels
    if k.empty or "k.plan_us_eager" not in k.columns:
        return pd.DataFrame(columns=COLS)
    rows = []
    for _, r in k[k["k.plan_us_eager"].notna()].iterrows():
        where = f"{r.get('path', '?')}/kernel.jsonl backend {r.get('k.backend')}"
        for kind in ("eager", "graph"):
            us = r.get(f"k.plan_us_{kind}")
            if us is None or pd.isna(us):
                continue
            busy = r.get(f"k.plan_us_busy_{kind}")
            rows.append({"gpu": r.get("provenance.gpu_name") or "no GPU (CPU)", "shape": r.get("cell.shape.name"),
                         "Lp": r.get("cell.prefix_len"), "B": r.get("cell.batch"), "k": r.get("cell.num_prefixes"),
                         "class_rows": _or(r.get("cell.class_rows"), "round_robin"),
                         "batch_form": _or(r.get("cell.batch_form"), "packed"), "step_kind": kind,
                         "backend": r.get("k.backend"), "paths": _paths(r.get("k.decisions")),
                         "plan_us": float(us), "busy_us": None if busy is None or pd.isna(busy) else float(busy),
                         "busy_ms": r.get("k.plan_busy_ms"), "top": _top(r.get(f"k.plan_profile_{kind}"), where),
                         "sweep": r.get("sweep"), "code": str(r.get("provenance.git_commit") or "unknown")[:7],
                         "path": r.get("path")})
    t = pd.DataFrame(rows)
    if t.empty:
        return pd.DataFrame(columns=COLS)
    base = t[t["backend"] == BASE][["path", "step_kind", "plan_us", "busy_us"]].rename(
        columns={"plan_us": "base_plan_us", "busy_us": "base_busy_us"})
    t = t.merge(base, on=["path", "step_kind"], how="left")
    t["plan_ratio"] = t["plan_us"] / t["base_plan_us"]
    t["busy_ratio"] = t["busy_us"] / t["base_busy_us"]
    t["status"] = "measured"
    t = t.sort_values(["gpu", "shape", "Lp", "B", "k", "class_rows", "batch_form", "step_kind", "sweep", "code", "backend"],
                      kind="stable")
    return t[COLS].reset_index(drop=True)


def lines(t: pd.DataFrame) -> list[str]:
    """The REPORT's paragraph: per kernel-bench sweep, GPU and step kind, GraniKV's plan against the paged
    backend's in the same cells, and where the worst one's host time goes."""
    L = ["", "Where that host time goes, one attention layer's plan alone (tables/plan_host.md, kernel "
             "benchmark): GraniKV's plan against the paged backend's in the same cell, with the costliest "
             "functions of the worst row under cProfile.", ""]
    t = t[(t["status"] == "measured") & (t["backend"] == "granikv")] if not t.empty else t
    if t.empty:
        return L + [f"- {NOT_MEASURED}: no kernel-bench row carries a plan time."]
    for (sweep, gpu, kind), g in t.groupby(["sweep", "gpu", "step_kind"], sort=True):
        worst = g.loc[g["plan_ratio"].idxmax()]
        busy = g.dropna(subset=["busy_ratio"])
        if busy.empty:
            tail = "."
        elif (busy["base_busy_us"] >= 1e3 * busy["busy_ms"]).all():     # the paged plan waited out the busy GPU too
            tail = ("; behind a busy GPU every backend's plan, paged included, waited for the device (these batches "
                    "had no host copy of the indptr), so that column says nothing about GraniKV.")
        else:
            tail = f"; behind a busy GPU {busy['busy_ratio'].min():.2f}-{busy['busy_ratio'].max():.2f}x."
        L.append(f"- {sweep} ({gpu}), {kind} plans: {int((g['plan_ratio'] <= 1).sum())} of {len(g)} cells at or "
                 f"below the paged backend's; plan_ratio {g['plan_ratio'].min():.2f}-{g['plan_ratio'].max():.2f} "
                 f"(worst: Lp={int(worst['Lp'])}, B={int(worst['B'])}, k={int(worst['k'])}, {worst['plan_us']:.0f} us "
                 f"against {worst['base_plan_us']:.0f} us; costliest: {worst['top'] or 'not profiled'})" + tail)
    return L


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return lines(frame(res))


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=6, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/plan_host.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"backend": "(none)", "status": f"{NOT_MEASURED}: no kernel-bench row carries a plan time "
                                                         "(run python -m runners.kernel_bench plan_reps=100 "
                                                         "profile_plan=16 plan_busy_ms=5)"}], columns=COLS)
    write_table(t, NAME, out, {"plan_us": 0, "base_plan_us": 0, "busy_us": 0, "base_busy_us": 0, "plan_ratio": 2,
                               "busy_ratio": 2, "busy_ms": 1},
                title="Host time of one decode step's plan, per backend (kernel benchmark)",
                note="plan_us: median host time of make_plan + load over the row's repetitions, on the eager "
                     "wrapper set or the CUDA-graph-mode set (step_kind); busy_us: the same while the GPU runs "
                     "busy_ms of other work, as the engine's overlap schedule plans (a plan that waits for the "
                     "device shows there); base_*: the paged backend (SGLang default's path) in the same cell and "
                     "step kind; ratio = backend / paged. batch_form: packed = the cell's slot lists given packed "
                     "(plan_us leaves out building them; GraniKV's plan rebuilds prefix-free copies), slot_table = "
                     "given as slot-table rows, every backend's plan gathers the lists it runs (the engine's form). "
                     "paths: the backend's path per prefix class. top: the "
                     "plan's costliest functions under cProfile, own microseconds per plan (indicative). A busy_us "
                     "of about busy_ms plus plan_us for every backend, paged included, means each plan read "
                     "something back from the device: the kernel bench's batches carried no host copy of the "
                     "indptr before the engine-like one they carry now, and plan() read it back every step.")
    return t
