"""granikv.attention.graph_step on the GPU: ONE captured one-layer decode step (a FlashInfer rest decode over
the rows' suffixes, the dense launches, the cascade launch, the row merge) replayed over many random plans
(group counts 0 to the maximum, gaps between slabs, COLD prefixes, shuffled rows, pad rows) against exact
fp32 attention over each row's slots; the Triton row kernels against their torch math; and the pinned
staging under a copy held back by a slow kernel. Run on the GPU host:
pytest -m gpu tests/test_attention_graph_step_gpu.py"""
import itertools
import math
import random

import pytest
import torch

from attn_util import FixedPolicy, flashinfer_available
from granikv.attention import flashinfer_ops as fo
from granikv.attention import reference as R
from granikv.attention.bench import capture_graph
from granikv.attention.graph_step import GraphLimits, GraphStep, capture_plan, plan_graph_step
from granikv.attention.row_kernels import gather_q, gather_rows, merge_rows, merge_rows_ref
from granikv.attention.staging import PinnedStaging

pytestmark = pytest.mark.gpu
needs_fi = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HQ, HKV, D = 32, 8, 128
POOL, W = 24576, 4200


_IDS = itertools.count()   # a prefix id names one prefix's slots for good, as the plugin's ids do


def _step(rng, lim, hydragen):
    """A random step over a pool whose first half holds HOT slabs (aligned to 8, mostly) and whose second
    half holds COLD prefixes and private slots."""
    raw = rng.randint(1, lim.batch)
    k = rng.randint(0, lim.groups + 2)
    classes, addr = [], 8
    for _ in range(k):
        pid = next(_IDS)
        lp = rng.choice([64, 256, 1024, 2048, 4096])
        start = -1
        if not hydragen and rng.random() < 0.8 and addr + lp < POOL // 2:
            start = addr + rng.choice([0, 0, 0, 1])
            addr = -(-(start + lp + rng.randint(0, 300)) // 8) * 8
        slots = list(range(start, start + lp)) if start >= 0 else rng.sample(range(POOL // 2, POOL), lp)
        classes.append((pid, lp, start, slots, rng.choice(["hydragen"] if hydragen else ["dense", "dense", "cascade", "paged"])))
    ids, lens, hots, rows = [], [], [], []
    table = torch.zeros(lim.batch + 1, W, dtype=torch.int32)
    for r in range(raw):
        c = rng.randrange(-1, k) if k else -1
        own = rng.sample(range(POOL // 2, POOL), rng.randint(1, 40))
        if c >= 0:
            pid, lp, start, slots, _ = classes[c]
            ids.append(pid), lens.append(lp), hots.append(start)
            row = slots + own
        else:
            ids.append(-1), lens.append(0), hots.append(-1)
            row = own
        table[r + 1, :len(row)] = torch.tensor(row, dtype=torch.int32)
        rows.append(row)
    return ids, lens, hots, table, rows, {c[0]: c[4] for c in classes}


class RestDecode:
    """The rest decode as SGLang runs it under full graphs: a graph-mode FlashInfer decode wrapper whose index
    buffer holds each row's slots from its skip on (built on the device from the slot table)."""

    def __init__(self, b, dev):
        i32 = dict(dtype=torch.int32, device=dev)
        self.bufs = {"indptr": torch.zeros(b + 1, **i32), "indices": torch.zeros(b * W, **i32),
                     "last_page_len": torch.ones(b, **i32)}
        self.w = fo.make_decode_wrapper(fo.workspace(dev), True, self.bufs)
        self.b, self.dev = b, dev

    def plan(self, table_d, rows_n, skip, lens):
        b = self.b
        full = list(lens) + [1] * (b - len(lens))                   # pad rows: one slot (table row 0's first)
        rest = [n - s for n, s in zip(full, skip)]
        ip = torch.tensor([0] + rest).cumsum(0)
        tab_rows = torch.tensor(list(range(1, len(lens) + 1)) + [0] * (b - len(lens)))
        flat = torch.cat([tab_rows[i] * W + skip[i] + torch.arange(rest[i]) for i in range(b)])
        idx = table_d.view(-1)[flat.to(self.dev)]
        fo.plan_decode(self.w, ip.int(), idx, torch.ones(b, dtype=torch.int32), HQ, HKV, D, torch.bfloat16,
                       torch.bfloat16, 1 / math.sqrt(D))

    def run(self, q, k, v):
        return self.w.run(q, fo.paged(k, v), return_lse=True)


def _check(o, q, k, v, rows, scale, tol=2e-2):
    for r, slots in enumerate(rows):
        idx = torch.tensor(slots, device=q.device)
        ref, _ = R.attention_ref(q[r:r + 1].float(), k[idx].float(), v[idx].float(), scale)
        err = float((o[r:r + 1].float() - ref).norm() / ref.norm())
        assert err < tol, (r, err)


@needs_fi
@pytest.mark.parametrize("folds,hydragen,backend,bucket", [((1, 2), False, "fa3", 1), ((1,), False, "fa2", 1),
                                                            ((1, 2), True, "fa3", 1), ((1, 2), False, "fa3", 32),
                                                            ((1, 2), True, "fa3", 32)])
def test_one_captured_step_replays_any_plan(folds, hydragen, backend, bucket):
    """ONE capture of rest decode + GraphStep.run, then 30 random steps (outputs poisoned before each replay):
    every real row matches exact attention over its whole slot list; ``bucket``: each launch's last class
    planned over its rows rounded up (the plugin's row_bucket)."""
    rng = random.Random(11 + len(folds) + hydragen)
    dev = torch.device("cuda")
    b = 48
    torch.manual_seed(0)
    k = torch.randn(POOL, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(POOL, HKV, D, device=dev, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    lim = GraphLimits(batch=b, folds=folds, fold_min_len=2048, groups=3, cascades=3,
                      region_len=16384 if hydragen else POOL, cascade_slots=POOL, scratch=hydragen, row_bucket=bucket)
    gs = GraphStep(lim, HQ, HKV, D, torch.bfloat16, dev, scale, backend=backend)
    rest = RestDecode(b, dev)
    q = torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16)
    table_d = torch.zeros(b + 1, W, dtype=torch.int32, device=dev)
    rpi = torch.arange(1, b + 1, device=dev)

    def step():
        o, lse = rest.run(q, k, v)
        gs.run(q, k, v, o, lse)
        return o

    gs.load(capture_plan(lim), table_d, rpi)
    rest.plan(table_d, b, [0] * b, [1] * b)
    graph, out = capture_graph(step)
    paths_seen = set()
    for _ in range(30):
        ids, lens, hots, table, rows, paths = _step(rng, lim, hydragen)
        table_d.copy_(table.to(dev))
        p = plan_graph_step(ids, lens, hots, lim, FixedPolicy(paths), group=HQ // HKV)
        paths_seen.update(c.choice for c in p.classes)
        gs.load(p, table_d, rpi)
        rest.plan(table_d, b, p.skip, [len(r) for r in rows])
        q.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, q, k, v, rows, scale)
    assert paths_seen >= ({"hydragen"} if hydragen else {"dense", "cascade", "paged"})


@needs_cuda
def test_triton_row_kernels_match_their_torch_math():
    torch.manual_seed(1)
    dev = torch.device("cuda")
    b, h, d = 37, 32, 128
    o = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
    lse = torch.randn(b, h, device=dev)
    srcs = [torch.randn(b, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    lses = [torch.randn(b, h, device=dev) for _ in range(3)]
    kind = torch.randint(0, 4, (b,), device=dev, dtype=torch.int32)
    src = torch.randperm(b, device=dev).int()
    for s, l in zip(srcs, lses):          # rows no one reads: NaN must not leak
        s[src[kind == 0].long()] = float("nan")
        l[src[kind == 0].long()] = float("nan")
    o2, l2 = o.clone(), lse.clone()
    merge_rows(o, lse, srcs, lses, kind, src)
    merge_rows_ref(o2, l2, srcs, lses, kind, src)
    torch.testing.assert_close(o.float(), o2.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, l2, rtol=1e-4, atol=1e-4)
    # sources of KV-folded launches: F sub-states per head, merged in the same launch; a head count off a power
    # of two (masked lanes)
    for hh, folds in ((h, [1, 2, 1]), (5, [4, 1, 2])):
        o = torch.randn(b, hh, d, device=dev, dtype=torch.bfloat16)
        lse = torch.randn(b, hh, device=dev)
        fs = [torch.randn(b, f * hh, d, device=dev, dtype=torch.bfloat16) for f in folds]
        fl = [torch.randn(b, f * hh, device=dev) for f in folds]
        kind = torch.randint(0, len(folds) + 1, (b,), device=dev, dtype=torch.int32)
        o2, l2 = o.clone(), lse.clone()
        merge_rows(o, lse, fs, fl, kind, src, folds=folds)
        merge_rows_ref(o2, l2, fs, fl, kind, src, folds=folds)
        torch.testing.assert_close(o.float(), o2.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, l2, rtol=1e-4, atol=1e-4)
    q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(b, device=dev).int()
    want = q.index_select(0, perm.long())
    for live in (None, torch.ones(1, device=dev, dtype=torch.int32)):   # ungated, and gated by a live step
        qp, qn = gather_q(q, perm, 2, live)
        assert torch.equal(qp, want) and torch.equal(qn, want.repeat(1, 2, 1))
        qp, qn = gather_q(q, perm, 1, live)
        assert qn is qp and torch.equal(qp, want)
    kv = torch.randn(500, 8, 128, device=dev, dtype=torch.bfloat16)
    dst = torch.zeros(64, 8, 128, device=dev, dtype=torch.bfloat16)
    di = torch.randperm(64, device=dev).int()
    si = torch.randint(0, 500, (64,), device=dev, dtype=torch.int32)
    gather_rows(dst, kv, di, si, torch.tensor([40], device=dev, dtype=torch.int32))
    assert torch.equal(dst[di[:40].long()], kv[si[:40].long()]) and not dst[di[40:].long()].any()
    # HydraGen's capacity (65,536 pairs, a fixed grid striding over them): counts of none, one partial tile, many
    # tiles per program, all; a row wider than one column block (masked tail)
    for cap, rows, counts in ((65536, (8, 128), (0, 5, 20001, 65536)), (4096, (1, 1030), (4095,))):
        kv = torch.randn(70000, *rows, device=dev, dtype=torch.bfloat16)
        di = torch.randperm(cap, device=dev).int()
        si = torch.randint(0, kv.shape[0], (cap,), device=dev, dtype=torch.int32)
        for n in counts:
            dst = torch.zeros(cap, *rows, device=dev, dtype=torch.bfloat16)
            gather_rows(dst, kv, di, si, torch.tensor([n], device=dev, dtype=torch.int32))
            want = torch.zeros_like(dst).index_copy_(0, di[:n].long(), kv.index_select(0, si[:n].long()))
            assert torch.equal(dst, want), (cap, rows, n)


@needs_cuda
def test_pinned_staging_is_not_rewritten_while_its_copy_is_in_flight():
    """A slow kernel holds the stream: the first write's copy waits behind it. The third write reuses the first
    slot, so it must wait for that copy; the value the first copy delivered (cloned right after it, in stream
    order) is the first write's, not the third's."""
    dev = torch.device("cuda")
    st = PinnedStaging(4, dev, slots=2)
    dst = torch.zeros(4, dtype=torch.int32, device=dev)
    torch.cuda._sleep(200_000_000)                         # ~0.1 s of GPU time ahead of the copies
    st.write([1, 1, 1, 1], dst)
    first = dst.clone()                                    # enqueued after the first copy
    st.write([2, 2, 2, 2], dst)
    st.write([3, 3, 3, 3], dst)                            # slot 0 again: its copy may still be pending
    torch.cuda.synchronize()
    assert first.tolist() == [1, 1, 1, 1] and dst.tolist() == [3, 3, 3, 3]
    assert st.waits >= 1
