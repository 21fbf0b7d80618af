"""Headline Lp sweep (paper Sec. 4, abstract): ShareGPT + shared prefix, Poisson at saturation,
B=256, Lp 512..16K, three model/TP configs; output tok/s per system and ratio to sglang_default.

Writes tables/headline.{csv,md} and figures/headline_throughput.{png,pdf} (throughput vs Lp per
system) and figures/headline_ratio.{png,pdf} (ratio to sglang_default vs Lp).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import LPS, PAPER_CONFIG_LABELS, rename_short, system_table, write_table
from analysis.load import Results
from analysis.plots import lines_vs

NAME = "headline"
FIGURES = ("headline_throughput", "headline_ratio")
SELECT = {"workload.kind": "=sharegpt", "workload.batch": "=256", "workload.num_prefixes": "=1"}
DIGITS = {"mean": 1, "sd": 1, "min": 1, "max": 1, "tpot_p50_ms": 2, "ttft_p50_ms": 1}


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = system_table(res.cells, res.config_columns, SELECT, ["config", "workload.prefix_len"],
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS})
    write_table(rename_short(t), NAME, out, DIGITS, title="Headline: ShareGPT + shared prefix, B=256 (output tok/s)",
                note="mean/sd/min/max over repetitions (n); ratios of rep means in the same configuration.")
    if not figures:
        return t
    lines_vs(t, "headline_throughput", out, "workload.prefix_len", ["config"], title="Output throughput vs Lp (B=256)")
    lines_vs(t, "headline_ratio", out, "workload.prefix_len", ["config"], value="ratio_vs_sglang_default",
             ylabel="x sglang_default", title="Throughput ratio to sglang_default vs Lp (B=256)")
    return t
