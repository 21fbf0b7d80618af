"""granikv.kv.eviction: unit tests over a tiny fake tree, and one hypothesis state machine that
checks the same eviction properties on both trees that use it (the engine's ``PrefixIndex`` and
the SGLang plugin's ``HotColdTree`` inside a model of SGLang's radix cache): a locked node never
goes, COLD room comes from COLD leaves least recently used first (HOT only below an evicted COLD
node), the amount freed, and the HOT window chosen (a brute-force oracle over every address)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from granikv.kv import KVCache, PrefixIndex, eviction
from granikv.kv.hot_pool import HotPool, Slab
from granikv.sglang_plugin.hot_region import SLAB_ATTR
from test_sglang_plugin_model import ModelAllocator, ModelRadixCache


# ---------------------------------------------------------------------- a tiny fake tree
@dataclass(eq=False)
class FakeNode:
    """A node of :class:`FakeTree`: ``size`` tokens, used at ``stamp``, in ``slab`` (None: COLD)."""

    name: str
    size: int
    stamp: int
    slab: Slab | None = None
    parent: "FakeNode | None" = None
    children: dict = field(default_factory=dict)
    lock_ref: int = 0


class FakeTree:
    """An eviction.Tree over :class:`FakeNode`; records what it was asked to remove, in order."""

    def __init__(self, hot_capacity: int = 0):
        self.root = FakeNode("root", 0, -1, lock_ref=1)
        self.hot = HotPool(hot_capacity)
        self.holders: dict[int, FakeNode] = {}
        self.gone: list[str] = []

    def add(self, parent, name, size, stamp, slab=None):
        n = FakeNode(name, size, stamp, slab, parent or self.root)
        n.parent.children[name] = n
        if slab is not None:
            self.holders[slab.start] = n
        return n

    def lock(self, node):
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def slab_of(self, node):
        return node.slab

    def tokens(self, node):
        return node.size

    def last_access(self, node):
        return node.stamp

    def evicted(self, node):
        return node.parent is None

    def remove_subtree(self, top, nodes, slabs, cold, hot):
        del top.parent.children[top.name]
        for n in nodes:
            n.parent = None
            self.gone.append(n.name)
        for s in slabs:
            del self.holders[s.start]
            self.hot.free(s)

    def evict(self, n, pool="cold", all_or_nothing=False):
        return eviction.evict(self, self.root, n, pool, eviction.subtree(self.root), lambda t: t.stamp, all_or_nothing)


def test_least_recently_used_unlocked_leaves_go_first_and_a_locked_node_never():
    t = FakeTree()
    a = t.add(None, "a", 4, stamp=5)
    t.add(a, "a1", 2, stamp=1)         # the oldest leaf, below a
    t.add(None, "b", 3, stamp=2)
    c = t.add(None, "c", 3, stamp=0)   # the oldest of all, but locked
    t.lock(c)
    assert t.evict(1) == 2 and t.gone == ["a1"]
    assert t.evict(4) == 7 and t.gone == ["a1", "b", "a"]   # b (2) before a, a leaf only now (5)
    assert t.evict(100) == 0 and t.gone == ["a1", "b", "a"]
    assert c.parent is t.root


def test_a_shortfall_frees_what_there_is_or_nothing_when_all_or_nothing():
    t = FakeTree()
    t.add(None, "a", 4, stamp=1)
    t.lock(t.add(None, "b", 4, stamp=0))
    assert eviction.evictable_tokens(t, t.root, "cold") == 4
    assert t.evict(5, all_or_nothing=True) == 0 and t.gone == []
    assert t.evict(4, all_or_nothing=True) == 4 and t.gone == ["a"]
    t.add(None, "c", 2, stamp=3)
    assert t.evict(5) == 2 and t.gone == ["a", "c"]
    assert t.evict(0) == 0 and t.evict(-3) == 0


def test_a_slab_goes_whole_and_cold_room_leaves_hot_leaves_alone():
    t = FakeTree(hot_capacity=10)
    slab = t.hot.alloc(6)
    up = t.add(None, "up", 2, stamp=0, slab=slab)   # one slab, split in two nodes
    t.add(up, "low", 4, stamp=0, slab=slab)
    t.add(None, "x", 3, stamp=9)
    assert t.evict(1, pool="cold") == 3 and t.gone == ["x"]   # the older HOT leaf frees no COLD slot
    assert t.evict(1, pool="cold") == 0
    assert eviction.evictable_tokens(t, t.root, "hot") == 6
    assert t.evict(1, pool="hot") == 6 and t.gone == ["x", "up", "low"] and t.hot.used_tokens == 0


def test_with_no_cold_leaf_left_the_stalest_cold_node_goes_with_the_hot_below_it():
    t = FakeTree(hot_capacity=8)
    old = t.add(None, "old", 2, stamp=1)
    t.add(old, "old.hot", 4, stamp=3, slab=t.hot.alloc(4))
    new = t.add(None, "new", 2, stamp=2)
    t.add(new, "new.hot", 4, stamp=6, slab=t.hot.alloc(4))
    assert eviction.stalest_blocked(t, t.root, "cold") is old   # newest use below it: 3 < 6
    assert t.evict(1) == 2 and t.gone == ["old", "old.hot"] and t.hot.used_tokens == 4
    t.lock(new.children["new.hot"])
    assert eviction.stalest_blocked(t, t.root, "cold") is None and t.evict(1) == 0


def test_the_hot_window_is_the_least_recently_used_one_and_a_locked_slab_stays():
    t = FakeTree(hot_capacity=12)
    a, b, c = (t.add(None, name, 4, stamp, t.hot.alloc(4)) for name, stamp in (("a", 7), ("b", 2), ("c", 5)))
    t.add(a, "a.cold", 1, stamp=8)
    assert eviction.evict_hot_extent(t, t.hot, t.holders, 4) == 4 and t.gone == ["b"]
    assert eviction.evict_hot_extent(t, t.hot, t.holders, 4) == 0   # a free extent fits already
    t.lock(c)
    assert eviction.evict_hot_extent(t, t.hot, t.holders, 8) == 4 and t.gone == ["b", "a", "a.cold"]
    assert eviction.evict_hot_extent(t, t.hot, t.holders, 12) == 0 and c.parent is t.root
    with pytest.raises(ValueError, match="positive int"):
        eviction.evict_hot_extent(t, t.hot, t.holders, 0)
    with pytest.raises(AssertionError, match="locked"):
        eviction.drop_subtree(t, c)


# ---------------------------------------------------------------------- both trees, one machine
class IndexSide:
    """The engine's PrefixIndex over a KVCache: HOT 28 slots, COLD 28; COLD eviction is all or nothing."""

    all_or_nothing = True

    def __init__(self):
        self.kv = KVCache(1, 56, 1, 2, hot_fraction=0.5)
        self.tree = self.idx = PrefixIndex(self.kv.hot_pool, self.kv.cold_pool)
        self.root, self.hot = self.idx.root, self.kv.hot_pool

    def insert(self, tokens, hot):
        m = self.idx.match(tokens)
        n = len(tokens) - m.length
        if n == 0:
            return
        slab = self.hot.alloc(n) if hot else None
        if hot and slab is None:
            return
        tail = torch.arange(slab.start, slab.end) if hot else self.kv.cold_pool.alloc(n)
        if tail is None:
            return
        self.idx.extend(m, tokens, torch.cat((m.slots, tail)), slab=slab)

    def lock(self, tokens):
        m = self.idx.match(tokens)
        if m.length:
            self.idx.lock(m.node)
        return [m.node] if m.length else []

    def unlock(self, node):
        self.idx.unlock(node)

    def evict_cold(self, n):
        return self.idx.evict(n, pool="cold")

    def evict_hot_extent(self, length):
        return self.idx.evict_hot_extent(length)

    def cold_free(self):
        return self.kv.cold_pool.free_tokens

    def check(self, nodes):
        cold = self.kv.cold_pool
        slots = [x for n in nodes if n.slab is None for x in n.slots.tolist()]
        assert sorted(slots) == (cold.owned_mask().nonzero().flatten() + cold.offset).tolist()


class PluginSide:
    """The plugin's HotColdTree inside the model of SGLang's radix cache: HOT slots 1..28, COLD 29;
    COLD eviction frees what it can."""

    all_or_nothing = False

    def __init__(self):
        self.a = ModelAllocator(57)
        self.c = ModelRadixCache(self.a, 4, 64, hot_fraction=0.5)
        self.tree, self.hot = self.c.hot, self.c.region.pool

    @property
    def root(self):
        return self.c.root_node

    def insert(self, tokens, hot):
        cached, _ = self.c.match_prefix(tokens)
        n = len(tokens) - len(cached)
        if n == 0:
            return
        slab = self.c.region.alloc(n) if hot else None
        if hot and slab is None:
            return
        tail = torch.arange(slab.start, slab.end) if hot else self.a.alloc(n)
        if tail is None:
            return
        _, node = self.c._raw_insert(tokens, torch.cat((cached, tail)))
        if slab is not None:
            self.c.hot.register(node, slab)

    def lock(self, tokens):
        cached, node = self.c.match_prefix(tokens)
        if len(cached):
            self.c.inc_lock_ref(node)
        return [node] if len(cached) else []

    def unlock(self, node):
        self.c.dec_lock_ref(node)

    def evict_cold(self, n):
        return self.c.hot.evict_cold(n, list(self.c.evictable_leaves), self.root)

    def evict_hot_extent(self, length):
        return self.c.hot.evict_hot_extent(length)

    def cold_free(self):
        return self.a.available_size()

    def check(self, nodes):
        cold = [x for n in nodes if getattr(n, SLAB_ATTR, None) is None for x in n.value.tolist()]
        owned = self.a.free_slots().tolist() + self.c.region.slots().tolist() + cold
        assert sorted(owned) == list(range(1, self.a.size + 1)), "a slot is owned twice or by no one"
        assert self.c.evictable_size() == self.c.hot.cold_evictable(self.root)


TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class TwoTreeMachine(RuleBasedStateMachine):
    """Inserts (HOT or COLD tails), locks, COLD eviction and HOT-extent eviction on one tree;
    each eviction is checked against a snapshot of the tree and the locks this machine holds."""

    side_type = IndexSide

    def __init__(self):
        super().__init__()
        self.side = self.side_type()
        self.held = []

    def _nodes(self):
        return eviction.subtree(self.side.root)[1:]

    def _snap(self):
        t, nodes = self.side.tree, self._nodes()
        pinned = set()
        for h in self.held:
            while h is not self.side.root:
                pinned.add(id(h))
                h = h.parent
        units = {}
        for n in nodes:
            slab = t.slab_of(n)
            key = ("hot", slab.start) if slab is not None else ("cold", id(n))
            u = units.setdefault(key, {"pool": key[0], "nodes": [], "pinned": False, "slab": slab})
            u["nodes"].append(n)
            u["pinned"] |= id(n) in pinned
        for key, u in units.items():
            ids = {id(n) for n in u["nodes"]}
            u["top"] = next(n for n in u["nodes"] if id(n.parent) not in ids)
            u["leaf"] = all(id(c) in ids for n in u["nodes"] for c in n.children.values())
            u["stamp"] = max(t.last_access(n) for n in u["nodes"])
            u["sub_stamp"] = max(t.last_access(n) for n in eviction.subtree(u["top"]))
            u["tokens"] = u["slab"].length if u["slab"] is not None else t.tokens(u["nodes"][0])
        return {"nodes": nodes, "parent": {id(n): n.parent for n in nodes}, "units": units}

    def _removed(self, snap):
        live = {id(n) for n in self._nodes()}
        return [n for n in snap["nodes"] if id(n) not in live]

    def _best_window(self, snap, length):
        pool = self.side.hot
        slabs = [u for u in snap["units"].values() if u["pool"] == "hot"]
        best = None
        for a in range(pool.offset, pool.offset + pool.capacity - length + 1):
            over = [u for u in slabs if u["slab"].start < a + length and u["slab"].end > a]
            if any(u["pinned"] for u in over):
                continue
            cost = max((u["sub_stamp"] for u in over), default=-1)
            best = cost if best is None else min(best, cost)
        return best

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        self.held += self.side.lock(tokens)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.side.unlock(self.held.pop(i % len(self.held)))

    @rule(tokens=TOKENS, hot=st.booleans())
    def insert(self, tokens, hot):
        self.side.insert(tokens, hot)

    @rule(n=st.integers(0, 30))
    def evict_cold(self, n):
        snap, t = self._snap(), self.side.tree
        evictable = sum(u["tokens"] for u in snap["units"].values() if u["pool"] == "cold" and not u["pinned"])
        free0 = self.side.cold_free()
        freed = self.side.evict_cold(n)
        removed = self._removed(snap)
        gone = {id(x) for x in removed}
        assert freed == sum(t.tokens(x) for x in removed if t.slab_of(x) is None) == self.side.cold_free() - free0
        if self.side.all_or_nothing and evictable < n:
            assert freed == 0 and not removed, "all or nothing: an impossible eviction evicted something"
            return
        assert freed >= min(n, evictable)
        for x in removed:  # a HOT node goes only below an evicted COLD one
            if t.slab_of(x) is not None:
                p = snap["parent"][id(x)]
                while p is not self.side.root and not (id(p) in gone and t.slab_of(p) is None):
                    p = snap["parent"][id(p)]
                assert p is not self.side.root, f"{x} (HOT) was evicted for COLD room but no COLD node above it was"
        cold = [u for u in snap["units"].values() if u["pool"] == "cold"]
        survivors = [u["stamp"] for u in cold if u["leaf"] and not u["pinned"] and id(u["top"]) not in gone]
        evicted = [u["stamp"] for u in cold if id(u["top"]) in gone]
        if survivors and evicted:  # least recently used first
            assert max(evicted) <= min(survivors)

    @rule(length=st.integers(1, 20))
    def evict_hot_extent(self, length):
        snap, pool = self._snap(), self.side.hot
        fits = pool.largest_free_extent >= length or length > pool.capacity
        window = None if fits else self._best_window(snap, length)  # None: nothing may go
        freed = self.side.evict_hot_extent(length)
        newest = max((self.side.tree.last_access(x) for x in self._removed(snap)), default=None)
        assert (freed > 0) == (window is not None) and newest == window, "not the least recently used window"
        assert window is None or pool.largest_free_extent >= length

    @invariant()
    def consistent(self):
        nodes = self._nodes()
        live = {id(n) for n in nodes}
        assert all(id(h) in live for h in self.held), "a locked node was evicted"
        for n in nodes:  # lock refs are exactly the locks held in each subtree
            want = 0
            for h in self.held:
                x = h
                while x is not self.side.root and x is not n:
                    x = x.parent
                want += x is n
            assert n.lock_ref == want, (n, want)
        self.side.check(nodes)


class PluginTwoTreeMachine(TwoTreeMachine):
    side_type = PluginSide


TestIndexEviction = TwoTreeMachine.TestCase
TestIndexEviction.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPluginEviction = PluginTwoTreeMachine.TestCase
TestPluginEviction.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
