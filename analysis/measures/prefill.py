"""Prefill steps in isolation (prefill_host.json files of runners/prefill_bench.py)."""
from __future__ import annotations
from pathlib import Path

import pandas as pd

from granikv.rawio import SchemaError, read_json


FILE = "prefill_host.json"


ROW_KEYS = ("tokens", "step_ms", "launch_ms", "forward_ms", "allreduce_calls", "allreduce_launch_us", "allreduce_ms")


COLS = ["model", "tp", "allreduce", "gpu", "commit", "tokens", "step_ms", "launch_ms", "forward_ms", "launch_share",
        "per_layer_launch_us", "allreduce_calls", "allreduce_launch_us", "allreduce_ms", "symm_vs_nccl_max_abs_diff",
        "symm_vs_nccl_same_token"]


def need_field(cond: bool, path: Path, fld: str, what: str) -> None:
    if not cond:
        raise SchemaError(f"{path}: field `{fld}` {what}. Fix: written only by runners/prefill_bench.py; "
                          "rerun it rather than editing the file")


def load(root: str | Path, ignored=()) -> pd.DataFrame:
    """One row per (file, token count), checked (a malformed file names its field); files under the
    ``ignored`` folders (Results.ignored: named by no campaign item or bench) are not read."""
    rows, root = [], Path(root)
    for path in sorted(root.rglob(FILE)):
        parts = path.relative_to(root).parts
        if any(p.startswith(".") for p in parts) or str(root / parts[0]) in ignored:
            continue
        d = read_json(path)
        need_field(isinstance(d, dict), path, "<top level>", "must be a JSON object")
        for key in ("rows", "config", "provenance"):
            need_field(key in d, path, key, "is missing")
        cfg, prov = d["config"], d["provenance"]
        need_field(isinstance(cfg.get("model"), dict) and "num_layers" in cfg["model"], path, "config.model.num_layers",
              "is missing")
        need_field(isinstance(d["rows"], list) and d["rows"], path, "rows", "must be a non-empty list")
        for i, r in enumerate(d["rows"]):
            for k in ROW_KEYS:
                need_field(isinstance(r.get(k), (int, float)), path, f"rows[{i}].{k}", "must be a number")
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
