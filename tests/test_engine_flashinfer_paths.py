"""The engine driving the backends' FlashInfer paths in CUDA-graph mode, on CPU, via ATTN's stand-in.

tests/fake_flashinfer.py computes with the reference but enforces what FlashInfer requires of
callers (int32 indices, fixed batch size and buffer capacity per graph-mode wrapper, reading only
the persistent buffers). Running the whole engine through it with padded decode batches checks
the engine <-> backend contract the H200 run relies on: pad rows, one plan per step, graph keys.
It does not capture real CUDA graphs and says nothing about FlashInfer's kernels.
"""
from __future__ import annotations
import sys

import pytest
import torch

import fake_flashinfer
from granikv.attention.decode import DecodeAttention
from granikv.attention.dispatch import Dispatcher
from granikv.attention.policy import GranikvPolicy, make_policy
from granikv.attention.prefill import PrefillAttention
from granikv.engine.engine import Engine
from test_engine import check_no_leak, check_tokens, make_cfg, reference, workload

pytestmark = pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")
MIXED = [{"lp_max": 50, "choice": "paged"}, {"meff_min": 12, "choice": "dense"}, {"choice": "cascade"}]


@pytest.fixture(autouse=True)
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())


def flashinfer_engine(name: str, graph: bool, table=MIXED, **kw) -> Engine:
    """An Engine whose decode backend and prefill attention take the FlashInfer code paths."""
    composed = name == "sglang_cascade_composed"     # SGLang-Cascade on the per-class cascade path
    eng = Engine(make_cfg("sglang_cascade" if composed else name, **kw), pad_batches=graph)
    m, s = eng.cfg.model, eng.cfg.system
    args = (m.num_heads, m.num_kv_heads, m.head_dim)
    opts = dict(device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer")
    if composed:
        opts["cascade_impl"] = "composed"
    if s.backend == "granikv":
        be = DecodeAttention(GranikvPolicy(Dispatcher(*args, "t", table, mode=s.dispatch)), *args, **opts)
    else:
        be = DecodeAttention(make_policy(s.backend), *args, **opts)
    be.rest_capacity = eng.backend.rest_capacity       # as Engine sets it (graph_rest_capacity)
    eng.backend = eng.runner.backend = be
    eng.prefill_attn = eng.runner.prefill_attn = PrefillAttention(*args, impl="flashinfer")
    return eng


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("name", ["sglang_default", "sglang_cascade", "sglang_cascade_composed", "hydragen", "granikv",
                                  "granikv_dense_only"])
def test_engine_on_flashinfer_paths(name, graph):
    reqs = workload(21, n=9, k=3, out=(3, 10))
    # a second run: one common-prefix class only, so the batch-global cascade engages
    pre = reqs[3].prompt_ids[:reqs[3].shared_len]
    wave = [type(reqs[3])(100 + i, pre + [7 + i, 11 * i % 512], 6, shared_len=len(pre), prefix_class=0)
            for i in range(5)]
    eng = flashinfer_engine(name, graph, chunk=40, cuda_graph_max_bs=8)
    used = set()
    for rs, key in ((reqs, "fi"), (wave, "fi-wave")):
        res = eng.run(rs)
        check_tokens(res, rs, reference(eng, rs, key))
        check_no_leak(eng)
        dec = [s for s in res.steps if s["kind"] == "decode"]
        if graph:
            assert any(s["padded_bs"] > s["batch_size"] for s in dec)
        used |= {d["backend"] for s in dec for d in s["decisions"]}
    if graph:
        assert len(eng.backend._gpu.sets) >= 2  # one wrapper set per graph key
    if name.startswith("sglang_cascade"):
        assert "cascade" in used
    if name == "sglang_cascade_composed":      # never FlashInfer's multi-level wrapper
        assert eng.backend._gpu.current is not None and not eng.backend._gpu.current.multilevel
        assert not any(ws.multilevel for ws in eng.backend._gpu.sets.values())
    if name == "granikv":
        assert {"dense", "cascade"} <= used or {"dense", "paged"} <= used


def _wave(n: int, lp: int = 60, seed: int = 3, first_rid: int = 200):
    """``n`` requests sharing one ``lp``-token prefix, output lengths 1..n: the decode batch drains n -> 1."""
    import random

    from granikv.request import Request

    rng = random.Random(seed)
    pre = [rng.randrange(512) for _ in range(lp)]
    return [Request(first_rid + i, pre + [rng.randrange(512) for _ in range(1 + i % 3)], 1 + i, shared_len=lp,
                    prefix_class=0) for i in range(n)]


def _trace_plans(eng) -> list[dict]:
    """Record, per plan (make_plan + load) of the engine's decode steps: batch, pads, graph flag, key, full cover."""
    be, seen, planned = eng.backend, [], []
    orig_make_plan, orig_load = be.make_plan, be.load

    def make_plan(batch):
        # the runner hands the plan the host copy of kv_indptr (no device->host sync per step on the GPU)
        assert batch.kv_indptr_host is not None and torch.equal(batch.kv_indptr_host, batch.kv_indptr.cpu())
        planned.append(batch)
        return orig_make_plan(batch)

    def load(step, graph=None):
        orig_load(step, graph)
        batch = planned[-1]
        ws = be._gpu.current
        seen.append({"bs": batch.batch_size, "npad": batch.num_pad, "graph": be.last_plan_graph, "key": be.graph_key(),
                     "choices": tuple(c.choice for c in be._plan.classes), "full_cover": getattr(ws, "full_cover", None),
                     "multilevel": ws.multilevel, "set_graph": ws.graph})
    be.make_plan, be.load = make_plan, load
    return seen


@pytest.mark.parametrize("name", ["sglang_default", "hydragen", "granikv"])
def test_eager_steps_share_one_wrapper_set(name):
    """Steps above cuda_graph_max_bs run eagerly on the GPU: they must share ONE eager wrapper set, not get
    a graph-mode set per batch size kept forever (regression: 8 MiB device + 8 MiB pinned each)."""
    reqs = _wave(12)
    # capture_at=1: every graph-shaped step is planned in graph mode (the capture policy has its own test)
    eng = flashinfer_engine(name, True, chunk=4096, cuda_graph_max_bs=4, cuda_graph_capture_at=1)
    seen = _trace_plans(eng)
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "fi-wave12"))
    sizes = eng.runner.sizes
    above = [s for s in seen if s["bs"] > sizes[-1]]
    assert above and all(s["graph"] is False and not s["set_graph"] for s in above)
    assert all(s["graph"] is True and s["set_graph"] for s in seen if s["bs"] <= sizes[-1])
    keys = set(eng.backend._gpu.sets)
    assert None in keys
    assert all(k is None or k[1] in sizes for k in keys), sorted(k[1] for k in keys if k is not None)
    assert len(keys) <= len({s["key"] for s in seen if s["graph"]}) + 1


def test_pad_rows_do_not_multiply_graph_keys():
    """A single-class batch draining 24 -> 1 under cuda_graph_max_bs 32: pad rows join the class for every
    class-splitting backend, so graph keys (one CUDA-graph capture each, inside timed steps) follow the
    padded size as for sglang_cascade, not each real class size; padded steps keep the no-gather
    full-cover path; decisions count real rows only."""
    reqs = _wave(24)
    n_keys, pad_keys, full_keys = {}, {}, {}
    table = [{"lp_max": 50, "choice": "paged"}, {"meff_min": 14 * 4, "choice": "dense"}, {"choice": "cascade"}]
    for name in ["sglang_cascade", "hydragen", "granikv", "granikv_dense_only"]:
        eng = flashinfer_engine(name, True, table=table, chunk=4096, cuda_graph_max_bs=32, cuda_graph_capture_at=1)
        seen = _trace_plans(eng)
        res = eng.run(reqs)
        check_tokens(res, reqs, reference(eng, reqs, "fi-wave24"))
        padded = [s for s in seen if s["npad"]]
        assert padded and all(s["graph"] for s in seen)
        n_keys[name] = len({(s["bs"], s["key"][3]) for s in seen})          # ignoring the rest-capacity bucket
        full_keys[name] = len({s["key"] for s in seen})
        # one shared capacity: largest graph batch x longest possible row, as SGLang's max_bs x context length
        assert {s["key"][2] for s in seen} == {32 * min(eng.cfg.model.max_position_embeddings, eng.kv.capacity_tokens)}
        assert eng.backend._gpu.rest_buf.numel() == eng.backend.rest_capacity   # ONE buffer for every graph set
        pad_keys[name] = len({(s["bs"], s["choices"]) for s in seen})
        for s in padded:
            assert len(s["choices"]) == 1 and s["key"][3][0][1] == s["bs"], s     # the class covers the padded batch
            if not s["multilevel"]:
                assert s["full_cover"], s
        if name == "granikv":   # dense iff B_class * group >= 56: real rows decide (13 real rows padded to 16: cascade)
            assert eng.runner.backend.group == 4
            assert any(s["bs"] - s["npad"] < 14 <= s["bs"] for s in seen)
            for s in seen:
                real = s["bs"] - s["npad"]
                assert s["choices"] == (("dense",) if real >= 14 else ("cascade",)), s
    for name in n_keys:
        assert n_keys[name] == pad_keys[name], (name, n_keys, pad_keys)
    assert full_keys == n_keys, (full_keys, n_keys)   # the rest-capacity part never adds a key (fixed capacity)
    assert n_keys["hydragen"] == n_keys["granikv_dense_only"] == n_keys["sglang_cascade"], n_keys


@pytest.mark.parametrize("budget", [4096, 768])
@pytest.mark.parametrize("name", ["sglang_default", "sglang_cascade", "hydragen", "granikv"])
def test_warmup_covers_every_graph_key_of_a_burst(name, budget):
    """A burst of B requests sharing one prefix, 40 output tokens each, after the engine's warm-up (the
    first B requests, outputs B+1..2): no graph-mode wrapper set (one CUDA-graph capture each on the
    GPU) is first needed inside the measured run. With graph keys bucketed by the batch's suffix-token
    count (before the fixed KV-pool capacity), the growing suffixes made new keys mid-run: the H200
    headline and grid cells captured graphs inside measured steps (hydragen: up to 27% of a run).
    budget=768: a pool smaller than the paged rows' slot count (12 rows x up to 103 slots, the prefix
    counted per row), as the a100_40gb preset at Lp=8K, B=256: a pool-sized buffer made a new key every step
    there (sglang_default: 372 captures in one run at 1e93c7b)."""
    from dataclasses import replace

    reqs = [replace(r, output_len=40) for r in _wave(12)]
    eng = flashinfer_engine(name, True, chunk=4096, cuda_graph_max_bs=16, budget=budget)
    assert eng.backend.rest_capacity == 16 * min(eng.cfg.model.max_position_embeddings, eng.kv.capacity_tokens)
    eng.cfg.warmup_requests = len(reqs)
    seen = _trace_plans(eng)
    warm_keys: set = set()
    orig_serve = eng._serve
    calls = []

    def serve(requests, on_step):
        calls.append(len(seen))
        return orig_serve(requests, on_step)
    eng._serve = serve
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "fi-wave12-40"))
    assert len(calls) == 2                              # warm-up, then the measured run
    warm_keys = {s["key"] for s in seen[:calls[1]] if s["graph"]}
    new = {s["key"] for s in seen[calls[1]:] if s["graph"]} - warm_keys
    assert not new, sorted(new)[:3]


@pytest.mark.parametrize("capture_at", [1, 2, 3])
@pytest.mark.parametrize("name", ["sglang_default", "hydragen", "granikv"])
def test_class_structures_captured_at_their_nth_step(name, capture_at):
    """hardware.cuda_graph_capture_at: in the measured run, a graph key holding split-off prefix classes is
    planned in graph mode (captured on the GPU) at its capture_at-th step and runs eagerly before (reason
    new_step_structure, the eager wrapper set); a key of the batch size alone (sglang_default's: SGLang
    captures those at startup) at its first step. The warm-up captures at the first step of every key."""
    reqs = [r for w in (_wave(6, seed=3), _wave(6, lp=70, seed=4, first_rid=300)) for r in w]  # 2 classes
    eng = flashinfer_engine(name, True, chunk=4096, cuda_graph_max_bs=16, cuda_graph_capture_at=capture_at)
    seen = _trace_plans(eng)
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "fi-two-waves"))
    count: dict = {}
    eager = 0
    for s in seen:
        key = (s["bs"], s["key"])
        count[key] = count.get(key, 0) + 1
        classes = bool(s["key"][3])
        assert classes == (name != "sglang_default"), s
        want = not classes or count[key] >= capture_at
        assert s["graph"] is want and s["set_graph"] is want, (s, count[key])
        eager += not want
    # (eager reasons are recorded where graphs exist: tests/test_engine_gpu.py)
    if name != "sglang_default" and capture_at > 1:
        assert eager > 0
    # with a warm-up of the same requests, every structure was met and captured there at its first step
    eng = flashinfer_engine(name, True, chunk=4096, cuda_graph_max_bs=16, cuda_graph_capture_at=capture_at)
    eng.cfg.warmup_requests = len(reqs)
    seen = _trace_plans(eng)
    calls, orig_serve = [], eng._serve
    eng._serve = lambda requests, on_step: (calls.append(len(seen)), orig_serve(requests, on_step))[1]
    eng.run(reqs)
    assert eng.runner.capture_at == capture_at and len(calls) == 2   # warm-up, then the measured run
    assert calls[1] > 0 and all(s["graph"] for s in seen[:calls[1]])
