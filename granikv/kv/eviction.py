"""Eviction over a radix tree whose KV lives in two pools: HOT slabs and COLD token slots.

The unit of eviction is a COLD node, or a HOT slab's whole group of nodes (a chain on one path,
split by matches); a unit goes only with everything below it. ``lock_ref`` counts the locks of a
node and of its descendants, so a unit whose top node has ``lock_ref == 0`` heads an entirely
unlocked subtree: evicting that subtree is always possible.

:class:`granikv.kv.PrefixIndex` (the compact engine's index) and the SGLang plugin's
``HotColdTree`` (over SGLang's ``TreeNode``) both evict through these functions; each is the
:class:`Tree` of its own nodes.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Iterable, Mapping, Protocol

from granikv.kv.hot_pool import HotPool, Slab


class Node(Protocol):
    """A radix-tree node as eviction reads it: ``parent`` (None for the root), ``children``
    (first token -> child node) and ``lock_ref`` (the locks on the node and below it; the root
    holds one, so it is never evicted)."""

    parent: Any
    children: dict
    lock_ref: int


class Tree(Protocol):
    """What eviction asks of the tree that holds the nodes (the trees name node fields differently)."""

    def slab_of(self, node: Node) -> Slab | None:
        """The HOT slab holding ``node``'s KV; None when it lives in COLD slots."""

    def tokens(self, node: Node) -> int:
        """The tokens (one slot each) ``node`` holds."""

    def last_access(self, node: Node) -> Any:
        """When ``node`` was last used; older compares smaller."""

    def evicted(self, node: Node) -> bool:
        """Whether ``node`` has left the tree by an eviction."""

    def remove_subtree(self, top: Node, nodes: list, slabs: list[Slab], cold: int, hot: int) -> None:
        """Take ``nodes`` out of the tree: ``top`` and every node below it (parents first, all
        unlocked). Their COLD slots (``cold`` of them) go back to the COLD pool, ``slabs``
        (``hot`` slots) whole to the HOT pool."""


def in_pool(tree: Tree, node: Node, pool: str | None) -> bool:
    """Whether ``node``'s KV lives in ``pool`` (``"hot"``, ``"cold"``; None: either)."""
    return pool is None or (tree.slab_of(node) is None) == (pool == "cold")


def unit_top(tree: Tree, node: Node) -> Node:
    """The top node of ``node``'s unit: itself (COLD), or the uppermost node of its slab."""
    slab = tree.slab_of(node)
    if slab is None:
        return node
    while node.parent is not None and tree.slab_of(node.parent) == slab:
        node = node.parent
    return node


def subtree(top: Node) -> list:
    """``top`` and every node below it, depth first, parents before their children."""
    out, stack = [], [top]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def is_leaf_unit(tree: Tree, top: Node) -> bool:
    """No child outside the unit headed by ``top``."""
    slab = tree.slab_of(top)
    if slab is None:
        return not top.children
    stack = [top]
    while stack:
        for c in stack.pop().children.values():
            if tree.slab_of(c) != slab:
                return False
            stack.append(c)
    return True


def evictable_tokens(tree: Tree, root: Node, pool: str) -> int:
    """Slots of ``pool`` eviction could free now: COLD tokens of unlocked nodes, or the whole
    slabs of unlocked HOT units."""
    total = 0
    for n in subtree(root)[1:]:
        if n.lock_ref or not in_pool(tree, n, pool):
            continue
        slab = tree.slab_of(n)
        if slab is None:
            total += tree.tokens(n)
        elif unit_top(tree, n) is n:
            total += slab.length
    return total


def evict(tree: Tree, root: Node, num_tokens: int, pool: str | None, candidates: Iterable[Node],
          priority: Callable[[Node], Any], all_or_nothing: bool = False) -> int:
    """Free at least ``num_tokens`` slots of ``pool`` from unlocked units; returns the slots of
    ``pool`` freed (of both pools with ``pool=None``).

    Leaf units of ``pool`` go first, lowest ``priority`` first (ties: their order in
    ``candidates``, the nodes the heap starts from; a unit's parent unit joins once it is a leaf).
    Once no leaf of ``pool`` is left, the unlocked unit of ``pool`` whose subtree was used least
    recently goes with its subtree (:func:`stalest_blocked`): a unit of the other pool is evicted
    only below one of ``pool``. A slab goes only whole, so more than asked may be freed. When
    fewer are evictable: ``all_or_nothing`` evicts nothing and returns 0, else all of them go.
    """
    if num_tokens <= 0 or (all_or_nothing and evictable_tokens(tree, root, pool) < num_tokens):
        return 0

    def ready(t) -> bool:  # an unlocked leaf unit of the pool, still in the tree
        return (t is not root and in_pool(tree, t, pool) and t.lock_ref == 0 and not tree.evicted(t)
                and is_leaf_unit(tree, t))

    seq = itertools.count()
    heap = [(priority(t), next(seq), t) for t in candidates if ready(t) and unit_top(tree, t) is t]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens:
        top = None
        while heap:
            t = heapq.heappop(heap)[2]
            if ready(t):
                top = t
                break
        if top is None:
            top = stalest_blocked(tree, root, pool)
            if top is None:
                break
        parent = top.parent
        cold, hot = drop_subtree(tree, top)
        freed += cold if pool == "cold" else hot if pool == "hot" else cold + hot
        if parent is not root:
            t = unit_top(tree, parent)
            if ready(t):
                heapq.heappush(heap, (priority(t), next(seq), t))
    return freed


def stalest_blocked(tree: Tree, root: Node, pool: str | None) -> Node | None:
    """The unlocked unit of ``pool`` with other units below it whose subtree was used least
    recently (then: the smallest subtree, then the first in depth-first order), or None."""
    best, best_key = None, None
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.lock_ref or not in_pool(tree, n, pool) or unit_top(tree, n) is not n or is_leaf_unit(tree, n):
            continue
        sub = subtree(n)
        key = (max(tree.last_access(m) for m in sub), sum(tree.tokens(m) for m in sub))
        if best_key is None or key < best_key:
            best, best_key = n, key
    return best


def evict_hot_extent(tree: Tree, pool: HotPool, holders: Mapping[int, Node], length: int) -> int:
    """Evict unlocked HOT units (each with its subtree) until one free extent of ``pool`` holds
    ``length`` slots; returns the HOT slots freed (0: an extent already fits, or none can).

    ``holders`` maps each live slab's start to a node of it. The slabs go as
    :meth:`HotPool.eviction_window` picks them: locked slabs never move; of the smallest windows
    of ``length`` slots, the one whose evicted subtrees were used least recently, fewer evicted
    tokens and a lower address breaking ties. Nothing is evicted when no window holds ``length``.
    """
    if not isinstance(length, int) or length <= 0:
        raise ValueError(f"evict_hot_extent: length must be a positive int, got {length!r}")
    if pool.fits(length) or pool.room(length) > pool.capacity:
        return 0
    info: dict[int, tuple] = {}  # slab start -> (newest access, tokens) of an evictable unit's subtree
    tops: dict[int, Node] = {}
    for start, node in holders.items():
        top = unit_top(tree, node)
        if top.lock_ref == 0:
            sub = subtree(top)
            info[start] = (max(tree.last_access(n) for n in sub), sum(tree.tokens(n) for n in sub))
            tops[start] = top
    window = pool.eviction_window(length, info)
    if not window:
        return 0
    freed = 0
    for start in window:
        if not tree.evicted(tops[start]):  # not already gone below another slab of the window
            freed += drop_subtree(tree, tops[start])[1]
    assert pool.fits(length), "evict_hot_extent: the window did not free up"
    return freed


def drop_subtree(tree: Tree, top: Node) -> tuple[int, int]:
    """Evict the unit headed by ``top`` and everything below it (all unlocked); returns the
    (COLD, HOT) slots freed."""
    if top.lock_ref:
        raise AssertionError(f"{type(tree).__name__}: evicting locked {top!r} (lock_ref={top.lock_ref})")
    nodes = subtree(top)
    slabs: dict[int, Slab] = {}
    cold = 0
    for n in nodes:
        slab = tree.slab_of(n)
        if slab is None:
            cold += tree.tokens(n)
        else:
            slabs.setdefault(slab.start, slab)
    hot = sum(s.length for s in slabs.values())
    tree.remove_subtree(top, nodes, list(slabs.values()), cold, hot)
    return cold, hot
