"""The dense prefix path as ONE ragged launch over every HOT group of a step, against the engine's per-group
dense calls (``runners.hot_batch_bench``: cells of kind ``hot_batch``, one per case; one kernel row per
variant). One row per GPU model and case: the engine's per-group time and the best batched variant's
(CUDA-graph replay, one layer's prefix state for every class), their ratio, the host time of the eager
launches of each form, the batched form's plan host time and the largest error against the fp32 reference.

Writes tables/hot_batch.{csv,md}. No figure.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.registry import register_exhibit

NAME = "hot_batch"
COLS = ["gpu", "case", "prefix_lens", "batch", "per_group_us", "per_group_host_us", "best", "best_us", "ratio",
        "best_plan_us", "best_host_us", "fa3_f1_us", "max_rel_err", "sweep", "status"]


def frame(res: Results) -> pd.DataFrame:
    """One row per (GPU, case) of every hot_batch cell."""
    k = res.kernels
    if k.empty or "cell.kind" not in k.columns:
        return pd.DataFrame(columns=COLS)
    k = k[k["cell.kind"] == "hot_batch"]
    rows = []
    for (gpu, sweep, case), g in k.groupby(["provenance.gpu_name", "sweep", "cell.cell_id"], sort=True, dropna=False):
        ok = g[g["k.time_ms"].notna()]
        base = ok[ok["k.backend"] == "per_group"]
        batched = ok[ok["k.backend"] != "per_group"]
        if base.empty or batched.empty:
            continue
        best = batched.loc[batched["k.time_ms"].idxmin()]
        f1 = batched[batched["k.backend"] == "batched_fa3_f1"]
        b = base.iloc[0]
        lens = g["cell.prefix_lens"].iloc[0]                  # a list, flattened as its JSON text
        lens = json.loads(lens) if isinstance(lens, str) else lens
        rows.append({"gpu": gpu, "case": case, "prefix_lens": "/".join(str(x) for x in lens),
                     "batch": int(g["cell.batch"].iloc[0]), "per_group_us": 1e3 * b["k.time_ms"],
                     "per_group_host_us": b["k.host_us"], "best": best["k.backend"], "best_us": 1e3 * best["k.time_ms"],
                     "ratio": best["k.time_ms"] / b["k.time_ms"], "best_plan_us": best["k.plan_us"],
                     "best_host_us": best["k.host_us"],
                     "fa3_f1_us": 1e3 * f1["k.time_ms"].iloc[0] if not f1.empty else float("nan"),
                     "max_rel_err": ok["k.rel_err"].max(), "sweep": sweep, "status": "measured"})
    return pd.DataFrame(rows, columns=COLS)


@register_exhibit(NAME)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/hot_batch.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"case": "(none)", "status": f"{NOT_MEASURED}: no hot_batch cell (run python -m "
                                                       "runners.hot_batch_bench hardware=<gpu preset>)"}], columns=COLS)
    write_table(t, NAME, out, {"per_group_us": 1, "per_group_host_us": 0, "best_us": 1, "ratio": 2, "best_plan_us": 0,
                               "best_host_us": 0, "fa3_f1_us": 1, "max_rel_err": 4},
                title="The dense prefix path as one batched launch over every HOT group, against per-group calls",
                note="One layer's prefix state for every class of a B-row decode step (Llama-3.1-8B shape), device "
                     "time of a CUDA-graph replay. per_group: the engine's dense path, one single prefill per class "
                     "on its HOT slab with the engine's KV fold; best: the fastest batched variant, one ragged batch "
                     "prefill over the region holding every slab (gaps as empty segments), named "
                     "batched_<FlashInfer backend>_f<KV fold>; ratio = best / per_group (< 1: the batched launch is "
                     "faster); *_host_us: host time of one eager call's launches; best_plan_us: host time of its "
                     "plan (once per step); fa3_f1_us: the batched fa3 launch without a fold; max_rel_err: the "
                     "largest error of any variant against the fp32 reference.")
    return t
