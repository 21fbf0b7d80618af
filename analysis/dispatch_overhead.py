"""Per-step dispatch overhead (paper B.5): the dispatcher's CPU time per decode step against the
step's wall time, from the dispatch trace (steps.jsonl) of the ``dispatch_overhead`` sweep
(granikv vs granikv_dense_only at Lp=16K, B=256).

steps.jsonl fields read: the dispatcher time (``dispatch_us``, else ``dispatch_ms`` /
``dispatch_s``) and the step wall time (``step_ms``, else ``step_time_ms`` / ``step_s``). A trace
without them is reported as not measured.

Writes tables/dispatch_overhead.{csv,md} and figures/dispatch_overhead.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, placeholder_figure, plt, save_figure, select, sort_rows, with_derived, write_table
from analysis.load import Results, load_steps

NAME = "dispatch_overhead"
SELECT = {"sweep_name": "~dispatch_overhead"}
DISPATCH_FIELDS = (("dispatch_us", 1.0), ("dispatch_ms", 1e3), ("dispatch_s", 1e6))
STEP_FIELDS = (("step_ms", 1.0), ("step_time_ms", 1.0), ("step_s", 1e3))


def _col(steps: pd.DataFrame, fields) -> pd.Series | None:
    for name, scale in fields:
        if name in steps.columns:
            return pd.to_numeric(steps[name], errors="coerce") * scale
    return None


def overhead_frame(res: Results) -> pd.DataFrame:
    """One row per dispatch_overhead cell: its columns plus steps, dispatcher us per step (mean,
    p99), step ms and the dispatcher's share of step time (``share_pct``)."""
    cells = with_derived(res.cells)
    cells = select(cells, {**SELECT, "kind": "=serving"}) if not cells.empty else cells
    rows = []
    for _, r in cells.iterrows():
        steps = load_steps(Path(res.root) / r["path"])
        d, s = _col(steps, DISPATCH_FIELDS), _col(steps, STEP_FIELDS)
        row = {**r.to_dict(), "steps": len(steps), "step_ms_mean": s.mean() if s is not None else np.nan}
        if d is not None:
            row.update(dispatch_us_mean=d.mean(), dispatch_us_p99=d.quantile(0.99))
            row["share_pct"] = 100 * row["dispatch_us_mean"] / (1e3 * row["step_ms_mean"])
        rows.append(row)
    return pd.DataFrame(rows)


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = overhead_frame(res)
    cols = ["config", "workload.prefix_len", "workload.batch", "system", "cell_id", "steps", "dispatch_us_mean",
            "dispatch_us_p99", "step_ms_mean", "share_pct", "status"]
    if t.empty:
        t = pd.DataFrame([{"config": "llama3_8b TP=1", "workload.prefix_len": 16384, "workload.batch": 256,
                           "system": s, "status": NOT_MEASURED} for s in ("granikv", "granikv_dense_only")], columns=cols)
    else:
        t["status"] = np.where(t.get("dispatch_us_mean", pd.Series(np.nan, index=t.index)).notna(), "measured",
                               f"{NOT_MEASURED}: steps.jsonl has no dispatcher time")
        t = sort_rows(t.reindex(columns=cols), ["config", "workload.prefix_len", "workload.batch", "system", "cell_id"])
    write_table(t, NAME, out, {"dispatch_us_mean": 3, "dispatch_us_p99": 3, "step_ms_mean": 3, "share_pct": 4},
                title="Per-step dispatch overhead (B.5)",
                note="paper: < 1 us CPU per step, < 0.2% of per-step wall time (A100).")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, "no dispatch_overhead cells with dispatcher timings")
        return t
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([f"{s}\n{c[-8:]}" for s, c in zip(m["system"], m["cell_id"])], m["share_pct"])
    ax.axhline(0.2, color="r", ls="--", lw=0.8, label="paper bound 0.2%")
    ax.set_ylabel("dispatch share of step time (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, NAME, out)
    return t
