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
