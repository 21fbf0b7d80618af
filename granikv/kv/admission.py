"""HOT-first admission of shared prefixes, COLD fallback, no demotion (paper B.10)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from granikv.kv.dynamic_split import DynamicSplit
from granikv.kv.prefix_index import Node, PrefixIndex, PrefixMatch
from granikv.kv.hot_pool import Slab


@dataclass
class Placement:
    """Where a request's shared prefix lives after admission.

    ``where`` is ``"hit"`` (already cached), ``"hot"`` (new HOT slab) or ``"cold"`` (new COLD
    ids, the paged fallback). ``slots`` ``[shared_len]`` are the prefix's global slot ids;
    ``new_from`` is the first token position whose KV the caller must compute (``shared_len``
    on a full hit); ``node`` is the index node of the prefix's last token, already locked
    once for this request (unlock it when the request finishes); ``node.uid`` identifies the
    prefix's slots while it is locked. ``hot_runs`` lists the ``(token_pos, slot_start, length)``
    contiguous HOT runs of the whole prefix, in token order (as :class:`PrefixMatch`).
    """

    where: str
    shared_len: int
    slots: torch.Tensor
    new_from: int
    node: Node
    slab: Slab | None = None
    hot_runs: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Admission:
    """Admits shared prefixes into the index: HOT if a contiguous extent fits, else COLD.

    A HOT prefix is never demoted or moved while cached. ``enable_hot=False`` (or a HOT
    pool of size 0) is the paged baseline. When no free HOT extent fits, unlocked slabs are
    evicted whole, least recently used first, to make one (``PrefixIndex.evict_hot_extent``;
    locked and live prefixes stay where they are); only when no extent can be made does the
    prefix fall back to COLD, evicting unlocked LRU prefixes from COLD alone
    (``evict(n, pool="cold")``) when COLD is short. If COLD cannot make room either, ``admit``
    returns None and nothing was evicted or allocated. ``log`` records each admission's
    placement, ``counts`` tallies them.

    ``split`` (a :class:`DynamicSplit` over the index's pools; None = the static split): when no
    free HOT extent fits, HOT first tries to grow into free COLD rows (``split.on_hot_miss``),
    before any slab is evicted; a COLD fallback first lets the split give back free HOT rows
    (``split.relieve``), before COLD prefixes are evicted.
    """

    index: PrefixIndex
    enable_hot: bool = True
    log: list[tuple[int, str, int]] = field(default_factory=list)  # (shared_len, where, slot_start)
    counts: Counter = field(default_factory=Counter)
    split: DynamicSplit | None = None

    def admit(self, tokens: Sequence[int], shared_len: int, match: PrefixMatch | None = None) -> Placement | None:
        """Place ``tokens[:shared_len]``. ``match``: the caller's ``index.match`` of exactly that
        prefix, its node locked by the caller since (saves matching the prefix again)."""
        if shared_len <= 0 or shared_len > len(tokens):
            raise ValueError(f"Admission.admit: shared_len must be in [1, len(tokens)={len(tokens)}], got {shared_len}")
        prefix = tokens[:shared_len]
        m = self.index.match(prefix) if match is None else match
        if m.length == shared_len:
            self.index.lock(m.node)
            return self._record(Placement("hit", shared_len, m.slots, shared_len, m.node, hot_runs=list(m.hot_runs)))
        self.index.lock(m.node)  # pin the cached part while we make room
        try:
            need = shared_len - m.length
            slab, ids = self._alloc_hot(need), None
            if slab is None:
                ids = self._alloc_cold(need)
                if ids is None:
                    return None
        finally:
            self.index.unlock(m.node)
        new = torch.arange(slab.start, slab.end, dtype=torch.int64) if slab is not None else ids
        slots = torch.cat((m.slots, new.to(m.slots.device)))
        node = self.index.extend(m, prefix, slots, slab=slab)
        self.index.lock(node)
        runs = list(m.hot_runs)
        if slab is not None:  # the new tail is one HOT run; it joins the last cached run if contiguous
            if runs and runs[-1][0] + runs[-1][2] == m.length and runs[-1][1] + runs[-1][2] == slab.start:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + need)
            else:
                runs.append((m.length, slab.start, need))
        where = "hot" if slab is not None else "cold"
        return self._record(Placement(where, shared_len, slots, m.length, node, slab, runs))

    def _alloc_hot(self, n: int) -> Slab | None:
        if not self.enable_hot or (self.index.hot_pool.capacity == 0 and self.split is None):
            return None
        slab = self.index.hot_pool.alloc(n)
        if slab is None and self.split is not None and self.split.on_hot_miss(n):  # grow into free COLD rows
            slab = self.index.hot_pool.alloc(n)
        if slab is None and self.index.evict_hot_extent(n) > 0:  # stale unlocked slabs make way
            slab = self.index.hot_pool.alloc(n)
        return slab

    def _alloc_cold(self, n: int) -> torch.Tensor | None:
        pool = self.index.cold_pool
        if self.split is not None:
            self.split.relieve(n)  # free HOT tail rows before cached COLD prefixes
        if pool.free_tokens < n:
            self.index.evict(n - pool.free_tokens, pool="cold")  # all or nothing, COLD only
        return pool.alloc(n) if pool.free_tokens >= n else None

    def _record(self, p: Placement) -> Placement:
        start = int(p.slots[p.new_from]) if p.new_from < p.shared_len else -1
        self.log.append((p.shared_len, p.where, start))
        self.counts[p.where] += 1
        return p
