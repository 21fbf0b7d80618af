"""Per-layer K/V buffers: one allocation, HOT rows first, COLD rows after."""
from __future__ import annotations

import torch

from granikv.kv.cold_pool import ORDERS, ColdPool
from granikv.kv.hot_pool import HotPool, Slab


class KVCache:
    """K and V buffers of ``[capacity_tokens, kv_heads, head_dim]`` for each layer.

    Rows ``[0, hot_tokens)`` are the HOT region (contiguous slabs, :class:`HotPool`), rows
    ``[hot_tokens, capacity_tokens)`` the COLD region (single-token slots, :class:`ColdPool`).
    Every slot has one global row index, so paged kernels address HOT and COLD alike (the
    paged fallback) and a HOT slab is also a plain contiguous view ``[Lp, kv_heads, head_dim]``.
    ``hot_fraction=0`` makes every slot COLD: the paged baseline, same code path.

    ``hot_tokens`` is the boundary between the regions. It is fixed (the static split) unless a
    :class:`granikv.kv.DynamicSplit` moves it over free rows; :meth:`reset_pools` puts it back at
    ``initial_hot_tokens``. ``cold_order`` is the COLD pool's fresh free-list order
    (:class:`ColdPool` ``order``; "highest_first" for a dynamic split).
    """

    def __init__(self, num_layers: int, capacity_tokens: int, kv_heads: int, head_dim: int,
                 hot_fraction: float = 0.2, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", cold_order: str = "fifo"):
        if not (0.0 <= hot_fraction < 1.0):
            raise ValueError(f"KVCache hot_fraction must be in [0, 1), got {hot_fraction!r} "
                             "(0 = paged baseline, 0.2 = the paper's default)")
        for name, v in (("num_layers", num_layers), ("capacity_tokens", capacity_tokens),
                        ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVCache {name} must be a positive int, got {v!r}")
        self.num_layers = num_layers
        self.capacity_tokens = capacity_tokens
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.hot_fraction = hot_fraction
        if cold_order not in ORDERS:  # before the buffers are allocated
            raise ValueError(f"KVCache cold_order must be one of {ORDERS}, got {cold_order!r}")
        self.initial_hot_tokens = int(capacity_tokens * hot_fraction)
        self.cold_order = cold_order
        self.dtype = dtype
        self.device = torch.device(device)
        # [layers, capacity, kv_heads, head_dim]: layer l's K is a view of one allocation
        self.k_buffer = torch.zeros(num_layers, capacity_tokens, kv_heads, head_dim, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros_like(self.k_buffer)
        self.reset_pools()

    def reset_pools(self) -> None:
        """Fresh, empty pools at the initial split: HOT rows ``[0, initial_hot_tokens)``, COLD the rest."""
        self.hot_tokens = self.initial_hot_tokens
        self.hot_pool = HotPool(self.hot_tokens, offset=0)
        self.cold_pool = ColdPool(self.capacity_tokens - self.hot_tokens, offset=self.hot_tokens,
                                  device=self.device, order=self.cold_order)

    def k(self, layer: int) -> torch.Tensor:
        """K of one layer, ``[capacity, kv_heads, head_dim]``."""
        return self.k_buffer[layer]

    def v(self, layer: int) -> torch.Tensor:
        """V of one layer, ``[capacity, kv_heads, head_dim]``."""
        return self.v_buffer[layer]

    def hot_view(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of HOT rows ``[start, start+length)``: contiguous ``[length, kv_heads, head_dim]`` views."""
        if start < 0 or start + length > self.hot_tokens:
            raise ValueError(f"hot_view [{start}, {start + length}) is outside the HOT region [0, {self.hot_tokens})")
        return self.k_buffer[layer, start:start + length], self.v_buffer[layer, start:start + length]

    def slab_view(self, layer: int, slab: Slab) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hot_view(layer, slab.start, slab.length)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at global slot ids ``slots`` ``[n]``."""
        self.k_buffer[layer, slots] = k.to(self.dtype)
        self.v_buffer[layer, slots] = v.to(self.dtype)

    def is_hot(self, slots: torch.Tensor) -> torch.Tensor:
        return slots < self.hot_tokens

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.k_buffer.element_size()
