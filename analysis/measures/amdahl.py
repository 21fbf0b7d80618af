"""Amdahl's prediction from the profiled attention share against the measured speed-up."""
from __future__ import annotations
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, THROUGHPUT, geomean, paired, select, with_derived
from analysis.gpu import GPU, gpu_names, only_gpu, ordered
from analysis.load import Results
from analysis.measures.kernels import layout_speedup
from analysis.measures.steps import cell_steps
from analysis.measures.traces import trace_frame






PAPER_S = 15.6


CELL = {"workload.kind": "=synthetic", "workload.num_prefixes": "=1", "workload.prefix_len": "=8192",
        "workload.batch": "=256"}


def amdahl(f: float, s: float) -> float:
    """Amdahl speed-up when a fraction ``f`` of the time is sped up ``s`` times."""
    return 1.0 / ((1.0 - f) + f / s)


PLAIN, PROFILED = "plain cells", "profiled cells, summed step time"


def step_time_ratio(res: Results, sel: dict) -> float:
    """sglang_default / GraniKV summed step time (decode + prefill steps, steps.jsonl) over the
    profiled cells matching ``sel`` (its system key is set here); NaN without such a pair. Both serve
    the same requests, so this is their throughput ratio without the time between steps."""

    cells = with_derived(res.cells)
    if cells.empty:
        return float("nan")
    prof = select(cells, {"instrumented": "=True"})
    t = {}
    for system in ("granikv", "sglang_default"):
        d = select(prof, {**sel, "system": f"={system}"})
        if d.empty:
            return float("nan")
        t[system] = float(np.mean([sum(cell_steps(Path(res.root) / c["path"], int(c["workload.batch"]))[k]
                                       for k in ("decode_s", "prefill_s")) for _, c in d.iterrows()]))
    return t["sglang_default"] / t["granikv"] if t["granikv"] > 0 else float("nan")


def measured_ratio(res: Results, model: str, tp: int, cell: dict | None = None) -> tuple[float, str]:
    """GraniKV / sglang_default at the profiler cell of (model, tp): (ratio, which cells): plain cells'
    output throughput, else the profiled cells' summed step time (see the module docstring)."""
    cells = with_derived(res.cells)
    if cells.empty:
        return float("nan"), ""
    sel = {**(cell or CELL), "model.name": f"={model}", "tp": f"={tp}"}
    p = paired(select(cells, {"instrumented": "=False"}), res.config_columns, {**sel, "system": "=granikv"},
               {"system": "=sglang_default"}, THROUGHPUT)
    if not p.empty:
        return geomean(p["ratio"]), PLAIN
    r = step_time_ratio(res, sel)
    return (r, PROFILED) if np.isfinite(r) else (float("nan"), "")


def amdahl_frame(res: Results) -> pd.DataFrame:
    """One row per config and GPU model: f, s (paper and ours), predictions, measured ratio, overshoot flags,
    each from that GPU model's cells and kernel rows alone (analysis.gpu.only_gpu)."""
    tf = trace_frame(res)
    rows = []
    d = select(tf, {**CELL, "system": "=sglang_default"}) if not tf.empty else tf
    for gpu in ordered(gpu_names(d)):
        mine = only_gpu(res, gpu)
        s_ours, _ = layout_speedup(mine)
        for (model, tp), g in d[gpu_names(d) == gpu].groupby(["model.name", "tp"], sort=True):
            f = float(g["share"].mean())
            meas, src = measured_ratio(mine, model, int(tp))
            rows.append({"config": g["config"].iloc[0], GPU: gpu, "f_attention_share": f, "s_paper": PAPER_S,
                         "s_ours": s_ours, "predicted_paper_s": amdahl(f, PAPER_S),
                         "predicted_our_s": amdahl(f, s_ours) if np.isfinite(s_ours) else np.nan,
                         "measured": meas, "measured_from": src,
                         "measured_profiled_steps": meas if src == PROFILED else
                         step_time_ratio(mine, {**CELL, "model.name": f"={model}", "tp": f"={tp}"})})
    t = pd.DataFrame(rows, columns=["config", GPU, "f_attention_share", "s_paper", "s_ours", "predicted_paper_s",
                                    "predicted_our_s", "measured", "measured_from", "measured_profiled_steps"])
    if not t.empty:
        t["overshoot_paper_s"] = np.where(t["measured"].notna(), t["predicted_paper_s"] > t["measured"], None)
        t["status"] = np.where(t["measured"].notna(), "measured", f"{NOT_MEASURED}: no granikv/sglang_default pair")
    return t
