"""Per-step dispatch overhead (paper B.5): the dispatcher's CPU time per decode step against the
decode step's wall time.

- step wall time: the decode steps (``kind == "decode"``) of each cell's dispatch trace
  (steps.jsonl ``step_time_s``) of every serving cell of a dispatching system (granikv,
  granikv_dense_only; the ``dispatch_overhead`` sweep, headline, grid, ...);
- dispatcher CPU time: the step's own ``dispatch_us`` when the engine records it (the host time of
  ``GranikvPolicy.choose`` in the step's plan: table lookups and writing the choices into the
  class plans; mean and p50 over the decode steps), else the kernel bench's ``dispatch_cost`` cell
  (``Dispatcher.choose_many`` alone for one prefix class in a tight loop, which is faster than
  the same code inside a running engine). ``bench_lookup_us`` (that cell) and ``plan_us_cpu``
  (the whole plan() on CPU tensors) are shown beside for scale.

Writes tables/dispatch_overhead.{csv,md} and figures/dispatch_overhead.{png,pdf}.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from analysis.clean import all_cells
from analysis.common import NOT_MEASURED, placeholder_figure, plt, save_figure, select, sort_rows, with_derived, write_table
from analysis.load import Results, load_steps
from granikv.rawio import data_path

NAME = "dispatch_overhead"
# boxplot's horizontal switch: `orientation` from matplotlib 3.10 on, `vert` (deprecated there) before
HORIZONTAL = {"orientation": "horizontal"} if tuple(int(x) for x in matplotlib.__version__.split(".")[:2]) >= (3, 10) \
    else {"vert": False}
FIGURES = (NAME,)
SELECT = {"kind": "=serving", "system.name": "~granikv"}


def bench_dispatch_us(res: Results) -> tuple[float, float]:
    """(Dispatcher.choose us per step for one class, whole plan() us) from the kernel bench, else NaN."""
    k = res.kernels
    if k.empty or not {"cell.kind", "k.backend", "k.num_classes", "k.us_per_step"} <= set(k.columns):
        return float("nan"), float("nan")
    d = select(k, {"cell.kind": "=dispatch", "k.num_classes": "=1"})
    pick = lambda b: float(d.loc[d["k.backend"] == b, "k.us_per_step"].mean()) if (d["k.backend"] == b).any() else float("nan")  # noqa: E731
    return pick("dispatcher"), pick("granikv_plan_cpu")


def decode_timings(cell: Path) -> tuple[int, float, tuple[float, float] | None]:
    """(decode steps, their mean step time in ms, (mean, p50) of their ``dispatch_us`` or None where the
    trace records none) of one cell's steps.jsonl; read once per file version (the table, a claim and the
    report's dispatch line ask for the same cells)."""
    trace = data_path(Path(cell) / "steps.jsonl")
    if not trace.exists():
        return _decode_timings(cell)   # load_steps names the missing file
    st = trace.stat()
    return _decode_timings_cached(str(cell), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=1024)
def _decode_timings_cached(cell: str, mtime_ns: int, size: int) -> tuple[int, float, tuple[float, float] | None]:
    return _decode_timings(cell)


def _decode_timings(cell: str | Path) -> tuple[int, float, tuple[float, float] | None]:
    steps = load_steps(cell)
    dec = steps[steps["kind"] == "decode"] if "kind" in steps.columns else steps
    step_ms = 1e3 * pd.to_numeric(dec["step_time_s"], errors="coerce").mean() if "step_time_s" in dec.columns else np.nan
    if "dispatch_us" in dec.columns and pd.to_numeric(dec["dispatch_us"], errors="coerce").notna().any():
        us = pd.to_numeric(dec["dispatch_us"], errors="coerce")
        return len(dec), step_ms, (float(us.mean()), float(us.median()))
    return len(dec), step_ms, None


def overhead_frame(res: Results) -> pd.DataFrame:
    """One row per dispatch_overhead cell: its columns plus decode steps, mean decode step ms,
    dispatcher us per step (and where it comes from), plan() us, and ``share_pct``. Every cell, those
    analysis.clean sets aside included: graph capture in a run does not touch the dispatcher's CPU time.
    Instrumented cells (torch.profiler, nsys) are left out: the profiler's host hooks slow the dispatcher too."""
    cells = with_derived(all_cells(res))
    cells = select(cells, {**SELECT, "instrumented": "=False"}) if not cells.empty else cells
    if not cells.empty:   # the plugin inside real SGLang: its dispatch cost is in tables/in_sglang (its own counters)
        cells = cells[~cells["system"].str.startswith("sglang_server")]
    bench_us, plan_us = bench_dispatch_us(res)
    rows = []
    for _, r in cells.iterrows():
        n_dec, step_ms, own = decode_timings(Path(res.root) / r["path"])
        if own is not None:
            (disp, p50), src = own, "steps.jsonl"
        else:
            disp, p50, src = bench_us, np.nan, "kernel_bench dispatch_cost" if np.isfinite(bench_us) else ""
        commit = str(r.get("provenance.git_commit") or "")[:7]
        rows.append({**r.to_dict(), "commit": commit, "decode_steps": n_dec, "step_ms_mean": step_ms, "dispatch_us": disp,
                     "dispatch_us_p50": p50, "dispatch_from": src, "bench_lookup_us": bench_us,
                     "plan_us_cpu": plan_us, "share_pct": 100 * disp / (1e3 * step_ms)})
    return pd.DataFrame(rows)


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = overhead_frame(res)
    from analysis.plots import gpu_names
    gpu = gpu_names(t)
    cols = ["config", "sweep", "workload.kind", "workload.prefix_len", "workload.batch", "system", "cell_id",
            "commit", "decode_steps", "step_ms_mean", "dispatch_us", "dispatch_us_p50", "dispatch_from", "bench_lookup_us",
            "plan_us_cpu", "share_pct", "status"]
    if t.empty:
        us, plan = bench_dispatch_us(res)
        t = pd.DataFrame([{"config": "llama3_8b TP=1", "workload.prefix_len": 16384, "workload.batch": 256,
                           "system": s, "bench_lookup_us": us, "plan_us_cpu": plan,
                           "status": f"{NOT_MEASURED}: no serving cell of a dispatching system (step time)"}
                          for s in ("granikv", "granikv_dense_only")], columns=cols)
    else:
        t["status"] = np.where(t["share_pct"].notna(), "measured", f"{NOT_MEASURED}: no dispatcher time or step time")
        t = sort_rows(t.reindex(columns=cols), ["config", "sweep", "workload.prefix_len", "workload.batch", "system",
                                                "cell_id"])
    write_table(t, NAME, out, {"step_ms_mean": 3, "dispatch_us": 3, "dispatch_us_p50": 3, "bench_lookup_us": 3,
                               "plan_us_cpu": 1, "share_pct": 4},
                title="Per-step dispatch overhead (B.5)",
                note="paper: < 1 us CPU per step, < 0.2% of per-step wall time (A100). dispatch_us: the engine's "
                     "per-step dispatcher time (mean over decode steps; p50 beside); bench_lookup_us: the table lookup "
                     "alone in a tight loop (kernel bench, one class); plan_us_cpu: GraniKV's whole plan() on CPU "
                     "tensors (B=256, one class), for scale. commit: the code each cell ran (the dispatcher's per-class "
                     "lookup was rewritten at 10ad10a).")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, "no dispatch_overhead cells with dispatcher and step timings")
        return t
    draw(m, out, gpu)
    return t


def draw(m: pd.DataFrame, out: Path, gpu: str) -> None:
    """Per sweep folder (one box per sweep, the GraniKV serving cells in it): the dispatcher's share of the
    decode step and its CPU time per step, each with the paper's bound."""
    from analysis.plots import PAPER_LABEL, paper_claims, title_of
    sweeps = sorted(m["sweep"].astype(str).unique(), key=lambda x: (-int((m["sweep"] == x).sum()), x))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.42 * len(sweeps) + 1.6), sharey=True)
    for ax, col in ((a1, "share_pct"), (a2, "dispatch_us")):
        data = [pd.to_numeric(m.loc[m["sweep"] == s_, col], errors="coerce").dropna().to_numpy() for s_ in sweeps]
        ax.boxplot(data, widths=0.6, showfliers=True, flierprops={"markersize": 3}, **HORIZONTAL)
        ax.set_yticks(range(1, len(sweeps) + 1), [f"{s_} ({len(d)})" for s_, d in zip(sweeps, data)], fontsize=7)
        ax.set_xscale("log")
    pc = paper_claims(["dispatch_overhead_share", "dispatch_overhead_cpu"]).set_index("id")
    if "dispatch_overhead_share" in pc.index:
        a1.axvline(pc.loc["dispatch_overhead_share", "value"], color="black", ls=":", lw=1.4,
                   label=f"{PAPER_LABEL}: < {pc.loc['dispatch_overhead_share', 'value']:g}%")
    if "dispatch_overhead_cpu" in pc.index:
        a2.axvline(pc.loc["dispatch_overhead_cpu", "value"], color="black", ls=":", lw=1.4,
                   label=f"{PAPER_LABEL}: < {pc.loc['dispatch_overhead_cpu', 'value']:g} us")
    a1.set_xlabel("dispatcher time / mean decode step (%, log)")
    a2.set_xlabel("dispatcher CPU time per decode step (us, mean over steps; log)")
    a1.set_title("share of the decode step", fontsize=9)
    a2.set_title("CPU time per step", fontsize=9)
    for ax in (a1, a2):
        ax.legend(fontsize=7, loc="lower right")
    configs = sorted(m["config"].dropna().astype(str).unique()) if "config" in m.columns else []
    fig.suptitle(title_of("Dispatcher cost per decode step, every GraniKV serving cell (cells per sweep in brackets)",
                          gpu, configs), fontsize=10)
    fig.tight_layout()
    save_figure(fig, NAME, out, data=m[["config", "sweep", "cell_id", "system", "decode_steps", "step_ms_mean",
                                        "dispatch_us", "share_pct"]])
