"""Headline Lp sweep (paper Sec. 4, abstract): ShareGPT + shared prefix, Poisson at saturation,
B=256, Lp 512..16K, three model/TP configs; output tok/s per system and ratio to sglang_default.

Writes tables/headline.{csv,md} and figures/headline_throughput.{png,pdf} (throughput vs Lp per
system) and figures/headline_ratio.{png,pdf} (ratio to sglang_default vs Lp).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import (HEADLINE_CELLS, LPS, PAPER_CONFIG_LABELS, THROUGHPUT, THROUGHPUT_DIGITS, rename_short,
                             select, system_table, write_table)
from analysis.load import Results
from analysis.paper import paper_claims
from analysis.plots import gpu_names, lines_vs, per_gpu
from analysis.registry import register_exhibit



NAME = "headline"
FIGURES = ("headline_throughput", "headline_ratio")


def paper_points():
    """The paper's headline ratios over SGLang default (Lp=16K) and parity bounds (Lp=512), per config."""
    c = paper_claims()
    c = c[(c["system"] == "granikv") & (c["base_system"] == "sglang_default") & (c["batch"] == 256)
          & (c["workload"] == "sharegpt") & (c["metric"] == THROUGHPUT)
          & c["lp"].notna() & c["check"].isin(("point", "bound_ge")) & c["k"].eq(1)]
    return c.assign(x=c["lp"])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    t = system_table(res.cells, res.config_columns, HEADLINE_CELLS, ["config", "workload.prefix_len"],
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS})
    write_table(rename_short(t), NAME, out, THROUGHPUT_DIGITS, title="Headline: ShareGPT + shared prefix, B=256 (output tok/s)",
                note="mean/sd/min/max over repetitions (n); ratios of rep means in the same configuration.")
    if not figures:
        return t
    cells = select(res.cells, HEADLINE_CELLS) if not res.cells.empty else res.cells
    gpu = gpu_names(cells)
    # the figures' frame: the same table built per GPU (a GPU's ratios over its own SGLang default), one row of
    # panels per GPU on one y axis; the written table is the one above
    f = per_gpu(cells, lambda c: system_table(c, res.config_columns, HEADLINE_CELLS, ["config", "workload.prefix_len"],
                                              expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS}))
    lines_vs(f, "headline_throughput", out, "workload.prefix_len", ["config"], gpu=gpu,
             title="Headline (ShareGPT + shared prefix, B=256): output tok/s vs Lp")
    lines_vs(f, "headline_ratio", out, "workload.prefix_len", ["config"], value="ratio_vs_sglang_default",
             ylabel="output throughput / sglang_default", skip_systems=("sglang_default",), hline=1.0, gpu=gpu,
             paper=paper_points(), title="Headline (B=256): throughput over SGLang default vs Lp")
    return t
