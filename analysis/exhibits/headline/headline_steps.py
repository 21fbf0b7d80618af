"""Step breakdown of the headline cells: where each run's time goes (decode vs prefill steps), and
the decode step time at full batch, so that a headline ratio can be explained by measurement.

From each headline cell's trace (steps.jsonl, measured steps only; warm-up excluded):
- ``decode_s`` / ``prefill_s``: summed wall time of decode / prefill steps (``step_time_s``);
- ``decode_full_p50_ms``: p50 decode step at full batch (``batch_size >= 0.9 * B``), the step
  the prefix attention backends differ on most;
- ``decode_batch_mean``: mean decode batch size; ``prefill_steps``: number of prefill steps;
  ``prefill_p50_ms``: p50 prefill step (the same prompts in every cell of a configuration, so two
  systems' prefill steps should take about as long; a pair that differs here ran differently);
- ``commit``: the code version(s) of the cell (provenance git commit);
- ``decode_eager_s`` / ``_steps`` / ``_p50_ms``: decode steps run without a CUDA graph (e.g. above
  ``cuda_graph_max_bs``), where host launch cost is not hidden;
- ``*_vs_sglang_default``: the same quantity over sglang_default's in the same configuration.

Writes tables/headline_steps.{csv,md}. No figure.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import LPS, PAPER_CONFIG_LABELS, select, sort_rows, system_table, with_derived, write_table
from analysis.headline import SELECT
from analysis.load import Results, SchemaError, load_steps
from granikv.config import SYSTEMS
from granikv.rawio import data_path

NAME = "headline_steps"
FIGURES: tuple[str, ...] = ()
FULL = 0.9          # a decode step is "at full batch" from 90% of the configured batch on
KEYS = ["config", "workload.prefix_len", "system.name"]
COLS = ["decode_full_p50_ms", "decode_s", "prefill_s", "prefill_steps", "prefill_p50_ms", "decode_batch_mean", "commit"]
DIGITS = {"decode_full_p50_ms": 2, "decode_s": 1, "prefill_s": 1, "decode_batch_mean": 1,
          "decode_full_p50_ms_vs_sglang_default": 2, "decode_s_vs_sglang_default": 2,
          "prefill_s_vs_sglang_default": 2, "prefill_p50_ms": 1, "duration_s": 1, "decode_eager_s": 1, "decode_eager_p50_ms": 2}


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
    """One row per headline cell (repetitions averaged), with ratios to sglang_default."""
    cells = select(with_derived(res.cells), SELECT)
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


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/headline_steps.{csv,md}: every row of the headline grid (config x Lp x system),
    with its status there and the breakdown where measured; return the table."""
    grid = system_table(res.cells, res.config_columns, SELECT, ["config", "workload.prefix_len"],
                        expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS})
    grid = grid[["config", "workload.prefix_len", "system", "status"]].rename(columns={"system": "system.name"})
    b = breakdown(res)
    if not b.empty:
        b = b.astype({"workload.prefix_len": grid["workload.prefix_len"].dtype})
    t = sort_rows(grid.merge(b, on=KEYS, how="left"), KEYS)
    t = t[[c for c in t.columns if c != "status"] + ["status"]]
    write_table(t.rename(columns={"system.name": "system", "workload.prefix_len": "Lp"}), NAME, out, DIGITS,
                title="Headline cells: step breakdown (measured steps, warm-up excluded)",
                note=f"decode_full_p50_ms: p50 decode step with batch >= {FULL:.0%} of B; decode_s / prefill_s: summed "
                     "step wall time by kind; decode_eager_*: decode steps run without a CUDA graph; *_vs_sglang_default: over sglang_default in the same configuration "
                     "(below 1 = less time).")
    return t


def baseline_cell(res: Results, cell: pd.Series, system: str = "sglang_default") -> pd.Series | None:
    """The uninstrumented cell of ``system`` with ``cell``'s configuration (same repetition), or None."""
    from analysis.common import identity
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


def claim_steps_line(res: Results, claim: pd.Series) -> str:
    """For a GraniKV-over-sglang_default claim: the step trace of each GraniKV cell the claim selects
    against sglang_default's in the same configuration. Empty without such a pair."""
    from analysis.common import parse_selectors
    cells = with_derived(res.cells)
    if cells.empty:
        return ""
    g = select(cells, {**parse_selectors(claim["selectors"]), "system.name": "=granikv", "instrumented": "=False"})
    parts = []
    for _, r in g.iterrows():
        b = baseline_cell(res, r)
        if b is not None:
            parts.append(steps_vs(res, r, b))
    return ("Step trace, GraniKV vs sglang_default (steps.jsonl): " + "; ".join(parts) + ".") if parts else ""
