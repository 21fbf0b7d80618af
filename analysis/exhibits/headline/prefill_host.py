"""Prefill step timing in isolation (``runners/prefill_bench.py``): where an eager prefill step's
time goes, per model, TP size and new-token count, so the headline's prefill share can be
explained by measurement (launch-bound host or GPU work; the all-reduces' part under TP).

Reads every ``prefill_host.json`` under the results folder (not cell folders: the serving loader
skips them). Columns: ``step_ms`` (the engine's prefill step), ``launch_ms`` (forward, host only),
``forward_ms`` (forward + synchronize), ``launch_share`` = launch_ms / forward_ms (near 1: bound by
the host), ``allreduce_*`` (the forward's all-reduces alone), ``per_layer_launch_us`` =
launch_ms / num_layers. Writes tables/prefill_host.{csv,md}. No figure.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.prefill import COLS, load
from analysis.registry import register_exhibit



NAME = "prefill_host"
FIGURES: tuple[str, ...] = ()
EXPECTED = (("llama3_8b", 1, "nccl"), ("qwen25_14b", 1, "nccl"), ("qwen25_14b", 2, "nccl"),
            ("qwen25_14b", 2, "symm_one_shot"))                           # runners/gpu/prefill.sh's default runs
TOKENS = (16, 128, 512, 2048)                                             # runners/prefill_bench.py's default
DIGITS = {"step_ms": 2, "launch_ms": 2, "forward_ms": 2, "launch_share": 2, "per_layer_launch_us": 0,
          "allreduce_launch_us": 1, "allreduce_ms": 2, "symm_vs_nccl_max_abs_diff": 4}


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/prefill_host.{csv,md}: the expected rows (EXPECTED x TOKENS, the GPU runs of
    runners/gpu/prefill.sh), each measured or not, then any other measured rows; return the table."""
    got = load(res.root, res.ignored) if Path(res.root).exists() else pd.DataFrame(columns=COLS)
    want = pd.DataFrame([{"model": m, "tp": tp, "allreduce": ar, "tokens": n} for m, tp, ar in EXPECTED for n in TOKENS])
    keys = ["model", "tp", "allreduce", "tokens"]
    t = want.merge(got, on=keys, how="left")
    extra = got.merge(want, on=keys, how="left", indicator=True)
    extra = extra[extra["_merge"] == "left_only"].drop(columns="_merge")
    t = pd.concat([t, extra], ignore_index=True) if not extra.empty else t
    t["status"] = ["measured" if pd.notna(v) else f"{NOT_MEASURED}: run runners/gpu/prefill.sh"
                   for v in t["step_ms"]]
    t = t[COLS + ["status"]]
    write_table(t, NAME, out, DIGITS, title="Prefill steps in isolation (runners/prefill_bench.py)",
                note="One request of `tokens` new tokens, no cached prefix; medians. step_ms: the engine's prefill "
                     "step; launch_ms: the forward until it returns (host); forward_ms: forward + synchronize; "
                     "launch_share near 1: bound by the host. allreduce_*: the forward's all-reduces alone "
                     "(launch per call; all calls with a synchronize). allreduce: nccl, or symm_one_shot (torch "
                     "symmetric-memory one-shot kernel, checked against NCCL: max abs difference, same first token).")
    return t
