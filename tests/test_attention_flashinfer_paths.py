"""The FlashInfer-path bookkeeping (gpu_paths.py) on CPU, against a FlashInfer stand-in that computes
with the reference: segments, buffers, CUDA-graph-mode re-planning, merges. (FlashInfer's own kernels
are checked by tests/test_attention_gpu.py on the GPU host.)"""
import sys

import pytest
import torch

import fake_flashinfer
from attn_util import make_step, rel_err
from granikv.attention import reference as R
from granikv.attention.dispatch import Dispatcher

MIXED = [{"lp_max": 8, "choice": "paged"}, {"meff_min": 12, "choice": "dense"}, {"choice": "cascade"}]
NAMES = ["paged", "cascade", "dense", "hydragen", "granikv"]


@pytest.fixture(autouse=True)
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())


def _make(name, hq, hkv, d, graph):
    from granikv.attention.backends import BACKEND_CLASSES, GranikvBackend

    kw = dict(device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer")
    if name == "granikv":
        return GranikvBackend(hq, hkv, d, dispatcher=Dispatcher(hq, hkv, d, "t", MIXED), **kw)
    return BACKEND_CLASSES[name](hq, hkv, d, **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("graph", [False, True])
def test_flashinfer_path_bookkeeping(name, graph):
    hq, hkv, d = 8, 2, 8
    layouts = [([100], [6], [True], 0), ([4, 100, 100, 60], [2, 1, 4, 5], [True, True, True, False], 2),
               ([30, 30], [3, 3], [True, False], 1), ([], [], [], 3), ([50], [2], [True], 0)]
    be = _make(name, hq, hkv, d, graph)
    for seed, (lps, sizes, hot, nopfx) in enumerate(layouts):
        for rep in range(2):          # re-plan the same structure with new data (graph mode reuses buffers)
            k, v, batch = make_step(seed * 10 + rep, hkv, d, lps, sizes, hot, n_noprefix=nopfx, max_suffix=5)
            q = torch.randn(batch.batch_size, hq, d)
            be.plan(batch)
            out = be.run(q, k, v)
            ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
            assert rel_err(out, ref) <= 1e-5, (name, graph, seed, be.last_decisions)
    if graph:
        assert len(be._gpu.sets) >= 2         # one wrapper set per graph_key


def test_graph_mode_reuses_set_for_same_key():
    be = _make("dense", 8, 2, 8, True)
    k, v, b1 = make_step(1, 2, 8, [50], [4], [True], max_suffix=1)
    be.plan(b1)
    key, ws = be.graph_key(), be._gpu.current
    k2, v2, b2 = make_step(2, 2, 8, [50], [4], [True], max_suffix=1)
    be.plan(b2)
    if be.graph_key() == key:
        assert be._gpu.current is ws


def test_prefill_attention_flashinfer_path():
    from granikv.attention.prefill import PrefillAttention

    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(30, 2, 8, generator=g), torch.randn(30, 2, 8, generator=g)
    q = torch.randn(5, 4, 8, generator=g)
    qo, kvp, kvi = torch.tensor([0, 2, 5]), torch.tensor([0, 6, 9]), torch.randperm(30, generator=g)[:9]
    pa = PrefillAttention(4, 2, 8, impl="flashinfer")
    pa.plan(qo, kvp, kvi)
    torch.testing.assert_close(pa.run(q, kc, vc), R.prefill_ref(q, kc, vc, qo, kvp, kvi)[0])


def _replay_as_captured(be, captured: dict, q, k, v):
    """run() as a CUDA graph captured at an earlier plan() would replay it: with the tensors (addresses)
    the wrapper set held at capture time, whose contents plan() has since rewritten (or not) in place."""
    ws = be._gpu.current
    now = dict(ws.__dict__)
    ws.__dict__.update(captured)
    try:
        return be.run(q, k, v)
    finally:
        ws.__dict__.update(now)


def _steps_same_key(be, hkv, d, n=2):
    """``n`` steps (seed, batch) whose plans share one graph_key but put different rows in the classes:
    two classes (40- and 20-token HOT prefixes, 3 requests each) and 3 prefix-less rows (like the
    engine's no-prefix request and pad rows), in a different order each seed."""
    by_key: dict = {}
    for seed in range(200):
        k, v, batch = make_step(seed, hkv, d, [40, 20], [3, 3], [True, True], n_noprefix=3, max_suffix=1)
        be.plan(batch)
        members = tuple(tuple(c.rows) for c in be._plan.classes)
        got = by_key.setdefault(be.graph_key(), {})
        got.setdefault(members, (seed, k, v, batch))
        if len(got) >= n:
            return list(got.values())[:n]
    raise AssertionError("no two layouts with one graph_key")


@pytest.mark.parametrize("name,mode", [("granikv", "cascade_only"), ("granikv", "dense_only"), ("granikv", "table"),
                                       ("hydragen", None), ("dense", None), ("paged", None)])
def test_graph_replay_after_replan_with_new_class_rows(name, mode):
    """Graph mode: a run() captured after one plan() must stay correct when replayed after a later plan()
    with the same graph_key but other rows in the classes (the engine's steps as requests join and
    leave). Regression: with two cascade classes, plan() put their rows into a freshly allocated
    tensor each step, so the captured graph kept gathering from the first step's (freed) buffer
    (device-side assert ``srcIndex < srcSelectDimSize`` in the engine GPU test for granikv)."""
    from granikv.attention.backends import GranikvBackend

    hq, hkv, d = 8, 2, 8
    if name == "granikv":
        table = [{"lp_min": 30, "choice": "dense"}, {"choice": "cascade"}]    # table: one dense, one cascade class
        be = GranikvBackend(hq, hkv, d, dispatcher=Dispatcher(hq, hkv, d, "t", table, mode=mode), device="cpu",
                            dtype=torch.float32, cuda_graph=True, impl="flashinfer")
    else:
        be = _make(name, hq, hkv, d, True)
    (_, k1, v1, b1), (_, k2, v2, b2) = _steps_same_key(be, hkv, d)
    be.plan(b1)
    captured = dict(be._gpu.current.__dict__)      # what the graph captured now would bake in
    ws = be._gpu.current
    be.plan(b2)
    assert be._gpu.current is ws
    q = torch.randn(b2.batch_size, hq, d, generator=torch.Generator().manual_seed(5))
    out = _replay_as_captured(be, captured, q, k2, v2)
    ref, _ = R.paged_decode_ref(q, k2, v2, b2.kv_indptr, b2.kv_indices)
    moved = [a for a, t in captured.items()
             if isinstance(t, torch.Tensor) and t.data_ptr() != ws.__dict__[a].data_ptr()]
    assert rel_err(out, ref) <= 1e-5, (name, mode, be.last_decisions, f"re-allocated by plan(): {moved}")
    assert not moved, f"plan() re-allocated {moved}: a captured graph would read the old storage"
