"""COLD pool free checks on CUDA. Run on the GPU host: pytest -m gpu tests/test_kv_cold_gpu.py

A CUDA pool checks its frees by default ("deferred": no stream sync per free; the next call whose
work the GPU has done, or check(), raises). Checks: the pool alone (no synchronising call, every
kind of bad free caught, "sync" raising in the free itself) and the engine run with the checks on,
in both modes, over a workload that evicts from both pools.
"""
from __future__ import annotations
import random

import pytest
import torch

from attn_util import flashinfer_available
from granikv.kv import ColdPool
from granikv.kv import cold_pool as cold_pool_mod

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_fi = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")


@needs_cuda
def test_gpu_cold_pool_checks_by_default_and_never_syncs():
    pool = ColdPool(1024, offset=64, device="cuda")
    assert pool.checks == "deferred"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in alloc / free raises
    try:
        for _ in range(60):  # wraps the ring
            pool.free(pool.alloc(37))
        a = pool.alloc(8)
        pool.free(a)
        pool.free(a[:1])  # a double free: caught without a host read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="double free"):
        pool.check()
    with pytest.raises(ValueError, match="double free"):
        pool.alloc(1)


@needs_cuda
def test_gpu_cold_pool_flag_surfaces_at_the_next_call_without_check():
    pool = ColdPool(64, device="cuda")
    a = pool.alloc(4)
    pool.free(a)
    pool.free(a[1:2])
    torch.cuda.synchronize()  # the flag's copy has landed: the next call sees it, no check() needed
    with pytest.raises(ValueError, match=r"\[%d\]" % int(a[1])):
        pool.alloc(1)


@needs_cuda
@pytest.mark.parametrize("bad,msg", [("never", "not allocated"), ("repeated", "not allocated"),
                                     ("outside", "outside")])
def test_gpu_cold_pool_flags_each_bad_free(bad, msg):
    pool = ColdPool(16, offset=100, device="cuda")
    pool.alloc(4)  # 100..103
    ids = {"never": [110], "repeated": [101, 101], "outside": [99, 116]}[bad]
    pool.free(torch.tensor(ids, device="cuda"))
    with pytest.raises(ValueError, match=msg):
        pool.check()


@needs_cuda
def test_gpu_cold_pool_sync_mode_raises_in_the_free_and_changes_nothing():
    pool = ColdPool(16, device="cuda", validate="sync")
    ids = pool.alloc(4)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1])
    assert pool.free_tokens == 16 and not bool(pool.owned_mask().any())
    with pytest.raises(ValueError, match="twice"):
        b = pool.alloc(2)
        pool.free(torch.stack((b[0], b[0])))
    assert pool.free_tokens == 14


@needs_fi
@pytest.mark.parametrize("checks", ["deferred", "sync"])
def test_gpu_engine_runs_with_cold_free_checks(monkeypatch, checks):
    """granikv on the GPU with the COLD free checks on (the default "deferred", and "sync", which
    raises at the faulty free itself): prefixes churn through HOT (slabs evicted for new ones) and
    COLD (prefixes too long for HOT, evicted for room); no bad free, nothing leaked; a planted
    double free on the engine's pool is caught."""
    from granikv.config import HardwareConfig, ModelConfig, RunConfig
    from granikv.engine.engine import Engine
    from granikv.config import system_config
    from granikv.request import Request

    monkeypatch.setitem(cold_pool_mod.DEFAULT_CHECKS, "cuda", checks)
    model = dict(name="small128", hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                 intermediate_size=1024, vocab_size=1024, max_position_embeddings=4096)
    hw = HardwareConfig(name="gpu", device="cuda", dtype="bfloat16", kv_budget_tokens=1024,
                        cuda_graph_max_bs=8, chunked_prefill_size=512, max_running_requests=2)
    cfg = RunConfig(model=ModelConfig(**model), system=system_config("granikv"), hardware=hw)
    cfg.system.hot_fraction = 0.2  # HOT 204: the 150/180 prefixes churn there; 600/500 are COLD (819 slots)
    rng = random.Random(0)
    pre = [[rng.randrange(1024) for _ in range(n)] for n in (150, 180, 600, 500)]
    reqs = [Request(i, pre[i % 4] + [rng.randrange(1024) for _ in range(rng.randrange(4, 20))], 8,
                    arrival_s=0.0, shared_len=len(pre[i % 4]), prefix_class=i % 4) for i in range(10)]
    eng = Engine(cfg)
    res = eng.run(reqs)
    pool = eng.kv.cold_pool
    assert pool.checks == checks
    pool.check()
    assert [len(r.output_ids) for r in res.records] == [8] * len(reqs)
    assert res.stats["evicted_tokens"] > 0 and res.stats["admissions"].get("hot", 0) >= 2
    idx = eng.storage.index
    assert all(n.lock_ref == 0 for n in idx.nodes())
    assert pool.used_tokens == sum(len(n) for n in idx.nodes() if n.slab is None) + 1  # + the padding slot
    free_slot = (~pool.owned_mask()).nonzero().flatten()[:1] + pool.offset
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(free_slot)
        pool.check()
