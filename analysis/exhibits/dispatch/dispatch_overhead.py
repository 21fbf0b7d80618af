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

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, placeholder_figure, plt, save_figure, sort_rows, write_table
from analysis.load import Results
from analysis.measures.dispatch import bench_dispatch_us, overhead_frame
from analysis.paper import paper_claims
from analysis.plots import PAPER_LABEL, gpu_names, legend_below, title_of
from analysis.registry import register_exhibit



NAME = "dispatch_overhead"
# boxplot's horizontal switch: `orientation` from matplotlib 3.10 on, `vert` (deprecated there) before
HORIZONTAL = {"orientation": "horizontal"} if tuple(int(x) for x in matplotlib.__version__.split(".")[:2]) >= (3, 10) \
    else {"vert": False}
FIGURES = (NAME,)


def draw(m: pd.DataFrame, out: Path, gpu: str) -> None:
    """Per sweep folder (one box per sweep, the GraniKV serving cells in it): the dispatcher's share of the
    decode step and its CPU time per step, each with the paper's bound."""
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
    configs = sorted(m["config"].dropna().astype(str).unique()) if "config" in m.columns else []
    fig.suptitle(title_of("Dispatcher cost per decode step, every GraniKV serving cell (cells per sweep in brackets)",
                          gpu, configs), fontsize=10)
    fig.tight_layout()
    legend_below(fig, [a1, a2], ncol=2)
    save_figure(fig, NAME, out, data=m[["config", "sweep", "cell_id", "system", "decode_steps", "step_ms_mean",
                                        "dispatch_us", "share_pct"]])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = overhead_frame(res)
    gpu = gpu_names(t)
    cols = ["config", "gpu", "sweep", "workload.kind", "workload.prefix_len", "workload.batch", "system", "cell_id",
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
        t = sort_rows(t.reindex(columns=cols), ["config", "gpu", "sweep", "workload.prefix_len", "workload.batch", "system",
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
