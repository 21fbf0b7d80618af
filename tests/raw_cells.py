"""Tiny synthetic raw cells on disk, as runners.run writes them (the fields the analysis reads): a serving
cell whose metrics.json is what its requests.jsonl gives (analysis.integrity), with a step trace."""
from __future__ import annotations
import zlib
from pathlib import Path

from analysis.integrity import summary_of
from granikv import rawio

MODELS = {"llama3_8b": {"name": "llama3_8b", "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
          "tiny": {"name": "tiny", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}}


def prov(gpu: str) -> dict:
    return {**{k: None for k in rawio.PROVENANCE_KEYS}, "gpu_name": gpu, "git_commit": "abc"}


def serving_cell(root: Path, sweep: str, *, system="granikv", lp=512, gpu="NVIDIA H200", rep=0, duration=2.0,
                 model="llama3_8b", tp=1, hardware="h200", kind="sharegpt", batch=256, dispatch_us=5.0,
                 step_s=0.01) -> Path:
    """One finished serving cell under ``root/sweep``: 4 requests of 64 output tokens over ``duration`` s
    (output throughput 256 / duration), decode steps of ``step_s`` with ``dispatch_us`` each."""
    d = root / sweep / f"rep={rep},system={system},workload.prefix_len={lp}"
    wl = {"kind": kind, "prefix_len": lp, "batch": batch, "num_prefixes": 1, "suffix_len": 32, "output_len": 64,
          "arrival": "poisson"}
    rawio.write_json(d / "config.json", {
        "model": MODELS[model], "tp": tp, "system": {"name": system}, "workload": wl,
        "hardware": {"name": hardware, "device": "cpu" if hardware == "cpu" else "cuda"}, "rep": rep, "seed": 0,
        "profile_steps": 0, "nsys": False, "sweep_name": sweep, "provenance": prov(gpu)})
    salt = zlib.crc32(str(d.relative_to(root)).encode()) / 2**40    # each cell's own run: its own token times
    reqs = [{"rid": i, "prompt_len": lp + 32, "shared_len": lp, "output_len": 64, "arrival_s": 0.1 * i,
             "first_token_s": 0.1 * i + 0.05 + salt, "finish_s": duration * (0.7 + 0.1 * i), "warmup": False}
            for i in range(4)]
    rawio.write_jsonl(d / "requests.jsonl", reqs)
    steps = [{"kind": "decode", "batch_size": 4, "step_time_s": step_s, "dispatch_us": dispatch_us,
              "backend": "dense"} for _ in range(8)]
    rawio.write_jsonl(d / "steps.jsonl", steps)
    metrics = {**{k: ({"dense": 8} if k == "dispatch_counts" else 10.0) for k in rawio.SERVING_METRICS},
               **summary_of(reqs), "num_input_tokens": 4 * (lp + 32)}
    rawio.write_json(d / "metrics.json", metrics)
    return d
