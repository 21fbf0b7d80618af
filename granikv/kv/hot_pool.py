"""HOT pool: contiguous slabs of token slots, one slab per shared prefix (first-fit)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Slab:
    """A contiguous run of token slots ``[start, start + length)`` in the HOT region.

    ``start`` is a global slot index (HOT rows come first in :class:`KVCache`), so a slab
    is both a plain view ``k[start:start+length]`` for dense kernels and a range of
    global ids for paged kernels.
    """

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


class HotPool:
    """First-fit allocator of contiguous extents over ``capacity`` token slots.

    Free space is a sorted list of disjoint extents ``(start, length)``; ``free`` coalesces a
    returned slab with its neighbours. A slab is never moved once allocated (no compaction),
    which is what keeps dense-backend addressing static while a prefix is cached.

    ``align``: every slab starts at a global slot that is a multiple of it (1: anywhere). A dense
    launch that folds ``f`` keys of a head into one (granikv.attention.hot_batch) needs slabs that
    start on a multiple of ``f``; the slots skipped to reach an aligned start stay free.
    """

    def __init__(self, capacity: int, offset: int = 0, align: int = 1):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"HotPool capacity must be an int >= 0, got {capacity!r}")
        if not isinstance(align, int) or isinstance(align, bool) or align < 1:
            raise ValueError(f"HotPool align must be an int >= 1, got {align!r}")
        self.capacity = capacity
        self.offset = offset
        self.align = align
        self._starts: list[int] = [offset] if capacity else []  # sorted free extent starts
        self._lens: list[int] = [capacity] if capacity else []
        self._live: dict[int, int] = {}  # start -> length of allocated slabs

    @property
    def free_tokens(self) -> int:
        return sum(self._lens)

    @property
    def used_tokens(self) -> int:
        return self.capacity - self.free_tokens

    @property
    def largest_free_extent(self) -> int:
        return max(self._lens, default=0)

    def room(self, n: int) -> int:
        """Free slots in one extent that always hold ``n`` slots from an aligned start."""
        return n + self.align - 1

    def fits(self, n: int) -> bool:
        """Whether :meth:`alloc` of ``n`` slots would succeed now."""
        a = self.align
        return any(length - (-(-s // a) * a - s) >= n for s, length in zip(self._starts, self._lens))

    @property
    def slabs(self) -> list[Slab]:
        """Allocated slabs, by start."""
        return [Slab(s, n) for s, n in sorted(self._live.items())]

    def alloc(self, n: int) -> Slab | None:
        """First free extent holding ``n`` slots from an aligned start, or None when none does."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"HotPool.alloc(n): n must be a positive int, got {n!r}")
        a = self.align
        for i, length in enumerate(self._lens):
            first = self._starts[i]
            start = -(-first // a) * a                  # the extent's first aligned slot
            head = start - first                        # slots skipped before it: they stay free
            if length - head < n:
                continue
            tail = length - head - n
            if head:
                self._lens[i] = head
                if tail:
                    self._starts.insert(i + 1, start + n)
                    self._lens.insert(i + 1, tail)
            elif tail:
                self._starts[i] = start + n
                self._lens[i] = tail
            else:
                del self._starts[i], self._lens[i]
            self._live[start] = n
            return Slab(start, n)
        return None

    def free(self, slab: Slab) -> None:
        """Return a whole slab; raises if it is not a live allocation (double free, wrong size)."""
        length = self._live.get(slab.start)
        if length is None:
            raise ValueError(f"HotPool.free: slab {slab} is not allocated (double free or foreign slab)")
        if length != slab.length:
            raise ValueError(
                f"HotPool.free: slab {slab} does not match the allocation at start={slab.start} "
                f"(length {length}); a HOT slab is freed only whole")
        del self._live[slab.start]
        i = bisect.bisect_left(self._starts, slab.start)
        start, n = slab.start, slab.length
        # coalesce with the right neighbour, then the left one
        if i < len(self._starts) and self._starts[i] == start + n:
            n += self._lens[i]
            del self._starts[i], self._lens[i]
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:
            self._lens[i - 1] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)

    # ------------------------------------------------------------------ a moving end (dynamic split)
    @property
    def end(self) -> int:
        """One past the last slot of the pool: ``offset + capacity``."""
        return self.offset + self.capacity

    @property
    def tail_free(self) -> int:
        """Length of the free extent that ends at :attr:`end` (0 when the last slot is in a slab)."""
        if self._starts and self._starts[-1] + self._lens[-1] == self.end:
            return self._lens[-1]
        return 0

    def grow(self, n: int) -> None:
        """Append ``n`` free slots ``[end, end + n)`` at the end (they join the tail free extent).
        Live slabs are untouched: the caller hands over rows nobody else uses (``DynamicSplit``)."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"HotPool.grow(n): n must be a positive int, got {n!r}")
        if self.tail_free:
            self._lens[-1] += n
        else:
            self._starts.append(self.end)
            self._lens.append(n)
        self.capacity += n

    def shrink(self, n: int) -> None:
        """Give back the last ``n`` slots; they must all be free (``n <= tail_free``), so no slab
        moves or loses a slot. Raises ValueError, changing nothing, otherwise."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"HotPool.shrink(n): n must be a positive int, got {n!r}")
        tail = self.tail_free
        if n > tail:
            raise ValueError(f"HotPool.shrink({n}): only the last {tail} slots of [{self.offset}, {self.end}) are "
                             "free; a HOT region shrinks only over free rows at its end")
        if n == tail:
            del self._starts[-1], self._lens[-1]
        else:
            self._lens[-1] -= n
        self.capacity -= n

    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(start, length)``, sorted and coalesced."""
        return list(zip(self._starts, self._lens))

    def eviction_window(self, length: int, evictable: Mapping[int, tuple]) -> list[int] | None:
        """The slabs to free so that one free extent holds ``length`` slots (the choice of
        :func:`granikv.kv.eviction.evict_hot_extent`, kept here with the pool it tiles).

        ``evictable`` maps the start of each slab that may be evicted to ``(newest_access,
        tokens)``: the most recent use of what would be evicted with it, and how many tokens
        that is; every other live slab is pinned (locked) and never moves. The candidate windows
        are runs of free extents and evictable slabs between pinned ones; of the windows starting
        at each block, the one whose newest access is the oldest is taken, fewer tokens and a
        lower address breaking ties. Returns the starts of the slabs of that window, in address
        order; ``[]`` when an extent already fits; None when no window can hold ``length``.
        With ``align`` > 1 a window must hold :meth:`room` slots (an aligned start inside it).
        Nothing is changed: the caller evicts (and ``free``s) the slabs it is given.
        """
        if not isinstance(length, int) or length <= 0:
            raise ValueError(f"HotPool.eviction_window: length must be a positive int, got {length!r}")
        if self.fits(length):
            return []
        length = self.room(length)
        if length > self.capacity:
            return None
        # blocks tiling the pool in address order: (start, length, info or None (free) or False (pinned))
        blocks = sorted([(s, n, None) for s, n in self.free_extents()]
                        + [(s, n, evictable.get(s, False)) for s, n in self._live.items()])
        best, best_starts = None, None
        for i in range(len(blocks)):
            if blocks[i][2] is False:
                continue
            total, newest, cost, starts = 0, -1, 0, []
            for j in range(i, len(blocks)):
                b = blocks[j]
                if b[2] is False:
                    break
                total += b[1]
                if b[2] is not None:
                    newest, cost = max(newest, b[2][0]), cost + b[2][1]
                    starts.append(b[0])
                if total >= length:
                    key = (newest, cost, blocks[i][0])
                    if best is None or key < best:
                        best, best_starts = key, starts
                    break
        return best_starts
