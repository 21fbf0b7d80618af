"""Eviction that frees the pool its caller needs: ``evict(n, pool=...)`` for COLD room, and HOT
admission that evicts stale unlocked slabs (whole, never moved) to make a contiguous extent.
Unit tests, a scheduler-level and an engine-level check, and a hypothesis state machine with
independent oracles (which units may go, LRU order, the window chosen, all or nothing)."""
from __future__ import annotations
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from granikv.kv import Admission, KVCache, PrefixIndex


def make(capacity=100, hot_fraction=0.3):
    kv = KVCache(1, capacity, 1, 2, hot_fraction=hot_fraction)
    return kv, PrefixIndex(kv.hot_pool, kv.cold_pool)


def toks(start, n):
    return list(range(start, start + n))


# ---------------------------------------------------------------------- HOT admission
def test_hot_admission_evicts_a_stale_slab_instead_of_falling_to_cold():
    kv, idx = make(100, 0.3)  # HOT 30
    adm = Admission(idx)
    a = adm.admit(toks(0, 20), 20)
    idx.unlock(a.node)  # its request finished: the slab is stale
    b = adm.admit(toks(100, 20), 20)  # 10 HOT slots free: only evicting the stale slab makes room
    assert b.where == "hot" and b.slab.start == 0
    assert idx.match(toks(0, 20)).length == 0 and idx.evicted_tokens == 20
    assert adm.counts == {"hot": 2} and kv.cold_pool.used_tokens == 0


def test_hot_admission_never_evicts_a_locked_or_live_slab():
    kv, idx = make(100, 0.3)
    adm = Admission(idx)
    a = adm.admit(toks(0, 20), 20)
    ext = adm.admit(toks(0, 20) + [7, 7], 22)  # a live extension: pins a's slab through its path
    idx.unlock(a.node)
    assert ext.where == "hot" and ext.slab.start == 20
    b = adm.admit(toks(100, 20), 20)
    assert b.where == "cold" and idx.evicted_tokens == 0
    assert idx.match(toks(0, 20)).hot_runs == [(0, a.slab.start, 20)]  # not moved, not demoted
    idx.unlock(ext.node)
    c = adm.admit(toks(200, 20), 20)  # now stale: it goes whole (with what is cached below it)
    assert c.where == "hot" and c.slab.start == a.slab.start and idx.match(toks(0, 20)).length == 0


def test_hot_window_is_the_least_recently_used_one_and_only_it_goes():
    kv, idx = make(200, 0.3)  # HOT 60
    adm = Admission(idx)
    a, b, c = (adm.admit(toks(s, 20), 20) for s in (0, 100, 200))  # slabs at 0, 20, 40
    assert [p.slab.start for p in (a, b, c)] == [0, 20, 40]
    for p in (a, b, c):
        idx.unlock(p.node)
    idx.match(toks(0, 20))  # a is now the most recently used; LRU order: b, c, a
    d = adm.admit(toks(300, 20), 20)
    assert d.where == "hot" and d.slab.start == 20  # only b went
    assert idx.match(toks(0, 20)).length == 20 and idx.match(toks(200, 20)).length == 20
    idx.unlock(d.node)
    idx.match(toks(0, 20))  # LRU: c, d, a
    e = adm.admit(toks(400, 40), 40)  # windows: a+d (newest a) or d+c (newest d): d and c go
    assert e.where == "hot" and e.slab.start == 20 and idx.match(toks(0, 20)).length == 20
    assert idx.match(toks(200, 20)).length == 0 and idx.match(toks(300, 20)).length == 0


def test_hot_eviction_does_nothing_when_no_window_can_hold_the_prefix():
    kv, idx = make(200, 0.3)  # HOT 60: slabs at 0, 20, 40
    adm = Admission(idx)
    a, b, c = (adm.admit(toks(s, 20), 20) for s in (0, 100, 200))
    idx.unlock(a.node)
    idx.unlock(c.node)  # b (the middle) stays locked: the largest window is 20
    p = adm.admit(toks(300, 30), 30)
    assert p.where == "cold" and idx.evicted_tokens == 0
    assert idx.evict_hot_extent(30) == 0 and idx.evict_hot_extent(61) == 0
    assert idx.match(toks(0, 20)).length == 20 and idx.match(toks(200, 20)).length == 20
    assert idx.evict_hot_extent(20) == 20  # a 20-slot window exists: the older stale slab goes
    assert idx.match(toks(0, 20)).length == 0 and idx.match(toks(200, 20)).length == 20
    idx.unlock(b.node)


def test_hot_eviction_takes_the_subtree_below_the_slab():
    kv, idx = make(100, 0.3)
    adm = Admission(idx)
    a = adm.admit(toks(0, 20), 20)
    ids = kv.cold_pool.alloc(25)
    idx.insert(toks(0, 20) + [5] * 5, torch.cat((a.slots, ids[20:])))  # a COLD branch below the slab
    kv.cold_pool.free(ids[:20])  # the caller's duplicates of the cached part
    idx.unlock(a.node)
    assert kv.cold_pool.used_tokens == 5
    b = adm.admit(toks(100, 25), 25)
    assert b.where == "hot" and kv.cold_pool.used_tokens == 0 and idx.evicted_tokens == 25
    assert [n.slab for n in idx.nodes()] == [b.slab]


# ---------------------------------------------------------------------- COLD room
def test_cold_eviction_skips_hot_slabs():
    kv, idx = make(100, 0.3)
    adm = Admission(idx)
    a = adm.admit(toks(0, 20), 20)  # HOT, the least recently used
    c = adm.admit(toks(100, 40), 40)  # too long for the 10 HOT slots left: COLD
    idx.unlock(a.node)
    idx.unlock(c.node)
    assert idx.evict(5, pool="cold") == 40  # the COLD prefix (whole node), not the older HOT slab
    assert kv.hot_pool.used_tokens == 20 and idx.match(toks(0, 20)).length == 20
    assert idx.evict(5, pool="cold") == 0  # nothing COLD left: nothing goes
    assert idx.evict(1, pool="hot") == 20 and idx.nodes() == []
    with pytest.raises(ValueError, match="pool must be"):
        idx.evict(1, pool="HOT")


def test_cold_eviction_reaches_a_cold_prefix_below_a_hot_extension():
    kv, idx = make(100, 0.3)
    adm = Admission(idx)
    x = adm.admit(toks(0, 40), 40)  # COLD (HOT holds 30)
    y = adm.admit(toks(0, 40) + toks(50, 10), 50)  # its extension: a HOT slab below the COLD node
    assert (x.where, y.where) == ("cold", "hot")
    z = adm.admit(toks(100, 25), 25)  # a newer COLD leaf
    for p in (x, y, z):
        idx.unlock(p.node)
    idx.match(toks(100, 25))  # z most recently used, still it goes first: it is a COLD leaf
    assert idx.evict(10, pool="cold") == 25 and kv.hot_pool.used_tokens == 10
    # no COLD leaf left: x goes with the HOT extension cached below it
    assert idx.evict(10, pool="cold") == 40 and kv.hot_pool.used_tokens == 0 and idx.nodes() == []


def test_pool_eviction_is_all_or_nothing():
    kv, idx = make(100, 0.0)  # all COLD
    adm = Admission(idx)
    a = adm.admit(toks(0, 30), 30)
    b = adm.admit(toks(100, 30), 30)
    idx.unlock(a.node)  # b stays locked: 30 evictable
    assert adm.admit(toks(200, 71), 71) is None  # 40 free + 30 evictable < 71: a stays cached
    assert idx.match(toks(0, 30)).length == 30 and idx.evicted_tokens == 0
    assert idx.evictable_tokens("cold") == 30 and idx.evictable_tokens("hot") == 0
    assert idx.evict(31, pool="cold") == 0 and idx.match(toks(0, 30)).length == 30
    assert adm.admit(toks(200, 70), 70).where == "cold" and idx.match(toks(0, 30)).length == 0
    idx.unlock(b.node)


def test_scheduler_makes_cold_room_without_dropping_hot_prefixes():
    """A request's own (suffix + output) slots are COLD: making room for them must not evict a
    stale HOT prefix that comes first in LRU order but frees no COLD slot."""
    from granikv.config import HardwareConfig
    from granikv.engine.scheduler import Scheduler, Seq, Storage
    from granikv.request import Request

    st_ = Storage(KVCache(1, 200, 1, 1, 0.5, torch.float32, "cpu"), enable_hot=True)  # HOT 100, COLD 100
    sch = Scheduler(st_, HardwareConfig(kv_budget_tokens=200, max_running_requests=8), max_rows=8)
    p0 = toks(0, 40)
    r0 = Request(0, p0 + [900, 901], 3, 0.0, shared_len=40, prefix_class=0)
    sch.add([Seq(r0, 0)])
    (s0,) = sch.admit_arrived(0.0)
    assert s0.where == "hot"
    s0.output_ids = [1, 2, 3]
    sch._retire()  # finished: its slab is cached, unlocked
    cold = st_.kv.cold_pool
    ids = cold.alloc(50)
    st_.index.insert(toks(500, 50), ids)  # a stale COLD prefix, more recent than the slab
    assert cold.free_tokens == 49  # (one slot is the engine's padding scratch)
    r1 = Request(1, toks(1000, 58), 3, 0.0, shared_len=0, prefix_class=-1)  # 60 own COLD slots
    sch.add([Seq(r1, 1)])
    (s1,) = sch.admit_arrived(0.0)
    assert s1.own.numel() == 60
    assert st_.index.match(toks(500, 50)).length == 0  # the COLD prefix made the room
    assert st_.index.match(p0).length == 40 and st_.kv.hot_pool.used_tokens == 40  # the slab stayed


@pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")
def test_engine_multiprefix_churn_keeps_new_prefixes_hot():
    """Four prefix classes in turn, one request at a time, HOT room for two prefixes: every prefix
    not cached goes HOT by evicting stale slabs (none falls back to COLD; a class may still hit
    where the window chosen kept its slab), and the tokens still equal the no-cache reference."""
    from granikv.config import HardwareConfig, ModelConfig, RunConfig
    from granikv.engine.engine import Engine
    from granikv.config import system_config
    from granikv.request import Request

    tiny = dict(hidden_size=64, num_layers=2, num_heads=16, num_kv_heads=4, head_dim=16, intermediate_size=128,
                vocab_size=512, max_position_embeddings=1024)
    rng = random.Random(3)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(70, 90))] for _ in range(4)]
    reqs = [Request(i, prefixes[i % 4] + [rng.randrange(512) for _ in range(rng.randrange(2, 8))], 3,
                    arrival_s=0.0, shared_len=len(prefixes[i % 4]), prefix_class=i % 4) for i in range(8)]
    cfg = RunConfig(model=ModelConfig(**tiny), system=system_config("granikv"),
                    hardware=HardwareConfig(kv_budget_tokens=400, chunked_prefill_size=8192, max_running_requests=1))
    cfg.system.hot_fraction = 0.5  # HOT 200: two prefixes
    eng = Engine(cfg)
    res = eng.run(reqs)
    adm = res.stats["admissions"]
    assert "cold" not in adm and adm["hot"] >= 6 and adm["hot"] + adm.get("hit", 0) == 8, adm
    assert res.stats["evicted_tokens"] > 0
    for r, rec in zip(reqs, res.records):
        assert rec.output_ids == eng.generate_reference(r.prompt_ids, r.output_len), r.rid
    assert all(n.lock_ref == 0 for n in eng.storage.index.nodes())


# ---------------------------------------------------------------------- state machine
# few symbols, so prefixes share paths (splits, COLD below HOT and HOT below COLD), a few more for churn
TOKENS = st.one_of(st.lists(st.integers(0, 1), min_size=1, max_size=12),
                   st.lists(st.integers(0, 3), min_size=1, max_size=12))
POOL = st.sampled_from(["hot", "cold"])


def _attached(n, root) -> bool:
    while n.parent is not None:
        n = n.parent
    return n is root


class EvictionMachine(RuleBasedStateMachine):
    """Admissions (HOT eviction included), COLD inserts, locks, ``evict(n, pool)`` and
    ``evict_hot_extent``; each eviction is checked against an oracle computed from a snapshot of
    the tree and the locks this machine holds (not from the index's own bookkeeping)."""

    def __init__(self):
        super().__init__()
        self.kv, self.idx = make(capacity=56, hot_fraction=0.5)  # HOT 28, COLD 28
        self.adm = Admission(self.idx)
        self.held = []  # locked nodes (one entry per lock)

    # -------------------------------------------------------------- oracle
    def _snap(self, extra_pin=None):
        nodes = self.idx.nodes()
        parent = {n.uid: n.parent for n in nodes}
        pinned = set()
        for h in self.held + ([extra_pin] if extra_pin is not None else []):
            x = h
            while x is not None and x is not self.idx.root:
                pinned.add(x.uid)
                x = x.parent
        sub_stamp = {}  # newest access in each node's subtree

        def walk(n):
            s = n.last_access
            for c in n.children.values():
                s = max(s, walk(c))
            sub_stamp[n.uid] = s
            return s
        for c in self.idx.root.children.values():
            walk(c)
        units = {}  # key -> dict(pool, nodes, tokens, pinned, top)
        for n in nodes:
            key = ("hot", n.slab.start) if n.slab is not None else ("cold", n.uid)
            u = units.setdefault(key, {"pool": key[0], "nodes": [], "pinned": False})
            u["nodes"].append(n)
            u["pinned"] |= n.uid in pinned
        for key, u in units.items():
            u["tokens"] = u["nodes"][0].slab.length if key[0] == "hot" else len(u["nodes"][0])
            ids = {n.uid for n in u["nodes"]}
            u["top"] = next(n for n in u["nodes"] if n.parent.uid not in ids)
            u["leaf"] = all(c.uid in ids for n in u["nodes"] for c in n.children.values())
            u["stamp"] = max(n.last_access for n in u["nodes"])
            u["sub_stamp"] = sub_stamp[u["top"].uid]
        return {"nodes": nodes, "parent": parent, "units": units}

    def _removed(self, snap):
        return [n for n in snap["nodes"] if not _attached(n, self.idx.root)]

    @staticmethod
    def _evictable(snap, pool):
        return sum(u["tokens"] for u in snap["units"].values() if u["pool"] == pool and not u["pinned"])

    def _best_window(self, snap, length):
        """Newest subtree access among the slabs of the best HOT window of ``length`` (brute force
        over every start address), or None when no window avoids the pinned slabs."""
        cap = self.kv.hot_pool.capacity
        slabs = [u for u in snap["units"].values() if u["pool"] == "hot"]
        best = None
        for a in range(0, cap - length + 1):
            over = [u for u in slabs if u["nodes"][0].slab.start < a + length and u["nodes"][0].slab.end > a]
            if any(u["pinned"] for u in over):
                continue
            cost = max((u["sub_stamp"] for u in over), default=-1)
            best = cost if best is None else min(best, cost)
        return best

    def _check_collateral(self, snap, removed, pool):
        """Every removed node of the other pool lies below a removed node of ``pool``."""
        gone = {n.uid for n in removed}
        for n in removed:
            if (n.slab is None) == (pool == "cold"):
                continue
            x, ok = snap["parent"][n.uid], False
            while x is not None and x is not self.idx.root:
                if x.uid in gone and (x.slab is None) == (pool == "cold"):
                    ok = True
                    break
                x = snap["parent"].get(x.uid)
            assert ok, f"{n} ({'HOT' if n.slab else 'COLD'}) was evicted to free {pool} but is not below an evicted {pool} unit"

    # -------------------------------------------------------------- rules
    @rule(tokens=TOKENS)
    def insert_cold(self, tokens):
        ids = self.kv.cold_pool.alloc(len(tokens))
        if ids is None:
            return
        done = self.idx.insert(tokens, ids)
        if done:
            self.kv.cold_pool.free(ids[:done])

    @rule(tokens=TOKENS, extra=st.integers(0, 2), keep=st.booleans())
    def admit(self, tokens, extra, keep):
        m = self.idx.match(tokens)  # what admit will match (and split) too; its path is pinned meanwhile
        need = len(tokens) - m.length
        snap = self._snap(extra_pin=m.node)
        hot = self.kv.hot_pool
        fits = hot.largest_free_extent >= need
        window = None if fits or need == 0 else self._best_window(snap, need)
        cold_ok = self.kv.cold_pool.free_tokens + self._evictable(snap, "cold") >= need
        p = self.adm.admit(tokens + [0] * extra, len(tokens))
        removed = self._removed(snap)
        if need == 0:
            assert p.where == "hit" and not removed
        elif fits:
            assert p.where == "hot" and not removed
        elif window is not None:
            assert p.where == "hot", "a HOT window was free to make but the prefix went elsewhere"
            assert removed and max(n.last_access for n in removed) == window, "not the least recently used window"
        else:  # no HOT window: COLD, evicting from COLD only (HOT only below an evicted COLD prefix)
            assert (p is not None) == cold_ok
            if p is None:
                assert not removed, "a failed admission evicted something"
            else:
                assert p.where == "cold"
            self._check_collateral(snap, removed, "cold")
        if p is not None:
            assert p.slots.numel() == len(tokens) and p.new_from == m.length
            if keep:  # still running; else its request finished at once and the prefix is stale
                self.held.append(p.node)
            else:
                self.idx.unlock(p.node)

    @rule(tokens=TOKENS, tail=st.lists(st.integers(0, 3), min_size=1, max_size=6), keep=st.booleans())
    def cold_then_extend(self, tokens, tail, keep):
        """A COLD prefix, then an admission extending it (a HOT slab below a COLD node when it fits)."""
        self.insert_cold(tokens)
        self.admit(tokens + tail, 0, keep)

    @rule(tokens=TOKENS, tail=st.lists(st.integers(0, 3), min_size=1, max_size=6), keep=st.booleans())
    def admit_then_branch(self, tokens, tail, keep):
        """An admission, then a COLD branch cached below it (COLD below a HOT slab when it went HOT)."""
        self.admit(tokens, 0, keep)
        self.insert_cold(tokens + tail)

    @precondition(lambda self: self.held)
    @rule()
    def drain(self):
        """Every running request finishes: everything cached is stale."""
        while self.held:
            self.idx.unlock(self.held.pop())

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

    @rule(n=st.integers(0, 30), pool=POOL)
    def evict_pool(self, n, pool):
        snap = self._snap()
        evictable = self._evictable(snap, pool)
        p = self.kv.cold_pool if pool == "cold" else self.kv.hot_pool
        free0 = p.free_tokens
        freed = self.idx.evict(n, pool=pool)
        removed = self._removed(snap)
        if n == 0 or evictable < n:
            assert freed == 0 and not removed, "all or nothing: an impossible eviction evicted something"
            return
        assert freed >= n and p.free_tokens - free0 == freed
        self._check_collateral(snap, removed, pool)
        gone = {n_.uid for n_ in removed}
        mine = [u for u in snap["units"].values() if u["pool"] == pool]
        survivors = [u["stamp"] for u in mine if u["leaf"] and not u["pinned"] and u["top"].uid not in gone]
        evicted = [u["stamp"] for u in mine if u["top"].uid in gone]
        if survivors:  # least recently used first
            assert max(evicted) <= min(survivors)

    @rule(length=st.integers(1, 20))
    def evict_extent(self, length):
        snap = self._snap()
        hot = self.kv.hot_pool
        trivial = hot.largest_free_extent >= length or length > hot.capacity
        window = None if trivial else self._best_window(snap, length)
        freed = self.idx.evict_hot_extent(length)
        removed = self._removed(snap)
        if window is None:
            assert freed == 0 and not removed
        else:
            assert freed > 0 and hot.largest_free_extent >= length
            assert max(n.last_access for n in removed) == window

    # -------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        idx, kv = self.idx, self.kv
        nodes = idx.nodes()
        slots = torch.cat([n.slots for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
        assert slots.numel() == slots.unique().numel(), "a slot is owned twice"
        assert idx.cached_tokens == sum(len(n) for n in nodes)
        cold = kv.cold_pool
        owned = cold.owned_mask()
        assert cold.free_tokens + int(owned.sum()) == cold.capacity, "COLD free + used != capacity"
        cached_cold = sorted(slots[slots >= kv.hot_tokens].tolist())
        assert cached_cold == (owned.nonzero().flatten() + cold.offset).tolist(), "COLD slots leaked or freed while cached"
        hot = kv.hot_pool
        slabs = hot.slabs
        assert hot.free_tokens + sum(s.length for s in slabs) == hot.capacity, "HOT free + used != capacity"
        tiles = sorted([(s.start, s.length) for s in slabs] + hot.free_extents())
        pos = 0
        for s, n in tiles:  # slabs and free extents tile the HOT region, no overlap, no gap
            assert s == pos and n > 0
            pos += n
        assert pos == hot.capacity
        for s in slabs:
            group = [n for n in nodes if n.slab == s]
            assert group, f"{s} is allocated but no node holds it"
            covered = sorted(x for n in group for x in n.slots.tolist())
            assert covered == list(range(s.start, s.end)), "a slab is not covered exactly by its nodes"
            assert sum(n.parent.slab != s for n in group) == 1, "a slab's nodes are not one chain"
        for n in nodes:
            if n.slab is not None:  # contiguous rows: a plain view for the dense kernels
                assert n.slots.tolist() == list(range(int(n.slots[0]), int(n.slots[0]) + len(n)))
        for h in self.held:
            assert _attached(h, idx.root), "a locked node was evicted"
        for n in nodes:  # lock refs are exactly the locks held in each subtree
            want = sum(1 for h in self.held if _on_path(n, h))
            assert n.lock_ref == want, (n, want)


def _on_path(anc, node) -> bool:
    while node is not None:
        if node is anc:
            return True
        node = node.parent
    return False


TestEvictionMachine = EvictionMachine.TestCase
TestEvictionMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
