"""COLD pool: token-granular slots (page size 1) for suffixes and decoded tokens."""
from __future__ import annotations

import torch


class ColdPool:
    """Vectorised allocator of single-token slots ``[offset, offset + capacity)``.

    The free list is a ring buffer of slot ids in one int64 tensor (SGLang keeps a tensor
    free list too); ``alloc`` and ``free`` touch only the ids they hand out or take back, so
    their cost is O(n) tensor work, never a Python loop per token. An ``owned`` mask and a
    stamp tensor catch double frees and foreign ids without sorting.

    ``validate`` (default: on for CPU pools, off for CUDA ones): ``free`` checks its ids. Each
    check reads a device value back to the host, i.e. synchronises the stream, which would make the
    engine's overlap schedule wait for the decode step in flight whenever a request finishes;
    SGLang's token pool does not check either. The CPU tests (state machine included) run with it.
    """

    def __init__(self, capacity: int, offset: int = 0, device: str | torch.device = "cpu",
                 validate: bool | None = None):
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"ColdPool capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.offset = offset
        self.device = torch.device(device)
        self._ring = torch.arange(offset, offset + capacity, dtype=torch.int64, device=self.device)
        self._head = 0  # index in _ring of the next id to hand out
        self._count = capacity  # free ids in the ring
        self._owned = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        self._stamp = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.validate = (self.device.type == "cpu") if validate is None else bool(validate)

    @property
    def free_tokens(self) -> int:
        return self._count

    @property
    def used_tokens(self) -> int:
        return self.capacity - self._count

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` distinct slot ids as an int64 tensor ``[n]``, or None if fewer are free."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"ColdPool.alloc(n): n must be a positive int, got {n!r}")
        if n > self._count:
            return None
        h, cap = self._head, self.capacity
        if h + n <= cap:
            ids = self._ring[h:h + n].clone()
        else:
            ids = torch.cat((self._ring[h:], self._ring[: h + n - cap]))
        self._head = (h + n) % cap
        self._count -= n
        self._owned[ids - self.offset] = True
        return ids

    def free(self, ids: torch.Tensor) -> None:
        """Give back ids from earlier ``alloc`` calls; raises on a foreign, free or repeated id."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("ColdPool.free(ids): ids must be a 1-D int64 tensor of slot ids")
        n = ids.numel()
        if n == 0:
            return
        local = ids - self.offset
        if self.validate:
            if bool(((local < 0) | (local >= self.capacity)).any()):
                raise ValueError(f"ColdPool.free: ids outside this pool's range "
                                 f"[{self.offset}, {self.offset + self.capacity})")
            if not bool(self._owned[local].all()):
                raise ValueError("ColdPool.free: an id is not allocated (double free or never allocated)")
            order = torch.arange(n, dtype=torch.int64, device=self.device)
            self._stamp[local] = order
            if not bool((self._stamp[local] == order).all()):
                raise ValueError("ColdPool.free: the same id appears twice in one free")
        self._owned[local] = False
        cap = self.capacity
        tail = (self._head + self._count) % cap
        if tail + n <= cap:
            self._ring[tail:tail + n] = ids
        else:
            k = cap - tail
            self._ring[tail:] = ids[:k]
            self._ring[: n - k] = ids[k:]
        self._count += n

    def owned_mask(self) -> torch.Tensor:
        """Bool ``[capacity]``: True where the slot is allocated (for checks, not hot paths)."""
        return self._owned.clone()
