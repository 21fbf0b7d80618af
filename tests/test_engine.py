"""The engine end to end on CPU (fp32, tiny model, greedy): tokens equal the no-cache reference.

Every system (and the ablations) must reproduce, token for token, a plain full-sequence forward
with no KV cache, over several seeds, with prefix hits, chunked prefill, evictions under a small
KV budget, mixed prefix classes, requests without a prefix, arrivals over time, padded batches,
and tensor parallelism (TP=2 and TP=4 on gloo, CPU processes).
"""
from __future__ import annotations
import os
import random
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from granikv.config import ABLATIONS, SYSTEMS, HardwareConfig, ModelConfig, RunConfig, system_config
from granikv.engine.engine import Engine
from granikv.request import Request

pytestmark = pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")

TINY = dict(hidden_size=64, num_layers=2, num_heads=16, num_kv_heads=4, head_dim=16, intermediate_size=128,
            vocab_size=512, max_position_embeddings=1024)


def make_cfg(system="granikv", budget=4096, chunk=8192, tp=1, seed=0, model=None, **hw) -> RunConfig:
    return RunConfig(model=model or ModelConfig(**TINY), system=system_config(system),
                     hardware=HardwareConfig(kv_budget_tokens=budget, chunked_prefill_size=chunk, **hw),
                     tp=tp, seed=seed)


def workload(seed: int, n: int = 10, k: int = 3, lp=(40, 96), no_prefix: int = 2, out=(1, 9),
             spread: float = 0.0) -> list[Request]:
    """k prefix classes of random lengths, unique suffixes, a few prefix-less requests, shuffled order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(*lp))] for _ in range(k)]
    reqs = []
    for i in range(n):
        c = i % k if i >= no_prefix else -1
        pre = prefixes[c] if c >= 0 else []
        suffix = [rng.randrange(512) for _ in range(rng.randrange(1, 24))]
        reqs.append(Request(i, pre + suffix, rng.randrange(*out), arrival_s=rng.random() * spread,
                            shared_len=len(pre), prefix_class=c))
    return reqs


_REF_CACHE: dict = {}


def reference(engine: Engine, reqs: list[Request], key) -> list[list[int]]:
    if key not in _REF_CACHE:
        _REF_CACHE[key] = [engine.generate_reference(r.prompt_ids, r.output_len) for r in reqs]
    return _REF_CACHE[key]


def check_tokens(res, reqs, ref):
    assert [r.rid for r in res.records] == [r.rid for r in reqs]
    for r, rec, want in zip(reqs, res.records, ref):
        assert rec.output_ids == want, f"request {r.rid} (class {r.prefix_class}, {rec.prefix_where})"
        assert len(rec.token_times_s) == r.output_len
        assert rec.token_times_s == sorted(rec.token_times_s)
        assert rec.token_times_s[0] >= rec.arrival_s


def check_no_leak(engine: Engine):
    st = engine.storage
    assert all(n.lock_ref == 0 for n in st.index.nodes()), "a prefix is still locked after the run"
    cold_cached = sum(len(n) for n in st.index.nodes() if n.slab is None)
    assert engine.kv.cold_pool.used_tokens == cold_cached + 1  # + the padding scratch slot


ALL = list(SYSTEMS) + list(ABLATIONS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_system_matches_reference(seed):
    """Prefix hits, mixed classes, prefix-less requests, chunked prefill of long prompts."""
    reqs = workload(seed, n=10, k=3)
    ref = None
    for name in ALL:
        eng = Engine(make_cfg(name, chunk=48, seed=seed))
        ref = ref or reference(eng, reqs, ("base", seed))
        res = eng.run(reqs)
        check_tokens(res, reqs, ref)
        check_no_leak(eng)
        hits = [r for r in res.records if r.prefix_where == "hit"]
        assert hits and all(r.cached_len > 0 for r in hits)
        assert sum(s["kind"] == "decode" for s in res.steps) > 0
        if name == "granikv_dense_only":
            assert res.stats["dispatch_counts"].get("dense", 0) > 0
        if name in ("sglang_default", "sglang_cascade", "hydragen", "granikv_no_hot"):
            assert res.stats["hot_capacity_tokens"] == 0 and "hot" not in res.stats["admissions"]
        if name == "granikv":
            assert res.stats["admissions"].get("hot", 0) > 0


def test_prefix_hits_are_not_recomputed():
    """A burst sharing one prefix: it is prefilled once; the others only compute their suffixes,
    and only once the prefix KV is written (here: after the chunk that completes it)."""
    rng = random.Random(5)
    pre = [rng.randrange(512) for _ in range(120)]
    reqs = [Request(i, pre + [rng.randrange(512) for _ in range(7)], 4, shared_len=120, prefix_class=0)
            for i in range(6)]
    for name in SYSTEMS:
        eng = Engine(make_cfg(name, chunk=50))  # prefix > chunk: the sharers must wait for its KV
        res = eng.run(reqs)
        check_tokens(res, reqs, reference(eng, reqs, "burst"))
        prefill_tokens = sum(s["num_tokens"] for s in res.steps if s["kind"] == "prefill")
        assert prefill_tokens == 120 + 6 * 7
        assert [r.cached_len for r in res.records] == [0] + [120] * 5
        # the sharers' prefill starts only after the prefix's last chunk
        first_sharer_step = next(i for i, s in enumerate(res.steps) if s["kind"] == "prefill" and s["batch_size"] > 1)
        assert sum(s["num_tokens"] for s in res.steps[:first_sharer_step]) >= 120


@pytest.mark.parametrize("name", ["sglang_default", "sglang_cascade", "granikv"])
def test_prompt_that_is_all_prefix(name):
    """suffix_len 0: later requests hit the whole prompt; the last token is recomputed for its logits
    without overwriting the shared KV, and the tokens still match the reference."""
    rng = random.Random(9)
    pre = [rng.randrange(512) for _ in range(60)]
    reqs = [Request(i, list(pre), 5, arrival_s=0.0 if i < 3 else 0.03, shared_len=60, prefix_class=0)
            for i in range(5)]
    reqs.append(Request(5, pre[:30], 4, shared_len=30, prefix_class=1))  # a prefix of the prefix: full hit
    eng = Engine(make_cfg(name, chunk=32))
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "allprefix"))
    assert res.records[0].cached_len == 0 and all(r.cached_len in (59, 29) for r in res.records[1:])
    check_no_leak(eng)


@pytest.mark.parametrize("name,hot", [("sglang_default", 0.0), ("granikv", 0.2), ("granikv", 0.5)])
def test_evictions_under_small_budget(name, hot):
    """Four prefix classes served in waves with room for about two prefixes: LRU eviction, same tokens."""
    reqs = workload(11, n=12, k=4, lp=(70, 90), no_prefix=0, out=(2, 6))
    for i, r in enumerate(reqs):
        r.arrival_s = 0.01 * (i // 3)  # waves of three
    cfg = make_cfg(name, budget=400 if hot == 0.5 else 330, max_running_requests=3)
    cfg.system.hot_fraction = hot
    eng = Engine(cfg)
    res = eng.run(reqs)
    if hot == 0.5:  # HOT holds two prefixes; later ones fall back to COLD (no demotion), slabs get evicted
        assert res.stats["admissions"].get("hot", 0) >= 2 and res.stats["admissions"].get("cold", 0) >= 1
    check_tokens(res, reqs, reference(eng, reqs, "evict"))
    assert res.stats["evicted_tokens"] > 0
    assert res.stats["cold_peak_tokens"] <= res.stats["cold_capacity_tokens"]
    check_no_leak(eng)


def test_arrivals_are_respected():
    reqs = workload(3, n=5, k=2, spread=0.0)
    for i, r in enumerate(reqs):
        r.arrival_s = 0.04 * i
    eng = Engine(make_cfg("granikv"))
    t0 = time.perf_counter()
    res = eng.run(reqs)
    assert time.perf_counter() - t0 >= 0.16
    check_tokens(res, reqs, reference(eng, reqs, "arrivals"))
    for r, rec in zip(reqs, res.records):
        assert rec.arrival_s == r.arrival_s and rec.token_times_s[0] >= r.arrival_s


def test_padded_batches_and_step_records():
    """Decode batches padded to graph sizes (3 -> 4, 5 -> 8) give the same tokens; steps are JSON rows."""
    import json

    reqs = workload(4, n=5, k=2, out=(6, 10))
    eng = Engine(make_cfg("granikv_dense_only", cuda_graph_max_bs=8), pad_batches=True)
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "pad"))
    dec = [s for s in res.steps if s["kind"] == "decode"]
    assert any(s["padded_bs"] > s["batch_size"] for s in dec)
    for s in dec:
        assert s["padded_bs"] in (1, 2, 4, 8) and s["padded_bs"] >= s["batch_size"]
        assert s["decisions"] and sum(s["meff"].values()) == 4 * sum(
            d["batch"] for d in s["decisions"] if d["prefix_id"] >= 0)
        assert sum(d["batch"] for d in s["decisions"]) == s["batch_size"]  # pad rows are not counted
        assert 0 < s["dispatch_us"] < s["plan_us"]                         # host CPU, the dispatcher inside plan()
    json.dumps(res.steps)
    assert [s["step"] for s in res.steps] == list(range(len(res.steps)))


def test_qwen2_and_llama3_rope_models():
    reqs = workload(6, n=5, k=2)
    qwen = ModelConfig(**{**TINY, "arch": "qwen2", "qkv_bias": True, "rope_theta": 1e6})
    llama = ModelConfig(**{**TINY, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    for m in (qwen, llama):
        for name in ("sglang_default", "granikv"):
            eng = Engine(make_cfg(name, model=m, chunk=40))
            check_tokens(eng.run(reqs), reqs, reference(eng, reqs, m.arch))


def test_no_requests():
    res = Engine(make_cfg()).run([])
    assert res.records == [] and res.steps == [] and res.stats["num_steps"] == 0


def test_warmup_is_excluded():
    """Warm-up fills the prefix cache; the measured pass starts from an empty one (no hit on its first request)."""
    reqs = workload(7, n=4, k=1, no_prefix=0)  # every request shares one prefix
    cfg = make_cfg("granikv")
    cfg.warmup_requests = 2
    eng = Engine(cfg)
    res = eng.run(reqs)
    check_tokens(res, reqs, reference(eng, reqs, "warm"))
    assert res.stats["warmup"]["requests"] == 2
    first = res.records[0]
    assert first.prefix_class == 0 and first.prefix_where in ("hot", "cold")  # cache was reset after warm-up
    assert first.cached_len == 0
    assert [r.prefix_where for r in res.records[1:]] == ["hit"] * 3  # the measured pass does reuse its own prefix
    assert res.stats["admissions"]["hit"] == 3


# ---------------------------------------------------------------------- bad input
def test_a_preset_for_another_gpu_is_refused(monkeypatch):
    """hardware=h200 on an H100 would run the H200's table and limits and record the cell under 'h200'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match=r"hardware.gpu_name.*'NVIDIA H200'.*'NVIDIA H100 80GB HBM3'.*runners.calibrate"):
        Engine(make_cfg(device="cuda", dtype="bfloat16", gpu_name="NVIDIA H200", name="h200"))


def test_bad_inputs_fail_before_work():
    with pytest.raises(ValueError, match="tp"):
        make_cfg(tp=3)
    with pytest.raises(ValueError, match="model.arch"):
        ModelConfig(arch="gpt2")
    m = ModelConfig(**TINY)
    m.arch = "mamba"  # mutated after validation: the engine checks again
    with pytest.raises(ValueError, match="unknown model architecture"):
        Engine(make_cfg(model=m))
    cfg = make_cfg()
    cfg.hardware.kv_budget_tokens = None
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        Engine(cfg)
    with pytest.raises(ValueError, match="hot_fraction"):
        s = system_config("sglang_default")
        s.hot_fraction = 0.2
        Engine(RunConfig(model=ModelConfig(**TINY), system=s, hardware=HardwareConfig(kv_budget_tokens=512)))
    calls = []
    eng = Engine(make_cfg("granikv", budget=100))
    big = [Request(0, [1] * 30, 4), Request(1, [2] * 50 + [3] * 60, 4, shared_len=50)]
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        eng.run(big, on_step=calls.append)
    long = [Request(0, [1] * 1020, 8)]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(make_cfg()).run(long, on_step=calls.append)
    with pytest.raises(ValueError, match="vocab"):
        Engine(make_cfg()).run([Request(0, [600], 2)], on_step=calls.append)
    assert calls == []


# ---------------------------------------------------------------------- tensor parallel
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, names, reqs, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {}
        for name in names:
            eng = Engine(make_cfg(name, chunk=48, tp=world))
            res[name] = [r.output_ids for r in eng.run(reqs).records]
        res["reference"] = [eng.generate_reference(r.prompt_ids, r.output_len) for r in reqs[:3]]
        # logits(out=...) (what every captured CUDA graph writes into) == the allocating path, all-gather included
        h = torch.randn(3, eng.model.embed.shape[1], generator=torch.Generator().manual_seed(5))
        buf = torch.full((3, eng.cfg.model.vocab_size), float("nan"))
        res["logits_out_ok"] = bool(torch.equal(eng.model.logits(h, out=buf), eng.model.logits(h)))
        out.put((rank, res))
    except BaseException as e:  # report instead of leaving the parent waiting
        out.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_tp1(world):
    reqs = workload(8, n=6, k=2, spread=0.02)
    names = ["sglang_default", "granikv"]
    want = {}
    for name in names:
        eng = Engine(make_cfg(name, chunk=48))
        want[name] = [r.output_ids for r in eng.run(reqs).records]
    assert want["sglang_default"] == want["granikv"]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, world, port, names, reqs, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=90) for _ in procs)
    errors = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not errors, errors
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank in range(world):
        for name in names:
            assert got[rank][name] == want[name], f"tp={world} rank {rank} {name}"
        assert got[rank]["reference"] == want["granikv"][:3]
        assert got[rank]["logits_out_ok"], f"tp={world} rank {rank}: logits(out=) differs"


@pytest.mark.parametrize("name", ["sglang_default", "granikv"])
def test_overlap_schedule_same_tokens_and_steps(name, monkeypatch):
    """Overlap (launch step t+1 before reading step t's tokens) vs not: identical tokens through
    arrivals, chunked prefill and evictions (the schedule itself may differ: KV is freed a step
    later), and the read-back really lags."""
    from granikv.engine import scheduler as S

    reqs = workload(7, n=12, k=3, out=(1, 12), spread=0.05)
    out = {}
    orig_after = S.Scheduler.after_decode
    for overlap in (False, True):
        events = []

        def after(self, seqs, toks, now, _o=orig_after):
            events.append(("read", len(seqs)))
            return _o(self, seqs, toks, now)

        monkeypatch.setattr(S.Scheduler, "after_decode", after)
        eng = Engine(make_cfg(name, budget=700, chunk=48, overlap_schedule=overlap))
        orig_decode = eng.runner.decode

        def decode(seqs, _o=orig_decode):
            events.append(("launch", len(seqs)))
            return _o(seqs)

        eng.runner.decode = decode
        res = eng.run(reqs)
        check_tokens(res, reqs, reference(eng, reqs, ("overlap", name)))
        check_no_leak(eng)
        out[overlap] = ([r.output_ids for r in res.records],
                        [(s["kind"], s["batch_size"]) for s in res.steps], events)
    assert out[True][0] == out[False][0]
    seq_off, seq_on = out[False][2], out[True][2]
    # without overlap every launch is read back before the next launch; with it, some launch comes
    # before the previous step's read-back
    assert all(a[0] == "launch" and b[0] == "read" for a, b in zip(seq_off[::2], seq_off[1::2]))
    assert any(a[0] == "launch" and b[0] == "launch" for a, b in zip(seq_on, seq_on[1:]))
    assert sum(e[0] == "launch" for e in seq_on) == sum(e[0] == "read" for e in seq_on)


def test_warmup_pass_walks_every_batch_size():
    """The warm-up serves the first n requests with output lengths n+1..2: decode batches n, n-1, ..., 1."""
    from granikv.engine.engine import warmup_requests

    reqs = workload(5, n=9, k=2, no_prefix=1, out=(1, 4))
    w = warmup_requests(reqs, 6)
    assert [r.output_len for r in w] == [7, 6, 5, 4, 3, 2] and all(r.arrival_s == 0.0 for r in w)
    assert [r.prompt_ids for r in w] == [r.prompt_ids for r in reqs[:6]]
    assert [r.output_len for r in warmup_requests(reqs, 6, max_len=len(reqs[0].prompt_ids) + 2)][0] == 2
    eng = Engine(make_cfg("granikv"))
    res = eng._serve(w, None)
    dec = [s["batch_size"] for s in res.steps if s["kind"] == "decode"]
    assert dec == [6, 5, 4, 3, 2, 1]


def test_class_rows_are_consecutive_for_class_splitting_backends():
    """granikv / hydragen decode each prefix class as consecutive rows; the SGLang baselines keep the
    scheduler's order. Tokens are unchanged either way (vs the no-cache reference)."""
    reqs = workload(11, n=12, k=3, no_prefix=2)
    for name, grouped in (("granikv", True), ("hydragen", True), ("sglang_default", False)):
        eng = Engine(make_cfg(name))
        orders = []
        orig = eng.runner.decode

        def spy(seqs, _o=orig):
            orders.append([s.prefix_id for s in seqs])
            return _o(seqs)

        eng.runner.decode = spy
        res = eng.run(reqs)
        check_tokens(res, reqs, reference(eng, reqs, ("grouped", 11)))
        assert eng.group_rows is grouped
        if grouped:
            assert all(o == sorted(o) for o in orders)
    assert any(o != sorted(o) for o in orders)           # sglang_default: arrival order, classes interleaved


def test_tp_all_reduce_routes_small_messages_to_the_one_shot_kernel(monkeypatch):
    """TPGroup.all_reduce with hardware.allreduce=symm_one_shot (the GPU path, exercised here with a
    stand-in kernel): a message that fits the staging buffer (same dtype and device) goes to the
    one-shot op on a slot of that buffer shaped as the message; anything else stays on
    torch.distributed (NCCL on the GPU)."""
    import torch.distributed as dist

    from granikv.engine.model import TPGroup
    tp = TPGroup(1)
    tp.size = 2                                   # as a 2-rank group would be, without one
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda x: calls.append(("dist", tuple(x.shape))))

    def one_shot(staged, x, op, group):
        calls.append(("one_shot", tuple(staged.shape), op, group))
        assert staged.data_ptr() == tp._symm_buf.data_ptr() and torch.equal(staged, torch.zeros_like(staged))
        return x * 2                              # what the sum over 2 equal ranks gives

    tp._symm_buf, tp._symm_group, tp._one_shot = torch.zeros(64), "g0", one_shot
    x = torch.ones(4, 8)
    assert torch.equal(tp.all_reduce(x), torch.full((4, 8), 2.0))
    big = torch.ones(9, 8)                        # 72 > 64 elements: NCCL
    assert tp.all_reduce(big) is big
    other = torch.ones(2, 4, dtype=torch.float64)  # another dtype: NCCL
    assert tp.all_reduce(other) is other
    assert calls == [("one_shot", (4, 8), "sum", "g0"), ("dist", (9, 8)), ("dist", (2, 4))]
    tp._symm_buf = None                           # hardware.allreduce=nccl: never the one-shot op
    tp.all_reduce(x)
    assert calls[-1] == ("dist", (4, 8))
    alone = TPGroup(1)
    alone.use_symm_one_shot(torch.device("cpu"), torch.float32, 1024)   # TP=1: nothing to set up
    assert alone._symm_buf is None
    cpu = TPGroup(1)
    cpu.size = 2
    with pytest.raises(ValueError, match="hardware.allreduce"):          # CPU tensors: no one-shot kernel
        cpu.use_symm_one_shot(torch.device("cpu"), torch.float32, 1024)
