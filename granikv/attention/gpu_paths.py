"""The FlashInfer (GPU) execution of a StepPlan: wrapper sets, persistent buffers, CUDA-graph mode.

One ``WrapperSet`` holds the FlashInfer wrappers and the index buffers of one step structure.
Eager mode (``cuda_graph=False``, or a step planned with ``graph=False``: one the runner will not
replay from a graph, e.g. above ``cuda_graph_max_bs``) uses a single set (key None) re-planned
every step. Graph mode keeps one set per ``backend.graph_key()``: a graph-mode FlashInfer wrapper
cannot change its batch size, and a captured graph bakes in buffer addresses, so everything run()
reads lives in buffers that plan() overwrites in place. Per layer, run() issues:

  rest decode (1 launch set) -> per split class: dense single prefill on the HOT slab view /
  hydragen gather + single prefill / ONE paged batch prefill for all per-class-cascade classes
  -> scatter into the prefix state -> ONE in-place merge.

The dense (and HydraGen) single prefill runs over ``n`` interleaved KV chunks folded into the head
dimension (flashinfer_ops.single_prefill_split: still one launch, plus one merge_states), with ``n``
chosen so the CTAs fill the SMs (FlashInfer's Hopper single prefill has no split-KV: 64 CTAs on 132
SMs at B=256, Hq=32). ``be.dense_kv_splits`` fixes ``n`` (1 = the plain call).

The batch-global ``cascade`` backend runs FlashInfer's MultiLevelCascadeAttentionWrapper (2 levels)
when ``be.cascade_impl == "multilevel"``; with ``"composed"`` its one class takes the per-class
cascade path above (batch prefill over the common prefix, tensor-core decode, merge).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from granikv.attention import flashinfer_ops as fo
from granikv.attention.batch import copy_from_host


def multilevel_cascade(be, split: list) -> bool:
    """True when this step runs FlashInfer's MultiLevelCascadeAttentionWrapper (batch-global cascade
    backend, ``cascade_impl="multilevel"``, a common prefix present)."""
    return be.name == "cascade" and be.cascade_impl == "multilevel" and bool(split)


def shared_scratch(be, lp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HydraGen's gather scratch, ONE pair per backend (K, V: [>= lp, Hkv, D]), grown to the next
    power of two when a longer prefix comes. Every wrapper set (and so every captured graph) of the
    backend points at it: steps run one after another, and a layer's scratch is dead once its
    attention returns. A set per structure kept its own copy before (2 x 16 MiB per set at Lp=8K,
    Llama-3.1-8B): hundreds of multi-prefix structures pinned tens of GiB (OOM, 2026-11-30)."""
    cur = getattr(be, "_scratch", None)
    if cur is None or cur[0].shape[0] < lp:
        n = 1 << max(0, lp - 1).bit_length()
        k = torch.empty(n, be.hkv, be.d, dtype=be.dtype, device=be.device)
        cur = be._scratch = (k, torch.empty_like(k))   # graphs captured on the old pair keep it alive
    return cur


class WrapperSet:
    """FlashInfer wrappers + persistent buffers for one step structure (see module doc)."""

    def __init__(self, be, graph: bool, batch_size: int, rest_cap: int, classes,
                 rest_buf: Optional[torch.Tensor] = None):
        self.be, self.graph = be, graph
        dev = be.device
        self.ws = fo.workspace(dev)
        self.tc = fo.use_tensor_cores(be.hq, be.hkv, be.dtype, be.tensor_core_decode)
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        b = batch_size
        i32 = dict(dtype=torch.int32, device=dev)
        # graph mode: the rest-decode indices live in ``rest_buf`` (the backend's shared buffer, int32
        # [>= rest_cap]) when given, else in a buffer of this set's own
        rest_idx = (rest_buf[:rest_cap] if rest_buf is not None else torch.zeros(rest_cap, **i32)) if graph else None
        split = [c for c in classes if c.choice != "paged"]
        self.multilevel = multilevel_cascade(be, split)
        self.decode = self.cascade = self.prefill = None
        if self.multilevel:
            lp = split[0].prefix_len
            bufs = None
            if graph:
                bufs = {"qo_indptr": [torch.zeros(2, **i32), torch.zeros(b + 1, **i32)],
                        "indptr": [torch.zeros(2, **i32), torch.zeros(b + 1, **i32)],
                        "indices": [torch.zeros(lp, **i32), rest_idx],
                        "last_page_len": [torch.ones(1, **i32), torch.ones(b, **i32)]}
            self.cascade = fo.make_cascade_wrapper(self.ws, 2, bufs)
        else:
            bufs = None
            if graph:
                bufs = {"indptr": torch.zeros(b + 1, **i32), "indices": rest_idx,
                        "last_page_len": torch.ones(b, **i32)}
            self.decode = fo.make_decode_wrapper(self.ws, self.tc, bufs)
            cas = [c for c in split if c.choice == "cascade"]
            if cas:
                n, nnz = len(cas), sum(c.prefix_len for c in cas)
                pbufs = None
                if graph:
                    pbufs = {"qo_indptr": torch.zeros(n + 1, **i32), "indptr": torch.zeros(n + 1, **i32),
                             "indices": torch.zeros(nnz, **i32), "last_page_len": torch.ones(n, **i32)}
                self.prefill = fo.make_prefill_paged_wrapper(self.ws, pbufs)
        self.last_page_len = torch.ones(b, dtype=torch.int32)            # host: FlashInfer's plan reads it on the host
        self.rows_buf = torch.zeros(b, dtype=torch.int64, device=dev)     # split classes' rows, class after class
        self.slots_buf: Optional[torch.Tensor] = None                     # hydragen prefix slots
        lp_h = max((c.prefix_len for c in split if c.choice == "hydragen"), default=0)
        if lp_h:
            self.slots_buf = torch.zeros(sum(c.prefix_len for c in split if c.choice == "hydragen"),
                                         dtype=torch.int64, device=dev)
            self.scratch_k, self.scratch_v = shared_scratch(be, lp_h)

    def plan(self, p) -> None:
        be = self.be
        b = p.batch_size
        split = [c for c in p.classes if c.choice != "paged"]
        if self.multilevel:
            c = split[0]
            dev = be.device
            fo.plan_cascade(self.cascade, [torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                            [torch.tensor([0, c.prefix_len], dtype=torch.int32), p.rest_indptr_host],
                            [c.slots.to(dev, torch.int32), p.rest_indices], be.hq, be.hkv, be.d, be.sm_scale,
                            be.dtype, be.dtype)
            self.segments = []
            return
        fo.plan_decode(self.decode, p.rest_indptr_host, p.rest_indices, self.last_page_len[:b], be.hq, be.hkv, be.d,
                       be.dtype, be.dtype, be.sm_scale)
        # rows of the split classes, packed class after class into one persistent buffer, cascade
        # classes first: their rows are then one contiguous view rows_buf[:n_cascade_rows], the same
        # storage at every plan() (a captured graph keeps reading it; the order is fixed by graph_key())
        split.sort(key=lambda c: c.choice != "cascade")             # stable
        rows_all = [r for c in split for r in c.rows]
        if rows_all:                 # ONE host->device copy for every split class's rows
            copy_from_host(self.rows_buf[:len(rows_all)], torch.tensor(rows_all, dtype=torch.int64))
        self.segments = []           # (choice, rows view, lp, hot_start, slots view, (row_start, n) or None)
        off, soff = 0, 0
        for c in split:
            n = len(c.rows)
            slots = None
            if c.choice == "hydragen":
                self.slots_buf[soff:soff + c.prefix_len].copy_(c.slots)
                slots = self.slots_buf[soff:soff + c.prefix_len]
                soff += c.prefix_len
            span = (c.row_start, n) if c.row_start >= 0 else None
            self.segments.append((c.choice, self.rows_buf[off:off + n], c.prefix_len, c.hot_start, slots, span))
            off += n
        # one class holding every request: all B queries attend the same prefix, so the prefix state
        # is computed on q as is and merged in place, no gather / scatter (order-free, graph-safe:
        # B_class == B is part of graph_key())
        self.full_cover = len(split) == 1 and len(split[0].rows) == b
        cas = [c for c in split if c.choice == "cascade"]
        self.cas_rows = None
        if cas:
            qo = [0]
            kv = [0]
            for c in cas:
                qo.append(qo[-1] + len(c.rows))
                kv.append(kv[-1] + c.prefix_len)
            fo.plan_prefill_paged(self.prefill, torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),
                                  torch.cat([c.slots for c in cas]), be.hq, be.hkv, be.d, causal=False,
                                  sm_scale=be.sm_scale, q_dtype=be.dtype, kv_dtype=be.dtype,
                                  last_page_len=self.last_page_len[:len(cas)])
            self.cas_rows = self.rows_buf[:qo[-1]]      # the cascade classes' rows, in qo order (packed first)

    def run(self, p, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        be = self.be
        kv = fo.paged(k_cache, v_cache)
        if self.multilevel:
            return self.cascade.run(q, kv)
        if not self.segments:
            return self.decode.run(q, kv)
        o, lse = self.decode.run(q, kv, return_lse=True)            # [B, Hq, D], [B, Hq] base 2
        if self.full_cover:
            seg = self.segments[0]
            if seg[0] == "cascade":
                oc, lc = self.prefill.run(q, kv, return_lse=True)
            else:
                oc, lc = self._prefix_state(seg, q, k_cache, v_cache, gather=False)
            fo.merge_state_in_place(o, lse, oc, lc)
            return o
        # a class with contiguous rows (the engine orders decode rows by class) reads q and merges
        # into o as slices; the others gather, scatter into one prefix state, and merge once
        gathered = [s for s in self.segments if s[0] != "cascade" and s[5] is None]
        o_pre = lse_pre = None
        if gathered or self.cas_rows is not None:
            o_pre = torch.zeros_like(o)
            lse_pre = torch.full_like(lse, -math.inf)
        for seg in self.segments:
            if seg[0] == "cascade":
                continue
            if seg[5] is not None:
                a, n = seg[5]
                oc, lc = self._prefix_state(seg, q[a:a + n], k_cache, v_cache, gather=False)
                fo.merge_state_in_place(o[a:a + n], lse[a:a + n], oc, lc)
                continue
            oc, lc = self._prefix_state(seg, q, k_cache, v_cache)
            o_pre.index_copy_(0, seg[1], oc)
            lse_pre.index_copy_(0, seg[1], lc)
        if self.cas_rows is not None:
            oc, lc = self.prefill.run(q.index_select(0, self.cas_rows), kv, return_lse=True)
            o_pre.index_copy_(0, self.cas_rows, oc)
            lse_pre.index_copy_(0, self.cas_rows, lc)
        if o_pre is not None:
            fo.merge_state_in_place(o, lse, o_pre, lse_pre)
        return o

    def _prefix_state(self, seg, q, k_cache, v_cache, gather: bool = True):
        choice, rows, lp, hs, slots, _ = seg
        qc = q.index_select(0, rows) if gather else q
        if choice == "dense":
            kp, vp = k_cache[hs:hs + lp], v_cache[hs:hs + lp]        # contiguous HOT slab views
        else:                                                       # hydragen: gather to scratch first
            kp, vp = self.scratch_k[:lp], self.scratch_v[:lp]
            torch.index_select(k_cache, 0, slots, out=kp)
            torch.index_select(v_cache, 0, slots, out=vp)
        return fo.single_prefill_split(qc, kp, vp, self.be.sm_scale, self.kv_splits(qc.shape[0], lp))

    def kv_splits(self, rows: int, lp: int) -> int:
        """KV chunks of a dense/HydraGen prefix call with ``rows`` queries over ``lp`` keys."""
        fixed = self.be.dense_kv_splits
        if fixed is not None:
            return fixed if lp % fixed == 0 else 1
        return fo.dense_kv_splits(rows, self.be.hq, lp, self.num_sms)


class GpuPaths:
    """Per-backend GPU state: the wrapper set(s) and which one the current step uses."""

    def __init__(self, be):
        self.be = be
        self.sets: dict = {}
        self.current: Optional[WrapperSet] = None
        # graph mode: ONE rest-decode index buffer (int32 [be.rest_capacity]) for every graph-mode set, as
        # SGLang keeps one CUDA-graph kv_indices buffer for all its graphs. Sharing is safe for the same
        # reason one set serves consecutive steps: plan() writes it on the compute stream, after the
        # previous step's kernels in stream order, and only the current step's plan is live.
        self.rest_buf: Optional[torch.Tensor] = None

    def plan(self, p, graph: Optional[bool] = None) -> None:
        """Plan step ``p`` on its wrapper set. ``graph``: whether the caller may replay a CUDA graph of
        this step (None = ``be.cuda_graph``). Eager steps share ONE set (key None), rebuilt when too
        small: a graph-mode set per batch size the runner never captures would pin memory forever."""
        be = self.be
        graph = be.cuda_graph if graph is None else (bool(graph) and be.cuda_graph)
        key = be.graph_key() if graph else None
        ws = self.sets.get(key)
        if ws is None or (not graph and not self._fits(ws, p)):
            from granikv.attention.backends import _pow2

            n = p.rest_indices.numel()
            cap = be.rest_bucket(n) if graph else _pow2(n)
            shared = None
            if graph and be.rest_capacity and cap == be.rest_capacity:
                if self.rest_buf is None or self.rest_buf.numel() != cap:
                    self.rest_buf = torch.zeros(cap, dtype=torch.int32, device=be.device)
                shared = self.rest_buf
            ws = WrapperSet(be, graph, p.batch_size, cap, p.classes, rest_buf=shared)
            self.sets[key] = ws
        ws.plan(p)
        self.current = ws

    @staticmethod
    def _fits(ws: WrapperSet, p) -> bool:
        """Eager mode: rebuild the (cheap) set when the structure needs other wrappers or buffers."""
        split = [c for c in p.classes if c.choice != "paged"]
        multilevel = multilevel_cascade(ws.be, split)
        if multilevel != ws.multilevel or ws.rows_buf.numel() < p.batch_size:
            return False
        if any(c.choice == "cascade" for c in split) and ws.prefill is None:
            return False
        need = [c.prefix_len for c in split if c.choice == "hydragen"]
        if need and (ws.slots_buf is None or ws.slots_buf.numel() < sum(need) or ws.scratch_k.shape[0] < max(need)):
            return False
        return True

    def release(self, key) -> None:
        """Drop the graph-mode wrapper set of ``key`` (its captured graph was evicted)."""
        self.sets.pop(key, None)

    def run(self, p, q, k_cache, v_cache) -> torch.Tensor:
        return self.current.run(p, q, k_cache, v_cache)
