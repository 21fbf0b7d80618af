"""Dense prefix attention through torch's fused attention kernels (cuDNN, FlashAttention-2).

An alternative kernel for the dense path's one call (``flashinfer_ops.single_prefill_split``): the
same result, q [N, Hq, D] over a contiguous HOT slab k/v [L, Hkv, D], as (o [N, Hq, D], lse [N, Hq]
fp32, base 2, FlashInfer's convention) so that the dense path merges it as it merges FlashInfer's.

The queries are packed by GQA group: kv head h attends with the N x G rows of its G query heads,
one sequence of M = N * G rows (``[1, Hkv, M, D]``, one copy of q), so no K/V is expanded. The KV is
split into ``n`` interleaved chunks folded into the head dimension as in single_prefill_split (key
t = n * t' + c of kv head h is key t' of head c * Hkv + h: a free view, BSHD strides), the packed
queries repeated per chunk, and the ``n`` chunk states merged. Kernels (``kernel``):

- ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` (cuDNN's fused flash attention);
- ``fa2``: ``aten._scaled_dot_product_flash_attention`` (torch's FlashAttention-2).

Both return the log-sum-exp (natural log, [1, H, M], or [1, H, M, 1] from cuDNN). On CPU (tests) either name runs
``aten._scaled_dot_product_flash_attention_for_cpu``, so the packing, chunking and merge are
checked against the reference there; the kernels themselves only run on the GPU host.
"""
from __future__ import annotations

import math

import torch

SDPA_KERNELS = ("cudnn", "fa2")
LOG2E = 1.0 / math.log(2.0)


def pack_queries(q: torch.Tensor, num_kv_heads: int, splits: int) -> torch.Tensor:
    """q [N, Hq, D] -> [1, splits * Hkv, N * G, D] contiguous: head c * Hkv + h holds kv head h's
    N x G query rows (row n * G + g = request n, query head h * G + g), the same for every chunk c."""
    n, hq, d = q.shape
    g = hq // num_kv_heads
    qp = q.view(n, num_kv_heads, g, d).permute(1, 0, 2, 3).reshape(num_kv_heads, n * g, d)   # copy
    return qp.unsqueeze(0).expand(splits, -1, -1, -1).reshape(1, splits * num_kv_heads, n * g, d)


def chunk_kv(k: torch.Tensor, splits: int) -> torch.Tensor:
    """k [L, Hkv, D] -> [1, splits * Hkv, L / splits, D], a free view with BSHD strides."""
    length, hkv, d = k.shape
    return k.view(length // splits, splits * hkv, d).permute(1, 0, 2).unsqueeze(0)


def unpack_states(o: torch.Tensor, lse: torch.Tensor, n: int, num_kv_heads: int, splits: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's o [1, splits * Hkv, N * G, D] and natural-log lse [1, splits * Hkv, N * G] ->
    per-chunk states o [N, splits, Hq, D] and base-2 lse [N, splits, Hq] fp32 (both contiguous)."""
    d = o.shape[-1]
    g = o.shape[2] // n
    # reshape copies unless G = 1, where it returns a strided view; merge_states needs contiguous states
    ov = o.view(splits, num_kv_heads, n, g, d).permute(2, 0, 1, 3, 4).reshape(n, splits, num_kv_heads * g, d)
    sv = lse.reshape(splits, num_kv_heads, n, g).permute(2, 0, 1, 3).reshape(n, splits, num_kv_heads * g)
    return ov.contiguous(), (sv.float() * LOG2E).contiguous()


def merge_chunks(o: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge chunk states o [N, S, H, D], s [N, S, H] (base 2) -> (o [N, H, D], s [N, H]): FlashInfer's
    merge_states on CUDA, the same arithmetic in torch elsewhere."""
    if o.shape[1] == 1:
        return o[:, 0], s[:, 0]
    if o.is_cuda:
        from granikv.attention import flashinfer_ops as fo
        return fo.fi().merge_states(o, s)
    m = s.max(dim=1, keepdim=True).values                          # [N, 1, H]
    w = torch.exp2(s - m)                                          # [N, S, H]
    tot = w.sum(dim=1)                                             # [N, H]
    out = (o.float() * w.unsqueeze(-1)).sum(dim=1) / tot.unsqueeze(-1)
    return out.to(o.dtype), m.squeeze(1) + torch.log2(tot)


def _kernel(qp, kp, vp, sm_scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not qp.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qp, kp, vp, 0.0, False, scale=sm_scale)
        return out, lse
    if kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(qp, kp, vp, None, True, 0.0, False, False,
                                                               scale=sm_scale)
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, 0.0, False, False, scale=sm_scale)
    return r[0], r[1]


def sdpa_prefill_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, splits: int = 1,
                       kernel: str = "cudnn") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense non-causal attention of q [N, Hq, D] over contiguous k/v [L, Hkv, D] with torch's fused
    ``kernel`` (see the module doc) over ``splits`` interleaved KV chunks -> (o [N, Hq, D], lse [N, Hq]
    fp32, base 2)."""
    if kernel not in SDPA_KERNELS:
        raise ValueError(f"sdpa_prefill_split: kernel must be one of {SDPA_KERNELS}, got {kernel!r}")
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    if splits < 1 or length % splits or hq % hkv or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"sdpa_prefill_split: need splits >= 1 dividing kv_len={length}, Hq={hq} a multiple of "
                         f"Hkv={hkv} and contiguous k/v (got splits={splits})")
    out, lse = _kernel(pack_queries(q, hkv, splits), chunk_kv(k, splits), chunk_kv(v, splits), sm_scale, kernel)
    return merge_chunks(*unpack_states(out, lse, n, hkv, splits))
