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
from granikv.attention.backends import BACKEND_CLASSES, GranikvBackend
from granikv.attention.dispatch import Dispatcher
from granikv.attention.prefill import PrefillAttention
from granikv.engine.engine import Engine
from test_engine import check_no_leak, check_tokens, make_cfg, reference, workload

pytestmark = pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")
MIXED = [{"lp_max": 50, "choice": "paged"}, {"meff_min": 12, "choice": "dense"}, {"choice": "cascade"}]


@pytest.fixture(autouse=True)
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())


def flashinfer_engine(name: str, graph: bool, **kw) -> Engine:
    """An Engine whose decode backend and prefill attention take the FlashInfer code paths."""
    eng = Engine(make_cfg(name, **kw), pad_batches=graph)
    m, s = eng.cfg.model, eng.cfg.system
    args = (m.num_heads, m.num_kv_heads, m.head_dim)
    opts = dict(device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer")
    if s.backend == "granikv":
        be = GranikvBackend(*args, dispatcher=Dispatcher(*args, "t", MIXED, mode=s.dispatch), **opts)
    else:
        be = BACKEND_CLASSES[s.backend](*args, **opts)
    eng.backend = eng.runner.backend = be
    eng.prefill_attn = eng.runner.prefill_attn = PrefillAttention(*args, impl="flashinfer")
    return eng


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("name", ["sglang_default", "sglang_cascade", "hydragen", "granikv", "granikv_dense_only"])
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
    if name == "sglang_cascade":
        assert "cascade" in used
    if name == "granikv":
        assert {"dense", "cascade"} <= used or {"dense", "paged"} <= used
