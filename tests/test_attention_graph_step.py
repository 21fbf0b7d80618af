"""granikv.attention.graph_step on the FlashInfer stand-in: the host plan of a captured decode step (a
permutation, per-row sources, fixed segment counts, paths the capture cannot hold moved) and ONE GraphStep
re-loaded for many random steps, each checked row by row against exact attention over the row's slots.
The stand-in's graph-mode wrappers read only their buffers and give NaN for rows a launch does not cover,
so a row merged from the wrong place fails."""
import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attn_util import FixedPolicy, fake_fi_module  # noqa: F401  (a fixture)
from granikv.attention import reference as R
from granikv.attention.graph_step import GraphLimits, GraphStep, capture_plan, plan_graph_step, shared_buffers
from granikv.attention.row_kernels import (GATHER_PROGRAMS_PER_SM, GATHER_ROWS, gather_programs, gather_q,
                                          gather_rows, merge_rows)

HQ, HKV, D = 4, 2, 8


_IDS = itertools.count()   # a prefix id names one prefix's slots for good, as the plugin's ids do


def _step(rng, lim, pool, table_w, hydragen=False):
    """A random step: classes (some HOT slabs aligned or not, some COLD), rows shuffled, pad rows; its slot
    table rows (prefix slots first, then private slots); returns ids, lens, hots, table, row lens, paths."""
    raw = rng.randint(1, lim.batch)
    k = rng.randint(0, 5)
    free = list(range(pool))
    slabs, paths, classes = [], {}, []
    addr = lim.dummy
    for _ in range(k):
        pid = next(_IDS)
        lp = rng.choice([4, 6, 8, 12])
        hot = not hydragen and rng.random() < 0.7
        if hot:
            addr = -(-addr // 4) * 4 + rng.choice([0, 0, 1])      # mostly aligned to fold 4
            start = addr
            addr += lp + rng.randint(0, 6)
            if addr > pool // 2:
                hot = False
        if hot:
            slots = list(range(start, start + lp))
        else:
            start = -1
            slots = rng.sample(range(pool // 2, pool), lp)
        paths[pid] = rng.choice(["hydragen"] if hydragen else ["dense", "dense", "cascade", "paged"])
        classes.append((pid, lp, start, slots))
    owner = [rng.randrange(-1, k) if k else -1 for _ in range(raw)]
    ids, lens, hots, rows = [], [], [], []
    table = torch.zeros(lim.batch + 3, table_w, dtype=torch.int32)
    for r, c in enumerate(owner):
        own = rng.sample(range(pool // 2, pool), rng.randint(1, 5))
        if c >= 0:
            pid, lp, start, slots = classes[c]
            ids.append(pid), lens.append(lp), hots.append(start)
            row = slots + own
        else:
            ids.append(-1), lens.append(0), hots.append(-1)
            row = own
        table[r + 3, :len(row)] = torch.tensor(row, dtype=torch.int32)
        rows.append(row)
    return ids, lens, hots, table, rows, paths


def _reference(q, k, v, rows, scale):
    out = torch.empty_like(q)
    for r, slots in enumerate(rows):
        idx = torch.tensor(slots)
        out[r:r + 1], _ = R.attention_ref(q[r:r + 1], k[idx], v[idx], scale)
    return out


def _rest_state(q, k, v, rows, skip, b, scale):
    """The rest decode's state: each real row over its slots past ``skip``, pad rows over one slot."""
    lists = [r[s:] for r, s in zip(rows, skip)] + [[0]] * (b - len(rows))
    ip = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).int()
    idx = torch.tensor([s for x in lists for s in x], dtype=torch.int32)
    return R.paged_decode_ref(q, k, v, ip, idx, scale)


def test_plan_is_a_permutation_with_each_launch_one_run_and_fixed_segment_counts():
    rng = random.Random(7)
    lim = GraphLimits(batch=12, folds=(1, 4), fold_min_len=8, groups=2, cascades=2, region_len=64, cascade_slots=24)
    for _ in range(200):
        ids, lens, hots, _, _, paths = _step(rng, lim, 96, 32)
        p = plan_graph_step(ids, lens, hots, lim, FixedPolicy(paths), group=HQ // HKV)
        assert sorted(p.perm) == list(range(12)) and all(p.perm[p.src[r]] == r for r in range(12))
        for i, hp in enumerate(p.dense):
            assert len(hp.qo_indptr) == lim.dense_segments + 1
            mine = [q for q in range(12) if p.kind[p.perm[q]] == i + 1]
            if mine:                                   # one run of qp, starting where its lead ends
                assert mine == list(range(mine[0], mine[-1] + 1))
                assert mine[0] == 0 or hp.qo_indptr[1] == mine[0]
        assert len(p.cas_qo) == lim.cascades + 2 and p.cas_kv[-1] <= lim.cascade_slots + lim.cascades + 1
        for c in p.classes:
            for r in c.rows:
                want = {"dense": None, "cascade": 3, "paged": 0}[c.choice]
                if want is not None:
                    assert p.kind[r] == want
                assert p.skip[r] == (0 if c.choice == "paged" else c.prefix_len)
            if c.choice == "dense":                    # only aligned HOT slabs inside the region are served dense
                f = lim.folds[p.kind[c.rows[0]] - 1]
                assert c.hot_start >= lim.dummy and c.hot_start % f == 0 and c.prefix_len % f == 0
            assert c.choice != "dense" or paths[c.prefix_id] == "dense"
        assert sum(1 for c in p.classes if c.choice == "cascade") <= lim.cascades


def test_a_class_the_capture_cannot_hold_moves_and_says_so():
    lim = GraphLimits(batch=8, folds=(1,), groups=1, cascades=1, region_len=64, cascade_slots=8)
    ids, lens, hots = [0, 0, 1, 1, 2, 2, 3, 3], [8] * 8, [8, 8, 16, 16, 24, 24, -1, -1]
    p = plan_graph_step(ids, lens, hots, lim, FixedPolicy({0: "dense", 1: "dense", 2: "dense", 3: "dense"}), 2)
    assert [c.choice for c in p.classes] == ["dense", "cascade", "paged", "paged"]
    assert p.kind == [1, 1, 2, 2, 0, 0, 0, 0] and p.skip == [8, 8, 8, 8, 0, 0, 0, 0]


@pytest.mark.parametrize("bad", [dict(batch=0), dict(batch=4, folds=(3,)), dict(batch=4, folds=(2, 2)),
                                 dict(batch=4, groups=0)])
def test_limits_name_the_bad_field(bad):
    with pytest.raises(ValueError, match="GraphLimits"):
        GraphLimits(**bad)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([(1,), (1, 4), (2,)]), st.booleans(), st.sampled_from([1, 3, 4]))
def test_one_graph_step_reloaded_for_many_steps_matches_exact_attention(fake_fi_module, seed, folds, hydragen,
                                                                         bucket):
    """ONE GraphStep (its buffers fixed, as a captured graph's), loaded with 8 random steps in turn: every real
    row of every step equals exact attention over its whole slot list, with each launch's last class planned
    over its rows rounded up to ``bucket`` (rows of other paths inside it are computed and left unread)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool, b = 96, 10
    lim = GraphLimits(batch=b, folds=folds, fold_min_len=8, groups=2, cascades=2,
                      region_len=64 if hydragen else pool // 2, cascade_slots=24, scratch=hydragen, row_bucket=bucket)
    k, v = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
    scale = 1 / math.sqrt(D)
    gs = GraphStep(lim, HQ, HKV, D, torch.float32, "cpu", scale, workspace=torch.empty(1))
    table = torch.zeros(b + 3, 40, dtype=torch.int32)
    gs.load(capture_plan(lim), table, torch.arange(3, b + 3))
    kept = 0
    for i in range(10):
        if i % 3 != 2:                  # every third step repeats the last one: the slot lists are kept
            ids, lens, hots, table, rows, paths = _step(rng, lim, pool, 40, hydragen)
        p = plan_graph_step(ids, lens, hots, lim, FixedPolicy(paths), group=HQ // HKV)
        before = gs.shared.get("key")
        gs.load(p, table, torch.arange(3, b + 3))
        kept += i % 3 == 2 and gs.shared["key"] == before
        q = torch.randn(b, HQ, D)
        o, lse = _rest_state(q, k, v, rows, p.skip, b, scale)
        gs.run(q, k, v, o, lse)
        want = _reference(q, k, v, rows, scale)
        torch.testing.assert_close(o[:len(rows)], want[:len(rows)], rtol=1e-4, atol=1e-4)
    assert kept == 3


def test_merge_rows_reads_only_the_named_source_row():
    """Rows past a source's covered rows hold NaN: a row that names another source stays finite."""
    torch.manual_seed(0)
    o, lse = torch.randn(5, 2, 4), torch.randn(5, 2)
    s0, l0 = torch.randn(5, 2, 4), torch.randn(5, 2)
    s1, l1 = torch.full((5, 2, 4), float("nan")), torch.full((5, 2), float("nan"))
    s1[1], l1[1] = torch.randn(2, 4), torch.randn(2)
    kind = torch.tensor([1, 2, 0, 1, 0], dtype=torch.int32)
    src = torch.tensor([4, 1, 2, 0, 3], dtype=torch.int32)
    want_o, want_l = o.clone(), lse.clone()
    for r, (kk, p) in enumerate(zip(kind.tolist(), src.tolist())):
        if kk:
            so, sl = (s0, l0) if kk == 1 else (s1, l1)
            want_o[r], want_l[r] = R.merge_state(o[r:r + 1], lse[r:r + 1], so[p:p + 1], sl[p:p + 1])
    merge_rows(o, lse, [s0, s1], [l0, l1], kind, src)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(lse, want_l)
    with pytest.raises(ValueError, match="1..4 sources"):
        merge_rows(o, lse, [], [], kind, src)


def test_a_folded_source_merges_its_sub_states_first():
    """A source of F sub-states per head (head f*H + j) is, for a row, the merge of its F states: the same as
    merging them one by one with the row's state."""
    torch.manual_seed(2)
    b, h, d = 4, 3, 5
    o, lse = torch.randn(b, h, d), torch.randn(b, h)
    so, sl = torch.randn(b, 2 * h, d), torch.randn(b, 2 * h)
    kind = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    src = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    got_o, got_l = o.clone(), lse.clone()
    merge_rows(got_o, got_l, [so], [sl], kind, src, folds=[2])
    want_o, want_l = o.clone(), lse.clone()
    for f in range(2):                                   # merging is associative: one sub-state at a time
        merge_rows(want_o, want_l, [so[:, f * h:(f + 1) * h].contiguous()], [sl[:, f * h:(f + 1) * h].contiguous()],
                   kind, src)
    torch.testing.assert_close(got_o, want_o)
    torch.testing.assert_close(got_l, want_l)
    assert torch.equal(got_o[1], o[1])                   # kind 0: untouched
    with pytest.raises(ValueError, match="folds"):
        merge_rows(got_o, got_l, [so], [sl], kind, src, folds=[2, 1])


def test_a_step_without_a_cascade_class_keeps_the_cascade_plan(fake_fi_module, monkeypatch):
    """Dense-only steps whose row counts change from step to step: the cascade launch covers no row, the same
    segments every such step, so its FlashInfer plan is made once (at the first such step) and kept; a cascade
    class re-plans."""
    from granikv.attention import graph_step as gsm

    calls = []
    real = gsm.fo.plan_prefill_paged
    monkeypatch.setattr(gsm.fo, "plan_prefill_paged", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    lim = GraphLimits(batch=8, folds=(1,), groups=2, cascades=2, region_len=64, cascade_slots=24)
    gs = GraphStep(lim, HQ, HKV, D, torch.float32, "cpu", 0.3, workspace=torch.empty(1))
    table = torch.zeros(9, 40, dtype=torch.int32)
    gs.load(capture_plan(lim), table, torch.arange(1, 9))
    assert len(calls) == 1
    for n in (3, 5, 8, 2):                                # a dense class of n rows, the rest without a prefix
        p = plan_graph_step([7] * n + [-1] * (8 - n), [8] * n + [0] * (8 - n), [8] * n + [-1] * (8 - n), lim,
                            FixedPolicy({7: "dense"}), HQ // HKV)
        assert p.cas_qo == [0] * (lim.cascades + 2) and p.split
        gs.load(p, table, torch.arange(1, 9))
    assert len(calls) == 2
    p = plan_graph_step([-1] * 8, [0] * 8, [-1] * 8, lim, FixedPolicy({}), HQ // HKV)   # nothing splits
    assert p.cas_qo == [0] * (lim.cascades + 2) and not p.split
    gs.load(p, table, torch.arange(1, 9))
    assert len(calls) == 2
    p = plan_graph_step([7] * 4 + [-1] * 4, [8] * 4 + [0] * 4, [-1] * 8, lim, FixedPolicy({7: "cascade"}), HQ // HKV)
    gs.load(p, table, torch.arange(1, 9))
    assert len(calls) == 3
    assert gs.live.tolist() == [1] and gs.meta.numel() == 4 * 8 + 2


def test_a_class_whose_rows_stay_inside_a_bucket_keeps_the_launch_plan(fake_fi_module, monkeypatch):
    """One dense class and one cascade class, their rows changing by one from step to step (requests joining
    and leaving): with row_bucket 4 each launch is re-planned only when its class crosses a multiple of 4,
    and each launch's last segment ends at the bucket (never past the batch); with row_bucket 1, every step."""
    from granikv.attention import graph_step as gsm

    def replans(bucket, sizes):
        dense, cas = [], []
        real_d, real_c = gsm.HotBatch.plan, gsm.fo.plan_prefill_paged
        monkeypatch.setattr(gsm.HotBatch, "plan", lambda self, hp: (dense.append(1), real_d(self, hp))[1])
        monkeypatch.setattr(gsm.fo, "plan_prefill_paged", lambda *a, **k: (cas.append(1), real_c(*a, **k))[1])
        lim = GraphLimits(batch=16, folds=(1,), groups=2, cascades=2, region_len=64, cascade_slots=24,
                          row_bucket=bucket)
        gs = GraphStep(lim, HQ, HKV, D, torch.float32, "cpu", 0.3, workspace=torch.empty(1))
        table = torch.zeros(17, 40, dtype=torch.int32)
        gs.load(capture_plan(lim), table, torch.arange(1, 17))
        dense.clear(), cas.clear()
        for nd, nc in sizes:
            ids = [7] * nd + [9] * nc + [-1] * (16 - nd - nc)
            lens = [8] * nd + [6] * nc + [0] * (16 - nd - nc)
            hots = [8] * nd + [-1] * (16 - nd)
            p = plan_graph_step(ids, lens, hots, lim, FixedPolicy({7: "dense", 9: "cascade"}), HQ // HKV)
            hp = p.dense[0]
            assert hp.qo_indptr[-1] == min(16, -(-nd // bucket) * bucket)              # the dense class, bucketed
            assert p.cas_qo[2] == min(16, nd + -(-nc // bucket) * bucket) and p.cas_qo[1] == nd
            gs.load(p, table, torch.arange(1, 17))
        return len(dense), len(cas)

    steps = [(5, 6), (6, 6), (7, 5), (8, 5), (7, 6), (9, 6), (8, 7)]
    assert replans(1, steps) == (7, 7)
    assert replans(4, steps) == (3, 7)        # dense: 8 rows, 12 at (9, 6), 8 again; the cascade's lead moves


def test_gather_q_permutes_and_repeats_the_heads():
    q = torch.randn(5, 3, 4)
    perm = torch.tensor([4, 0, 3, 1, 2], dtype=torch.int32)
    qp, qn = gather_q(q, perm, 4)
    assert torch.equal(qp, q[perm.long()]) and torch.equal(qn, q[perm.long()].repeat(1, 4, 1))
    qp1, qn1 = gather_q(q, perm, 1)
    assert qn1 is qp1 and torch.equal(qp1, qp)
    with pytest.raises(ValueError, match="fold"):
        gather_q(q, perm, 0)


def test_gather_rows_copies_only_the_counted_pairs():
    src = torch.arange(20.0).view(10, 2)
    dst = torch.full((6, 2), -1.0)
    gather_rows(dst, src, torch.tensor([5, 0, 3], dtype=torch.int32), torch.tensor([9, 2, 4], dtype=torch.int32),
                torch.tensor([2], dtype=torch.int32))
    assert dst[5].tolist() == [18.0, 19.0] and dst[0].tolist() == [4.0, 5.0] and (dst[3] == -1).all()


def test_gather_rows_grid_is_fixed_per_gpu_not_per_pair():
    """HydraGen's scratch holds 65,536 pairs: the launch is a few programs per SM whatever the capacity, and a
    small capacity gets no more programs than its tiles."""
    sms = 132
    assert gather_programs(sms, 65536) == GATHER_PROGRAMS_PER_SM * sms == gather_programs(sms, 1 << 20)
    assert gather_programs(sms, 40) == -(-40 // GATHER_ROWS)
    assert gather_programs(sms, 0) == 1


def test_a_new_prefix_with_the_last_steps_segment_lengths_gets_its_own_slots(fake_fi_module):
    """Two steps whose cascade segments have the same lengths but different prefixes: the second is served
    its own prefix slots (the kept slot lists are keyed by the prefix ids too)."""
    torch.manual_seed(3)
    b, pool = 4, 64
    lim = GraphLimits(batch=b, folds=(1,), groups=1, cascades=1, region_len=32, cascade_slots=16)
    k, v = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
    gs = GraphStep(lim, HQ, HKV, D, torch.float32, "cpu", 0.3, workspace=torch.empty(1))
    for pid, base in ((1, 40), (2, 50)):
        rows = [list(range(base, base + 8)) + [60 + r] for r in range(b)]
        table = torch.tensor([[0] * 9] + rows, dtype=torch.int32)
        p = plan_graph_step([pid] * b, [8] * b, [-1] * b, lim, FixedPolicy({pid: "cascade"}), HQ // HKV)
        gs.load(p, table, torch.arange(1, b + 1))
        q = torch.randn(b, HQ, D)
        o, lse = _rest_state(q, k, v, rows, p.skip, b, 0.3)
        gs.run(q, k, v, o, lse)
        torch.testing.assert_close(o, _reference(q, k, v, rows, 0.3), rtol=1e-4, atol=1e-4)


def test_a_plan_loaded_again_after_another_batch_size_rewrote_the_shared_buffers(fake_fi_module):
    """Two captured batch sizes share the cascade slot list. A's plan, loaded again after B's step, writes no
    step arrays (they are A's own and unchanged) but gets its shared slot list back: A's rows stay exact."""
    torch.manual_seed(5)
    pool, scale = 64, 0.3
    k, v = torch.randn(pool, HKV, D), torch.randn(pool, HKV, D)
    big = GraphLimits(batch=6, folds=(1,), groups=1, cascades=1, region_len=32, cascade_slots=16)
    sh = shared_buffers(big, HKV, D, torch.float32, "cpu")
    steps = {}
    for b, pid, base in ((4, 1, 40), (6, 2, 48)):
        lim = GraphLimits(batch=b, folds=(1,), groups=1, cascades=1, region_len=32, cascade_slots=16)
        gs = GraphStep(lim, HQ, HKV, D, torch.float32, "cpu", scale, workspace=torch.empty(1), shared=sh)
        rows = [list(range(base, base + 8)) + [60 + r % 4] for r in range(b)]
        table = torch.tensor([[0] * 9] + rows, dtype=torch.int32)
        p = plan_graph_step([pid] * b, [8] * b, [-1] * b, lim, FixedPolicy({pid: "cascade"}), HQ // HKV)
        steps[b] = (gs, p, rows, table)
    for b in (4, 6, 4):
        gs, p, rows, table = steps[b]
        writes = gs.staging.next
        gs.load(p, table, torch.arange(1, b + 1))
        q = torch.randn(b, HQ, D)
        o, lse = _rest_state(q, k, v, rows, p.skip, b, scale)
        gs.run(q, k, v, o, lse)
        torch.testing.assert_close(o, _reference(q, k, v, rows, scale), rtol=1e-4, atol=1e-4)
    assert gs.staging.next == writes                  # the last load of b=4 staged nothing new
