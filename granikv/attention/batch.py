"""The layout of one decode step that decode attention plans from (the engine builds it).

Contract between a host (the engine, or SGLang through the plugin) and
granikv.attention.decode.DecodeAttention: plan once per step from a :class:`DecodeBatch`, then run
once per layer on that layer's K/V buffers (FlashInfer's plan/run split).
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DecodeBatch:
    """One decode step: B requests, each with one query token and its KV slots.

    kv_indptr   int64 [B+1]  request i's slots are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices  int64 [nnz]  global KV slot ids (rows of KVCache buffers): the shared prefix
                             first, then the request's own tokens, the current token last
    prefix_lens list[int] [B]  leading slots of request i that are its shared prefix (0 = none)
    prefix_ids  list[int] [B]  class key: equal id <=> identical prefix slots; -1 = no prefix
    hot_starts  list[int] [B]  first global row of the prefix when it is one contiguous HOT
                             run (slots hot_start .. hot_start+prefix_len-1), else -1
    kv_indptr_host  optional int64 [B+1] host copy of kv_indptr (saves plan() a device->host sync)
    num_pad     the last ``num_pad`` rows are CUDA-graph padding, not requests: path decisions
                count only the other rows (pad rows may sit in a prefix class; outputs unused)
    All index tensors live on the KV buffers' device; the lists are host-side.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    prefix_lens: list[int]
    prefix_ids: list[int]
    hot_starts: list[int]
    kv_indptr_host: Optional[torch.Tensor] = None
    num_pad: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device`` without blocking the host: on CUDA it is staged in pinned
    memory and copied asynchronously (a plain ``.to(cuda)`` synchronises the stream, which would
    make the engine's overlap schedule wait for the step in flight). On CPU: ``.to``."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` without blocking the host on CUDA (pinned staging, async), see ``to_device``."""
    if dst.is_cuda:
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


def host_i64(values: list[int]) -> torch.Tensor:
    """An int64 host tensor of a list of ints, about 4x faster than ``torch.tensor(values)`` at a
    thousand entries (the list is packed by ``array`` in C, then wrapped without a copy)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


_aranges: dict[torch.device, torch.Tensor] = {}


def arange(n: int, device: torch.device | str) -> torch.Tensor:
    """``torch.arange(n, device=device)`` (int64) as a view of one cached buffer per device, grown to the
    next power of two: no launch per call once grown. Read-only: never write into the view."""
    device = torch.device(device)
    buf = _aranges.get(device)
    if buf is None or buf.numel() < n:
        buf = _aranges[device] = torch.arange(1 << max(n - 1, 0).bit_length(), device=device)
    return buf[:n]
