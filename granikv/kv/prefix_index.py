"""Radix tree over token ids mapping cached tokens to KV slot locations (HOT slab or COLD ids)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from granikv.kv import eviction
from granikv.kv.cold_pool import ColdPool
from granikv.kv.hot_pool import HotPool, Slab

_clock = itertools.count()
_uids = itertools.count()


class Node:
    """A radix-tree edge: ``key`` tokens whose KV lives at global ``slots`` ``[len(key)]``.

    ``slab`` is the HOT slab these slots belong to (None for COLD). Several nodes may share
    one slab after a split; the slab is freed only when all of them are evicted together.
    ``uid`` is unique per node object, never reused; a split keeps it on the lower part (the
    node that still ends where it ended), the new upper part gets a fresh one.
    """

    __slots__ = ("key", "slots", "slab", "parent", "children", "lock_ref", "last_access", "uid")

    def __init__(self, key: tuple, slots: torch.Tensor, slab: Slab | None, parent: "Node | None"):
        self.key = key
        self.slots = slots
        self.slab = slab
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = next(_clock)
        self.uid = next(_uids)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        where = f"hot@{self.slab.start}" if self.slab else "cold"
        return f"Node(len={len(self.key)}, {where}, lock={self.lock_ref})"


@dataclass
class PrefixMatch:
    """Result of :meth:`PrefixIndex.match`.

    ``length`` tokens are cached; their slots are ``slots`` ``[length]`` (global ids; read-only:
    it may be the node's own tensor);
    ``node`` is the deepest matched node (lock it to pin the path; the root when nothing
    matched); ``hot_runs`` lists ``(token_pos, slot_start, length)`` runs of the match that
    are contiguous HOT rows, in token order.
    """

    length: int
    slots: torch.Tensor
    node: Node
    hot_runs: list[tuple[int, int, int]]

    def longest_hot_run(self) -> tuple[int, int, int] | None:
        return max(self.hot_runs, key=lambda r: r[2], default=None)


class PrefixIndex:
    """One radix index over both pools (RadixAttention-style), with lock refs and LRU eviction.

    ``insert`` records where tokens' KV lives; ``match`` returns the longest cached prefix
    (splitting a node at the match boundary so the result can be locked exactly); ``lock``
    pins a path (a locked node is never evicted); ``evict(n, pool)`` frees least-recently-used
    unlocked prefixes until ``n`` slots of the pool a caller needs are free, a HOT slab only as a
    whole; ``evict_hot_extent`` frees unlocked slabs until one contiguous HOT extent fits.
    """

    def __init__(self, hot_pool: HotPool, cold_pool: ColdPool):
        self.hot_pool = hot_pool
        self.cold_pool = cold_pool
        self.root = Node((), torch.empty(0, dtype=torch.int64), None, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._slab_nodes: dict[int, set[Node]] = {}  # slab.start -> nodes holding its slots
        self.cached_tokens = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``tokens``; touches the path for LRU."""
        key = tuple(tokens)
        node, pos = self.root, 0
        parts: list[torch.Tensor] = []
        runs: list[tuple[int, int, int]] = []
        stamp = next(_clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            parts.append(child.slots)
            if child.slab is not None:
                start = int(child.slots[0])
                if runs and runs[-1][1] + runs[-1][2] == start and runs[-1][0] + runs[-1][2] == pos:
                    p, s, ln = runs[-1]
                    runs[-1] = (p, s, ln + n)
                else:
                    runs.append((pos, start, n))
            node, pos = child, pos + n
        slots = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(pos, slots, node, runs)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int], slots: torch.Tensor, slab: Slab | None = None) -> int:
        """Record that ``tokens``' KV lives at ``slots`` ``[len(tokens)]`` (global ids).

        Returns how many leading tokens were already cached: their entries in ``slots`` are
        not taken (the caller still owns those slots and frees its duplicates). With
        ``slab``, the newly cached tail must lie inside that HOT slab.
        """
        _check_slots("insert", len(tokens), slots)
        if len(tokens) == 0:
            return 0
        m = self.match(tokens)
        if m.length < len(tokens):
            self._attach(m.node, tokens, m.length, slots, slab, "insert")
        return m.length

    def extend(self, m: PrefixMatch, tokens: Sequence[int], slots: torch.Tensor, slab: Slab | None = None) -> Node:
        """:meth:`insert` without matching again: ``m`` is this index's :meth:`match` of ``tokens``,
        its node still in place (locked since); caches ``tokens[m.length:]`` at ``slots[m.length:]``
        under ``m.node`` and returns the new node (the one ending at ``len(tokens)``)."""
        _check_slots("extend", len(tokens), slots)
        if not m.length < len(tokens):
            raise ValueError(f"PrefixIndex.extend: nothing to add ({len(tokens)} tokens, {m.length} cached)")
        return self._attach(m.node, tokens, m.length, slots, slab, "extend")

    def _attach(self, node: Node, tokens: Sequence[int], done: int, slots: torch.Tensor, slab: Slab | None,
                what: str) -> Node:
        tail = slots[done:].to(torch.int64)
        if slab is not None:
            lo, hi = int(tail.min()), int(tail.max())
            if lo < slab.start or hi >= slab.end:
                raise ValueError(f"PrefixIndex.{what}: new slots [{lo}, {hi}] are not inside {slab}")
        key = tuple(tokens[done:])
        if key[0] in node.children:
            raise ValueError(f"PrefixIndex.{what}: {node} already has a child for token {key[0]} (stale match?)")
        new = Node(key, tail.clone(), slab, node)
        node.children[key[0]] = new
        if slab is not None:
            self._slab_nodes.setdefault(slab.start, set()).add(new)
        self.cached_tokens += len(new)
        return new

    def _split(self, child: Node, n: int) -> Node:
        """Split ``child`` after its first ``n`` tokens; returns the new upper node."""
        upper = Node(child.key[:n], child.slots[:n], child.slab, child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.parent.children[child.key[0]] = upper
        child.key, child.slots = child.key[n:], child.slots[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        if child.slab is not None:
            self._slab_nodes[child.slab.start].add(upper)
        return upper

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors (reference counts up the path)."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        n = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                raise ValueError(f"PrefixIndex.unlock: {n} is not locked (unlock without lock)")
            n = n.parent
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction
    # The units and the algorithm are granikv.kv.eviction's; this index is its Tree.
    def evictable_tokens(self, pool: str | None = None) -> int:
        """Cached tokens that eviction could free now: of both pools (``pool=None``), or of
        ``"hot"`` (whole slabs of unlocked groups) or ``"cold"``."""
        if pool is None:
            return sum(len(n) for n in self._nodes() if n.lock_ref == 0)
        _check_pool(pool)
        return eviction.evictable_tokens(self, self.root, pool)

    def evict(self, num_tokens: int, pool: str | None = None) -> int:
        """Free at least ``num_tokens`` slots of ``pool`` (``"hot"`` or ``"cold"``) from unlocked
        cached prefixes, least recently used first; returns the slots of ``pool`` freed.

        All or nothing: when fewer than ``num_tokens`` slots of ``pool`` are evictable, nothing
        is evicted and 0 is returned. Units of the pool that are leaves go first, in LRU order
        (a unit's use: its top node's); a unit of the other pool is evicted only below a unit of
        ``pool`` that is evicted with its whole subtree, once no leaf of ``pool`` is left (a COLD
        prefix under which a HOT extension is cached, say). A HOT slab goes only whole, so more
        than ``num_tokens`` HOT slots may be freed.

        ``pool=None``: the any-pool LRU over leaves, a unit ordered by its lowest node's use, as
        many tokens of either pool as it can (returns tokens of both pools freed); it cannot make
        room in one pool on purpose.
        """
        if num_tokens < 0:
            raise ValueError(f"PrefixIndex.evict: num_tokens must be >= 0, got {num_tokens}")
        if pool is None:
            return eviction.evict(self, self.root, num_tokens, None, self._nodes(), _lowest_use)
        _check_pool(pool)
        return eviction.evict(self, self.root, num_tokens, pool, self._nodes(), lambda t: (t.last_access, t.uid),
                              all_or_nothing=True)

    def evict_hot_extent(self, length: int) -> int:
        """Evict unlocked HOT slabs (each with its subtree) until one free HOT extent holds
        ``length`` slots; returns the HOT slots freed (0: an extent already fits, or none can).

        Locked slabs never move, so the candidate windows are the runs of free extents and
        unlocked slabs between locked ones. Of the smallest windows of ``length`` slots, the one
        whose evicted subtrees were used least recently (the newest access among them is the
        oldest) is taken, fewer evicted tokens and a lower address breaking ties; only the slabs
        of that window are evicted (and what is cached below them). Nothing is evicted when no
        window can hold ``length``.
        """
        holders = {start: next(iter(group)) for start, group in self._slab_nodes.items()}
        return eviction.evict_hot_extent(self, self.hot_pool, holders, length)

    # ------------------------------------------------------------------ eviction.Tree
    @staticmethod
    def tokens(node: Node) -> int:
        return len(node)

    @staticmethod
    def last_access(node: Node) -> int:
        return node.last_access

    @staticmethod
    def evicted(node: Node) -> bool:
        return node.parent is None

    def remove_subtree(self, top: Node, nodes: list[Node], slabs: list[Slab], cold: int, hot: int) -> None:
        """Unlink ``top``'s subtree ``nodes``; their COLD slots go back in one ``free`` call."""
        cold_slots = [n.slots for n in nodes if n.slab is None]
        if cold_slots:
            self.cold_pool.free(cold_slots[0] if len(cold_slots) == 1 else torch.cat(cold_slots))
        for slab in slabs:
            del self._slab_nodes[slab.start]
            self.hot_pool.free(slab)
        del top.parent.children[top.key[0]]
        for n in nodes:
            n.parent = None
        self.cached_tokens -= cold + hot
        self.evicted_tokens += cold + hot

    # ------------------------------------------------------------------ introspection
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def nodes(self) -> list[Node]:
        return list(self._nodes())

    def slab_of(self, node: Node) -> Slab | None:
        return node.slab


def _lowest_use(top: Node) -> tuple[int, int]:
    """The use of a unit's lowest node (the leaf the any-pool LRU finds it by)."""
    n = top
    while n.slab is not None:
        below = next((c for c in n.children.values() if c.slab == n.slab), None)
        if below is None:
            break
        n = below
    return n.last_access, n.uid


def _check_pool(pool) -> None:
    if pool not in ("hot", "cold"):
        raise ValueError(f"PrefixIndex: pool must be 'hot' or 'cold' (or None for either), got {pool!r}")


def _check_slots(what: str, n: int, slots) -> None:
    if slots is None:
        raise ValueError(f"PrefixIndex.{what}: slots is required (tokens without locations)")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.numel() != n:
        got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"PrefixIndex.{what}: slots must be a 1-D tensor with one id per token ({n}), got {got}")


def _common_len(a: tuple, key: tuple, pos: int) -> int:
    """Length of the common prefix of ``a`` and ``key[pos:]``."""
    n = min(len(a), len(key) - pos)
    if a[:n] == key[pos:pos + n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed compares, O(log n) of them
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == key[pos:pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
