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
                             first, then the request's own tokens, the current token last;
                             None when the slots are given as rows of a slot table (below)
    prefix_lens list[int] [B]  leading slots of request i that are its shared prefix (0 = none)
    prefix_ids  list[int] [B]  class key: equal id <=> identical prefix slots; -1 = no prefix
    hot_starts  list[int] [B]  first global row of the prefix when it is one contiguous HOT
                             run (slots hot_start .. hot_start+prefix_len-1), else -1
    kv_indptr_host  optional int64 [B+1] host copy of kv_indptr (saves plan() a device->host sync)
    num_pad     the last ``num_pad`` rows are CUDA-graph padding, not requests: path decisions
                count only the other rows (pad rows may sit in a prefix class; outputs unused)
    slot_table  int64 [R, W] (device, contiguous) instead of kv_indices: request i's slots are
                slot_table[slot_rows[i], :kv_indptr[i+1]-kv_indptr[i]] (the engine's slot table,
                SGLang's req_to_token). The plan then gathers exactly the slot list it runs,
                the prefix already left out where a class splits off: ONE gather, where a
                materialised kv_indices costs a gather for the full lists and then a second
                pass that drops the prefixes. Needs ``kv_indptr_host``.
    slot_rows   int64 [B] (host): each request's row of ``slot_table``
    All index tensors live on the KV buffers' device; the lists are host-side.
    """

    kv_indptr: torch.Tensor
    kv_indices: Optional[torch.Tensor]
    prefix_lens: list[int]
    prefix_ids: list[int]
    hot_starts: list[int]
    kv_indptr_host: Optional[torch.Tensor] = None
    num_pad: int = 0
    slot_table: Optional[torch.Tensor] = None
    slot_rows: Optional[torch.Tensor] = None

    def __post_init__(self):
        self._rows: Optional[list[int]] = None             # slot_rows as a host list, made on first use
        if (self.kv_indices is None) == (self.slot_table is None):
            raise ValueError("DecodeBatch: give exactly one of kv_indices (the packed slot lists) and slot_table "
                             "(with slot_rows)")
        if self.slot_table is not None:
            b = len(self.prefix_lens)
            if self.slot_table.dim() != 2 or not self.slot_table.is_contiguous():
                raise ValueError(f"DecodeBatch.slot_table: must be a contiguous [rows, width] tensor, got shape "
                                 f"{tuple(self.slot_table.shape)}")
            if self.slot_rows is None or self.slot_rows.device.type != "cpu" or self.slot_rows.numel() != b:
                raise ValueError(f"DecodeBatch.slot_rows: a slot table needs a host tensor of {b} row ids "
                                 "(request i's slots are slot_table[slot_rows[i]])")
            if self.kv_indptr_host is None:
                raise ValueError("DecodeBatch.kv_indptr_host: a slot table needs the host copy of kv_indptr "
                                 "(the gather's offsets are computed on the host)")

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    def all_slots(self) -> torch.Tensor:
        """int64 [nnz] (device): every request's whole slot list, packed by kv_indptr (kv_indices, or
        gathered from the slot table: for references and checks, not for a step's plan)."""
        if self.kv_indices is not None:
            return self.kv_indices
        ip = self.kv_indptr_host.to(torch.int64)
        return self.slot_lists(None, ip)[1].long()

    def prefix_slots(self, row: int, prefix_len: int, indptr: Optional[list[int]] = None) -> torch.Tensor:
        """int64 [prefix_len] (device view): the first ``prefix_len`` slot ids of request ``row``.
        ``indptr``: kv_indptr as a host list (needed with kv_indices)."""
        if self.slot_table is not None:
            if self._rows is None:                     # host list once per batch: a tensor index per class costs more
                self._rows = self.slot_rows.tolist()
            return self.slot_table[self._rows[row], :prefix_len]
        s0 = indptr[row]
        return self.kv_indices[s0:s0 + prefix_len]

    def slot_lists(self, skip: Optional[torch.Tensor], rest_indptr_h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot lists one decode kernel reads: request i's slots from position ``skip[i]`` on.

        skip          int64 [B] host, None = 0 (every request's whole list)
        rest_indptr_h int64 [B+1] host: cumsum of (list length - skip), the packed layout (kv_indptr's
                      host copy when skip is None)
        -> (rest_indptr int32 [B+1], rest_indices int32 [nnz]), both on the device; no stream sync.
        """
        dev = self.kv_indptr.device
        nnz = int(rest_indptr_h[-1])
        if self.slot_table is not None:
            # flat slot j of request i: table.view(-1)[row_i * W + skip_i + (j - rest_indptr_i)]
            w = self.slot_table.shape[1]
            off = self.slot_rows * w - rest_indptr_h[:-1]                    # [B] host
            if skip is not None:
                off += skip
            b = off.numel()
            packed = to_device(torch.cat([off, rest_indptr_h.diff(), rest_indptr_h]), dev)
            off_d, lens_d, rest_indptr_d = packed.split([b, b, b + 1])    # [B], [B], [B+1]
            flat = arange(nnz, dev) + torch.repeat_interleave(off_d, lens_d, output_size=nnz)   # [nnz]
            return rest_indptr_d.int(), self.slot_table.view(-1).index_select(0, flat).int()
        if skip is None:
            return self.kv_indptr.int(), self.kv_indices.int()
        b = skip.numel()
        # rest slot j of row i sits at kv position j + (slots skipped by rows 0..i) = j + cumsum(skip)[i]
        packed = to_device(torch.cat([skip.cumsum(0), rest_indptr_h]), dev)   # one async host->device copy
        shift, rest_indptr_d = packed.split([b, b + 1])                   # [B], [B+1]
        j = arange(nnz, dev)                                              # [nnz]
        row = torch.searchsorted(rest_indptr_d[1:], j, right=True)         # [nnz] the row of rest slot j
        return rest_indptr_d.int(), self.kv_indices.index_select(0, j + shift.index_select(0, row)).int()


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
