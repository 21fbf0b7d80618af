"""Continuous batching over the storage layer: arrivals, admission, chunked prefill, decode, frees.

Policy (SGLang's defaults where it has them): first-come first-served admission of arrived
requests while the KV budget and ``max_running_requests`` allow; prefill has priority over
decode; a prefill step takes chunks of ready requests up to ``chunked_prefill_size`` tokens
(a long prompt is split, its next chunk continues first); otherwise one decode step runs for
every request whose prefill is done.

KV accounting: a request's shared prefix goes through :class:`granikv.kv.Admission` (index hit,
new HOT slab, or COLD fallback, evicting LRU prefixes under pressure); its own tokens (suffix
and all but the last output token) are COLD slots reserved at admission, so a running request
never needs more memory and nothing is ever preempted. A request whose cached prefix tokens
are still being prefilled by another request waits until that KV is written (SGLang defers
such in-batch prefix sharers the same way); it never reads unwritten KV.

With a dynamic split (``Storage(split=SplitPolicy)``, ``system.hot_split=dynamic``) the HOT/COLD
boundary moves (granikv.kv.dynamic_split): before COLD prefixes are evicted to make room for a
request's own slots, free rows at HOT's end are given back to COLD when COLD would fall below its
watermark (the admission-pressure signal); a HOT admission that finds no extent first tries to
grow HOT into free COLD rows (inside :class:`granikv.kv.Admission`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from granikv.config import HardwareConfig
from granikv.kv import Admission, DynamicSplit, KVCache, Node, Placement, PrefixIndex, SplitPolicy
from granikv.request import Request


@dataclass
class Seq:
    """A request in flight: its slots, prefill progress and generated tokens.

    ``slots`` ``[prompt_len + output_len - 1]`` global KV slot ids: the shared prefix first,
    then the request's own COLD slots (``own``). KV for positions ``[0, computed)`` is written.
    """

    req: Request
    order: int
    slots: torch.Tensor | None = None
    own: torch.Tensor | None = None
    placement: Placement | None = None
    cached_len: int = 0              # prompt tokens whose KV was in the index at admission
    reused: int = 0                  # of those, how many are not recomputed (cached_len, or one less on a full hit)
    computed: int = 0
    prefix_id: int = -1
    hot_start: int = -1
    row: int = -1
    waits_on: list["Seq"] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)     # tokens the host has read back
    token_times: list[float] = field(default_factory=list)
    issued: int = 0                  # tokens launched (>= len(output_ids): the overlap schedule reads them a step late)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.computed >= self.prompt_len

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.req.output_len

    @property
    def where(self) -> str:
        return self.placement.where if self.placement is not None else "none"

    def ready(self) -> bool:
        """True when every cached prefix token this request reads has been written."""
        self.waits_on = [w for w in self.waits_on
                         if w.computed < min(self.cached_len, w.req.shared_len)]
        return not self.waits_on


@dataclass
class PrefillChunk:
    """Positions ``[start, end)`` of ``seq``'s prompt computed in one prefill step."""

    seq: Seq
    start: int
    end: int


class Storage:
    """The KV pools, prefix index and admission over one :class:`KVCache`'s buffers (reset per run).

    ``split``: the policy of a dynamic HOT/COLD split (None: the static split, the boundary fixed
    at ``kv.initial_hot_tokens``); each reset builds a fresh :class:`DynamicSplit` from the
    initial boundary. Build ``kv`` with ``cold_order="highest_first"`` for a dynamic split (its COLD
    pool then hands out the rows farthest from the boundary first, so HOT can grow).
    """

    def __init__(self, kv: KVCache, enable_hot: bool, split: SplitPolicy | None = None):
        self.kv = kv
        self.enable_hot = enable_hot
        self.policy = split
        self.reset()

    def reset(self) -> None:
        kv = self.kv
        kv.reset_pools()
        self.index = PrefixIndex(kv.hot_pool, kv.cold_pool)
        self.split = DynamicSplit(kv, self.policy) if self.policy is not None else None
        hot_ok = kv.hot_tokens > 0 or (self.split is not None and self.policy.hot_max > 0)
        self.admission = Admission(self.index, enable_hot=self.enable_hot and hot_ok, split=self.split)
        self.pad_slot = int(kv.cold_pool.alloc(1)[0])  # scratch slot for CUDA-graph padding rows
        self.peak_hot = self.peak_cold = 0

    def own_capacity(self) -> int:
        return self.kv.cold_pool.capacity - 1  # minus the pad slot

    def observe(self) -> None:
        self.peak_hot = max(self.peak_hot, self.kv.hot_pool.used_tokens)
        self.peak_cold = max(self.peak_cold, self.kv.cold_pool.used_tokens)


def check_fits(req: Request, storage: Storage) -> None:
    """Raise if ``req`` could never be admitted, even into an empty cache.

    With a dynamic split the boundary an idle engine is left at can be anywhere in the policy's
    bounds (cached slabs may hold HOT at ``hot_max``), so the check takes the worst case: COLD at
    its smallest (``capacity - hot_max``) and a prefix sure of HOT only up to ``hot_min``."""
    kv = storage.kv
    own = len(req.prompt_ids) - req.shared_len + req.output_len - 1
    pol = storage.policy
    if pol is not None:
        cold = pol.min_cold - 1  # minus the pad slot
        hot_ok = storage.admission.enable_hot and req.shared_len <= pol.hot_min
        need_cold = own + (0 if hot_ok else req.shared_len)
        if need_cold > cold:
            raise ValueError(
                f"config error at `system.hot_max_fraction`: request {req.rid} needs {need_cold} COLD KV slots "
                f"(prompt {len(req.prompt_ids)}, shared {req.shared_len}, output {req.output_len}); with "
                f"system.hot_split=dynamic the COLD region can shrink to {pol.min_cold} of {kv.capacity_tokens} "
                f"tokens (HOT up to {pol.hot_max}), which cannot hold it; lower hot_max_fraction, raise the "
                f"budget (hardware.kv_budget_tokens / mem_fraction) or shorten the workload")
        return
    cold = storage.own_capacity()
    hot_ok = storage.admission.enable_hot and req.shared_len <= kv.hot_tokens
    need_cold = own + (0 if hot_ok else req.shared_len)
    if need_cold > cold:
        raise ValueError(
            f"config error at `hardware.kv_budget_tokens`: request {req.rid} needs {need_cold} COLD KV "
            f"slots (prompt {len(req.prompt_ids)}, shared {req.shared_len}, output {req.output_len}) but the "
            f"budget gives {kv.capacity_tokens} tokens ({cold} COLD, {kv.hot_tokens} HOT); raise the budget "
            f"(kv_budget_tokens / mem_fraction) or shorten the workload")


def _on_one_path(a: Node, b: Node) -> bool:
    """True when ``a`` is ``b`` or an ancestor of it, or the other way round (the token paths of
    the two agree up to the shallower one's end). Walks the few nodes up each path."""
    for lo, hi in ((a, b), (b, a)):
        n = lo
        while n is not None:
            if n is hi:
                return True
            n = n.parent
    return False


class Scheduler:
    """Admits arrived requests, picks each step's work, records tokens and frees finished requests."""

    def __init__(self, storage: Storage, hw: HardwareConfig, max_rows: int):
        self.storage = storage
        self.hw = hw
        self.free_rows = deque(range(max_rows))
        self.pending: deque[Seq] = deque()   # not yet arrived or not yet admitted, by arrival
        self.active: list[Seq] = []          # admitted, not finished (prefilling or decoding)
        self.done: list[Seq] = []
        self.writers: list[Seq] = []         # admitted seqs still writing new prefix KV
        self.admitted_rows: list[Seq] = []   # seqs admitted in the last schedule() (runner fills rows)

    def add(self, seqs: list[Seq]) -> None:
        self.pending.extend(sorted(seqs, key=lambda s: (s.req.arrival_s, s.order)))

    @property
    def idle(self) -> bool:
        return not self.pending and not self.active

    def next_arrival(self) -> float | None:
        return self.pending[0].req.arrival_s if self.pending else None

    # ------------------------------------------------------------------ admission
    def _make_room(self, n: int) -> bool:
        """Evict LRU unlocked prefixes from COLD until ``n`` COLD slots are free (HOT slabs stay,
        unless cached below an evicted COLD prefix); False, with nothing evicted, if that is
        impossible now."""
        index, cold = self.storage.index, self.storage.kv.cold_pool
        if self.storage.split is not None:
            self.storage.split.relieve(n)  # free HOT tail rows first (COLD admission pressure)
        if cold.free_tokens < n:
            index.evict(n - cold.free_tokens, pool="cold")
        return cold.free_tokens >= n

    def _admit(self, s: Seq) -> bool:
        st, req = self.storage, s.req
        index, cold = st.index, st.kv.cold_pool
        prompt = req.prompt_ids
        own_n = len(prompt) - req.shared_len + req.output_len - 1
        # the one match of the shared prefix per admission attempt; Admission reuses it
        m = index.match(prompt[:req.shared_len]) if req.shared_len else None
        pin = m.node if m is not None else None
        if pin is not None:
            index.lock(pin)  # keep our cached prefix while making room for our own slots
        try:
            own = torch.empty(0, dtype=torch.int64, device=st.kv.device)
            if own_n:
                if not self._make_room(own_n):
                    return False
                own = cold.alloc(own_n)
            pl = None
            if req.shared_len:
                pl = st.admission.admit(prompt, req.shared_len, match=m)
                if pl is None:  # make COLD room for the uncached part (the paged fallback) and retry once
                    if self._make_room(req.shared_len - m.length):
                        pl = st.admission.admit(prompt, req.shared_len, match=m)
                if pl is None:
                    if own_n:
                        cold.free(own)
                    return False
        finally:
            if pin is not None:
                index.unlock(pin)
        s.own, s.placement = own, pl
        if pl is not None:
            s.slots = torch.cat((pl.slots.to(own.device), own))
            s.cached_len = s.computed = pl.new_from
            if s.computed == len(prompt):  # full hit: recompute the last token for its logits (as SGLang);
                s.computed -= 1            # its K/V goes to the scratch slot, never over the shared prefix
            s.prefix_id = pl.node.uid  # equal id <=> same locked index node <=> identical prefix slots
            runs = pl.hot_runs
            if len(runs) == 1 and runs[0][0] == 0 and runs[0][2] == req.shared_len:
                s.hot_start = runs[0][1]
            # writers of KV we read: their prefix path and our cached path overlap (m.node ends at cached_len)
            s.waits_on = [w for w in self.writers if w.placement.new_from < s.cached_len
                          and _on_one_path(m.node, w.placement.node)]
            if pl.new_from < req.shared_len:
                self.writers.append(s)
        else:
            s.slots = own
        s.reused = s.computed
        s.row = self.free_rows.popleft()
        st.observe()
        return True

    def admit_arrived(self, now: float) -> list[Seq]:
        """FCFS admission of requests with ``arrival_s <= now``; stops at the first that does not fit."""
        new = []
        while (self.pending and self.pending[0].req.arrival_s <= now
               and len(self.active) < self.hw.max_running_requests and self.free_rows):
            s = self.pending[0]
            if not self._admit(s):
                break
            self.pending.popleft()
            self.active.append(s)
            new.append(s)
        return new

    # ------------------------------------------------------------------ step selection
    def prefill_chunks(self) -> list[PrefillChunk]:
        budget, chunks = self.hw.chunked_prefill_size, []
        for s in self.active:
            if budget == 0:
                break
            if s.prefill_done or not s.ready():
                continue
            n = min(s.prompt_len - s.computed, budget)
            chunks.append(PrefillChunk(s, s.computed, s.computed + n))
            budget -= n
        return chunks

    def decode_seqs(self) -> list[Seq]:
        """Requests to decode next: prefill done and fewer tokens launched than their output length
        (lengths are fixed by the workload, no EOS, so this needs no token read back)."""
        return [s for s in self.active if s.prefill_done and s.issued < s.req.output_len]

    # ------------------------------------------------------------------ results
    def after_prefill(self, chunks: list[PrefillChunk], tokens: list[int | None], now: float) -> None:
        for c, tok in zip(chunks, tokens):
            c.seq.computed = c.end
            if tok is not None:  # the chunk that completes the prompt yields the first token
                c.seq.output_ids.append(tok)
                c.seq.token_times.append(now)
                c.seq.issued = 1
        self.writers = [w for w in self.writers if w.computed < w.req.shared_len]
        self._retire()

    def launched_decode(self, seqs: list[Seq]) -> None:
        """A decode step for ``seqs`` was launched (its tokens arrive with ``after_decode``)."""
        for s in seqs:
            s.issued += 1

    def after_decode(self, seqs: list[Seq], tokens: list[int], now: float) -> None:
        for s, tok in zip(seqs, tokens):
            s.output_ids.append(tok)
            s.token_times.append(now)
        self._retire()

    def _retire(self) -> None:
        st = self.storage
        keep = []
        for s in self.active:
            if not s.finished:
                keep.append(s)
                continue
            if s.own.numel():
                st.kv.cold_pool.free(s.own)
            if s.placement is not None:
                st.index.unlock(s.placement.node)
            self.free_rows.append(s.row)
            self.done.append(s)
        self.active = keep
