"""The FlashInfer (GPU) execution of a StepPlan: wrapper sets, persistent buffers, CUDA-graph mode.

One ``WrapperSet`` holds the FlashInfer wrappers and the index buffers of one step structure.
Eager mode (key None: a step no CUDA graph will replay, e.g. above ``cuda_graph_max_bs``) uses a
single set re-planned every step. Graph mode keeps one set per graph key (DecodeAttention.graph_key,
opaque here): a graph-mode FlashInfer wrapper cannot change its batch size, and a captured graph
bakes in buffer addresses, so everything run() reads lives in buffers that plan() overwrites in
place. Per layer, run() issues:

  rest decode (1 launch set) -> per split class: dense single prefill on the HOT slab view /
  hydragen gather + single prefill / ONE paged batch prefill for all per-class-cascade classes
  -> scatter into the prefix state -> ONE in-place merge. Classes whose rows are one run of the
  batch (the engine orders rows by class) skip the gather and scatter: they read q and merge into o
  as slices (the cascade classes as ONE slice when their rows, class after class, are one run).

The dense (and HydraGen) single prefill runs over ``n`` interleaved KV chunks folded into the head
dimension (flashinfer_ops.single_prefill_split: still one launch, plus one merge_states), with ``n``
chosen so the CTAs fill the SMs (FlashInfer's Hopper single prefill has no split-KV: 64 CTAs on 132
SMs at B=256, Hq=32). ``KernelSpec.dense_kv_splits`` fixes ``n`` (1 = the plain call).

With ``KernelSpec.multilevel_cascade`` (the batch-global cascade, ``cascade_impl="multilevel"``) a
step with a split class runs FlashInfer's MultiLevelCascadeAttentionWrapper (2 levels); otherwise
that class takes the per-class cascade path above (batch prefill, tensor-core decode, merge).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Optional

import torch

from granikv.attention import flashinfer_ops as fo
from granikv.attention import sdpa_ops
from granikv.attention.batch import copy_from_host, host_i64
from granikv.attention.plan import ClassPlan, StepPlan


def host_range(name: str):
    """A torch.profiler range ``name`` while the profiler records, else nothing (no cost outside a trace).
    Eager calls only: a replayed CUDA graph carries no host range inside it."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def prefix_mark():
    """A ``prefix_attention`` range around a prefix-attention call (the GPU annotation the
    distance_to_limit and profiler exhibits split a step's attention by)."""
    return host_range("prefix_attention")


def pow2(n: int) -> int:
    """The next power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def rest_bucket(n: int, capacity: Optional[int]) -> int:
    """Rest-decode index capacity of a graph-mode wrapper set for a step with ``n`` rest indices:
    ``capacity`` (the shared buffer) when it holds them, else the next power of two (a set of its
    own; cannot happen when the engine sized the capacity, kept for direct use)."""
    return capacity if capacity and n <= capacity else pow2(n)


@dataclass(frozen=True)
class KernelSpec:
    """What every FlashInfer call of one DecodeAttention is built with (heads per TP rank)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    sm_scale: float
    tensor_cores: bool                    # decode wrappers' use_tensor_cores (SGLang's rule)
    dense_kv_splits: Optional[int]        # KV chunks of a dense/HydraGen prefix call; None = fill the SMs
    multilevel_cascade: bool              # a split step runs MultiLevelCascadeAttentionWrapper
    fast_decode_plan: bool = False        # decode re-plans through flashinfer_ops.plan_decode(fast=True)
    dense_kernel: str = "flashinfer"      # the dense prefix call: flashinfer | cudnn | fa2 (sdpa_ops)


@dataclass(slots=True)
class Segment:
    """One split-off class as run() reads it: views into its wrapper set's persistent buffers."""

    choice: str                           # dense | hydragen | cascade
    rows: torch.Tensor                    # int64 [B_class] view of rows_buf
    prefix_len: int
    hot_start: int
    slots: Optional[torch.Tensor]         # hydragen: int64 [Lp] view of slots_buf, else None
    span: Optional[tuple[int, int]]       # (row_start, B_class) when the rows are contiguous, else None


def cascade_span(cas: list[ClassPlan]) -> Optional[tuple[int, int]]:
    """(first row, rows) when the rows of the cascade classes ``cas``, class after class, are one run
    of the batch, else None (some class's rows are not a run, or two classes are not adjacent)."""
    if not cas or cas[0].row_start < 0:
        return None
    end = cas[0].row_start
    for c in cas:
        if c.row_start != end:
            return None
        end += len(c.rows)
    return cas[0].row_start, end - cas[0].row_start


class WrapperSet:
    """FlashInfer wrappers + persistent buffers for one step structure (see module doc)."""

    def __init__(self, paths: "GpuPaths", graph: bool, batch_size: int, rest_cap: int, split: list[ClassPlan],
                 rest_buf: Optional[torch.Tensor] = None):
        spec = self.spec = paths.spec
        self.graph = graph
        dev = spec.device
        self.ws = fo.workspace(dev)
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        b = batch_size
        i32 = dict(dtype=torch.int32, device=dev)
        # graph mode: the rest-decode indices live in ``rest_buf`` (the shared buffer, int32
        # [>= rest_cap]) when given, else in a buffer of this set's own
        rest_idx = (rest_buf[:rest_cap] if rest_buf is not None else torch.zeros(rest_cap, **i32)) if graph else None
        self.multilevel = spec.multilevel_cascade and bool(split)
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
            self.decode = fo.make_decode_wrapper(self.ws, spec.tensor_cores, bufs)
            cas = [c for c in split if c.choice == "cascade"]
            if cas:
                n, nnz = len(cas), sum(c.prefix_len for c in cas)
                pbufs = None
                if graph:
                    pbufs = {"qo_indptr": torch.zeros(n + 1, **i32), "indptr": torch.zeros(n + 1, **i32),
                             "indices": torch.zeros(nnz, **i32), "last_page_len": torch.ones(n, **i32)}
                self.prefill = fo.make_prefill_paged_wrapper(self.ws, pbufs)
        self.last_page_len = torch.ones(b, dtype=torch.int32)            # host: FlashInfer's plan reads it on the host
        self.decode_plan = ""        # which decode plan the last plan() ran: plan | fast ("" before one / multilevel)
        # (qo_indptr, kv_indptr) of the per-class cascade prefill's last plan: a step with the same
        # ones re-uses that schedule (see plan())
        self.cas_shape: Optional[tuple] = None
        self.rows_buf = torch.zeros(b, dtype=torch.int64, device=dev)     # split classes' rows, class after class
        self.slots_buf: Optional[torch.Tensor] = None                     # hydragen prefix slots
        lp_h = max((c.prefix_len for c in split if c.choice == "hydragen"), default=0)
        if lp_h:
            self.slots_buf = torch.zeros(sum(c.prefix_len for c in split if c.choice == "hydragen"),
                                         dtype=torch.int64, device=dev)
            self.scratch_k, self.scratch_v = paths.scratch(lp_h)

    def fits(self, p: StepPlan) -> bool:
        """Eager mode: whether this set's wrappers and buffers serve ``p`` (else the cheap set is rebuilt)."""
        if (self.spec.multilevel_cascade and bool(p.split)) != self.multilevel or self.rows_buf.numel() < p.batch_size:
            return False
        if any(c.choice == "cascade" for c in p.split) and self.prefill is None:
            return False
        need = [c.prefix_len for c in p.split if c.choice == "hydragen"]
        if need and (self.slots_buf is None or self.slots_buf.numel() < sum(need) or self.scratch_k.shape[0] < max(need)):
            return False
        return True

    def plan(self, p: StepPlan) -> None:
        spec = self.spec
        b = p.batch_size
        if self.multilevel:
            c = p.split[0]
            fo.plan_cascade(self.cascade, [torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                            [torch.tensor([0, c.prefix_len], dtype=torch.int32), p.rest_indptr_host],
                            [c.slots.to(spec.device, torch.int32), p.rest_indices], spec.num_q_heads,
                            spec.num_kv_heads, spec.head_dim, spec.sm_scale, spec.dtype, spec.dtype)
            self.segments: list[Segment] = []
            return
        self.decode_plan = fo.plan_decode(self.decode, p.rest_indptr_host, p.rest_indices, self.last_page_len[:b],
                                          spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.dtype,
                                          spec.sm_scale, fast=spec.fast_decode_plan)
        # rows of the split classes, packed class after class into one persistent buffer, cascade
        # classes first: their rows are then one contiguous view rows_buf[:n_cascade_rows], the same
        # storage at every plan() (a captured graph keeps reading it; the order is fixed by the graph key)
        split = sorted(p.split, key=lambda c: c.choice != "cascade")    # stable
        # one class holding every request: all B queries attend the same prefix, so the prefix state
        # is computed on q as is and merged in place, no gather / scatter (order-free, graph-safe:
        # B_class == B is part of the graph key)
        self.full_cover = len(split) == 1 and len(split[0].rows) == b
        cas = [c for c in split if c.choice == "cascade"]
        # cascade classes whose rows, packed class after class, are one run of the batch (the engine
        # orders decode rows by class): the batched prefill reads q and merges into o as one slice at
        # that run, no gather / scatter (the row runs are part of the graph key)
        self.cas_span = cascade_span(cas)
        # run() reads rows_buf only to gather / scatter: for cascade classes that are not one run, and
        # for classes whose rows are not one run (contiguous classes are read as slices); else the copy
        # is skipped (a graph key fixes the choices and row runs, so a captured graph never reads rows
        # it was not given)
        if not self.full_cover and ((cas and self.cas_span is None) or any(c.row_start < 0 for c in split)):
            rows_all = [r for c in split for r in c.rows]
            copy_from_host(self.rows_buf[:len(rows_all)], host_i64(rows_all))   # ONE host->device copy
        self.segments = []
        off, soff = 0, 0
        for c in split:
            n = len(c.rows)
            slots = None
            if c.choice == "hydragen":
                self.slots_buf[soff:soff + c.prefix_len].copy_(c.slots)
                slots = self.slots_buf[soff:soff + c.prefix_len]
                soff += c.prefix_len
            span = (c.row_start, n) if c.row_start >= 0 else None
            self.segments.append(Segment(c.choice, self.rows_buf[off:off + n], c.prefix_len, c.hot_start, slots, span))
            off += n
        self.cas_rows = None
        if cas:
            qo = [0]
            kv = [0]
            for c in cas:
                qo.append(qo[-1] + len(c.rows))
                kv.append(kv[-1] + c.prefix_len)
            slots = torch.cat([c.slots for c in cas]) if len(cas) > 1 else cas[0].slots     # [sum Lp] device
            shape = (tuple(qo), tuple(kv))
            if shape == self.cas_shape and fo.keeps_prefill_schedule(self.prefill):
                # the prefill schedule depends only on the indptrs: keep it, give the kernel this
                # step's prefix slots (the classes' prefixes stay put while they live: mostly the same ids)
                fo.set_prefill_indices(self.prefill, slots)
            else:
                fo.plan_prefill_paged(self.prefill, torch.tensor(qo, dtype=torch.int32),
                                      torch.tensor(kv, dtype=torch.int32), slots, spec.num_q_heads,
                                      spec.num_kv_heads, spec.head_dim, causal=False, sm_scale=spec.sm_scale,
                                      q_dtype=spec.dtype, kv_dtype=spec.dtype,
                                      last_page_len=self.last_page_len[:len(cas)])
                self.cas_shape = shape
            if self.cas_span is None:
                self.cas_rows = self.rows_buf[:qo[-1]]  # the cascade classes' rows, in qo order (packed first)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], k_cache / v_cache [C, Hkv, D] -> o [B, Hq, D]."""
        kv = fo.paged(k_cache, v_cache)
        if self.multilevel:
            return self.cascade.run(q, kv)
        if not self.segments:
            return self.decode.run(q, kv)
        o, lse = self.decode.run(q, kv, return_lse=True)            # [B, Hq, D], [B, Hq] base 2
        if self.full_cover:
            seg = self.segments[0]
            if seg.choice == "cascade":
                with prefix_mark():
                    oc, lc = self.prefill.run(q, kv, return_lse=True)
            else:
                oc, lc = self._prefix_state(seg, q, k_cache, v_cache, gather=False)
            fo.merge_state_in_place(o, lse, oc, lc)
            return o
        # a class with contiguous rows (the engine orders decode rows by class) reads q and merges
        # into o as slices; the others gather, scatter into one prefix state, and merge once
        gathered = [s for s in self.segments if s.choice != "cascade" and s.span is None]
        o_pre = lse_pre = None
        if gathered or self.cas_rows is not None:
            o_pre = torch.zeros_like(o)
            lse_pre = torch.full_like(lse, -math.inf)
        if self.cas_span is not None:
            a, n = self.cas_span
            with prefix_mark():
                oc, lc = self.prefill.run(q[a:a + n], kv, return_lse=True)
            fo.merge_state_in_place(o[a:a + n], lse[a:a + n], oc, lc)
        for seg in self.segments:
            if seg.choice == "cascade":
                continue
            if seg.span is not None:
                a, n = seg.span
                oc, lc = self._prefix_state(seg, q[a:a + n], k_cache, v_cache, gather=False)
                fo.merge_state_in_place(o[a:a + n], lse[a:a + n], oc, lc)
                continue
            oc, lc = self._prefix_state(seg, q, k_cache, v_cache)
            o_pre.index_copy_(0, seg.rows, oc)
            lse_pre.index_copy_(0, seg.rows, lc)
        if self.cas_rows is not None:
            with prefix_mark():
                oc, lc = self.prefill.run(q.index_select(0, self.cas_rows), kv, return_lse=True)
            o_pre.index_copy_(0, self.cas_rows, oc)
            lse_pre.index_copy_(0, self.cas_rows, lc)
        if o_pre is not None:
            fo.merge_state_in_place(o, lse, o_pre, lse_pre)
        return o

    def _prefix_state(self, seg: Segment, q, k_cache, v_cache, gather: bool = True):
        with prefix_mark():
            return self._prefix_state_call(seg, q, k_cache, v_cache, gather)

    def _prefix_state_call(self, seg: Segment, q, k_cache, v_cache, gather: bool):
        lp, hs = seg.prefix_len, seg.hot_start
        qc = q.index_select(0, seg.rows) if gather else q
        if seg.choice == "dense":
            kp, vp = k_cache[hs:hs + lp], v_cache[hs:hs + lp]        # contiguous HOT slab views
        else:                                                       # hydragen: gather to scratch first
            kp, vp = self.scratch_k[:lp], self.scratch_v[:lp]
            torch.index_select(k_cache, 0, seg.slots, out=kp)
            torch.index_select(v_cache, 0, seg.slots, out=vp)
        if seg.choice == "dense" and self.spec.dense_kernel != "flashinfer":
            return sdpa_ops.sdpa_prefill_split(qc, kp, vp, self.spec.sm_scale, self.kv_splits(qc.shape[0], lp, True),
                                               self.spec.dense_kernel)
        return fo.single_prefill_split(qc, kp, vp, self.spec.sm_scale, self.kv_splits(qc.shape[0], lp))

    def kv_splits(self, rows: int, lp: int, gqa_packed: bool = False) -> int:
        """KV chunks of a dense/HydraGen prefix call with ``rows`` queries over ``lp`` keys (``gqa_packed``:
        the sdpa_ops kernels, whose CTAs tile the G x rows of each kv head)."""
        fixed = self.spec.dense_kv_splits
        if fixed is not None:
            return fixed if lp % fixed == 0 else 1
        s = self.spec
        if gqa_packed:
            return fo.dense_kv_splits(rows * (s.num_q_heads // s.num_kv_heads), s.num_kv_heads, lp, self.num_sms)
        return fo.dense_kv_splits(rows, s.num_q_heads, lp, self.num_sms)


class GpuPaths:
    """One DecodeAttention's GPU state: its wrapper sets, the one the current step uses, shared buffers."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.sets: dict = {}
        self.current: Optional[WrapperSet] = None
        # graph mode: ONE rest-decode index buffer (int32 [rest_capacity]) for every graph-mode set, as
        # SGLang keeps one CUDA-graph kv_indices buffer for all its graphs. Sharing is safe for the same
        # reason one set serves consecutive steps: plan() writes it on the compute stream, after the
        # previous step's kernels in stream order, and only the current step's plan is live.
        self.rest_buf: Optional[torch.Tensor] = None
        self._scratch: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def scratch(self, lp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """HydraGen's gather scratch, ONE pair (K, V: [>= lp, Hkv, D]) for every wrapper set (and so
        every captured graph), grown to the next power of two when a longer prefix comes. Steps run
        one after another, and a layer's scratch is dead once its attention returns. A set per
        structure with its own copy (2 x 16 MiB per set at Lp=8K, Llama-3.1-8B) pinned tens of GiB
        over hundreds of multi-prefix structures."""
        cur = self._scratch
        if cur is None or cur[0].shape[0] < lp:
            s = self.spec
            k = torch.empty(pow2(lp), s.num_kv_heads, s.head_dim, dtype=s.dtype, device=s.device)
            cur = self._scratch = (k, torch.empty_like(k))   # graphs captured on the old pair keep it alive
        return cur

    def plan(self, p: StepPlan, key: Optional[Hashable], rest_capacity: Optional[int]) -> None:
        """Plan step ``p`` on its wrapper set: the graph-mode set of ``key``, or, key None, the ONE
        eager set, rebuilt when too small (a graph-mode set per batch size the runner never captures
        would pin memory forever). ``rest_capacity``: the shared graph-mode index buffer's size."""
        graph = key is not None
        ws = self.sets.get(key)
        if ws is None or (not graph and not ws.fits(p)):
            n = p.rest_indices.numel()
            cap = rest_bucket(n, rest_capacity) if graph else pow2(n)
            shared = None
            if graph and rest_capacity and cap == rest_capacity:
                if self.rest_buf is None or self.rest_buf.numel() != cap:
                    self.rest_buf = torch.zeros(cap, dtype=torch.int32, device=self.spec.device)
                shared = self.rest_buf
            ws = WrapperSet(self, graph, p.batch_size, cap, p.split, rest_buf=shared)
            self.sets[key] = ws
        ws.plan(p)
        self.current = ws

    def release(self, key: Hashable) -> None:
        """Drop the graph-mode wrapper set of ``key`` (its captured graph was evicted)."""
        self.sets.pop(key, None)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.current.run(q, k_cache, v_cache)
