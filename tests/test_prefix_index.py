"""Prefix index and admission: unit tests, and a hypothesis state machine checked after every step."""
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from granikv.kv import Admission, KVCache, PrefixIndex


def make(capacity=100, hot_fraction=0.3):
    kv = KVCache(1, capacity, 1, 2, hot_fraction=hot_fraction)
    return kv, PrefixIndex(kv.hot_pool, kv.cold_pool)


def test_match_insert_split_and_hot_runs():
    kv, idx = make()
    ids = kv.cold_pool.alloc(5)
    assert idx.insert([1, 2, 3, 4, 5], ids) == 0
    m = idx.match([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == ids[:3].tolist() and m.hot_runs == []
    slab = kv.hot_pool.alloc(4)
    idx.insert([7, 7, 8, 8], torch.arange(slab.start, slab.end), slab=slab)
    m = idx.match([7, 7, 8, 8, 1])
    assert m.length == 4 and m.hot_runs == [(0, slab.start, 4)]
    m = idx.match([7, 7, 5])  # splits the HOT node; the run is still contiguous
    assert m.length == 2 and m.hot_runs == [(0, slab.start, 2)]
    assert idx.match([7, 7, 8, 8]).hot_runs == [(0, slab.start, 4)]


def test_insert_returns_cached_overlap_and_rejects_missing_slots():
    kv, idx = make()
    a = kv.cold_pool.alloc(3)
    idx.insert([1, 2, 3], a)
    b = kv.cold_pool.alloc(4)
    assert idx.insert([1, 2, 3, 4], b) == 3  # caller still owns b[:3]
    assert idx.match([1, 2, 3, 4]).slots.tolist() == a.tolist() + [b[3].item()]
    with pytest.raises(ValueError, match="slots is required"):
        idx.insert([5], None)
    with pytest.raises(ValueError, match="one id per token"):
        idx.insert([5, 6], torch.tensor([1]))
    slab = kv.hot_pool.alloc(2)
    with pytest.raises(ValueError, match="not inside"):
        idx.insert([9, 9], torch.tensor([slab.start, slab.end]), slab=slab)


def test_lock_protects_and_evict_is_lru_to_the_right_pool():
    kv, idx = make(capacity=100, hot_fraction=0.3)
    a, b = kv.cold_pool.alloc(5), kv.cold_pool.alloc(5)
    idx.insert([1] * 5, a)
    idx.insert([2] * 5, b)
    m = idx.match([1] * 5)
    idx.lock(m.node)
    free0 = kv.cold_pool.free_tokens
    assert idx.evict(100) == 5  # only the unlocked one goes
    assert kv.cold_pool.free_tokens == free0 + 5
    assert idx.match([1] * 5).length == 5 and idx.match([2] * 5).length == 0
    idx.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        idx.unlock(m.node)
    assert idx.evict(1) == 5 and kv.cold_pool.free_tokens == kv.cold_pool.capacity


def test_hot_slab_freed_only_whole():
    kv, idx = make(capacity=100, hot_fraction=0.3)
    slab = kv.hot_pool.alloc(6)
    idx.insert([5, 5, 5, 6, 6, 6], torch.arange(slab.start, slab.end), slab=slab)
    m = idx.match([5, 5, 5, 0])  # split: two nodes share the slab
    cold = kv.cold_pool.alloc(2)
    idx.insert([5, 5, 5, 0, 0], torch.cat((m.slots, cold)))  # a COLD branch under the slab
    held = idx.match([5, 5, 5, 0, 0]).node
    idx.lock(held)
    assert idx.evict(100) == 0  # the slab's upper node is pinned through the branch
    assert kv.hot_pool.used_tokens == 6
    idx.unlock(held)
    assert idx.evict(1) >= 2  # LRU: first the cold leaf ...
    idx.evict(100)
    assert kv.hot_pool.used_tokens == 0 and kv.hot_pool.largest_free_extent == kv.hot_pool.capacity
    assert idx.nodes() == []


def test_admission_hot_first_then_cold_then_hit():
    kv, idx = make(capacity=100, hot_fraction=0.3)  # HOT = 30 slots
    adm = Admission(idx)
    p1 = adm.admit(list(range(20)) + [99], 20)
    assert p1.where == "hot" and p1.new_from == 0 and p1.slab.length == 20
    p2 = adm.admit(list(range(100, 120)), 20)  # 10 HOT slots left: no fit -> COLD
    assert p2.where == "cold" and int(p2.slots.min()) >= kv.hot_tokens
    p3 = adm.admit(list(range(20)) + [7], 20)
    assert p3.where == "hit" and p3.slots.tolist() == p1.slots.tolist() and p3.new_from == 20
    assert adm.counts == {"hot": 1, "cold": 1, "hit": 1}
    assert [w for _, w, _ in adm.log] == ["hot", "cold", "hit"]
    # no demotion: the HOT prefix stays where it was while cached
    assert idx.match(list(range(20))).hot_runs == [(0, p1.slab.start, 20)]
    with pytest.raises(ValueError, match="shared_len"):
        adm.admit([1, 2], 3)


def test_admission_evicts_unlocked_to_make_room_and_gives_none_when_full():
    kv, idx = make(capacity=40, hot_fraction=0.0)  # paged baseline: everything COLD
    adm = Admission(idx)
    p = adm.admit(list(range(30)), 30)
    assert p.where == "cold"
    assert adm.admit(list(range(100, 120)), 20) is None  # locked prefix cannot be evicted
    idx.unlock(p.node)
    q = adm.admit(list(range(100, 120)), 20)
    assert q is not None and q.where == "cold"
    assert idx.match(list(range(30))).length < 30  # the LRU prefix was evicted for room


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class IndexMachine(RuleBasedStateMachine):
    """Random alloc/insert/match/lock/unlock/evict/admit; checked against a dict reference."""

    def __init__(self):
        super().__init__()
        self.kv, self.idx = make(capacity=60, hot_fraction=0.4)
        self.adm = Admission(self.idx)
        self.ref: dict[tuple, int] = {}  # token prefix -> slot of its last token
        self.held = []  # locked nodes
        evict, evict_hot = self.idx.evict, self.idx.evict_hot_extent

        def evict_and_forget(*args, **kwargs):  # Admission evicts too: forget freed entries before their slots are reused
            freed = evict(*args, **kwargs)
            self._drop_freed()
            return freed

        def evict_hot_and_forget(length):
            freed = evict_hot(length)
            self._drop_freed()
            return freed

        self.idx.evict = evict_and_forget
        self.idx.evict_hot_extent = evict_hot_and_forget

    def _record(self, tokens, slots, start):
        for i in range(start, len(tokens)):
            self.ref[tuple(tokens[: i + 1])] = int(slots[i])

    def _drop_freed(self):
        cold_owned = self.kv.cold_pool.owned_mask()
        live = {(s.start, s.end) for s in self.kv.hot_pool.slabs}
        def alive(slot):
            if slot >= self.kv.hot_tokens:
                return bool(cold_owned[slot - self.kv.hot_tokens])
            return any(a <= slot < b for a, b in live)
        self.ref = {k: v for k, v in self.ref.items() if alive(v)}

    @rule(tokens=TOKENS)
    def insert_cold(self, tokens):
        ids = self.kv.cold_pool.alloc(len(tokens))
        if ids is None:
            return
        done = self.idx.insert(tokens, ids)
        if done:
            self.kv.cold_pool.free(ids[:done])
        self._record(tokens, self.idx.match(tokens).slots, done)

    @rule(tokens=TOKENS, extra=st.integers(0, 3))
    def admit(self, tokens, extra):
        before = self.idx.match(tokens).length
        p = self.adm.admit(tokens + [0] * extra, len(tokens))
        if p is None:
            return
        self.held.append(p.node)
        assert p.new_from == before and p.slots.numel() == len(tokens)
        self._record(tokens, p.slots, p.new_from)

    @rule(tokens=TOKENS)
    def match(self, tokens):
        m = self.idx.match(tokens)
        n = 0
        while n < len(tokens) and tuple(tokens[: n + 1]) in self.ref:
            n += 1
        assert m.length == n
        assert m.slots.tolist() == [self.ref[tuple(tokens[: i + 1])] for i in range(n)]

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

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        self.idx.evict(n)
        self._drop_freed()

    @invariant()
    def pools_consistent(self):
        nodes = self.idx.nodes()
        slots = torch.cat([nd.slots for nd in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
        assert slots.numel() == slots.unique().numel(), "a slot is owned twice"
        cold = self.kv.cold_pool
        assert cold.free_tokens + cold.used_tokens == cold.capacity
        cold_slots = slots[slots >= self.kv.hot_tokens]
        owned = cold.owned_mask().nonzero().flatten() + cold.offset
        assert sorted(cold_slots.tolist()) == owned.tolist(), "COLD slots leaked or freed while cached"
        hot = self.kv.hot_pool
        slabs = hot.slabs
        assert hot.free_tokens + sum(s.length for s in slabs) == hot.capacity
        for a, b in zip(slabs, slabs[1:]):
            assert a.end <= b.start, "HOT slabs overlap"
        for s in slabs:  # each live slab is exactly covered by its nodes
            covered = sorted(x for nd in nodes if nd.slab == s for x in nd.slots.tolist())
            assert covered == list(range(s.start, s.end))
        for nd in self.held:  # locked nodes are never evicted
            x = nd
            while x.parent is not None:
                x = x.parent
            assert x is self.idx.root, "a locked node was evicted"


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_admission_cold_fallback_evicts_from_cold_only():
    kv, idx = make(capacity=100, hot_fraction=0.3)  # HOT 30, COLD 70
    adm = Admission(idx)
    hot = adm.admit(list(range(20)), 20)  # the LRU entry: a HOT slab
    cold = adm.admit(list(range(100, 160)), 60)  # 10 HOT left and the slab is locked: COLD
    assert (hot.where, cold.where) == ("hot", "cold")
    idx.unlock(hot.node)
    idx.unlock(cold.node)
    # 35 tokens fit no HOT window (HOT is 30): COLD, where 10 are free. The COLD prefix is evicted;
    # the older HOT slab (first in LRU order, but it frees no COLD slot) stays cached
    p = adm.admit(list(range(200, 235)), 35)
    assert p is not None and p.where == "cold"
    assert kv.hot_pool.used_tokens == 20 and idx.match(list(range(20))).length == 20
    assert idx.match(list(range(100, 160))).length == 0 and idx.evicted_tokens == 60
