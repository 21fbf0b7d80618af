"""COLD pool: token-granular slots (page size 1) for suffixes and decoded tokens."""
from __future__ import annotations

import torch

CHECK_MODES = ("sync", "deferred", "off")
ORDERS = ("fifo", "highest_first")  # the free list: a FIFO ring from ascending ids | kept sorted, highest first
# the mode a pool gets when ``validate`` is None, by device type (anything not listed: "deferred");
# tests may set DEFAULT_CHECKS["cuda"] = "sync" to have a CUDA engine raise at the faulty free itself
DEFAULT_CHECKS = {"cpu": "sync", "cuda": "deferred"}


def default_checks(device: str | torch.device) -> str:
    """The free-check mode of a pool on ``device`` when none is asked for."""
    return DEFAULT_CHECKS.get(torch.device(device).type, "deferred")


class ColdPool:
    """Vectorised allocator of single-token slots ``[offset, offset + capacity)``.

    The free list is a ring buffer of slot ids in one int64 tensor (SGLang keeps a tensor
    free list too); ``alloc`` and ``free`` touch only the ids they hand out or take back, so
    their cost is O(n) tensor work, never a Python loop per token. A per-slot allocation count
    (1 allocated, 0 free, below 0 freed more often than allocated; ids outside the pool count on
    a sentinel slot at either end) catches double frees, never-allocated ids, ids repeated within
    one free and foreign ids, without sorting: ``free`` subtracts one per id it gets back
    (``index_add_``, so a repeated id counts twice) and looks at the smallest count it touched.

    ``validate`` picks how ``free`` checks (``CHECK_MODES``; True is "sync", False "off", None
    ``default_checks(device)``: "sync" on CPU, "deferred" on CUDA):

    - "sync": the bad ``free`` raises ValueError and changes nothing. One device-to-host read
      per call, i.e. a stream sync on CUDA, which would make the engine's overlap schedule wait
      for the decode step in flight whenever a request finishes.
    - "deferred": the same count, with no host read: the smallest count seen is kept on the
      device (a handful of small kernels per free call, none synchronising) and, on CUDA, copied
      to pinned host memory behind an event. The next ``alloc`` / ``free`` whose event has
      completed (usually the next step's), or any ``check()``, raises ValueError naming the
      slots; the free list may then hold a slot twice, so every later call raises too.
    - "off": no check (SGLang's token pool does not check either).

    ``order`` is how ids are handed out: "fifo" (ids ascending at first, then in the order they
    were freed; the static split's pool) or "highest_first" (always the highest free ids: ``free``
    merges what it gets back into the sorted free list, O(free list) device work, still no host
    read). The second is for a pool below a HOT region whose end moves (:mod:`granikv.kv.
    dynamic_split`): the rows next to that end are the last handed out, so they stay free for the
    HOT region to grow into whenever COLD is not nearly full. A pool's low end moves with
    :meth:`release_low` (its lowest rows, all free, go to the HOT region) and :meth:`extend_low`
    (the rows just below come back).
    """

    def __init__(self, capacity: int, offset: int = 0, device: str | torch.device = "cpu",
                 validate: bool | str | None = None, order: str = "fifo"):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"ColdPool capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.offset = offset
        self.device = torch.device(device)
        if validate is None:
            mode = default_checks(self.device)
        elif isinstance(validate, bool):
            mode = "sync" if validate else "off"
        else:
            mode = validate
        if mode not in CHECK_MODES:
            raise ValueError(f"ColdPool validate must be a bool, None or one of {CHECK_MODES}, got {validate!r}")
        self.checks = mode
        self.validate = mode != "off"  # whether free() checks at all
        if order not in ORDERS:
            raise ValueError(f"ColdPool order must be one of {ORDERS}, got {order!r}")
        self.order = order
        # [capacity] free ids from _head on, _count of them (wrapping around); the rest is stale
        self._ring = torch.arange(offset, offset + capacity, dtype=torch.int64, device=self.device)
        if order == "highest_first":
            self._ring = self._ring.flip(0)
        self._head = 0  # index in _ring of the next id to hand out
        self._count = capacity  # free ids in the ring
        # allocation count of slot offset + i at [i + 1]; [0] and [capacity + 1] take ids outside the pool
        self._cnt = torch.zeros(capacity + 2, dtype=torch.int32, device=self.device)
        self._one = torch.ones((), dtype=torch.int32, device=self.device)
        self._low = torch.zeros((), dtype=torch.int32, device=self.device)  # deferred: smallest count seen
        self._low_host = self._event = None
        if mode == "deferred" and self.device.type == "cuda":
            self._low_host = torch.zeros((), dtype=torch.int32, pin_memory=True)
            self._event = torch.cuda.Event()
        self._broken: str | None = None  # set once a deferred check found a bad free

    @property
    def free_tokens(self) -> int:
        return self._count

    @property
    def used_tokens(self) -> int:
        return self.capacity - self._count

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` distinct slot ids as an int64 tensor ``[n]``, or None if fewer are free."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"ColdPool.alloc(n): n must be a positive int, got {n!r}")
        if self.checks == "deferred":
            self._raise_if_flagged(block=False)
        if n > self._count:
            return None
        h, cap = self._head, self.capacity
        if h + n <= cap:
            ids = self._ring[h:h + n].clone()
        else:
            ids = torch.cat((self._ring[h:], self._ring[: h + n - cap]))
        self._head = (h + n) % cap
        self._count -= n
        self._cnt[ids - (self.offset - 1)] = 1
        return ids

    def free(self, ids: torch.Tensor) -> None:
        """Give back ids from earlier ``alloc`` calls; a foreign, free or repeated id raises
        (at once with checks "sync", at a later call with "deferred"; see the class). ``ids`` may
        lie on the host (the prefix index keeps cached prefixes' slots there): they are copied to
        the pool's device first."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("ColdPool.free(ids): ids must be a 1-D int64 tensor of slot ids")
        n = ids.numel()
        if n == 0:
            return
        if ids.device != self.device:
            ids = ids.to(self.device)
        mode = self.checks
        if mode == "off":
            self._cnt[ids - (self.offset - 1)] = 0
        else:
            if mode == "deferred":
                self._raise_if_flagged(block=False)
            idx = (ids - (self.offset - 1)).clamp_(0, self.capacity + 1)  # outside -> a sentinel slot
            self._cnt.index_add_(0, idx, self._one.expand(n), alpha=-1)
            low = self._cnt[idx].amin()
            if mode == "sync":
                if int(low) < 0:  # the one host read of a checked free
                    self._cnt.index_add_(0, idx, self._one.expand(n))  # undo: the pool is unchanged
                    raise ValueError(self._diagnose(idx))
            else:
                torch.minimum(self._low, low, out=self._low)
                if self._event is not None:
                    self._low_host.copy_(self._low, non_blocking=True)
                    self._event.record()
        if self.order == "highest_first":  # the free list stays sorted, highest first
            self._set_ring(_merge_descending(self._free_ids(), ids))
            return
        cap = self.capacity
        tail = (self._head + self._count) % cap
        if tail + n <= cap:
            self._ring[tail:tail + n] = ids
        else:
            k = cap - tail
            self._ring[tail:] = ids[:k]
            self._ring[: n - k] = ids[k:]
        self._count += n

    def check(self) -> None:
        """Raise ValueError if any free so far gave back a bad id (waits for the device's pending
        work; with checks "sync" or "off" there is nothing pending to look at)."""
        if self.checks == "deferred":
            self._raise_if_flagged(block=True)

    def owned_mask(self) -> torch.Tensor:
        """Bool ``[capacity]``: True where the slot is allocated (for checks, not hot paths)."""
        return self._cnt[1:self.capacity + 1] > 0

    # ------------------------------------------------------------------ a moving low end (dynamic split)
    def head_free(self, limit: int) -> int:
        """How many of the lowest rows ``[offset, offset + limit)`` are free before the first
        allocated one (at most ``limit``). One host read (a stream sync on CUDA)."""
        limit = min(int(limit), self.capacity)
        if limit <= 0:
            return 0
        owned = self._cnt[1:limit + 1] != 0                          # [limit]
        return int(torch.where(owned.any(), owned.to(torch.int32).argmax(), limit))

    def release_low(self, n: int) -> None:
        """Hand the lowest ``n`` rows ``[offset, offset + n)`` out of this pool for good (to the HOT
        region below it); they must all be free. Raises ValueError, changing nothing, otherwise.
        O(capacity) tensor work and a host read: for the rare boundary move, not a hot path."""
        if not isinstance(n, int) or not 0 < n <= self.capacity:
            raise ValueError(f"ColdPool.release_low(n): n must be an int in [1, {self.capacity}], got {n!r}")
        if self.checks == "deferred":
            self._raise_if_flagged(block=True)
        if self.head_free(n) < n:
            raise ValueError(f"ColdPool.release_low({n}): rows [{self.offset}, {self.offset + n}) are not all free; "
                             "the boundary moves only over free rows")
        free = self._free_ids()
        keep = free[free >= self.offset + n]                          # [free_tokens - n], hand-out order kept
        if keep.numel() != self._count - n:
            raise ValueError(f"ColdPool.release_low({n}): the free list does not hold rows [{self.offset}, "
                             f"{self.offset + n}) exactly once (a bad free with checks off?)")
        self._cnt = torch.cat((self._cnt[:1], self._cnt[n + 1:]))    # [capacity - n + 2], sentinels kept
        self.offset += n
        self.capacity -= n
        self._set_ring(keep)

    def extend_low(self, n: int) -> None:
        """Take the ``n`` rows just below the pool, ``[offset - n, offset)``, as free rows (from the
        HOT region below, which gave them up). They join the end of the free list: handed out after
        every row free now, the row at the new low end last."""
        if not isinstance(n, int) or not 0 < n <= self.offset:
            raise ValueError(f"ColdPool.extend_low(n): n must be an int in [1, offset={self.offset}], got {n!r}")
        if self.checks == "deferred":
            self._raise_if_flagged(block=False)
        new = torch.arange(self.offset - 1, self.offset - n - 1, -1, dtype=torch.int64, device=self.device)  # [n]
        free = torch.cat((self._free_ids(), new))                     # [free_tokens + n]
        zeros = torch.zeros(n, dtype=self._cnt.dtype, device=self.device)
        self._cnt = torch.cat((self._cnt[:1], zeros, self._cnt[1:]))  # [capacity + n + 2]
        self.offset -= n
        self.capacity += n
        self._set_ring(free)

    def _free_ids(self) -> torch.Tensor:
        """The free ids in hand-out order, ``[free_tokens]`` (a copy)."""
        h, c, cap = self._head, self._count, self.capacity
        if h + c <= cap:
            return self._ring[h:h + c].clone()
        return torch.cat((self._ring[h:], self._ring[:h + c - cap]))

    def _set_ring(self, free: torch.Tensor) -> None:
        """A ring of ``capacity`` entries holding ``free`` ``[k]`` from index 0."""
        ring = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        ring[:free.numel()] = free
        self._ring, self._head, self._count = ring, 0, free.numel()

    # ------------------------------------------------------------------ checks
    def _raise_if_flagged(self, block: bool) -> None:
        if self._broken is None:
            if self._event is None:
                low = int(self._low)  # CPU (or a device without events): a plain read, no stream to wait on
            elif block or self._event.query():  # query(): has the last free's copy landed? (never waits)
                self._event.synchronize()
                low = int(self._low_host)
            else:
                return
            if low >= 0:
                return
            bad = (self._cnt < 0).nonzero().flatten()
            slots = [int(i) - 1 + self.offset for i in bad[:8] if 0 < int(i) <= self.capacity]
            outside = bool(((bad == 0) | (bad == self.capacity + 1)).any())
            self._broken = (
                "ColdPool.free: an id was not allocated (double free, never allocated, or repeated in one "
                f"free){'; an id outside this pool' if outside else ''}; slots freed more often than "
                f"allocated: {slots if slots else 'none still negative'}. Found after the fact (checks="
                "'deferred', the CUDA default: no stream sync per free), so the free list may hold a slot "
                "twice and this pool is unusable; ColdPool(validate='sync') raises in the faulty free itself")
        raise ValueError(self._broken)

    def _diagnose(self, idx: torch.Tensor) -> str:
        """The message of a failed "sync" free (its counts already restored)."""
        if bool(((idx == 0) | (idx == self.capacity + 1)).any()):
            return f"ColdPool.free: ids outside this pool's range [{self.offset}, {self.offset + self.capacity})"
        if not bool((self._cnt[idx] == 1).all()):
            return "ColdPool.free: an id is not allocated (double free or never allocated)"
        return "ColdPool.free: the same id appears twice in one free"


def _merge_descending(free: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``free`` ``[f]`` (distinct, descending) and ``ids`` ``[n]`` (distinct, any order, none in
    ``free``) as one descending ``[f + n]`` tensor: a sort of the ``n`` new ids and a merge by
    binary search (O(f log n)), not a sort of the whole list; no host read."""
    new = ids.sort(descending=True).values                        # [n]
    a, b = free.neg(), new.neg()                                  # ascending views of both
    out = torch.empty(free.numel() + new.numel(), dtype=torch.int64, device=free.device)
    # each element's place in the merge: its own index + how many of the other list come before it
    out[torch.arange(free.numel(), device=free.device) + torch.searchsorted(b, a)] = free
    out[torch.arange(new.numel(), device=free.device) + torch.searchsorted(a, b)] = new
    return out
