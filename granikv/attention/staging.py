"""Pinned host staging for the small per-step arrays a captured decode step reads.

The host writes a step's plan (a few int32 arrays) into pinned memory and copies it to the device
asynchronously, so planning never waits for the GPU. Under an overlap scheduler the next step is
planned while the last copy may still be in flight; rewriting the pinned buffer then would change
what that copy reads. ``PinnedStaging`` keeps ``slots`` pinned buffers used in turn, each with an
event recorded after its copy: a slot is rewritten only once its previous copy has completed (the
wait is on that event alone, almost always already done; never a stream or device sync).
"""
from __future__ import annotations

import array
from typing import Optional

import torch


class PinnedStaging:
    """``slots`` pinned int32 buffers of ``size`` entries for async copies into device buffers.

    ``write(values, dst)``: values (a list of ints, at most ``size``) go through the next slot into
    ``dst[:len(values)]`` (int32, on the device; on CPU a plain copy). ``waits`` counts the writes that
    found their slot's previous copy still in flight and waited for it.
    """

    def __init__(self, size: int, device: torch.device | str, slots: int = 2):
        if size < 1 or slots < 1:
            raise ValueError(f"PinnedStaging: size and slots must be >= 1, got {size}, {slots}")
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.bufs = [torch.zeros(size, dtype=torch.int32, pin_memory=cuda) for _ in range(slots)]
        self.events: list[Optional[torch.cuda.Event]] = [None] * slots
        self.next = 0
        self.waits = 0

    def write(self, values: list[int], dst: torch.Tensor) -> None:
        """Stage ``values`` and copy them into ``dst[:len(values)]`` on the current stream (async on CUDA)."""
        n = len(values)
        i = self.next
        buf = self.bufs[i]
        if n > buf.numel():
            raise ValueError(f"PinnedStaging.write: {n} values exceed the staging size {buf.numel()}")
        ev = self.events[i]
        if ev is not None and not ev.query():       # this slot's last copy is still in flight
            self.waits += 1
            ev.synchronize()
        if n:                                       # packed in C, then one memcpy into the pinned slot
            buf[:n] = torch.frombuffer(array.array("i", values), dtype=torch.int32)
        if dst.is_cuda:
            dst[:n].copy_(buf[:n], non_blocking=True)
            ev = self.events[i] or torch.cuda.Event()
            ev.record()
            self.events[i] = ev
        else:
            dst[:n].copy_(buf[:n])
        self.next = (i + 1) % len(self.bufs)
