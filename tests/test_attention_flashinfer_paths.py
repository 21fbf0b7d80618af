"""The FlashInfer-path bookkeeping (gpu_paths.py) on CPU, against a FlashInfer stand-in that computes
with the reference: segments, buffers, CUDA-graph-mode re-planning, merges. (FlashInfer's own kernels
are checked by tests/test_attention_gpu.py on the GPU host.)"""
import sys

import pytest
import torch

import fake_flashinfer
from attn_util import make_step, rel_err
from granikv.attention import reference as R
from granikv.attention.decode import DecodeAttention
from granikv.attention.dispatch import Dispatcher
from granikv.attention.policy import GranikvPolicy, make_policy

MIXED = [{"lp_max": 8, "choice": "paged"}, {"meff_min": 12, "choice": "dense"}, {"choice": "cascade"}]
NAMES = ["paged", "cascade", "cascade_composed", "dense", "hydragen", "granikv"]


@pytest.fixture(autouse=True)
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())


def _make(name, hq, hkv, d, graph, splits=None, decode_plan="flashinfer"):
    kw = dict(device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer", dense_kv_splits=splits,
              decode_plan=decode_plan)
    if name == "granikv":
        return DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "t", MIXED)), hq, hkv, d, **kw)
    if name == "cascade_composed":   # SGLang-Cascade's split on the per-class cascade path
        return DecodeAttention(make_policy("cascade"), hq, hkv, d, cascade_impl="composed", **kw)
    return DecodeAttention(make_policy(name), hq, hkv, d, **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("splits,grouped", [(None, False), (4, False), (None, True)])
def test_flashinfer_path_bookkeeping(name, graph, splits, grouped):
    """Every backend's FlashInfer path equals the reference over class layouts and re-plans."""
    hq, hkv, d = 8, 2, 8
    layouts = [([100], [6], [True], 0), ([4, 100, 100, 60], [2, 1, 4, 5], [True, True, True, False], 2),
               ([30, 30], [3, 3], [True, False], 1), ([], [], [], 3), ([50], [2], [True], 0)]
    be = _make(name, hq, hkv, d, graph, splits)
    for seed, (lps, sizes, hot, nopfx) in enumerate(layouts):
        for rep in range(2):          # re-plan the same structure with new data (graph mode reuses buffers)
            k, v, batch = make_step(seed * 10 + rep, hkv, d, lps, sizes, hot, n_noprefix=nopfx, max_suffix=5,
                                    grouped=grouped)
            q = torch.randn(batch.batch_size, hq, d)
            be.plan(batch)
            out = be.run(q, k, v)
            ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
            assert rel_err(out, ref) <= 1e-5, (name, graph, seed, be.last_decisions)
            if name == "cascade_composed":
                assert be._gpu.current.cascade is None and not be._gpu.current.multilevel
    if graph:
        assert len(be._gpu.sets) >= 2         # one wrapper set per graph_key


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("graph", [False, True])
def test_fast_decode_plan_replans_every_path_exactly(name, graph):
    """decode_plan="fast": each decode wrapper's first plan is plan(), every later one FlashInfer's
    fast_decode_plan (which writes no graph-mode buffer: the stand-in fails if the indptr buffer was not
    written first, and its kernels read the buffers, so stale indices would show in the output)."""
    hq, hkv, d = 8, 2, 8
    be = _make(name, hq, hkv, d, graph, decode_plan="fast")
    fake_flashinfer.DECODE_WRAPPERS.clear()
    layouts = [([100], [6], [True], 0), ([4, 100, 100, 60], [2, 1, 4, 5], [True, True, True, False], 2),
               ([30, 30], [3, 3], [True, False], 1), ([], [], [], 3), ([50], [2], [True], 0)]
    for rep in range(3):
        for seed, (lps, sizes, hot, nopfx) in enumerate(layouts):
            k, v, batch = make_step(seed * 10 + rep, hkv, d, lps, sizes, hot, n_noprefix=nopfx, max_suffix=5)
            q = torch.randn(batch.batch_size, hq, d)
            be.plan(batch)
            ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
            assert rel_err(be.run(q, k, v), ref) <= 1e-5, (name, graph, seed, rep)
    wrappers = fake_flashinfer.DECODE_WRAPPERS
    if name == "cascade":          # the multilevel wrapper plans its own levels; decode-only steps still replan fast
        wrappers = [w for w in wrappers if sum(w.plans.values())]
    assert wrappers and all(w.plans["plan"] == 1 for w in wrappers), [w.plans for w in wrappers]
    assert sum(w.plans["fast"] for w in wrappers) > 0


def test_fast_decode_plan_falls_back_to_plan_without_it(monkeypatch):
    """A FlashInfer without fast_decode_plan: every step takes plan()."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module(fast_plan=False))
    be = DecodeAttention(make_policy("dense"), 8, 2, 8, device="cpu", dtype=torch.float32, impl="flashinfer",
                         decode_plan="fast")
    fake_flashinfer.DECODE_WRAPPERS.clear()
    for rep in range(3):
        k, v, batch = make_step(rep, 2, 8, [50], [4], [True], max_suffix=3)
        q = torch.randn(batch.batch_size, 8, 8)
        be.plan(batch)
        ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
        assert rel_err(be.run(q, k, v), ref) <= 1e-5
    assert [w.plans for w in fake_flashinfer.DECODE_WRAPPERS] == [{"plan": 3, "fast": 0}]
    assert be._gpu.current.decode_plan == "plan"


def test_default_decode_plan_never_takes_the_fast_path():
    be = DecodeAttention(make_policy("dense"), 8, 2, 8, device="cpu", dtype=torch.float32, impl="flashinfer")
    fake_flashinfer.DECODE_WRAPPERS.clear()
    for rep in range(2):
        k, v, batch = make_step(rep, 2, 8, [50], [4], [True], max_suffix=3)
        be.plan(batch)
    assert [w.plans for w in fake_flashinfer.DECODE_WRAPPERS] == [{"plan": 2, "fast": 0}]


def test_unknown_decode_plan_names_the_field():
    with pytest.raises(ValueError, match="decode_plan must be one of"):
        DecodeAttention(make_policy("dense"), 8, 2, 8, device="cpu", impl="flashinfer", decode_plan="quick")


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
    hq, hkv, d = 8, 2, 8
    if name == "granikv":
        table = [{"lp_min": 30, "choice": "dense"}, {"choice": "cascade"}]    # table: one dense, one cascade class
        be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "t", table, mode=mode)), hq, hkv, d, device="cpu",
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


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("graph", [False, True])
def test_decode_tensor_cores_follow_sglang_rule(name, graph):
    """SGLang's rule for every backend's decode wrappers: bf16 KV with Hq/Hkv >= 4 -> use_tensor_cores=True,
    Hq/Hkv = 2 -> False (baselines get SGLang's settings; regression guard for flashinfer_ops/gpu_paths)."""
    layouts = [([100], [6], [True], 0), ([4, 100, 100, 60], [2, 1, 4, 5], [True, True, True, False], 2),
               ([30, 30], [3, 3], [True, False], 1), ([], [], [], 3)]
    for hq, hkv, want in ((8, 2, True), (16, 2, True), (4, 2, False), (2, 2, False)):
        kw = dict(device="cpu", dtype=torch.bfloat16, cuda_graph=graph, impl="flashinfer")
        if name == "granikv":
            be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, 8, "t", MIXED)), hq, hkv, 8, **kw)
        elif name == "cascade_composed":
            be = DecodeAttention(make_policy("cascade"), hq, hkv, 8, cascade_impl="composed", **kw)
        else:
            be = DecodeAttention(make_policy(name), hq, hkv, 8, **kw)
        fake_flashinfer.DECODE_WRAPPERS.clear()
        for seed, (lps, sizes, hot, nopfx) in enumerate(layouts):
            be.plan(make_step(seed, hkv, 8, lps, sizes, hot, n_noprefix=nopfx, max_suffix=5)[2], graph=graph)
            be.plan(make_step(seed, hkv, 8, lps, sizes, hot, n_noprefix=nopfx, max_suffix=5)[2], graph=False)
        built = fake_flashinfer.DECODE_WRAPPERS
        assert built, (name, graph, "no decode wrapper built")
        assert all(w.use_tensor_cores is want for w in built), (name, graph, hq, hkv,
                                                                  [w.use_tensor_cores for w in built])


def _padded_class_step(seed, hkv, d, n_real, n_pad, lp=40, hot=True):
    """A step of ``n_real`` requests in one class plus ``n_pad`` CUDA-graph pad rows inside the class (the
    engine's padding): pad rows hold the prefix slots and one scratch slot; DecodeBatch.num_pad marks them."""
    from granikv.attention.batch import DecodeBatch

    k, v, b = make_step(seed, hkv, d, [lp], [n_real], [hot], max_suffix=4)
    ind, ptr = b.kv_indices.tolist(), b.kv_indptr.tolist()
    scratch = min(set(range(k.shape[0])) - set(ind))     # an unused slot (make_step leaves spare room)
    prefix = ind[:lp]
    for _ in range(n_pad):
        ind += prefix + [scratch]
        ptr.append(len(ind))
    bs = n_real + n_pad
    return k, v, DecodeBatch(torch.tensor(ptr), torch.tensor(ind), [lp] * bs, [b.prefix_ids[0]] * bs,
                             [b.hot_starts[0]] * bs, kv_indptr_host=torch.tensor(ptr), num_pad=n_pad)


@pytest.mark.parametrize("name", ["dense", "hydragen", "granikv", "cascade", "cascade_composed"])
def test_padded_single_class_full_cover(name):
    """Pad rows in the one class: the no-gather full-cover path (multilevel for cascade), class size =
    padded batch in graph_key(), and the real rows' outputs equal the reference."""
    hq, hkv, d = 8, 2, 8
    be = _make(name, hq, hkv, d, True)
    k, v, batch = _padded_class_step(3, hkv, d, 5, 3)
    be.plan(batch)
    ws = be._gpu.current
    assert ws.multilevel if name == "cascade" else ws.full_cover, be.last_decisions
    assert be.graph_key()[3][0][1] == 8
    q = torch.randn(8, hq, d)
    ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
    assert rel_err(be.run(q, k, v)[:5], ref[:5]) <= 1e-5


def test_pad_rows_do_not_change_the_decision_and_skip_a_paged_prefix():
    """granikv decides on real rows (num_pad excluded): 3 real rows + 5 pad rows with dense from B_class 4
    -> cascade, as unpadded; with a paged rule the pad rows skip the prefix (1-token rows, as SGLang pads)."""
    hq, hkv, d = 8, 2, 8
    rules = {"split": [{"meff_min": 4 * 4, "choice": "dense"}, {"choice": "cascade"}], "paged": [{"choice": "paged"}]}
    for rule, want in (("split", "cascade"), ("paged", "paged")):
        for graph in (False, True):
            be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "t", rules[rule])), hq, hkv, d, device="cpu",
                                 dtype=torch.float32, cuda_graph=graph, impl="flashinfer")
            k, v, batch = _padded_class_step(4, hkv, d, 3, 5)
            be.plan(batch)
            assert [c.choice for c in be._plan.classes] == [want]
            if rule == "paged":
                rest = be._plan.rest_indptr_host
                assert (rest[4:] - rest[3:-1]).tolist() == [1] * 5      # pad rows: the scratch slot only
            q = torch.randn(8, hq, d)
            ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
            assert rel_err(be.run(q, k, v)[:3], ref[:3]) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_plan_reads_host_indptr_without_device_copy(name):
    """With DecodeBatch.kv_indptr_host set (the engine sets it), plan() must not copy kv_indptr back to the
    host (a device->host sync every decode step on the GPU); results match the reference."""
    from torch.overrides import TorchFunctionMode

    hq, hkv, d = 8, 2, 8
    k, v, batch = make_step(7, hkv, d, [40, 20], [3, 2], [True, False], n_noprefix=2, max_suffix=4)
    batch.kv_indptr_host = batch.kv_indptr.clone()
    watched = batch.kv_indptr
    host_reads = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__,
                  torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__getitem__}
    hits = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in host_reads and args and args[0] is watched:
                if not (func is torch.Tensor.to and any(isinstance(a, torch.dtype) for a in args[1:])
                        and not any(isinstance(a, (str, torch.device)) for a in args[1:])):
                    hits.append(func.__name__)
            return func(*args, **(kwargs or {}))

    be = _make(name, hq, hkv, d, False)
    with Watch():
        be.plan(batch)
    assert not hits, f"plan() read kv_indptr back to the host via {hits}"
    q = torch.randn(batch.batch_size, hq, d)
    ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
    assert rel_err(be.run(q, k, v), ref) <= 1e-5


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (10, 2), (32, 8)])
@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_single_prefill_split_equals_reference(hq, hkv, splits):
    """Interleaved KV chunks folded into heads + merge_states == one attention over the whole slab."""
    from granikv.attention import flashinfer_ops as fo

    g = torch.Generator().manual_seed(hq * 100 + splits)
    n, lp, d = 7, 64, 16
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(lp, hkv, d, generator=g), torch.randn(lp, hkv, d, generator=g)
    o, lse = fo.single_prefill_split(q, k, v, 0.3, splits)
    ro, rl = R.attention_ref(q, k, v, 0.3)
    assert o.shape == (n, hq, d) and lse.shape == (n, hq)
    assert rel_err(o, ro) <= 1e-5 and torch.allclose(lse, rl, atol=1e-4)


def test_single_prefill_split_rejects_uneven_chunks():
    from granikv.attention import flashinfer_ops as fo

    with pytest.raises(ValueError, match="divisible"):
        fo.single_prefill_split(torch.randn(2, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8), 0.3, 4)


def test_dense_kv_splits_fills_the_sms():
    """FlashInfer's Hopper single prefill: ceil(rows/128) x Hq CTAs; the split fills 132 SMs' waves."""
    from granikv.attention.flashinfer_ops import dense_kv_splits

    assert dense_kv_splits(256, 32, 16384, 132) == 2        # 64 CTAs -> 128
    assert dense_kv_splits(32, 32, 16384, 132) == 4         # 32 -> 128
    assert dense_kv_splits(512, 32, 16384, 132) == 1        # 128 CTAs already
    assert dense_kv_splits(256, 20, 16384, 132) == 8        # Qwen-14B per TP=2 rank: 40 -> 320 (81%)
    assert dense_kv_splits(256, 32, 16384, 0) == 1          # CPU
    assert dense_kv_splits(8, 32, 256, 132) == 2            # chunks stay >= 128 keys
    assert dense_kv_splits(8, 32, 16383, 132) == 1          # odd Lp: no even split
    assert dense_kv_splits(8, 4, 1 << 20, 132) == 16        # capped at max_splits


def test_dense_kv_splits_setting_is_used_and_checked():
    be = _make("dense", 8, 2, 8, False, 4)
    k, v, batch = make_step(3, 2, 8, [64], [5], [True], max_suffix=3)
    be.plan(batch)
    assert be._gpu.current.kv_splits(5, 64) == 4 and be._gpu.current.kv_splits(5, 30) == 1
    with pytest.raises(ValueError, match="dense_kv_splits"):
        _make("dense", 8, 2, 8, False, 0)


def test_host_copies_on_cpu():
    from granikv.attention.batch import copy_from_host, to_device

    t = torch.arange(5)
    assert torch.equal(to_device(t, "cpu"), t)
    dst = torch.zeros(7, dtype=torch.int64)
    copy_from_host(dst[:5], t)
    assert dst.tolist() == [0, 1, 2, 3, 4, 0, 0]



def test_grouped_rows_take_the_slice_path():
    """Consecutive rows of a dense class are read and merged as slices (no gather): the segment says so."""
    be = _make("dense", 8, 2, 8, False)
    k, v, batch = make_step(4, 2, 8, [40, 60], [3, 4], [True, True], n_noprefix=2, grouped=True)
    be.plan(batch)
    spans = [seg.span for seg in be._gpu.current.segments]
    assert spans and all(sp is not None for sp in spans)
    out = be.run(torch.randn(batch.batch_size, 8, 8), k, v)
    assert out.shape == (batch.batch_size, 8, 8)
    assert all(c.row_start >= 0 for c in be._plan.classes)


def test_hydragen_graph_sets_share_one_scratch_and_release_frees_a_set():
    """Every graph-mode wrapper set of a HydraGen backend gathers into ONE scratch pair (a set per
    structure kept its own before: hundreds of multi-prefix structures pinned tens of GiB on the
    H200, OOM 2026-11-30); a longer prefix grows it to the next power of two; release_graph drops
    exactly the set of its key."""
    be = _make("hydragen", 8, 2, 8, True)
    keys, sets = [], []
    for seed, lps, sizes in ((1, [50, 30], [3, 2]), (2, [50, 30], [2, 2]), (3, [40], [4])):
        k, v, b = make_step(seed, 2, 8, lps, sizes, [False] * len(lps), max_suffix=3, grouped=True)
        be.plan(b)
        keys.append(be.graph_key())
        sets.append(be._gpu.current)
        q = torch.randn(b.batch_size, 8, 8)
        ref, _ = R.paged_decode_ref(q, k, v, b.kv_indptr, b.kv_indices)
        assert rel_err(be.run(q, k, v), ref) <= 1e-5    # sets sharing the scratch stay exact
    assert len(set(keys)) == 3 and len({id(s) for s in sets}) == 3
    ptrs = {s.scratch_k.data_ptr() for s in sets} | {s.scratch_v.data_ptr() for s in sets}
    assert len(ptrs) == 2                               # one K and one V scratch for all sets
    assert sets[0].scratch_k.shape[0] == 64             # max Lp 50 -> next power of two
    k, v, b = make_step(4, 2, 8, [100], [2], [False], max_suffix=3, grouped=True)
    be.plan(b)
    grown = be._gpu.current
    assert grown.scratch_k.shape[0] == 128 and grown.scratch_k.data_ptr() != sets[0].scratch_k.data_ptr()
    assert sets[0].scratch_k.shape[0] == 64             # older sets (captured graphs) keep their pair
    be.release_graph(keys[1])
    assert keys[1] not in be._gpu.sets and keys[0] in be._gpu.sets and keys[2] in be._gpu.sets


@pytest.mark.parametrize("kernel", ["cudnn", "fa2"])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_dense_kernel_takes_the_dense_call_only(kernel, graph, splits, monkeypatch):
    """dense_kernel=cudnn/fa2: the dense prefix call goes to sdpa_ops (== reference over layouts), HydraGen's
    and the cascade's calls stay FlashInfer's; an unknown kernel names the field."""
    from granikv.attention import sdpa_ops

    calls = []
    real = sdpa_ops.sdpa_prefill_split
    monkeypatch.setattr(sdpa_ops, "sdpa_prefill_split", lambda *a: calls.append(a[-1]) or real(*a))
    hq, hkv, d = 8, 2, 8
    for name, want in (("dense", True), ("hydragen", False), ("granikv", True)):
        calls.clear()
        kw = dict(device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer", dense_kv_splits=splits,
                  dense_kernel=kernel)
        pol = GranikvPolicy(Dispatcher(hq, hkv, d, "t", MIXED)) if name == "granikv" else make_policy(name)
        be = DecodeAttention(pol, hq, hkv, d, **kw)
        for seed, (lps, sizes, hot) in enumerate([([64], [6], [True]), ([4, 64, 64], [2, 4, 5], [True, True, False])]):
            k, v, batch = make_step(seed, hkv, d, lps, sizes, hot, max_suffix=5)
            q = torch.randn(batch.batch_size, hq, d)
            be.plan(batch)
            ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
            assert rel_err(be.run(q, k, v), ref) <= 1e-5, (name, be.last_decisions)
        assert bool(calls) == want and set(calls) <= {kernel}, name
    with pytest.raises(ValueError, match="dense_kernel"):
        DecodeAttention(make_policy("dense"), hq, hkv, d, device="cpu", impl="flashinfer", dense_kernel="triton")


@pytest.mark.parametrize("name,marks", [("dense", True), ("hydragen", True), ("cascade_composed", True),
                                        ("paged", False)])
def test_prefix_attention_is_marked_only_while_profiling(name, marks, monkeypatch):
    """Under torch.profiler each prefix-attention call runs inside a `prefix_attention` range (the split
    analysis.distance_to_limit reads); without a profiler no range is opened at all."""
    from torch.profiler import ProfilerActivity, profile

    hq, hkv, d = 8, 2, 8
    be = _make(name, hq, hkv, d, False)
    if name == "cascade_composed":   # the batch-global cascade splits only a prefix common to the whole batch
        k, v, batch = make_step(1, hkv, d, [64], [6], [True], max_suffix=5)
    else:
        k, v, batch = make_step(1, hkv, d, [4, 64, 64], [2, 4, 5], [True, True, False], max_suffix=5)
    q = torch.randn(batch.batch_size, hq, d)
    be.plan(batch)
    opened = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda n: opened.append(n) or real(n))
    be.run(q, k, v)
    assert opened == []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        be.run(q, k, v)
    names = {e.name for e in prof.events()}
    assert ("prefix_attention" in names) == marks, sorted(names)[:20]


def test_remember_absent_makes_a_missing_import_fail_at_once(monkeypatch):
    """An absent optional module is recorded in sys.modules as None: importing it then raises the same
    ModuleNotFoundError without a sys.path search; an installed module is left alone."""
    import importlib
    import sys

    from granikv.attention import flashinfer_ops as fo

    missing = "granikv_no_such_module_xyz"
    monkeypatch.delitem(sys.modules, missing, raising=False)
    assert fo.remember_absent((missing, "json")) == [missing]
    assert sys.modules[missing] is None and sys.modules["json"] is not None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(missing)
    calls = []

    class Recorder:                                     # the first finder the import system asks
        @staticmethod
        def find_spec(name, path=None, target=None):
            calls.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [Recorder, *sys.meta_path])
    with pytest.raises(ModuleNotFoundError):
        __import__(missing)
    assert calls == []                                  # recorded as absent: no finder asked
    assert fo.remember_absent((missing,)) == []         # already recorded
    del sys.modules[missing]                            # not recorded: every import searches again
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError):
            __import__(missing)
    assert calls == [missing, missing]


@pytest.mark.parametrize("graph", [False, True])
def test_cascade_prefill_schedule_is_kept_while_its_indptrs_stay(graph):
    """The per-class cascade prefill is planned once per (qo, kv) indptr shape: re-plans of the same shape
    with other prefix slots only hand the kernel the new ids (outputs still exact); a new shape plans."""
    hq, hkv, d = 8, 2, 8
    be = DecodeAttention(GranikvPolicy(Dispatcher(hq, hkv, d, "t", [{"choice": "cascade"}])), hq, hkv, d,
                         device="cpu", dtype=torch.float32, cuda_graph=graph, impl="flashinfer")
    for seed in range(3):            # COLD prefixes: new slot ids every seed, same class sizes and lengths
        k, v, batch = make_step(seed, hkv, d, [40, 24], [3, 2], [False, False], n_noprefix=1, max_suffix=1,
                                grouped=True)
        q = torch.randn(batch.batch_size, hq, d)
        be.plan(batch)
        assert rel_err(be.run(q, k, v), R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)[0]) <= 1e-4
    prefill = be._gpu.current.prefill
    assert prefill.plans == 1 and len(be._gpu.sets) == 1          # graph mode: one key, one wrapper set
    k, v, batch = make_step(9, hkv, d, [40, 24], [2, 3], [False, False], n_noprefix=1, max_suffix=1, grouped=True)
    q = torch.randn(batch.batch_size, hq, d)
    be.plan(batch)
    assert rel_err(be.run(q, k, v), R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)[0]) <= 1e-4
    if not graph:                    # graph mode: another class size is another graph key, another set
        assert prefill.plans == 2
