"""Exact attention in plain torch (fp32 accumulation): the oracle every backend is tested against.

LSE convention (used everywhere in granikv, identical to FlashInfer's): the log-sum-exp is
**base 2** over the *scaled* scores, ``lse = log2(sum_j exp(s_j))`` with ``s_j = sm_scale * q.k_j``,
i.e. ``lse = lse_natural * log2(e)``. An empty KV segment has ``lse = -inf`` and output 0, so
merging it with anything is the identity.

Shapes: q ``[N, Hq, D]``, k/v ``[L, Hkv, D]``, o ``[N, Hq, D]`` (q's dtype), lse ``[N, Hq]`` fp32.
GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (FlashInfer's and SGLang's mapping).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

LOG2E = math.log2(math.e)


def default_scale(head_dim: int) -> float:
    """Softmax scale ``1/sqrt(D)`` (what FlashInfer uses when sm_scale is None)."""
    return 1.0 / math.sqrt(head_dim)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"attention: q, k, v must be 3-D [N,H,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: head_dim of q ({q.shape[2]}) != head_dim of k ({k.shape[2]})")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention: Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: Optional[float] = None,
                  mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row attends to every key (``mask`` [N, L] bool, True = attend, optional).

    q [N, Hq, D], k/v [L, Hkv, D] -> (o [N, Hq, D] in q.dtype, lse [N, Hq] fp32, base 2).
    """
    _check_qkv(q, k, v)
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = default_scale(d) if sm_scale is None else sm_scale
    if k.shape[0] == 0 or n == 0:
        return (torch.zeros_like(q), torch.full((n, hq), -math.inf, dtype=torch.float32, device=q.device))
    qf = q.float().view(n, hkv, g, d)                       # [N, Hkv, G, D]
    kf, vf = k.float(), v.float()                           # [L, Hkv, D]
    s = torch.einsum("nhgd,lhd->hgnl", qf, kf) * scale      # [Hkv, G, N, L]
    if mask is not None:
        s = s.masked_fill(~mask.to(torch.bool).view(1, 1, n, -1), -math.inf)
    m = s.amax(dim=-1, keepdim=True)                        # [Hkv, G, N, 1]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    den = p.sum(dim=-1, keepdim=True)                       # [Hkv, G, N, 1]
    o = torch.einsum("hgnl,lhd->nhgd", p / den.clamp_min(1e-30), vf)
    lse = (torch.log(den) + m_safe).squeeze(-1) * LOG2E     # [Hkv, G, N]
    lse = torch.where(den.squeeze(-1) > 0, lse, torch.full_like(lse, -math.inf))
    o = torch.where((den.squeeze(-1) > 0).permute(2, 0, 1).unsqueeze(-1), o, torch.zeros_like(o))
    return o.reshape(n, hq, d).to(q.dtype), lse.permute(2, 0, 1).reshape(n, hq).contiguous()


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, sm_scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with page size 1: query i attends to slots ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.

    q [B, Hq, D], k_cache/v_cache [C, Hkv, D] -> (o [B, Hq, D], lse [B, Hq]).
    """
    b = q.shape[0]
    if kv_indptr.numel() != b + 1:
        raise ValueError(f"paged_decode_ref: kv_indptr has {kv_indptr.numel()} entries, needs batch+1 = {b + 1}")
    ptr = kv_indptr.tolist()
    o = torch.empty_like(q)
    lse = torch.empty(b, q.shape[1], dtype=torch.float32, device=q.device)
    for i in range(b):
        slots = kv_indices[ptr[i]:ptr[i + 1]].long()
        o[i:i + 1], lse[i:i + 1] = attention_ref(q[i:i + 1], k_cache[slots], v_cache[slots], sm_scale)
    return o, lse


def prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: torch.Tensor,
                kv_indptr: torch.Tensor, kv_indices: torch.Tensor, causal: bool = True,
                sm_scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged prefill/extend over paged KV (page size 1), cached-prefix-aware causal mask.

    Request i has queries ``q[qo_indptr[i]:qo_indptr[i+1]]`` (qo_len tokens) and KV slots
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` (kv_len >= qo_len); its last qo_len KV slots are
    the new tokens, so query j (0-based) sees KV positions ``< kv_len - qo_len + j + 1`` when
    causal (FlashInfer's bottom-right aligned causal mask). q [T, Hq, D] -> (o [T, Hq, D], lse [T, Hq]).
    """
    nreq = qo_indptr.numel() - 1
    if kv_indptr.numel() != nreq + 1:
        raise ValueError(f"prefill_ref: qo_indptr ({nreq + 1}) and kv_indptr ({kv_indptr.numel()}) lengths differ")
    qp, kp = qo_indptr.tolist(), kv_indptr.tolist()
    if qp[-1] != q.shape[0]:
        raise ValueError(f"prefill_ref: qo_indptr[-1]={qp[-1]} != number of query tokens {q.shape[0]}")
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    for i in range(nreq):
        qo_len, kv_len = qp[i + 1] - qp[i], kp[i + 1] - kp[i]
        if qo_len == 0:
            continue
        if causal and kv_len < qo_len:
            raise ValueError(f"prefill_ref: request {i} has kv_len={kv_len} < qo_len={qo_len} "
                             "(its KV slots must include the new tokens)")
        slots = kv_indices[kp[i]:kp[i + 1]].long()
        mask = None
        if causal:
            qpos = torch.arange(qo_len, device=q.device).unsqueeze(1) + (kv_len - qo_len)
            mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= qpos      # [qo_len, kv_len]
        o[qp[i]:qp[i + 1]], lse[qp[i]:qp[i + 1]] = attention_ref(
            q[qp[i]:qp[i + 1]], k_cache[slots], v_cache[slots], sm_scale, mask)
    return o, lse


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attention states over disjoint KV segments (base-2 LSE).

    v_* [N, H, D], s_* [N, H] fp32 -> (v [N, H, D] in v_a.dtype, s [N, H] fp32).
    A segment with s = -inf contributes nothing; two empty segments give (0, -inf).
    """
    sa, sb = s_a.float(), s_b.float()
    m = torch.maximum(sa, sb)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp2(sa - m_safe), torch.exp2(sb - m_safe)       # [N, H]
    den = wa + wb
    v = (v_a.float() * wa.unsqueeze(-1) + v_b.float() * wb.unsqueeze(-1)) / den.clamp_min(1e-30).unsqueeze(-1)
    s = torch.where(den > 0, m_safe + torch.log2(den.clamp_min(1e-30)), torch.full_like(m, -math.inf))
    return v.to(v_a.dtype), s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: Optional[torch.Tensor] = None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place, rows where ``mask`` [N] is True (all if None)."""
    vm, sm = merge_state(v, s, v_other, s_other)
    if mask is None:
        v.copy_(vm)
        s.copy_(sm)
    else:
        mk = mask.to(torch.bool)
        v.copy_(torch.where(mk.view(-1, 1, 1), vm, v))
        s.copy_(torch.where(mk.view(-1, 1), sm, s))
