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

A row is one GPU model's cells (column ``gpu``): two GPU models are never averaged.

Writes tables/headline_steps.{csv,md}. No figure.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import LPS, PAPER_CONFIG_LABELS, sort_rows, system_table, write_table
from analysis.gpu import GPU
from analysis.load import Results
from analysis.measures.steps import FULL, KEYS, SELECT, breakdown
from analysis.registry import register_exhibit



NAME = "headline_steps"
FIGURES: tuple[str, ...] = ()
DIGITS = {"decode_full_p50_ms": 2, "decode_s": 1, "prefill_s": 1, "decode_batch_mean": 1,
          "decode_full_p50_ms_vs_sglang_default": 2, "decode_s_vs_sglang_default": 2,
          "prefill_s_vs_sglang_default": 2, "prefill_p50_ms": 1, "duration_s": 1, "decode_eager_s": 1, "decode_eager_p50_ms": 2}


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/headline_steps.{csv,md}: every row of the headline grid (config x Lp x system),
    with its status there and the breakdown where measured; return the table."""
    grid = system_table(res.cells, res.config_columns, SELECT, ["config", "workload.prefix_len"],
                        expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS})
    grid = grid.reindex(columns=["config", "workload.prefix_len", GPU, "system", "status"])    # gpu: none without cells
    grid = grid.rename(columns={"system": "system.name"})
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
