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
from analysis.load import Results, SchemaError
from granikv.rawio import read_json

NAME = "prefill_host"
FIGURES: tuple[str, ...] = ()
FILE = "prefill_host.json"
ROW_KEYS = ("tokens", "step_ms", "launch_ms", "forward_ms", "allreduce_calls", "allreduce_launch_us", "allreduce_ms")
COLS = ["model", "tp", "allreduce", "gpu", "commit", "tokens", "step_ms", "launch_ms", "forward_ms", "launch_share",
        "per_layer_launch_us", "allreduce_calls", "allreduce_launch_us", "allreduce_ms", "symm_vs_nccl_max_abs_diff",
        "symm_vs_nccl_same_token"]
EXPECTED = (("llama3_8b", 1, "nccl"), ("qwen25_14b", 1, "nccl"), ("qwen25_14b", 2, "nccl"),
            ("qwen25_14b", 2, "symm_one_shot"))                           # runners/gpu/prefill.sh's default runs
TOKENS = (16, 128, 512, 2048)                                             # runners/prefill_bench.py's default
DIGITS = {"step_ms": 2, "launch_ms": 2, "forward_ms": 2, "launch_share": 2, "per_layer_launch_us": 0,
          "allreduce_launch_us": 1, "allreduce_ms": 2, "symm_vs_nccl_max_abs_diff": 4}


def _need(cond: bool, path: Path, fld: str, what: str) -> None:
    if not cond:
        raise SchemaError(f"{path}: field `{fld}` {what}. Fix: written only by runners/prefill_bench.py; "
                          "rerun it rather than editing the file")


def load(root: str | Path) -> pd.DataFrame:
    """One row per (file, token count), checked (a malformed file names its field)."""
    rows, root = [], Path(root)
    for path in sorted(root.rglob(FILE)):
        if any(p.startswith(".") for p in path.relative_to(root).parts):
            continue
        d = read_json(path)
        _need(isinstance(d, dict), path, "<top level>", "must be a JSON object")
        for key in ("rows", "config", "provenance"):
            _need(key in d, path, key, "is missing")
        cfg, prov = d["config"], d["provenance"]
        _need(isinstance(cfg.get("model"), dict) and "num_layers" in cfg["model"], path, "config.model.num_layers",
              "is missing")
        _need(isinstance(d["rows"], list) and d["rows"], path, "rows", "must be a non-empty list")
        for i, r in enumerate(d["rows"]):
            for k in ROW_KEYS:
                _need(isinstance(r.get(k), (int, float)), path, f"rows[{i}].{k}", "must be a number")
            rows.append({"model": cfg["model"]["name"], "tp": int(cfg["tp"]),
                         "allreduce": cfg.get("hardware", {}).get("allreduce", "nccl"),
                         "symm_vs_nccl_max_abs_diff": r.get("symm_vs_nccl_max_abs_diff", float("nan")),
                         "symm_vs_nccl_same_token": r.get("symm_vs_nccl_same_token", ""),
                         "gpu": prov.get("gpu_name") or "no GPU (CPU)",
                         "commit": str(prov.get("git_commit", "unknown"))[:7],
                         **{k: r[k] for k in ROW_KEYS},
                         "launch_share": r["launch_ms"] / r["forward_ms"] if r["forward_ms"] > 0 else float("nan"),
                         "per_layer_launch_us": r["launch_ms"] * 1e3 / cfg["model"]["num_layers"]})
    t = pd.DataFrame(rows, columns=COLS)
    return t.sort_values(["model", "tp", "allreduce", "gpu", "tokens"], kind="stable").reset_index(drop=True) if not t.empty else t


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/prefill_host.{csv,md}: the expected rows (EXPECTED x TOKENS, the GPU runs of
    runners/gpu/prefill.sh), each measured or not, then any other measured rows; return the table."""
    got = load(res.root) if Path(res.root).exists() else pd.DataFrame(columns=COLS)
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
