"""Step traces (steps.jsonl) of serving cells: decode and prefill time per cell."""
from __future__ import annotations
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import HEADLINE_CELLS, identity, select, sort_rows, with_derived
from analysis.gpu import GPU, with_gpu
from analysis.load import Results, load_steps
from analysis.measures.sglang import SYSTEMS
from granikv.rawio import SchemaError, data_path

SELECT = HEADLINE_CELLS   # the cells whose steps are broken down: the headline's



FULL = 0.9          # a decode step is "at full batch" from 90% of the configured batch on


KEYS = ["config", "workload.prefix_len", GPU, "system.name"]    # a row: one GPU model's cells of a system


COLS = ["decode_full_p50_ms", "decode_s", "prefill_s", "prefill_steps", "prefill_p50_ms", "decode_batch_mean", "commit"]


def cell_steps(path: str | Path, batch: int) -> dict:
    """The breakdown of one cell (NaN where its trace has no such steps); worked out once per trace file
    version (this table, analysis.distance_to_limit, analysis.amdahl and the report read the same cells)."""
    trace = data_path(Path(path) / "steps.jsonl")
    if not trace.exists():
        return _cell_steps(path, batch)   # load_steps names the missing file
    st = trace.stat()
    return dict(_cell_steps_cached(str(path), batch, st.st_mtime_ns, st.st_size))


@lru_cache(maxsize=1024)
def _cell_steps_cached(path: str, batch: int, mtime_ns: int, size: int) -> dict:
    return _cell_steps(path, batch)


def _cell_steps(path: str | Path, batch: int) -> dict:
    s = load_steps(path)
    for col in ("kind", "step_time_s", "batch_size"):
        if col not in s.columns:
            raise SchemaError(f"{Path(path) / 'steps.jsonl'}: `{col}` is missing from the step records "
                              "(rerun the cell with the current engine)")
    dec, pre = s[s["kind"] == "decode"], s[s["kind"] == "prefill"]
    full = dec[dec["batch_size"] >= FULL * batch]
    # decode steps run without a CUDA graph (batch above cuda_graph_max_bs, ...): their time apart
    eager = dec[~dec["cuda_graph"].astype(bool)] if "cuda_graph" in dec.columns else dec.iloc[0:0]
    return {"decode_eager_s": float(eager["step_time_s"].sum()), "decode_eager_steps": len(eager),
            "decode_eager_p50_ms": float(eager["step_time_s"].median() * 1e3) if len(eager) else np.nan,
            "decode_full_p50_ms": float(full["step_time_s"].median() * 1e3) if len(full) else np.nan,
            "decode_full_steps": len(full),
            "decode_s": float(dec["step_time_s"].sum()), "decode_steps": len(dec), "prefill_s": float(pre["step_time_s"].sum()),
            "prefill_steps": len(pre),
            "prefill_p50_ms": float(pre["step_time_s"].median() * 1e3) if len(pre) else np.nan,
            "decode_batch_mean": float(dec["batch_size"].mean()) if len(dec) else np.nan}


def breakdown(res: Results) -> pd.DataFrame:
    """One row per headline configuration and GPU model (repetitions averaged), with ratios to sglang_default
    on the same GPU model."""
    cells = select(with_gpu(with_derived(res.cells)), SELECT)
    cells = cells[cells["system"].isin(SYSTEMS)] if not cells.empty else cells   # the four systems of the paper
    if cells.empty:
        return pd.DataFrame(columns=KEYS + COLS)
    rows = []
    for _, c in cells.iterrows():
        rows.append({**{k: c.get(k) for k in KEYS}, "duration_s": c.get("duration_s"),
                     "commit": str(c.get("provenance.git_commit") or "?")[:7],
                     **cell_steps(Path(res.root) / c["path"], int(c["workload.batch"]))})
    raw = pd.DataFrame(rows)
    t = raw.groupby(KEYS, dropna=False, as_index=False).mean(numeric_only=True)
    commits = raw.groupby(KEYS, dropna=False)["commit"].agg(lambda v: ",".join(sorted(set(v))))
    t["commit"] = [commits.get(tuple(k), "") for k in t[KEYS].itertuples(index=False)]
    base = t[t["system.name"] == "sglang_default"].set_index(KEYS[:-1])
    for col in ("decode_full_p50_ms", "decode_s", "prefill_s"):
        ref = t.set_index(KEYS[:-1]).index.map(lambda k: base[col].get(k, np.nan) if k in base.index else np.nan)
        t[f"{col}_vs_sglang_default"] = t[col].to_numpy() / np.asarray(ref, dtype=float)
    return sort_rows(t, KEYS)


def baseline_cell(res: Results, cell: pd.Series, system: str = "sglang_default") -> pd.Series | None:
    """The uninstrumented cell of ``system`` with ``cell``'s configuration (same repetition), or None."""
    cells = with_derived(res.cells)
    base = cells[(cells["system.name"] == system) & (cells["instrumented"] == False)]  # noqa: E712
    for c in identity(cells, res.config_columns):
        if c.startswith("system."):
            continue
        base = base[(base[c] == cell[c]) | (base[c].isna() & pd.isna(cell[c]))]
    return None if base.empty else base.iloc[0]


def steps_vs(res: Results, cell: pd.Series, base: pd.Series) -> str:
    """Where two runs' time went (steps.jsonl): summed decode and prefill step time, the prefill share of
    ``cell``'s step time, the mean decode batch, and decode steps run without a CUDA graph (eager)."""
    g, d = (cell_steps(Path(res.root) / c["path"], int(c["workload.batch"])) for c in (cell, base))
    line = (f"decode steps {g['decode_s']:.2f} s vs {d['decode_s']:.2f} s, prefill steps {g['prefill_s']:.2f} s vs "
            f"{d['prefill_s']:.2f} s ({g['prefill_s'] / (g['decode_s'] + g['prefill_s']):.0%} of GraniKV's step time), "
            f"mean decode batch {g['decode_batch_mean']:.0f} vs {d['decode_batch_mean']:.0f}, eager decode steps "
            f"{g['decode_eager_steps']} vs {d['decode_eager_steps']}")
    gd, dd = (float(c.get("duration_s", np.nan)) for c in (cell, base))
    if np.isfinite(gd) and np.isfinite(dd):
        # overlap schedule: a decode step's wall time ends when the previous step's tokens are read back, so
        # GPU time shows up in whichever host interval waits for it (a step, or the work between steps)
        line += (f", outside steps {gd - g['decode_s'] - g['prefill_s']:.2f} s vs {dd - d['decode_s'] - d['prefill_s']:.2f} s "
                 f"of {gd:.2f} s vs {dd:.2f} s (scheduling, admission and eviction between steps; with the "
                 "overlap schedule, GPU time is counted in whichever host interval waits for it)")
    if g["decode_eager_steps"] and d["decode_eager_steps"]:
        line += (f" (no CUDA graph: {g['decode_eager_s']:.2f} s vs {d['decode_eager_s']:.2f} s, p50 "
                 f"{g['decode_eager_p50_ms']:.1f} vs {d['decode_eager_p50_ms']:.1f} ms per step; with graphs: "
                 f"{g['decode_s'] - g['decode_eager_s']:.2f} s vs {d['decode_s'] - d['decode_eager_s']:.2f} s)")
    return line
