"""The pure core of the ``granikv`` radix cache backend: no SGLang import, tested on CPU.

Two parts:

- :class:`HotRegion`: a contiguous range of slots taken out of a token allocator of SGLang's
  shape (``TokenToKVPoolAllocator``: slots ``1..size`` free at start, ``alloc(n)`` gives the
  first ``n`` free slots as an int64 tensor or None, ``free(indices)``, ``available_size()``)
  and handed out as slabs, first-fit, by :class:`granikv.kv.HotPool`. A slab goes back to the
  region only whole; the region's slots never go back to the allocator while it exists.
- :class:`HotColdTree`: admission and eviction over a radix tree of SGLang's ``TreeNode`` shape
  (the node protocol below), where a node is HOT when its slots are one slab's and COLD when
  they are the allocator's. Admission is HOT-first: a free extent, else unlocked slabs evicted
  whole to make one (``HotPool.eviction_window``), else the prefix stays COLD (the paged
  fallback). A slab whose node is locked is never evicted or moved. COLD eviction (the
  allocator's shortfall) takes COLD leaves only, LRU first; a COLD node blocked by an unlocked
  HOT node below it goes with its whole subtree. Both evictions are :mod:`granikv.kv.eviction`'s,
  the algorithm ``granikv.kv.PrefixIndex`` uses; the tree is its ``Tree``.

Node protocol (what ``sglang.srt.mem_cache.radix_cache.TreeNode`` has): ``parent`` (None for the
root), ``children`` (a dict), ``lock_ref`` (int; a lock counts on the node and on every ancestor,
so ``lock_ref == 0`` means the whole subtree is unlocked), ``value`` (1-D int64 tensor of slot
ids, one per token), ``last_access_time``; an evicted node keeps its parent link and carries
:data:`GONE_ATTR`. HOT nodes carry the attribute ``granikv_slab``
(:data:`SLAB_ATTR`), set by :meth:`HotColdTree.register` and copied onto the upper half of a
split by :meth:`HotColdTree.on_split`.

Promotion. A shared prefix longer than one prefill chunk is cached chunk by chunk in COLD slots,
as SGLang caches it, so that requests arriving meanwhile share the chunks done so far. When the
prefix is whole, :meth:`HotColdTree.admit_prefix` copies it, cached head and new tail, into one
slab and points the head's nodes at it: the prefix becomes one HOT run. The head's old COLD slots
may still be in the rows of the requests that matched them; they stay with their node
(:data:`RETIRED_ATTR`) until no lock is left on it (:meth:`HotColdTree.after_unlock`), then go
back to the allocator.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from granikv.kv import eviction
from granikv.kv.hot_pool import HotPool, Slab
from granikv.kv.split_policy import SplitPolicy

SLAB_ATTR = "granikv_slab"
GONE_ATTR = "granikv_evicted"  # set on a node once this core evicted it
RETIRED_ATTR = "granikv_retired"  # a promoted node's old COLD slots, freed once the node is unlocked


class TokenAllocator(Protocol):
    """The part of SGLang's ``TokenToKVPoolAllocator`` (page size 1) the region uses."""

    size: int

    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def free(self, free_index: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


class HotRegion:
    """``hot_tokens`` contiguous slots taken out of ``allocator``, handed out as slabs first-fit.

    The slots are taken with one ``allocator.alloc(hot_tokens)`` call, which must return a
    contiguous ascending range: SGLang's allocator does on a fresh (or just cleared) free list,
    ``1..hot_tokens``. Anything else is refused (and given back) rather than used. A slab's slots
    return to the region only whole (:meth:`free`); :meth:`release` gives the whole region back.
    Each slab gets an id, unique for the region's life (slab ids are never reused).
    """

    def __init__(self, allocator: TokenAllocator, hot_tokens: int, align: int = 1):
        self.allocator = allocator
        self.align = align          # slab starts are multiples of it (HotPool's align: the dense launch's KV fold)
        self.start = self.end = 0
        self.pool = HotPool(0, align=align)
        self._ids: dict[int, int] = {}  # slab start -> slab id
        self._next_id = itertools.count()
        self.carve(hot_tokens)

    @staticmethod
    def tokens_for(allocator_size: int, hot_fraction: float) -> int:
        """The HOT slots of a pool of ``allocator_size`` slots: ``floor(size * hot_fraction)``."""
        if not 0.0 <= hot_fraction < 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1), got {hot_fraction!r}")
        return int(allocator_size * hot_fraction)

    # ------------------------------------------------------------------ the region itself
    def carve(self, hot_tokens: int) -> None:
        """Take ``hot_tokens`` contiguous slots out of the allocator (the region must be empty)."""
        if not isinstance(hot_tokens, int) or hot_tokens < 0:
            raise ValueError(f"HotRegion: hot_tokens must be an int >= 0, got {hot_tokens!r}")
        if self.capacity:
            raise RuntimeError("HotRegion.carve: the region already holds slots (release() it first)")
        if hot_tokens == 0:
            self.start = self.end = 0
            self.pool = HotPool(0, align=self.align)
            return
        if self.allocator.available_size() < hot_tokens:
            raise RuntimeError(f"HotRegion: the allocator has {self.allocator.available_size()} free slots, "
                               f"fewer than the {hot_tokens} HOT slots asked for")
        ids = self.allocator.alloc(hot_tokens)
        if ids is None:
            raise RuntimeError(f"HotRegion: the allocator refused {hot_tokens} slots")
        ids = ids.to(torch.int64)
        lo = int(ids[0])
        if ids.numel() != hot_tokens or not torch.equal(ids.cpu(), torch.arange(lo, lo + hot_tokens)):
            self.allocator.free(ids)
            raise RuntimeError(
                "HotRegion: the allocator's first free slots are not one contiguous range; the HOT "
                "region must be carved from a fresh or just-cleared allocator (SGLang's free list is "
                "1..size then)")
        self.start, self.end = lo, lo + hot_tokens
        self.pool = HotPool(hot_tokens, offset=lo, align=self.align)
        self._ids.clear()

    def release(self) -> None:
        """Give every slot of the region back to the allocator; no slab may be live."""
        if self.pool.slabs:
            raise RuntimeError(f"HotRegion.release: {len(self.pool.slabs)} slabs are still live")
        if self.capacity:
            self.allocator.free(torch.arange(self.start, self.end, dtype=torch.int64))
        self.start = self.end = 0
        self.pool = HotPool(0, align=self.align)
        self._ids.clear()

    def reset(self) -> None:
        """Forget every slab (the index was emptied); the region keeps its slots."""
        self.pool = HotPool(self.capacity, offset=self.start, align=self.align)
        self._ids.clear()

    def recarve_after_clear(self, hot_tokens: int | None = None) -> None:
        """The allocator took every slot back (SGLang's ``clear()``, e.g. by ``/flush_cache`` or a
        resize): forget the slabs and take the region again (``hot_tokens``: a new size)."""
        n = self.capacity if hot_tokens is None else hot_tokens
        self.start = self.end = 0
        self.pool = HotPool(0, align=self.align)
        self._ids.clear()
        self.carve(n)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def free_tokens(self) -> int:
        return self.pool.free_tokens

    @property
    def used_tokens(self) -> int:
        return self.pool.used_tokens

    @property
    def tail_free(self) -> int:
        """Free slots at the region's end (what a shrink can give back)."""
        return self.pool.tail_free

    # ------------------------------------------------------------------ a moving end (dynamic split)
    def grow(self, n: int) -> bool:
        """Take the ``n`` slots just above the region from the allocator; True when done.

        Only when the allocator's next ``n`` free slots are exactly ``[end, end + n)``: SGLang's
        allocator hands out the head of its free list, which is ascending after a merge, so the rows
        above HOT come first when they are free and nothing below them is. Otherwise the slots go
        straight back and nothing changes (choosing them would need the allocator's private free
        list). An empty region grows from slot 1, SGLang's first."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"HotRegion.grow(n): n must be a positive int, got {n!r}")
        if self.allocator.available_size() < n:
            return False
        base = self.end if self.capacity else max(self.start, 1)
        ids = self.allocator.alloc(n)
        if ids is None:
            return False
        ids = ids.to(torch.int64)
        if ids.numel() != n or not torch.equal(ids.cpu(), torch.arange(base, base + n)):
            self.allocator.free(ids)
            return False
        if not self.capacity:
            self.start = self.end = base
            self.pool = HotPool(0, offset=base, align=self.align)
        self.pool.grow(n)
        self.end += n
        return True

    def shrink(self, n: int) -> None:
        """Give the region's last ``n`` slots back to the allocator; they must be free (no slab
        moves or loses a slot: ``HotPool.shrink`` refuses otherwise, changing nothing)."""
        self.pool.shrink(n)
        self.allocator.free(torch.arange(self.end - n, self.end, dtype=torch.int64))
        self.end -= n

    def slots(self) -> torch.Tensor:
        """Every slot id of the region, ``[capacity]`` int64."""
        return torch.arange(self.start, self.end, dtype=torch.int64)

    def contains(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of ``slots`` lie in the region."""
        return (slots >= self.start) & (slots < self.end)

    # ------------------------------------------------------------------ slabs
    def alloc(self, n: int) -> Slab | None:
        """A slab of ``n`` contiguous slots, first-fit, or None when no free extent holds ``n``."""
        slab = self.pool.alloc(n)
        if slab is not None:
            self._ids[slab.start] = next(self._next_id)
        return slab

    def free(self, slab: Slab) -> None:
        """Return a whole slab to the region (``HotPool.free`` refuses a part or a stranger)."""
        self.pool.free(slab)
        del self._ids[slab.start]

    def slab_id(self, slab: Slab) -> int:
        return self._ids[slab.start]

    def table(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live slab table ``(start, length, slab_id)``, three int64 ``[S]`` tensors sorted by
        start: what :func:`granikv.sglang_plugin.slab_groups.group_by_slab` takes."""
        slabs = self.pool.slabs
        t = torch.tensor([[s.start, s.length, self._ids[s.start]] for s in slabs], dtype=torch.int64).reshape(-1, 3)
        t = t.to(device)
        return t[:, 0], t[:, 1], t[:, 2]


@dataclass
class AdmitResult:
    """What :meth:`HotColdTree.admit_prefix` did. ``where``: ``"hit"`` (the prefix was cached
    already), ``"hot"`` (its uncached tail ``[cached, n)`` now lives in ``slab``; its COLD rows
    ``src`` were copied to ``dst``; the caller gives ``src`` back to the allocator) or ``"cold"``
    (no extent could be had: the prefix stays in its COLD slots, the paged fallback)."""

    where: str
    cached: int
    slab: Slab | None = None
    node: Any = None
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    promoted: int = 0   # cached COLD head tokens moved into the slab with the tail ("hot" only)


class HotColdTree:
    """HOT-first admission and lock-respecting eviction over a radix tree of SGLang's node shape.

    ``free_cold(slots)`` gives a COLD node's slots back to the allocator (SGLang:
    ``allocator.free_segment(value, start_pos=0)``); ``delete_leaf(node)`` unlinks a leaf from
    its parent and does the index's own accounting (SGLang: ``RadixCache._delete_leaf`` and its
    remove event). ``hot_locked`` counts the HOT tokens in locked nodes: call
    :meth:`before_lock` / :meth:`before_unlock` right before the index's own lock walk.
    """

    def __init__(self, region: HotRegion, free_cold: Callable[[torch.Tensor], None],
                 delete_leaf: Callable[[Any], None], split: SplitPolicy | None = None):
        self.region = region
        self.split = split   # None: the static split (the region keeps its size)
        self.moves = {"grown": 0, "grow_refused": 0, "shrunk": 0}   # dynamic split: slots moved, refusals
        self._free_cold = free_cold
        self._delete_leaf = delete_leaf
        self._bottom: dict[int, Any] = {}  # slab start -> the lowest node holding its slots
        self.hot_locked = 0
        self.counts = {"hit": 0, "hot": 0, "cold": 0, "promoted": 0}  # admissions by outcome
        self.retired_tokens = 0  # old COLD slots of promoted nodes, not yet given back
        self.evicted_hot_tokens = 0
        self.evicted_cold_tokens = 0

    # ------------------------------------------------------------------ nodes
    @staticmethod
    def slab_of(node) -> Slab | None:
        return getattr(node, SLAB_ATTR, None)

    def register(self, node, slab: Slab) -> None:
        """``node`` (a new leaf-end node of the index) holds exactly ``slab``'s slots."""
        if len(node.value) != slab.length:
            raise ValueError(f"HotColdTree.register: node holds {len(node.value)} slots, {slab} has {slab.length}")
        setattr(node, SLAB_ATTR, slab)
        self._bottom[slab.start] = node

    def on_split(self, upper, lower) -> None:
        """The index split ``lower`` and made ``upper`` of its first tokens (SGLang's
        ``_split_node``: the new node is the upper part, the old object keeps the rest)."""
        slab = self.slab_of(lower)
        if slab is not None:
            setattr(upper, SLAB_ATTR, slab)
        old = getattr(lower, RETIRED_ATTR, None)
        if old is not None:           # the retired slots follow their tokens: the upper part's go up
            k = len(upper.value)
            setattr(upper, RETIRED_ATTR, old[:k])
            setattr(lower, RETIRED_ATTR, old[k:])

    def after_unlock(self, node) -> None:
        """Called right after the index took a lock off ``node``'s path: a promoted node left with
        no lock gives its old COLD slots back (no request's row can hold them any more)."""
        if self.retired_tokens == 0:
            return
        n = node
        while n is not None and n.parent is not None:
            old = getattr(n, RETIRED_ATTR, None)
            if old is not None and n.lock_ref == 0:
                self._free_cold(old)
                self.retired_tokens -= len(old)
                delattr(n, RETIRED_ATTR)
            n = n.parent

    def retired_slots(self, nodes: Iterable) -> list[torch.Tensor]:
        """The retired slots held by ``nodes`` (for accounting checks)."""
        return [getattr(n, RETIRED_ATTR) for n in nodes if getattr(n, RETIRED_ATTR, None) is not None]

    def _cold_head(self, node, cached: int) -> list | None:
        """The nodes holding the matched ``cached`` tokens ending at ``node``, top first, when every
        one is COLD and none holds retired slots already; else None."""
        path, n = [], node
        while n is not None and n.parent is not None:
            if self.slab_of(n) is not None or getattr(n, RETIRED_ATTR, None) is not None:
                return None
            path.append(n)
            n = n.parent
        path.reverse()
        return path if sum(len(p.value) for p in path) == cached else None

    def _path_hot(self, node, ref: int) -> int:
        n, tokens = node, 0
        while n is not None and n.parent is not None:  # the root (parent None) is never HOT
            if n.lock_ref == ref and self.slab_of(n) is not None:
                tokens += len(n.value)
            n = n.parent
        return tokens

    def before_lock(self, node) -> None:
        """Called right before the index adds a lock on ``node``'s path."""
        self.hot_locked += self._path_hot(node, 0)

    def before_unlock(self, node) -> None:
        """Called right before the index takes a lock off ``node``'s path."""
        self.hot_locked -= self._path_hot(node, 1)

    @property
    def hot_evictable(self) -> int:
        """HOT tokens cached in unlocked nodes."""
        return self.region.used_tokens - self.hot_locked

    def reset(self) -> None:
        self._bottom.clear()
        self.hot_locked = 0
        self.retired_tokens = 0   # the index is emptied and the allocator re-lists every slot
        self.region.reset()

    def live_slabs(self) -> dict[int, Any]:
        """Slab start -> its lowest node, for every slab the index holds."""
        return dict(self._bottom)

    # ------------------------------------------------------------------ admission
    def alloc_slab(self, n: int) -> Slab | None:
        """HOT-first: a free extent of ``n`` slots; else, with a dynamic split, one made by growing
        the region into the free slots above it (``split.grow_by``: tried first, it keeps every
        cached slab); else one made by evicting unlocked slabs whole; None when none can be had
        (the caller leaves the prefix COLD)."""
        room = self.split.hot_max if self.split is not None else self.region.capacity
        if room == 0 or n > room:
            return None
        slab = self.region.alloc(n)
        if slab is None and self.split is not None and self._grow_for(n):
            slab = self.region.alloc(n)
        if slab is None and n <= self.region.capacity and self.evict_hot_extent(n) > 0:
            slab = self.region.alloc(n)
        return slab

    def _grow_for(self, n: int) -> bool:
        r = self.region
        # the allocator's free list is private: grow_by is not told which slots above HOT are free
        # (cold_head_free=n passes that rule), region.grow checks it by what the allocator hands out
        d = self.split.grow_by(n, r.capacity, r.tail_free, r.allocator.available_size(), cold_head_free=n)
        if d <= 0:
            return False
        if not r.grow(d):              # the slots above HOT were not the allocator's next free ones
            self.moves["grow_refused"] += 1
            return False
        self.moves["grown"] += d
        return True

    # ------------------------------------------------------------------ COLD pressure (dynamic split)
    @property
    def shrinkable(self) -> int:
        """Free HOT slots a shrink could give the allocator now (0 with the static split)."""
        if self.split is None:
            return 0
        return max(0, min(self.region.tail_free, self.region.capacity - self.split.hot_min))

    def relieve(self, shortfall: int) -> int:
        """The allocator is ``shortfall`` slots short of an allocation: give it free slots at HOT's
        end (``split.shrink_by``: enough for the allocation and the COLD watermark, never a slot in
        use, never below ``hot_min``), before any cached COLD prefix is evicted. Returns the slots
        given (0 with the static split)."""
        if self.split is None or shortfall <= 0:
            return 0
        r = self.region
        avail = r.allocator.available_size()
        k = self.split.shrink_by(shortfall + avail, r.capacity, r.tail_free, avail)
        if k > 0:
            r.shrink(k)
            self.moves["shrunk"] += k
        return k

    def admit_prefix(self, key: Sequence, value: torch.Tensor, n: int, *,
                     match: Callable[[Sequence], tuple[torch.Tensor, Any]],
                     insert: Callable[[Sequence, torch.Tensor], Any],
                     lock: Callable[[Any], None], unlock: Callable[[Any], None],
                     copy_rows: Callable[[torch.Tensor, torch.Tensor], None],
                     promote: bool = False) -> AdmitResult:
        """Admit the shared prefix ``key[:n]`` whose KV sits at COLD slots ``value[:n]``.

        ``match(prefix) -> (cached_slots, node)`` is the index's longest match (it may split);
        ``insert(prefix, slots) -> node`` caches ``prefix`` at ``slots`` and returns the node
        ending at ``len(prefix)``; ``lock`` / ``unlock`` pin a path while room is made;
        ``copy_rows(dst, src)`` copies the KV rows of every layer. On ``"hot"`` the tail
        ``[cached, n)`` is cached at a new slab, and ``value[cached:n]`` (``result.src``) is no
        longer the index's: the caller gives it back to the allocator.

        ``promote``: when the cached head is all COLD (a prefix cached chunk by chunk), the slab
        takes the whole prefix: the head's rows are copied too, its nodes point at the slab, and
        their old slots are retired (the module docstring). The caller must hold a lock on the
        head (the request being cached does) and rewrite that request's row over the head.
        """
        n = min(int(n), len(key))
        if n <= 0:
            raise ValueError(f"HotColdTree.admit_prefix: n must be >= 1, got {n}")
        prefix = key[:n]
        cached_slots, node = match(prefix)
        cached = len(cached_slots)
        head = self._cold_head(node, cached) if promote and cached > 0 else None
        if cached >= n and head is None:
            self.counts["hit"] += 1
            return AdmitResult("hit", cached, node=node)
        if head is not None:
            return self._promote(prefix, value, n, cached_slots, node, head, insert, lock, unlock, copy_rows)
        lock(node)  # pin the cached part while room is made
        try:
            slab = self.alloc_slab(n - cached)
        finally:
            unlock(node)
        if slab is None:
            self.counts["cold"] += 1
            return AdmitResult("cold", cached, node=node)
        src = value[cached:n].to(torch.int64)
        dst = torch.arange(slab.start, slab.end, dtype=torch.int64, device=src.device)
        copy_rows(dst, src)
        new = insert(prefix, torch.cat((cached_slots.to(torch.int64).to(src.device), dst)))
        self.register(new, slab)
        self.counts["hot"] += 1
        return AdmitResult("hot", cached, slab, new, src, dst)

    def _promote(self, prefix, value, n, cached_slots, node, head, insert, lock, unlock, copy_rows) -> AdmitResult:
        cached = len(cached_slots)     # <= n (match() was asked for key[:n]); n: cached whole, chunk by chunk
        lock(node)
        try:
            slab = self.alloc_slab(n)
        finally:
            unlock(node)
        if slab is None:               # (the head is locked: making room never evicts it)
            self.counts["cold"] += 1
            return AdmitResult("cold", cached, node=node)
        src = torch.cat((cached_slots.to(torch.int64).to(value.device), value[cached:n].to(torch.int64)))
        dst = torch.arange(slab.start, slab.end, dtype=torch.int64, device=src.device)   # [n]
        copy_rows(dst, src)
        at = 0
        for h in head:                 # point the head at the slab; its old slots wait for its last lock
            k = len(h.value)
            setattr(h, RETIRED_ATTR, h.value)
            h.value = dst[at:at + k].to(h.value.device)
            setattr(h, SLAB_ATTR, slab)
            if h.lock_ref > 0:
                self.hot_locked += k
            self.retired_tokens += k
            at += k
        new = insert(prefix, dst.to(cached_slots.device))
        setattr(new, SLAB_ATTR, slab)
        self._bottom[slab.start] = new
        self.counts["hot"] += 1
        self.counts["promoted"] += 1
        return AdmitResult("hot", cached, slab, new, src[cached:], dst[cached:], promoted=cached)

    # ------------------------------------------------------------------ eviction
    def evict_hot_extent(self, length: int) -> int:
        """Evict unlocked slabs (each with its subtree) until one free extent holds ``length``
        slots; returns the HOT slots freed (0: an extent already fits, or none can be made)."""
        return eviction.evict_hot_extent(self, self.region.pool, self._bottom, length)

    def evict_cold(self, num_tokens: int, leaves: Iterable, root,
                   priority: Callable[[Any], Any] = lambda n: n.last_access_time) -> int:
        """Free at least ``num_tokens`` COLD slots (the allocator's shortfall), lowest
        ``priority`` first (SGLang: its eviction strategy; LRU by default); returns COLD slots
        freed (fewer when that is all there is).

        ``leaves`` are the index's evictable leaves (unlocked, no child); HOT ones are skipped:
        they hold no allocator slot. A COLD parent left childless joins the heap. Once no COLD
        leaf is left, the unlocked COLD node with children whose subtree was used least recently
        goes with its subtree (its slabs go whole): an unlocked COLD node is never out of reach.
        """
        return eviction.evict(self, root, num_tokens, "cold", leaves, priority)

    def cold_evictable(self, root) -> int:
        """COLD tokens in unlocked nodes (for checks: the index keeps this as a counter)."""
        return eviction.evictable_tokens(self, root, "cold")

    # ------------------------------------------------------------------ eviction.Tree
    @staticmethod
    def tokens(node) -> int:
        return len(node.value)

    @staticmethod
    def last_access(node):
        return node.last_access_time

    @staticmethod
    def evicted(node) -> bool:
        return node.parent is None or getattr(node, GONE_ATTR, False)

    def remove_subtree(self, top, nodes: list, slabs: list[Slab], cold: int, hot: int) -> None:
        """Delete ``nodes`` children first (each is a leaf when ``delete_leaf`` takes it), each
        COLD one's slots back to the allocator on the way; then the slabs back to the region."""
        for node in reversed(nodes):
            if self.slab_of(node) is None:
                self._free_cold(node.value)
            self._delete_leaf(node)
            setattr(node, GONE_ATTR, True)  # SGLang keeps a deleted node's parent link: mark it
        for slab in slabs:
            del self._bottom[slab.start]
            self.region.free(slab)
        self.evicted_cold_tokens += cold
        self.evicted_hot_tokens += hot
