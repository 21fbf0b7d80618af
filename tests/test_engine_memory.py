"""GPU-memory bookkeeping of the engine, on CPU: the captured-graph cap (least recently replayed
graph evicted with the wrapper set it pinned) and the KV budget's refusal to size itself from
memory an earlier engine of the process still holds. Both caused failures on the H200
(2026-11-30: OOM in multi-prefix warm-ups; KV budgets of one sweep spread over 384K-870K tokens)."""
from __future__ import annotations
from collections import OrderedDict
from types import SimpleNamespace
import pytest
import torch

from granikv.config import HardwareConfig, ModelConfig, RunConfig
from granikv.engine import engine as engine_mod
from granikv.engine.runner import ModelRunner


class _Backend:
    def __init__(self):
        self.released = []

    def release_graph(self, key):
        self.released.append(key)


def _runner(max_graphs: int, keys: list) -> SimpleNamespace:
    r = SimpleNamespace(graphs=OrderedDict((k, ("graph", "logits")) for k in keys), max_graphs=max_graphs,
                        backend=_Backend(), graphs_evicted=0, device=torch.device("cpu"))
    return r


def test_capture_cap_evicts_least_recently_replayed_and_releases_its_set():
    r = _runner(3, [(8, "a"), (16, "b"), (8, "c")])
    r.graphs.move_to_end((8, "a"))                     # replayed last: now the most recent
    ModelRunner._evict_for_capture(r)
    assert list(r.graphs) == [(8, "c"), (8, "a")]      # room for one more: 2 left of cap 3
    assert r.backend.released == ["b"] and r.graphs_evicted == 1


def test_capture_cap_zero_keeps_every_graph():
    r = _runner(0, [(1, k) for k in range(500)])
    ModelRunner._evict_for_capture(r)
    assert len(r.graphs) == 500 and r.backend.released == [] and r.graphs_evicted == 0


def test_cap_is_a_checked_setting():
    with pytest.raises(ValueError, match="hardware.cuda_graph_max_graphs"):
        HardwareConfig(cuda_graph_max_graphs=-1)
    with pytest.raises(ValueError, match="hardware.cuda_graph_capture_at"):
        HardwareConfig(cuda_graph_capture_at=0)


def _fake_cuda(monkeypatch, allocated: int, free: int, total: int, reserved: int | None = None):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: reserved if reserved is not None else allocated)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free, total))


def _cfg(mem_fraction: float = 0.9) -> RunConfig:
    return RunConfig(model=ModelConfig(), hardware=HardwareConfig(device="cpu", kv_budget_tokens=None,
                                                                  mem_fraction=mem_fraction))


def test_kv_budget_refuses_memory_of_an_earlier_engine(monkeypatch):
    gib = 2 ** 30
    dev = SimpleNamespace(type="cuda")
    _fake_cuda(monkeypatch, allocated=70 * gib, free=60 * gib, total=140 * gib)
    with pytest.raises(RuntimeError, match="earlier engine of this process is still referenced"):
        engine_mod.kv_budget_tokens(_cfg(), 1024, dev, own_bytes=16 * gib)


def test_kv_budget_takes_mem_fraction_of_free_memory(monkeypatch):
    gib = 2 ** 30
    dev = SimpleNamespace(type="cuda")
    _fake_cuda(monkeypatch, allocated=16 * gib + 300 * 2 ** 20, free=123 * gib, total=140 * gib)
    n = engine_mod.kv_budget_tokens(_cfg(0.9), gib // 1024, dev, own_bytes=16 * gib)
    assert n == int((123 * gib - 14 * gib) // (gib // 1024))   # free - total x (1 - 0.9)


def test_kv_budget_refuses_segments_pinned_by_live_blocks(monkeypatch):
    """Freed blocks that share a segment with live ones stay reserved after empty_cache(): the
    budget would shrink (the H200 pattern: an earlier engine's KV segment holding new weights)."""
    gib = 2 ** 30
    _fake_cuda(monkeypatch, allocated=16 * gib, free=70 * gib, total=140 * gib, reserved=69 * gib)
    with pytest.raises(RuntimeError, match="stay cached after empty_cache"):
        engine_mod.kv_budget_tokens(_cfg(), 1024, SimpleNamespace(type="cuda"), own_bytes=16 * gib)


def test_drop_graphs_releases_sets_and_forgets_the_pool():
    """Recapturing into the pool of destroyed graphs trips a torch allocator assert (prefill bench,
    H200, 2026-11-30): dropping every graph must drop the pool handle too."""
    r = _runner(0, [(8, "a"), (16, "b")])
    r.graph_pool = ("pool", 1)
    ModelRunner.drop_graphs(r)
    assert not r.graphs and r.graph_pool is None and sorted(r.backend.released) == ["a", "b"]


def test_evicting_the_last_graph_forgets_the_pool():
    r = _runner(1, [(8, "a")])
    r.graph_pool = ("pool", 1)
    ModelRunner._evict_for_capture(r)
    assert not r.graphs and r.graph_pool is None
