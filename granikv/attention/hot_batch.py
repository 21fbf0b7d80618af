"""The dense prefix path as ONE batched launch over every HOT group of a step.

The engine's dense path calls one single prefill per prefix class, each on its own contiguous HOT slab
(``flashinfer_ops.single_prefill_split``). Here every class served dense reads its slab through ONE
FlashInfer ragged batch prefill over the HOT region that holds the slabs:

- the region ``[region_start, region_start + region_len)`` of the KV cache is one contiguous tensor;
  its slabs, in address order, are the KV segments of the ragged call, and the gaps between them
  (slots of other classes, free slots) are segments with no queries;
- the query rows of the groups, group after group in the same address order, are one run of the batch
  (``row_start``, ``rows``): the engine and the plugin order decode rows by class;
- the KV fold of the engine's dense call is kept inside the one launch: key ``t = fold * t' + c`` of kv
  head ``h`` becomes key ``t'`` of kv head ``c * Hkv + h`` (a free view of the region), query head
  ``c * Hq + j`` is query head ``j``, and one ``merge_states`` folds the ``fold`` partial states. This
  needs ``region_start`` and every slab's start and length divisible by ``fold`` (HOT slabs aligned to it);
- a plan for ``max_segments`` segments pads with empty segments, so a wrapper captured in a CUDA graph
  (whose batch size is fixed at its first plan) is re-planned for any group count up to that size;
- ``lead_rows``: query rows before the groups' run (rows another launch serves) form a first segment
  over the region's first folded key, a dummy no slab may hold; their outputs are left unused. A
  captured launch then reads every row of a fixed query tensor, wherever its groups' rows begin.

``plan_hot_batch`` is pure host arithmetic (tested on CPU). ``HotBatch`` plans once per step and runs per
layer, as FlashInfer's cascade wrappers do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from granikv.attention import flashinfer_ops as fo


@dataclass(frozen=True)
class HotGroup:
    """One prefix class served dense: its HOT slab and its query rows (one run of the batch)."""

    hot_start: int          # first slot of the slab in the KV cache
    prefix_len: int         # Lp: slab length in tokens
    row_start: int          # first decode row of the class
    rows: int               # B_class


@dataclass(frozen=True)
class HotBatchPlan:
    """What one ragged launch reads, in folded keys (``fold`` keys of a kv head per folded key).

    qo_indptr / kv_indptr: host int32 lists of ``segments + 1`` entries; KV offsets are relative to
    ``region_start // fold``. Segment i covers q rows ``[qo_indptr[i], qo_indptr[i+1])`` of the
    groups' run and folded keys ``[kv_indptr[i], kv_indptr[i+1])``.
    """

    fold: int
    region_start: int       # slot of the region's first key (multiple of fold)
    region_len: int         # slots in the region (multiple of fold)
    row_start: int          # first decode row of the groups' run
    rows: int               # rows of the run (sum of B_class)
    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]

    @property
    def segments(self) -> int:
        return len(self.qo_indptr) - 1


def plan_hot_batch(groups: Sequence[HotGroup], fold: int = 1, max_segments: Optional[int] = None,
                   region: Optional[tuple[int, int]] = None, lead_rows: int = 0) -> HotBatchPlan:
    """The ragged segments of ``groups`` (any order; sorted by address here), gaps as empty segments,
    padded with empty segments to ``max_segments`` when given. ``region`` (start, length): a fixed region
    holding every slab (a captured launch bakes the region's address in), else the span of the slabs.
    ``lead_rows``: rows before the groups' run, served by the dummy first segment (module doc; needs
    ``region``, and the groups' rows then start at ``lead_rows``). Raises ValueError naming the field."""
    if fold < 1 or fold & (fold - 1):
        raise ValueError(f"hot_batch.fold: must be a power of two >= 1, got {fold}")
    gs = sorted(groups, key=lambda g: g.hot_start)
    for g in gs:
        if g.prefix_len <= 0 or g.rows <= 0 or g.hot_start < 0 or g.row_start < 0:
            raise ValueError(f"hot_batch.groups: need hot_start, row_start >= 0 and prefix_len, rows > 0, got {g}")
        if g.hot_start % fold or g.prefix_len % fold:
            raise ValueError(f"hot_batch.fold: slab [{g.hot_start}, +{g.prefix_len}) is not aligned to fold={fold}; "
                             "align HOT slabs to the fold or use a smaller fold")
    for a, b in zip(gs, gs[1:]):
        if b.hot_start < a.hot_start + a.prefix_len:
            raise ValueError(f"hot_batch.groups: slabs overlap ({a} and {b})")
        if b.row_start != a.row_start + a.rows:
            raise ValueError("hot_batch.groups: the groups' rows must be one run of the batch in slab address order "
                             f"({a} then {b}); order decode rows by slab address")
    if lead_rows < 0 or (lead_rows and region is None):
        raise ValueError(f"hot_batch.lead_rows: must be >= 0, and > 0 only with a fixed region, got {lead_rows}")
    if lead_rows and gs and (gs[0].row_start != lead_rows or gs[0].hot_start < region[0] + fold):
        raise ValueError(f"hot_batch.lead_rows: the groups' rows must start at row {lead_rows}, and no slab may hold "
                         f"the region's first {fold} keys (the lead rows' dummy), got {gs[0]}")
    qo, kv = [0], [0]
    if lead_rows:                                   # the lead rows' segment: one folded dummy key
        qo.append(lead_rows)
        kv.append(1)
    base = region[0] if region is not None else (gs[0].hot_start if gs else 0)
    stop = region[0] + region[1] if region is not None else (gs[-1].hot_start + gs[-1].prefix_len if gs else 0)
    if base % fold or stop % fold:
        raise ValueError(f"hot_batch.region: [{base}, {stop}) is not aligned to fold={fold}")
    if gs and (gs[0].hot_start < base or gs[-1].hot_start + gs[-1].prefix_len > stop):
        raise ValueError(f"hot_batch.region: [{base}, {stop}) does not hold every slab")
    end = base + fold * (1 if lead_rows else 0)
    for g in gs:
        if g.hot_start > end:                       # a gap: keys no query of this launch reads
            qo.append(qo[-1])
            kv.append((g.hot_start - base) // fold)
        qo.append(qo[-1] + g.rows)
        kv.append((g.hot_start + g.prefix_len - base) // fold)
        end = g.hot_start + g.prefix_len
    if stop > end:                                  # the region's tail past the last slab
        qo.append(qo[-1])
        kv.append((stop - base) // fold)
    n = len(qo) - 1
    if max_segments is not None:
        if n > max_segments:
            raise ValueError(f"hot_batch.max_segments: the step needs {n} segments (groups and gaps), the captured "
                             f"launch holds {max_segments}; capture with more segments")
        qo += [qo[-1]] * (max_segments - n)
        kv += [kv[-1]] * (max_segments - n)
    return HotBatchPlan(fold, base, stop - base, 0 if lead_rows else (gs[0].row_start if gs else 0),
                        lead_rows + sum(g.rows for g in gs), tuple(qo), tuple(kv))


class HotBatch:
    """One ragged FlashInfer prefill for every dense group of a step (module doc).

    graph: the wrapper's indptr buffers are fixed (``max_segments + 1`` int32 each) and ``plan`` writes
    them in place, so a captured ``run`` replays any later plan of the same segment count. A graph-mode
    ``run`` reads every row of ``q`` (the plan's rows are its first rows; the rest come back unset): the
    first plan, before capture, must cover every row (FlashInfer sizes a captured launch's work on it).
    """

    def __init__(self, ws: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 sm_scale: float, backend: str = "auto", max_segments: Optional[int] = None):
        self.hq, self.hkv, self.d, self.dtype, self.sm_scale = num_q_heads, num_kv_heads, head_dim, dtype, sm_scale
        self.max_segments = max_segments
        bufs = {}
        if max_segments is not None:
            i32 = dict(dtype=torch.int32, device=ws.device)
            bufs = dict(use_cuda_graph=True, qo_indptr_buf=torch.zeros(max_segments + 1, **i32),
                        kv_indptr_buf=torch.zeros(max_segments + 1, **i32))
        self.wrapper = fo.fi().BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend, **bufs)
        self.plan_: Optional[HotBatchPlan] = None

    def plan(self, p: HotBatchPlan) -> None:
        """Host plan of one step (once per step; every layer's run reads it)."""
        if self.max_segments is not None and p.segments != self.max_segments:
            raise ValueError(f"hot_batch.plan: {p.segments} segments, the wrapper holds {self.max_segments}; "
                             "plan with max_segments")
        n = p.fold
        self.wrapper.plan(torch.tensor(p.qo_indptr, dtype=torch.int32), torch.tensor(p.kv_indptr, dtype=torch.int32),
                          n * self.hq, n * self.hkv, self.d, causal=False, sm_scale=self.sm_scale,
                          q_data_type=self.dtype, kv_data_type=self.dtype)
        self.plan_ = p

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, D], k_cache / v_cache [C, Hkv, D] -> prefix state of the groups' rows:
        (o [rows, Hq, D], lse [rows, Hq] fp32, base 2); graph mode: of every row of q (class doc)."""
        p = self.plan_
        n = p.fold
        qs = q if self.max_segments is not None else q[p.row_start:p.row_start + p.rows]
        rows = qs.shape[0]
        o, s = self.run_folded(qs.repeat(1, n, 1) if n > 1 else qs, k_cache, v_cache)
        if n == 1:
            return o, s
        return fo.fi().merge_states(o.view(rows, n, self.hq, self.d), s.view(rows, n, self.hq))

    def run_folded(self, qn: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """The launch on queries already repeated for the plan's fold n: qn [rows, n*Hq, D] (head f*Hq + j =
        query head j) -> (o [rows, n*Hq, D], lse [rows, n*Hq]) holding n sub-states per head, unmerged (head
        f*Hq + j: the keys at positions = f mod n of each slab); :meth:`run` merges them."""
        p = self.plan_
        n = p.fold
        if qn.shape[1] != n * self.hq:
            raise ValueError(f"hot_batch.run_folded: queries of {qn.shape[1]} heads for fold {n} x {self.hq} heads")
        kr = k_cache[p.region_start:p.region_start + p.region_len].view(p.region_len // n, n * self.hkv, self.d)
        vr = v_cache[p.region_start:p.region_start + p.region_len].view(p.region_len // n, n * self.hkv, self.d)
        return self.wrapper.run(qn, kr, vr, return_lse=True)
