"""Slab grouping of a decode batch: which HOT slab each request's prefix starts in, and for how long.

Pure torch, no SGLang import, no Python loop over requests: one ``searchsorted`` over the slab
table and one cumulative product over the batch's KV index rows. Runs on the device the
tensors are on (CPU in the tests, CUDA in a server).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SlabGroups:
    """Per request and per group results of :func:`group_by_slab` (``B`` requests, ``G`` groups).

    - ``slab_id`` ``[B]`` int64: the id of the slab the request's first KV index lies in, -1 if
      none (its prefix is COLD, or its sequence is empty).
    - ``hot_len`` ``[B]`` int64: how many leading KV indices lie contiguously in that slab
      (``row[j] == row[0] + j`` and inside the slab, ``j < seq_len``); 0 where ``slab_id`` is -1.
    - ``offset`` ``[B]`` int64: ``row[0] - slab start`` (0 for a prefix that starts its slab;
      -1 where ``slab_id`` is -1).
    - ``order`` ``[B]`` int64: request indices grouped by ``slab_id`` (ascending, -1 first),
      stable: within a group, batch order.
    - ``group_slab`` ``[G]``, ``group_start`` ``[G]``, ``group_size`` ``[G]`` int64: group ``g``
      is ``order[group_start[g] : group_start[g] + group_size[g]]``, all with slab id
      ``group_slab[g]``.
    """

    slab_id: torch.Tensor
    hot_len: torch.Tensor
    offset: torch.Tensor
    order: torch.Tensor
    group_slab: torch.Tensor
    group_start: torch.Tensor
    group_size: torch.Tensor


def group_by_slab(kv_rows: torch.Tensor, seq_lens: torch.Tensor, slab_start: torch.Tensor,
                  slab_len: torch.Tensor, slab_id: torch.Tensor) -> SlabGroups:
    """Group a batch's requests by the HOT slab their KV rows start in.

    ``kv_rows`` ``[B, W]`` (int32 or int64): row ``b`` holds request ``b``'s KV slot indices for
    token positions ``0..W-1`` (SGLang: ``req_to_token[req_pool_indices, :W]``); only the first
    ``seq_lens[b]`` entries count. ``W`` bounds the run measured: pass at least the longest
    slab's length (a run never exceeds its slab) for exact ``hot_len``; cost is O(B * W).
    ``seq_lens`` ``[B]``. The slab table: ``slab_start``, ``slab_len``, ``slab_id`` ``[S]``
    (any order; slabs are disjoint), e.g. ``HotRegion.table(device)``.
    """
    if kv_rows.dim() != 2:
        raise ValueError(f"group_by_slab: kv_rows must be [B, W], got shape {tuple(kv_rows.shape)}")
    B, W = kv_rows.shape
    dev = kv_rows.device
    rows = kv_rows.to(torch.int64)
    seq = seq_lens.to(device=dev, dtype=torch.int64).reshape(B)
    starts = slab_start.to(device=dev, dtype=torch.int64).reshape(-1)
    lens = slab_len.to(device=dev, dtype=torch.int64).reshape(-1)
    ids = slab_id.to(device=dev, dtype=torch.int64).reshape(-1)
    minus1 = torch.full((B,), -1, dtype=torch.int64, device=dev)
    if B == 0 or W == 0 or starts.numel() == 0:
        sid = minus1
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        return _groups(sid, zero, minus1.clone())

    starts, perm = torch.sort(starts)
    lens, ids = lens[perm], ids[perm]
    first = rows[:, 0].contiguous()
    k = torch.searchsorted(starts, first, right=True) - 1  # the last slab starting at or before first
    kc = k.clamp(min=0)
    end = starts[kc] + lens[kc]
    inside = (k >= 0) & (first < end) & (seq > 0)

    # leading run: position j continues it iff rows[:, j] == first + j; a run stops at the slab's
    # end and at the sequence's end
    pos = torch.arange(W, device=dev, dtype=torch.int64)
    cont = rows == first.unsqueeze(1) + pos.unsqueeze(0)  # [B, W]; column 0 is always True
    run = torch.cumprod(cont.to(torch.int32), dim=1).sum(dim=1).to(torch.int64)
    run = torch.minimum(torch.minimum(run, end - first), seq)

    sid = torch.where(inside, ids[kc], minus1)
    hot_len = torch.where(inside, run, torch.zeros_like(run))
    offset = torch.where(inside, first - starts[kc], minus1)
    return _groups(sid, hot_len, offset)


def _groups(sid: torch.Tensor, hot_len: torch.Tensor, offset: torch.Tensor) -> SlabGroups:
    sorted_sid, order = torch.sort(sid, stable=True)
    group_slab, group_size = torch.unique_consecutive(sorted_sid, return_counts=True)
    group_start = torch.cumsum(group_size, 0) - group_size
    return SlabGroups(sid, hot_len, offset, order, group_slab, group_start.to(torch.int64),
                      group_size.to(torch.int64))
