"""Prefill / extend attention: ragged new tokens attending causally to their request's KV slots.

This is what SGLang runs for extend batches with page size 1: FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` (causal, bottom-right aligned mask), planned once per
forward and run per layer. The KV of the new tokens must be written to the cache before ``run``.
"""
from __future__ import annotations

from typing import Optional

import torch

from granikv.attention import reference


class PrefillAttention:
    """Ragged causal prefill over paged KV (page size 1): ``plan`` once per forward, ``run`` per layer.

    plan(qo_indptr [R+1], kv_indptr [R+1], kv_indices [nnz]): request i's new tokens are
    ``q[qo_indptr[i]:qo_indptr[i+1]]`` and its KV slots (cached prefix first, new tokens last)
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.
    run(q [T, Hq, D], k_cache [C, Hkv, D], v_cache [C, Hkv, D]) -> o [T, Hq, D].
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, workspace: Optional[torch.Tensor] = None,
                 sm_scale: Optional[float] = None, impl: Optional[str] = None):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"PrefillAttention: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.hq, self.hkv, self.d = num_q_heads, num_kv_heads, head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.sm_scale = reference.default_scale(head_dim) if sm_scale is None else sm_scale
        self._gpu = (impl or ("flashinfer" if self.device.type == "cuda" else "torch")) == "flashinfer"
        self._plan: Optional[tuple] = None
        if self._gpu:
            from granikv.attention import flashinfer_ops as fo

            self._wrapper = fo.make_prefill_paged_wrapper(workspace if workspace is not None else fo.workspace(self.device))

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, causal: bool = True) -> None:
        """Record (CPU) or plan (FlashInfer) one ragged prefill batch."""
        if qo_indptr.numel() != kv_indptr.numel():
            raise ValueError(f"PrefillAttention.plan: qo_indptr has {qo_indptr.numel()} entries, kv_indptr {kv_indptr.numel()}")
        if self._gpu:
            from granikv.attention import flashinfer_ops as fo

            fo.plan_prefill_paged(self._wrapper, qo_indptr, kv_indptr, kv_indices, self.hq, self.hkv, self.d,
                                  causal=causal, sm_scale=self.sm_scale, q_dtype=self.dtype, kv_dtype=self.dtype)
        self._plan = (qo_indptr, kv_indptr, kv_indices, causal)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the planned new tokens, ``o [T, Hq, D]``."""
        if self._plan is None:
            raise RuntimeError("PrefillAttention.run called before plan()")
        if self._gpu:
            return self._wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))
        qo_indptr, kv_indptr, kv_indices, causal = self._plan
        o, _ = reference.prefill_ref(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, causal, self.sm_scale)
        return o
