"""Deterministic traces of the storage layer and the engine under the STATIC HOT/COLD split.

Used by tests/test_engine_dynamic_split.py to check that the static split behaves exactly as it did
before the dynamic split existed: the expected digests there were produced by running this module
against the code of commit 6fcaea2 (before granikv.kv.dynamic_split), with

    PYTHONPATH=<a copy of that commit's tree> python -c "import split_trace; print(split_trace.digests())"

It uses only APIs that existed then (Storage, Scheduler, Seq, KVCache, Engine, Request), so the same
trace can run on both versions. Node uids (process-global counters) are left out: they depend on what
ran before in the process, not on the storage layer.
"""
from __future__ import annotations

import hashlib
import json
import random

import torch

from granikv.config import HardwareConfig, ModelConfig, RunConfig, SystemConfig
from granikv.engine.scheduler import Scheduler, Seq, Storage
from granikv.kv import KVCache
from granikv.request import Request

# (hot_fraction, capacity, prefix classes, requests, max running, seed)
SCHED_CASES = {
    "hot30": (0.3, 420, 6, 40, 6, 0),
    "hot50_small": (0.5, 400, 5, 36, 4, 1),
    "paged": (0.0, 300, 4, 30, 5, 2),
}
TINY = dict(hidden_size=64, num_layers=2, num_heads=16, num_kv_heads=4, head_dim=16, intermediate_size=128,
            vocab_size=512, max_position_embeddings=1024)


def _requests(seed: int, k: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(30, 90))] for _ in range(k)]
    out = []
    for i in range(n):
        c = rng.randrange(k + 1) - 1          # -1: no shared prefix
        pre = prefixes[c] if c >= 0 else []
        if c >= 0 and rng.random() < 0.25:    # a strict prefix of a class's prefix (node splits)
            pre = pre[:rng.randrange(5, len(pre))]
        suffix = [rng.randrange(512) for _ in range(rng.randrange(1, 20))]
        out.append(Request(i, pre + suffix, rng.randrange(1, 8), arrival_s=0.0, shared_len=len(pre),
                           prefix_class=c))
    return out


def sched_trace(hot_fraction: float, cap: int, k: int, n: int, max_running: int, seed: int,
                storage: Storage | None = None) -> dict:
    """Admit a burst FCFS, finish the two oldest running requests per round, record every placement.

    ``storage``: the Storage to drive (default: a static one built as before the dynamic split)."""
    st = storage or Storage(KVCache(1, cap, 1, 1, hot_fraction, torch.float32, "cpu"), enable_hot=hot_fraction > 0)
    sch = Scheduler(st, HardwareConfig(kv_budget_tokens=cap, max_running_requests=max_running), max_rows=max_running)
    sch.add([Seq(r, i) for i, r in enumerate(_requests(seed, k, n))])
    rounds = []
    while not sch.idle:
        new = sch.admit_arrived(0.0)
        placed = [(s.req.rid, s.where, s.cached_len, s.hot_start, s.slots.tolist()) for s in new]
        for s in sch.active[:2]:              # the two oldest finish
            s.computed = s.prompt_len
            s.output_ids = [0] * s.req.output_len
        sch._retire()
        rounds.append({"placed": placed, "hot_free": st.kv.hot_pool.free_extents(),
                       "cold_free": st.kv.cold_pool.free_tokens, "hot_tokens": st.kv.hot_tokens})
        if len(rounds) > 4 * n:
            raise RuntimeError("sched_trace: no progress")
    return {"rounds": rounds, "log": [list(x) for x in st.admission.log],
            "evicted": st.index.evicted_tokens, "cached": st.index.cached_tokens,
            "peaks": [st.peak_hot, st.peak_cold]}


def engine_trace(system: SystemConfig | None = None) -> dict:
    """A tiny fp32 engine over a burst with room for about two prefixes (evictions, COLD fallback)."""
    from granikv.engine.engine import Engine
    from granikv.config import system_config

    rng = random.Random(11)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(70, 90))] for _ in range(4)]
    reqs = [Request(i, prefixes[i % 4] + [rng.randrange(512) for _ in range(rng.randrange(1, 24))],
                    rng.randrange(2, 6), arrival_s=0.0, shared_len=len(prefixes[i % 4]), prefix_class=i % 4)
            for i in range(12)]
    cfg = RunConfig(model=ModelConfig(**TINY), system=system or system_config("granikv"),
                    hardware=HardwareConfig(kv_budget_tokens=400, chunked_prefill_size=64, max_running_requests=3),
                    seed=0)
    cfg.system.hot_fraction = 0.5
    res = Engine(cfg).run(reqs)
    keys = ("kv_budget_tokens", "hot_capacity_tokens", "cold_capacity_tokens", "hot_peak_tokens",
            "cold_peak_tokens", "evicted_tokens", "admissions", "num_steps")
    return {"records": [(r.rid, r.prefix_where, r.cached_len, r.output_ids) for r in res.records],
            "stats": {k: res.stats[k] for k in keys},
            "steps": [(s["kind"], s["batch_size"], s["num_tokens"]) for s in res.steps]}


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def digests() -> dict[str, str]:
    out = {name: digest(sched_trace(*case)) for name, case in SCHED_CASES.items()}
    out["engine"] = digest(engine_trace())
    return out
