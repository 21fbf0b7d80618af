"""The dynamic HOT/COLD split (granikv.kv.dynamic_split, granikv.kv.split_policy): the pools' moving
ends, the grow / shrink rules, and a hypothesis state machine over a moving boundary with admissions,
evictions, locks and COLD allocations, checked after every step against state kept by the machine
itself (which slots it owns, which slabs it saw), not against the pools' own bookkeeping."""
from __future__ import annotations
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from granikv.kv import Admission, ColdPool, DynamicSplit, HotPool, KVCache, PrefixIndex, Slab, SplitPolicy


# ---------------------------------------------------------------------- the pools' moving ends
def test_hot_pool_grows_into_its_tail_extent_and_shrinks_only_over_free_rows():
    pool = HotPool(10)
    a = pool.alloc(6)
    assert pool.tail_free == 4 and pool.end == 10
    pool.grow(5)                                   # joins the free tail: one extent [6, 15)
    assert pool.capacity == 15 and pool.free_extents() == [(6, 9)] and pool.slabs == [a]
    b = pool.alloc(9)
    assert b == Slab(6, 9) and pool.tail_free == 0
    with pytest.raises(ValueError, match="only the last 0 slots"):
        pool.shrink(1)
    pool.grow(3)                                   # no free tail: a new extent at the end
    assert pool.free_extents() == [(15, 3)]
    pool.free(a)                                   # a hole in the middle is not the tail
    assert pool.tail_free == 3
    with pytest.raises(ValueError, match="free rows at its end"):
        pool.shrink(4)
    assert pool.capacity == 18 and pool.free_extents() == [(0, 6), (15, 3)]  # the refused shrink changed nothing
    pool.shrink(3)
    assert pool.capacity == 15 and pool.free_extents() == [(0, 6)] and pool.slabs == [b]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            pool.grow(bad)
        with pytest.raises(ValueError, match="positive int"):
            pool.shrink(bad)


def test_empty_hot_pool_grows_from_nothing():
    pool = HotPool(0)
    assert pool.alloc(1) is None and pool.tail_free == 0
    pool.grow(4)
    assert pool.alloc(4) == Slab(0, 4)


@pytest.mark.parametrize("checks", ["sync", "deferred", "off"])
def test_cold_pool_release_and_extend_low(checks):
    pool = ColdPool(10, offset=5, validate=checks, order="highest_first")
    ids = pool.alloc(3)
    assert ids.tolist() == [14, 13, 12]           # highest_first: the far end goes first
    assert pool.head_free(4) == 4 and pool.head_free(100) == 7
    pool.release_low(4)                           # rows 5..8 leave
    assert (pool.offset, pool.capacity, pool.free_tokens) == (9, 6, 3)
    assert sorted(pool._free_ids().tolist()) == [9, 10, 11]
    assert pool.owned_mask().tolist() == [False] * 3 + [True] * 3
    got = pool.alloc(3)
    assert sorted(got.tolist()) == [9, 10, 11] and pool.alloc(1) is None
    pool.free(torch.cat((ids, got)))
    pool.extend_low(2)                            # rows 7, 8 come back, handed out after the others
    assert (pool.offset, pool.capacity, pool.free_tokens) == (7, 8, 8)
    order = pool.alloc(8).tolist()
    assert sorted(order[:6]) == list(range(9, 15)) and order[6:] == [8, 7]
    pool.check()


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 200), unique=True, max_size=40), k=st.integers(0, 40),
       frees=st.lists(st.integers(1, 8), max_size=8))
def test_highest_first_pool_always_hands_out_its_highest_free_rows(ids, k, frees):
    """Whatever was freed in whatever order, the next ids handed out are the highest free ones."""
    pool = ColdPool(201, order="highest_first")
    held = pool.alloc(201)
    back = [held[200 - i] for i in ids]           # held is descending: held[200 - i] == i
    pool.free(torch.stack(back[:k]) if back[:k] else torch.empty(0, dtype=torch.int64))
    freed = sorted(ids[:k], reverse=True)
    for n in frees:
        got = pool.alloc(n)
        if got is None:
            assert n > len(freed)
            continue
        assert got.tolist() == freed[:n]
        freed = freed[n:]
        pool.free(got[::2].clone())               # some back, in any order
        freed = sorted(freed + got[::2].tolist(), reverse=True)
    assert pool.free_tokens == len(freed)


def test_cold_pool_refuses_to_release_a_row_in_use():
    pool = ColdPool(8, offset=2)                  # fifo: the lowest rows go first
    ids = pool.alloc(2)
    assert ids.tolist() == [2, 3] and pool.head_free(5) == 0
    with pytest.raises(ValueError, match="not all free"):
        pool.release_low(1)
    assert (pool.offset, pool.capacity, pool.free_tokens) == (2, 8, 6)
    pool.free(ids[:1])                            # row 2 free, row 3 still in use
    assert pool.head_free(5) == 1
    with pytest.raises(ValueError, match="not all free"):
        pool.release_low(2)
    pool.release_low(1)
    with pytest.raises(ValueError, match=r"in \[1, offset=3\]"):
        pool.extend_low(4)
    with pytest.raises(ValueError, match=r"in \[1, 7\]"):
        pool.release_low(8)
    with pytest.raises(ValueError, match="order"):
        ColdPool(4, order="random")


# ---------------------------------------------------------------------- the rules
POL = SplitPolicy(capacity=100, initial=20, hot_min=10, hot_max=50, watermark=5)


def test_grow_rule_takes_the_deficit_or_nothing():
    # need 12, 4 free at HOT's end: grow by 8
    assert POL.grow_by(12, boundary=20, hot_tail_free=4, cold_free=60, cold_head_free=30) == 8
    assert POL.grow_by(4, 20, 4, 60, 30) == 0        # nothing missing
    assert POL.grow_by(12, 43, 4, 60, 30) == 0       # 43 + 8 > hot_max
    assert POL.grow_by(12, 42, 4, 60, 30) == 8       # 42 + 8 == hot_max
    assert POL.grow_by(12, 20, 4, 60, 7) == 0        # a COLD row next to the boundary is in use
    assert POL.grow_by(12, 20, 4, 17, 30) == 0       # COLD would keep 9 < 2 x watermark
    assert POL.grow_by(12, 20, 4, 18, 30) == 8       # keeps exactly 10


def test_shrink_rule_restores_the_watermark_from_free_tail_rows_only():
    assert POL.shrink_by(need=0, boundary=30, hot_tail_free=10, cold_free=5) == 0    # at the watermark
    assert POL.shrink_by(0, 30, 10, 3) == 2
    assert POL.shrink_by(8, 30, 10, 6) == 7           # 8 + 5 - 6
    assert POL.shrink_by(8, 30, 4, 6) == 4            # only 4 rows free at HOT's end
    assert POL.shrink_by(8, 13, 10, 0) == 3           # down to hot_min, never below
    assert POL.shrink_by(8, 10, 10, 0) == 0
    assert POL.shrink_by(8, 30, 0, 0) == 0            # HOT's last row is in a slab: nothing moves


def test_policy_from_fractions_and_bad_bounds():
    p = SplitPolicy.from_fractions(1000, 0.2, 0.05, 0.6, 0.02)
    assert (p.initial, p.hot_min, p.hot_max, p.watermark, p.min_cold) == (200, 50, 600, 20, 400)
    with pytest.raises(ValueError, match="hot_min <= initial <= hot_max < capacity"):
        SplitPolicy(100, 20, 30, 50, 5)
    with pytest.raises(ValueError, match="hot_min <= initial <= hot_max < capacity"):
        SplitPolicy(100, 20, 0, 100, 5)
    with pytest.raises(ValueError, match="int >= 0"):
        SplitPolicy(100, 20, 0, 50, -1)


def _split(cap=40, hot=0.25, hot_min=2, hot_max=30, wm=2):
    kv = KVCache(1, cap, 1, 1, hot_fraction=hot, cold_order="highest_first")
    pol = SplitPolicy(cap, kv.hot_tokens, hot_min, hot_max, wm)
    return kv, DynamicSplit(kv, pol)


def test_split_moves_keep_every_row_in_one_pool_and_slabs_in_place():
    kv, sp = _split()                              # HOT [0, 10), COLD [10, 40)
    a = kv.hot_pool.alloc(8)
    assert sp.on_hot_miss(6)                      # 2 free at the end, grow by 4
    assert sp.boundary == kv.hot_tokens == 14 and kv.cold_pool.offset == 14
    b = kv.hot_pool.alloc(6)
    assert b == Slab(8, 6) and kv.hot_pool.slabs == [a, b]
    assert kv.hot_pool.capacity + kv.cold_pool.capacity == 40
    with pytest.raises(ValueError, match="free rows at its end"):
        sp.shrink(1)                               # [13, 14) is in slab b
    kv.hot_pool.free(b)
    sp.shrink(6)
    assert kv.hot_tokens == 8 and kv.cold_pool.offset == 8 and kv.cold_pool.free_tokens == 32
    assert kv.hot_view(0, 0, 8)[0].shape == (8, 1, 1)
    with pytest.raises(ValueError, match="outside the HOT region"):
        kv.hot_view(0, 8, 1)
    assert (sp.moves, sp.grown, sp.shrunk, sp.lowest, sp.highest) == (2, 4, 6, 8, 14)


def test_split_does_not_grow_over_a_cold_row_in_use():
    kv, sp = _split(cap=40, hot=0.25)
    ids = kv.cold_pool.alloc(30)                  # every COLD row, the one next to the boundary last
    kv.cold_pool.free(ids[:-1])
    assert int(ids[-1]) == 10
    assert not sp.on_hot_miss(4) and kv.hot_tokens == 10
    with pytest.raises(ValueError, match="not all free"):
        sp.grow(1)
    assert kv.hot_tokens == 10 and kv.hot_pool.capacity == 10 and kv.cold_pool.capacity == 30


def test_split_rejects_pools_that_do_not_tile_the_buffer():
    kv = KVCache(1, 40, 1, 1, hot_fraction=0.25)
    kv.cold_pool = ColdPool(29, offset=11)
    with pytest.raises(ValueError, match="tile the buffer"):
        DynamicSplit(kv, SplitPolicy(40, 10, 0, 20, 1))
    with pytest.raises(ValueError, match="outside the policy"):
        DynamicSplit(KVCache(1, 40, 1, 1, hot_fraction=0.25), SplitPolicy(40, 5, 0, 5, 1))


# ---------------------------------------------------------------------- state machine
CAP, HOT0, HOT_MIN, HOT_MAX, WM = 64, 12, 4, 44, 3
TOKENS = st.one_of(st.lists(st.integers(0, 1), min_size=1, max_size=14),
                   st.lists(st.integers(0, 5), min_size=1, max_size=14))


def _attached(n, root) -> bool:
    while n.parent is not None:
        n = n.parent
    return n is root


class SplitMachine(RuleBasedStateMachine):
    """Admissions through ``Admission(split=...)`` (grow on a HOT miss, shrink before a COLD
    fallback), requests' own COLD allocations after ``relieve`` (the scheduler's signal), raw
    ``grow`` / ``shrink`` of any size (refused over a row in use), evictions, locks and frees."""

    def __init__(self):
        super().__init__()
        self.kv = KVCache(1, CAP, 1, 1, hot_fraction=HOT0 / CAP, cold_order="highest_first")
        self.idx = PrefixIndex(self.kv.hot_pool, self.kv.cold_pool)
        self.split = DynamicSplit(self.kv, SplitPolicy(CAP, HOT0, HOT_MIN, HOT_MAX, WM))
        self.adm = Admission(self.idx, split=self.split)
        self.held = []          # locked nodes, one entry per lock
        self.own = []           # COLD allocations of running requests (not cached): [n] int64 each
        self.layout = {}        # token path -> slot of every cached token, after the last step

    # -------------------------------------------------------------- oracles from the machine's own state
    def _owned_cold(self) -> set[int]:
        cached = {int(x) for n in self.idx.nodes() if n.slab is None for x in n.slots}
        return cached | {int(x) for ids in self.own for x in ids}

    def _tail_free(self) -> int:
        """Free HOT rows at the boundary: from the slabs the cached nodes name."""
        ends = [n.slab.end for n in self.idx.nodes() if n.slab is not None]
        return self.kv.hot_tokens - max(ends, default=0)

    def _head_free(self) -> int:
        owned, b, n = self._owned_cold(), self.kv.hot_tokens, 0
        while b + n < CAP and b + n not in owned:
            n += 1
        return n

    def _pools(self):
        hot, cold = self.kv.hot_pool, self.kv.cold_pool
        return (hot.capacity, hot.free_extents(), hot.slabs, cold.offset, cold.capacity, cold.free_tokens,
                cold._free_ids().tolist())

    # -------------------------------------------------------------- rules
    @rule(tokens=TOKENS, extra=st.integers(0, 2), keep=st.booleans())
    def admit(self, tokens, extra, keep):
        m = self.idx.match(tokens)
        need = len(tokens) - m.length
        b0, free0 = self.kv.hot_tokens, self.kv.cold_pool.free_tokens
        fits = self.kv.hot_pool.largest_free_extent >= need
        tail, head = self._tail_free(), self._head_free()
        d = need - tail  # the policy, restated: grow by the deficit within hot_max, over free rows, keeping 2 x WM
        grow = d if need and not fits and d > 0 and b0 + d <= HOT_MAX and head >= d and free0 - d >= 2 * WM else 0
        p = self.adm.admit(tokens + [0] * extra, len(tokens))
        b1 = self.kv.hot_tokens
        if grow:  # the rules allow growth: HOT grows by the deficit and the new slab ends at the boundary
            assert p is not None and p.where == "hot", "HOT could grow but the prefix went elsewhere"
            assert b1 == b0 + grow and p.slab.end == b1
        elif need and fits:
            assert p.where == "hot" and b1 == b0
        else:
            assert b1 <= b0, "HOT grew although the rules forbid it"
        if p is not None:
            assert p.slots.numel() == len(tokens) and p.new_from == m.length
            if keep:
                self.held.append(p.node)
            else:
                self.idx.unlock(p.node)

    @rule(tokens=TOKENS)
    def insert_cold(self, tokens):
        ids = self.kv.cold_pool.alloc(len(tokens))
        if ids is None:
            return
        done = self.idx.insert(tokens, ids)
        if done:
            self.kv.cold_pool.free(ids[:done])

    @rule(n=st.integers(1, 24))
    def own_alloc(self, n):
        """A request's own slots: the scheduler's pressure signal, then the COLD allocation."""
        b0, free0, tail = self.kv.hot_tokens, self.kv.cold_pool.free_tokens, self._tail_free()
        want = max(0, min(n + WM - free0, tail, b0 - HOT_MIN))
        moved = self.split.relieve(n)
        assert moved == want and self.kv.hot_tokens == b0 - want
        assert self.kv.cold_pool.free_tokens == free0 + want
        ids = self.kv.cold_pool.alloc(n)
        assert (ids is None) == (free0 + want < n)
        if ids is not None:
            assert int(ids.min()) >= self.kv.hot_tokens
            self.own.append(ids)

    @precondition(lambda self: self.own)
    @rule(i=st.integers(0, 100))
    def own_free(self, i):
        self.kv.cold_pool.free(self.own.pop(i % len(self.own)))

    @rule(n=st.integers(1, 20))
    def raw_grow(self, n):
        b = self.kv.hot_tokens
        if b + n > HOT_MAX:
            return
        before, ok = self._pools(), self._head_free() >= n
        try:
            self.split.grow(n)
        except ValueError:
            assert not ok, "grow refused over free rows"
            assert self._pools() == before, "a refused grow changed the pools"
        else:
            assert ok, "grow moved the boundary over a COLD row in use"
            assert self.kv.hot_tokens == b + n

    @rule(n=st.integers(1, 20))
    def raw_shrink(self, n):
        b = self.kv.hot_tokens
        if b - n < HOT_MIN:
            return
        before, ok = self._pools(), self._tail_free() >= n
        try:
            self.split.shrink(n)
        except ValueError:
            assert not ok, "shrink refused over free rows"
            assert self._pools() == before, "a refused shrink changed the pools"
        else:
            assert ok, "shrink gave back a row of a slab"
            assert self.kv.hot_tokens == b - n

    @rule(n=st.integers(1, 30), pool=st.sampled_from(["hot", "cold"]))
    def evict(self, n, pool):
        self.idx.evict(n, pool=pool)

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        m = self.idx.match(tokens)
        if m.length:
            self.idx.lock(m.node)
            self.held.append(m.node)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.idx.unlock(self.held.pop(i % len(self.held)))

    # -------------------------------------------------------------- invariants
    def _walk(self):
        out, stack = {}, [((), self.idx.root)]
        while stack:
            path, node = stack.pop()
            for c in node.children.values():
                p = path + c.key
                for i, s in enumerate(c.slots.tolist()):
                    out[path + c.key[:i + 1]] = s
                stack.append((p, c))
        return out

    @invariant()
    def consistent(self):
        kv, idx = self.kv, self.idx
        hot, cold, b = kv.hot_pool, kv.cold_pool, kv.hot_tokens
        nodes = idx.nodes()
        # the boundary: one number, in the policy's bounds, every row in exactly one pool
        assert HOT_MIN <= b <= HOT_MAX
        assert hot.offset == 0 and hot.capacity == b and cold.offset == b and cold.capacity == CAP - b
        # no slot owned twice: cached slots and the running requests' own slots are all distinct
        owned = torch.cat([n.slots for n in nodes] + self.own + [torch.empty(0, dtype=torch.int64)])
        assert owned.numel() == owned.unique().numel(), "a slot is owned twice"
        # HOT: slabs and free extents tile [0, b); free + used = capacity
        slabs = hot.slabs
        tiles = sorted([(s.start, s.length) for s in slabs] + hot.free_extents())
        pos = 0
        for s, n in tiles:
            assert s == pos and n > 0, "HOT slabs and free extents overlap or leave a gap"
            pos += n
        assert pos == b
        assert hot.free_tokens + sum(s.length for s in slabs) == hot.capacity
        # slabs contiguous, below the boundary, covered exactly by their nodes
        for s in slabs:
            group = [n for n in nodes if n.slab == s]
            assert group, f"{s} is allocated but no node holds it"
            assert sorted(x for n in group for x in n.slots.tolist()) == list(range(s.start, s.end))
        for n in nodes:
            if n.slab is not None:
                first = int(n.slots[0])
                assert n.slots.tolist() == list(range(first, first + len(n))) and n.slab.end <= b
        # COLD: what is allocated is exactly what the machine owns; the free list holds the rest once
        mine = self._owned_cold()
        assert all(x >= b for x in mine), "a COLD slot lies in the HOT region"
        assert (cold.owned_mask().nonzero().flatten() + cold.offset).tolist() == sorted(mine)
        assert cold.free_tokens + len(mine) == cold.capacity, "COLD free + used != capacity"
        free = cold._free_ids().tolist()
        assert sorted(free) == sorted(set(range(b, CAP)) - mine), "the COLD free list lost or doubled a row"
        assert free == sorted(free, reverse=True), "COLD does not hand out its highest free rows first"
        # the whole buffer
        assert hot.free_tokens + hot.used_tokens + cold.free_tokens + cold.used_tokens == CAP
        # nothing locked evicted
        for h in self.held:
            assert _attached(h, idx.root), "a locked node was evicted"
        # no cached slab moved: a token cached before and after this step kept its slot
        layout = self._walk()
        moved = [p for p in layout.keys() & self.layout.keys() if layout[p] != self.layout[p]]
        assert not moved, f"cached tokens changed slots: {moved[:3]}"
        self.layout = layout


TestSplitMachine = SplitMachine.TestCase
TestSplitMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
