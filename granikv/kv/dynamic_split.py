"""A dynamic HOT/COLD split: the boundary of one :class:`KVCache` moves online, over free rows only.

The static split fixes HOT rows ``[0, hot_fraction x capacity)`` at boot (the paper's design);
here the boundary ``b = kv.hot_tokens`` moves while the engine runs, by the rules of
:class:`granikv.kv.split_policy.SplitPolicy` (read its module docstring for when and by how
much). The mechanics, kept apart from the rules:

- ``grow(n)``: COLD rows ``[b, b + n)``, all free, leave the COLD pool (``ColdPool.release_low``)
  and join the free extent at the HOT pool's end (``HotPool.grow``); ``b += n``.
- ``shrink(n)``: HOT rows ``[b - n, b)``, all free (``n <= HotPool.tail_free``), leave the HOT pool
  (``HotPool.shrink``) and join the COLD pool's free list (``ColdPool.extend_low``); ``b -= n``.

Either refuses (ValueError, nothing changed) when a row it would move is in use, so no cached
slab moves, no slot changes owner while owned, and every row is in exactly one pool: HOT
capacity + COLD capacity = ``kv.capacity_tokens`` at every boundary. The pools are changed in
place, so a :class:`PrefixIndex` over them sees the new boundary at once. The COLD pool of a
dynamic split is built with ``order="highest_first"``: it always hands out its highest free rows,
so the rows next to the boundary are the last used and HOT can grow into them.
"""
from __future__ import annotations

from granikv.kv.kv_cache import KVCache
from granikv.kv.split_policy import SplitPolicy


class DynamicSplit:
    """Moves ``kv``'s HOT/COLD boundary by ``policy``; ``on_hot_miss`` and ``relieve`` are the two
    signals (from :class:`granikv.kv.Admission` and the engine's scheduler), ``grow`` / ``shrink``
    the raw moves. Counts what it did: ``moves``, ``grown`` / ``shrunk`` rows, the ``lowest`` and
    ``highest`` boundary seen since construction."""

    def __init__(self, kv: KVCache, policy: SplitPolicy):
        hot, cold = kv.hot_pool, kv.cold_pool
        if hot.offset != 0 or cold.offset != kv.hot_tokens or hot.capacity != kv.hot_tokens \
                or hot.capacity + cold.capacity != kv.capacity_tokens:
            raise ValueError(f"DynamicSplit: the pools must tile the buffer as HOT [0, b) + COLD [b, capacity); got "
                             f"HOT [{hot.offset}, {hot.end}), COLD at {cold.offset} x {cold.capacity}, b={kv.hot_tokens}, "
                             f"capacity {kv.capacity_tokens}")
        if policy.capacity != kv.capacity_tokens:
            raise ValueError(f"DynamicSplit: policy for {policy.capacity} rows, buffer of {kv.capacity_tokens}")
        if not policy.hot_min <= kv.hot_tokens <= policy.hot_max:
            raise ValueError(f"DynamicSplit: boundary {kv.hot_tokens} outside the policy's "
                             f"[{policy.hot_min}, {policy.hot_max}]")
        self.kv, self.policy = kv, policy
        self.moves = self.grown = self.shrunk = 0
        self.lowest = self.highest = kv.hot_tokens

    @property
    def boundary(self) -> int:
        """The first COLD row (= HOT rows)."""
        return self.kv.hot_tokens

    # ------------------------------------------------------------------ the rules
    def on_hot_miss(self, need: int) -> bool:
        """A HOT extent of ``need`` rows was asked for and none is free: grow if the policy allows.
        True when HOT grew (then an extent of ``need`` rows is free at its end)."""
        hot, cold = self.kv.hot_pool, self.kv.cold_pool
        tail = hot.tail_free
        deficit = need - tail
        if deficit <= 0:
            return False
        # the head scan (a host read) only when the cheap rules pass
        if self.policy.grow_by(need, self.boundary, tail, cold.free_tokens, deficit) == 0:
            return False
        d = self.policy.grow_by(need, self.boundary, tail, cold.free_tokens, cold.head_free(deficit))
        if d:
            self.grow(d)
        return d > 0

    def relieve(self, need: int = 0) -> int:
        """A COLD allocation of ``need`` rows is about to be made: give back free HOT tail rows if
        COLD would fall below the watermark (the policy's shrink rule). Returns the rows moved."""
        d = self.policy.shrink_by(need, self.boundary, self.kv.hot_pool.tail_free, self.kv.cold_pool.free_tokens)
        if d:
            self.shrink(d)
        return d

    # ------------------------------------------------------------------ the moves
    def grow(self, n: int) -> None:
        """Move COLD rows ``[b, b + n)`` (all free) into HOT. ValueError, nothing changed, if one is in use."""
        self.kv.cold_pool.release_low(n)   # checks first: raises before anything changed
        self.kv.hot_pool.grow(n)
        self._moved(n)

    def shrink(self, n: int) -> None:
        """Move HOT rows ``[b - n, b)`` (all free) into COLD. ValueError, nothing changed, if one is in a slab."""
        self.kv.hot_pool.shrink(n)         # checks first: raises before anything changed
        self.kv.cold_pool.extend_low(n)
        self._moved(-n)

    def _moved(self, delta: int) -> None:
        self.kv.hot_tokens += delta
        self.moves += 1
        if delta > 0:
            self.grown += delta
        else:
            self.shrunk -= delta
        self.lowest = min(self.lowest, self.kv.hot_tokens)
        self.highest = max(self.highest, self.kv.hot_tokens)

    def stats(self) -> dict:
        """What the split did, for a cell's metrics (token counts). ``hot_capacity_tokens`` and
        ``cold_capacity_tokens`` are each region's largest size in the run (so a peak never exceeds
        its capacity; the two may add up to more than the buffer); ``hot_final_tokens`` the boundary
        at the end."""
        cap = self.kv.capacity_tokens
        return {"hot_split": "dynamic", "hot_capacity_tokens": self.highest, "cold_capacity_tokens": cap - self.lowest,
                "hot_capacity_min_tokens": self.lowest, "hot_capacity_max_tokens": self.highest,
                "hot_final_tokens": self.boundary, "hot_boundary_moves": self.moves,
                "hot_grown_tokens": self.grown, "hot_shrunk_tokens": self.shrunk}
