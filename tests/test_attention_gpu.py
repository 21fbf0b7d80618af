"""FlashInfer (GPU) paths vs the torch reference. Run on the GPU host: pytest -m gpu tests/test_attention*.py"""
import pytest
import torch

from attn_util import flashinfer_available, make_step, rel_err
from granikv.attention import reference as R

pytestmark = pytest.mark.gpu


needs_fi = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")
MIXED = [{"lp_max": 64, "choice": "paged"}, {"meff_min": 64, "choice": "dense"}, {"choice": "cascade"}]
SHAPES = [(32, 8, 128), (20, 4, 128), (8, 8, 128)]


def _backend(name, hq, hkv, d, cuda_graph=False, decode_plan="flashinfer"):
    from types import SimpleNamespace

    from granikv.attention.decode import make_backend
    from granikv.attention.dispatch import Dispatcher

    disp = Dispatcher(hq, hkv, d, "test", MIXED) if name == "granikv" else None
    impl = "composed" if name == "cascade_composed" else "multilevel"
    name = "cascade" if name == "cascade_composed" else name
    return make_backend(SimpleNamespace(backend=name, dispatch="table", tensor_core_decode="auto",
                                        decode_plan=decode_plan), hq, hkv, d,
                        "cuda", torch.bfloat16, dispatcher=disp, cuda_graph=cuda_graph, cascade_impl=impl)


def _ref(q, k, v, batch):
    return R.paged_decode_ref(q.float(), k.float(), v.float(), batch.kv_indptr, batch.kv_indices)[0]


@needs_fi
@pytest.mark.parametrize("name", ["paged", "cascade", "cascade_composed", "dense", "hydragen", "granikv"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["one_class", "mixed"])
def test_backend_matches_reference(name, shape, layout):
    hq, hkv, d = shape
    if layout == "one_class":
        k, v, batch = make_step(1, hkv, d, [1000], [16], [True], dtype=torch.bfloat16, device="cuda")
    else:
        k, v, batch = make_step(2, hkv, d, [700, 33, 300, 90], [9, 2, 1, 20], [True, True, False, True],
                                n_noprefix=3, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
    be = _backend(name, hq, hkv, d)
    be.plan(batch)
    out = be.run(q, k, v)
    assert rel_err(out, _ref(q, k, v, batch)) <= 2e-2, be.last_decisions


def _capture(be, q, k, v):
    """``be.run`` warmed up on a side stream (JIT outside capture) and captured: (graph, output)."""
    from granikv.attention.bench import capture_graph
    return capture_graph(lambda: be.run(q, k, v))


@needs_fi
@pytest.mark.parametrize("name", ["paged", "cascade", "cascade_composed", "dense", "hydragen", "granikv"])
def test_cuda_graph_replay_after_replan(name):
    hq, hkv, d = 32, 8, 128
    k, v, batch = make_step(3, hkv, d, [512], [8], [True], dtype=torch.bfloat16, device="cuda")
    be = _backend(name, hq, hkv, d, cuda_graph=True)
    q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
    be.plan(batch)
    key = be.graph_key()
    g, out = _capture(be, q, k, v)
    # same structure, new data: one more suffix slot per request is NOT the same key in general,
    # so re-plan the same layout with fresh K/V and queries
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    q.copy_(torch.randn_like(q))
    be.plan(batch)
    assert be.graph_key() == key
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _ref(q, k, v, batch)) <= 2e-2


@needs_fi
@pytest.mark.parametrize("mode", ["cascade_only", "dense_only", "table"])
def test_cuda_graph_replay_after_replan_new_class_rows(mode):
    """A graph captured with two split-off classes replays correctly after a re-plan with the same
    graph_key but other rows in the classes (regression: two cascade classes' rows lived in a tensor
    re-allocated by every plan(), read by the captured graph at its old address)."""
    from granikv.attention.decode import DecodeAttention
    from granikv.attention.dispatch import Dispatcher
    from granikv.attention.policy import GranikvPolicy

    hq, hkv, d = 8, 2, 128
    table = [{"lp_min": 500, "choice": "dense"}, {"choice": "cascade"}]     # table: 700 dense, 300 cascade
    be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "test", table, mode=mode)), hq, hkv, d, device="cuda",
                         dtype=torch.bfloat16, cuda_graph=True)
    steps: dict = {}
    for seed in range(200):         # two layouts with one graph_key and different class rows
        k, v, batch = make_step(seed, hkv, d, [700, 300], [6, 6], [True, True], n_noprefix=4, max_suffix=1,
                                dtype=torch.bfloat16, device="cuda")
        be.plan(batch)
        got = steps.setdefault(be.graph_key(), {})
        got.setdefault(tuple(tuple(c.rows) for c in be._plan.classes), (k, v, batch))
        if len(got) == 2:
            break
    assert len(got) == 2, "no two layouts with one graph_key"
    (k, v, b1), (k2, v2, b2) = list(got.values())
    q = torch.randn(b1.batch_size, hq, d, device="cuda").bfloat16()
    be.plan(b1)
    g, out = _capture(be, q, k, v)
    k.copy_(k2)                       # the graph reads these buffers: the new step's data goes into them
    v.copy_(v2)
    q.copy_(torch.randn_like(q))
    be.plan(b2)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _ref(q, k, v, b2)) <= 2e-2, be.last_decisions


@needs_fi
def test_prefill_matches_reference():
    from granikv.attention.prefill import PrefillAttention

    hq, hkv, d = 32, 8, 128
    C = 4096
    k = torch.randn(C, hkv, d, device="cuda").bfloat16()
    v = torch.randn(C, hkv, d, device="cuda").bfloat16()
    perm = torch.randperm(C, device="cuda")
    qo = torch.tensor([0, 100, 101, 400], device="cuda")
    kvp = torch.tensor([0, 900, 1901, 2200], device="cuda")       # cached prefixes 800, 1000, 0
    kvi = perm[:2200]
    q = torch.randn(400, hq, d, device="cuda").bfloat16()
    pa = PrefillAttention(hq, hkv, d, "cuda", torch.bfloat16)
    pa.plan(qo, kvp, kvi)
    out = pa.run(q, k, v)
    ref, _ = R.prefill_ref(q.float(), k.float(), v.float(), qo, kvp, kvi)
    assert rel_err(out, ref) <= 2e-2


@needs_fi
def test_flashinfer_merge_and_lse_base_match_reference():
    from granikv.attention import flashinfer_ops as fo

    q = torch.randn(64, 32, 128, device="cuda").bfloat16()
    k = torch.randn(3000, 8, 128, device="cuda").bfloat16()
    v = torch.randn(3000, 8, 128, device="cuda").bfloat16()
    oa, la = fo.single_prefill(q, k[:1000], v[:1000], R.default_scale(128))
    ob, lb = fo.single_prefill(q, k[1000:], v[1000:], R.default_scale(128))
    ra, rla = R.attention_ref(q, k[:1000], v[:1000])
    assert (la - rla).abs().max() < 2e-2                 # base-2 LSE on both sides
    om, lm = fo.merge_state(oa, la, ob, lb)
    ro, rl = R.attention_ref(q.float(), k.float(), v.float())
    assert rel_err(om, ro) <= 2e-2 and (lm - rl).abs().max() < 2e-2
    fo.merge_state_in_place(oa, la, ob, lb)
    assert rel_err(oa, ro) <= 2e-2


@needs_fi
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_dense_kv_split_matches_reference(shape, splits):
    """FlashInfer's single prefill over interleaved KV chunks folded into heads, merged: == one attention."""
    from granikv.attention import flashinfer_ops as fo

    hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(splits)
    q = torch.randn(200, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(4096, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(4096, hkv, d, device="cuda", generator=g).bfloat16()
    o, lse = fo.single_prefill_split(q, k, v, d ** -0.5, splits)
    ro, rl = R.attention_ref(q.float(), k.float(), v.float(), d ** -0.5)
    assert rel_err(o.float(), ro) <= 2e-2
    assert torch.allclose(lse, rl, atol=2e-2, rtol=1e-3)


@needs_fi
@pytest.mark.parametrize("name", ["paged", "cascade", "dense", "hydragen", "granikv"])
def test_plan_does_not_wait_for_the_gpu(name):
    """plan() while a long kernel runs returns before it ends: no stream sync on the host (the
    engine's overlap schedule plans step t+1 while step t runs)."""
    import dataclasses
    import time

    hq, hkv, d = 32, 8, 128
    k, v, batch = make_step(5, hkv, d, [2000], [64], [True], dtype=torch.bfloat16, device="cuda")
    batch = dataclasses.replace(batch, kv_indptr_host=batch.kv_indptr.cpu())
    be = _backend(name, hq, hkv, d, cuda_graph=True)
    be.plan(batch)                      # builds the wrapper set
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)    # ~1 s of GPU time on the stream
    busy = torch.cuda.Event()
    busy.record()
    t0 = time.perf_counter()
    be.plan(batch)
    dt = time.perf_counter() - t0
    still_busy = not busy.query()
    torch.cuda.synchronize()
    assert still_busy and dt < 0.5, f"{name}: plan() took {dt:.3f} s and the sleep kernel had ended: it waited"


@needs_fi
@pytest.mark.parametrize("name", ["paged", "cascade_composed", "dense", "granikv"])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_fast_decode_plan_matches_reference_over_replans(name, cuda_graph):
    """decode_plan="fast" (FlashInfer's fast_decode_plan after the first plan, the SGLang plugin's
    setting): re-planned steps of one structure with new KV lengths and slots, eager and graph-mode
    wrappers, against the reference; and the fast path was taken where FlashInfer has it."""
    import flashinfer

    hq, hkv, d = 32, 8, 128
    be = _backend(name, hq, hkv, d, cuda_graph=cuda_graph, decode_plan="fast")
    if cuda_graph:
        be.rest_capacity = 1 << 15         # one shared rest buffer, so every step keys the same wrapper set
    plans = []
    for seed in range(4):                  # the same class layout, new suffix lengths and slots each step
        k, v, batch = make_step(10 + seed, hkv, d, [700], [24], [True], max_suffix=40, dtype=torch.bfloat16,
                                device="cuda")
        q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
        be.plan(batch)
        plans.append(be._gpu.current.decode_plan)
        assert rel_err(be.run(q, k, v), _ref(q, k, v, batch)) <= 2e-2, (name, cuda_graph, seed)
    if hasattr(flashinfer, "fast_decode_plan"):
        assert "fast" in plans, plans


@needs_fi
@pytest.mark.parametrize("mode", ["cascade_only", "dense_only", "table"])
@pytest.mark.parametrize("n_noprefix", [0, 3])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_grouped_classes_match_reference(mode, n_noprefix, cuda_graph):
    """Classes of consecutive rows (the engine's order): the cascade classes' rows are then one run
    of the batch, read and merged as one slice (no gather / scatter); with rows without a prefix
    first, the run starts past them. Eager and graph-replayed, against the reference."""
    from granikv.attention.decode import DecodeAttention
    from granikv.attention.dispatch import Dispatcher
    from granikv.attention.gpu_paths import cascade_span
    from granikv.attention.policy import GranikvPolicy

    hq, hkv, d = 32, 8, 128
    table = [{"lp_min": 500, "choice": "dense"}, {"choice": "cascade"}]
    k, v, batch = make_step(3, hkv, d, [700, 300, 520, 64], [5, 7, 4, 6], [True, True, True, True],
                            n_noprefix=n_noprefix, dtype=torch.bfloat16, device="cuda", grouped=True)
    q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
    be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "test", table, mode=mode)), hq, hkv, d, device="cuda",
                         dtype=torch.bfloat16, cuda_graph=cuda_graph)
    be.plan(batch)
    ws = be._gpu.current
    cas = [c for c in be._plan.split if c.choice == "cascade"]
    if mode == "cascade_only":
        assert ws.cas_span == (n_noprefix, batch.batch_size - n_noprefix) and ws.cas_rows is None
    assert ws.cas_span == cascade_span(cas)
    if cuda_graph:
        g, out = _capture(be, q, k, v)
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
    else:
        out = be.run(q, k, v)
    assert rel_err(out, _ref(q, k, v, batch)) <= 2e-2, be.last_decisions


@needs_fi
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cascade_prefill_schedule_kept_over_new_slots(cuda_graph, monkeypatch):
    """Re-plans of one per-class cascade shape (same class sizes and prefix lengths) with other prefix
    slots keep FlashInfer's prefill schedule and only hand over the new slot ids: every step still
    matches the reference, eager and graph-replayed, and the prefill was planned once."""
    from granikv.attention import flashinfer_ops as fo
    from granikv.attention.decode import DecodeAttention
    from granikv.attention.dispatch import Dispatcher
    from granikv.attention.policy import GranikvPolicy

    plans = []
    real_plan = fo.plan_prefill_paged
    monkeypatch.setattr(fo, "plan_prefill_paged", lambda *a, **kw: (plans.append(1), real_plan(*a, **kw))[1])
    hq, hkv, d = 32, 8, 128
    be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "test", [{"choice": "cascade"}])), hq, hkv, d,
                         device="cuda", dtype=torch.bfloat16, cuda_graph=cuda_graph)
    g = out = None
    for seed in range(3):            # COLD prefixes: other slot ids each seed, one shape
        k, v, batch = make_step(seed, hkv, d, [700, 300], [5, 7], [False, False], n_noprefix=2, max_suffix=1,
                                dtype=torch.bfloat16, device="cuda", grouped=True)
        if g is None:
            kb, vb = k, v
            q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
        else:
            kb.copy_(k)
            vb.copy_(v)
            q.copy_(torch.randn_like(q))
        be.plan(batch)
        if cuda_graph:
            if g is None:
                g, out = _capture(be, q, kb, vb)
            g.replay()
            torch.cuda.synchronize()
        else:
            out = be.run(q, kb, vb)
        assert rel_err(out, _ref(q, kb, vb, batch)) <= 2e-2, (seed, be.last_decisions)
    assert fo.keeps_prefill_schedule(be._gpu.current.prefill) and len(plans) == 1 and len(be._gpu.sets) == 1
