"""Two row kernels of a captured decode step: merge prefix states found at permuted rows, and copy
KV rows to a scratch up to a count held on the device. Each is one launch on CUDA.

merge_rows.

A captured decode step (granikv.attention.graph_step) computes the prefix state of its split rows in a
permuted row order (each prefix launch reads one run of rows). Row ``r`` of the output then merges the
state found at row ``src[r]`` of source ``kind[r] - 1`` (``kind[r] == 0``: no prefix, row untouched):

    o[r], lse[r] = merge((o[r], lse[r]), (sources_o[k][src[r]], sources_lse[k][src[r]]))     k = kind[r] - 1

with FlashInfer's convention: lse in base 2. Rows of a source that no row names may hold anything
(NaN included): they are never read into the result.

``merge_rows`` runs one Triton kernel on CUDA (at most :data:`MAX_SOURCES` sources) and the same math
in torch elsewhere; ``merge_rows_ref`` is that torch math, the reference of the GPU test.

gather_rows. ``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count[0]``: the index buffers have a fixed
capacity (a captured graph reads them) and only the first ``count`` pairs, written per step, are live
(HydraGen's prefix gather into its scratch). The launch covers the capacity; programs past the count
return at once, so the copy costs what the live rows cost.
"""
from __future__ import annotations

from typing import Sequence

import torch

MAX_SOURCES = 4

try:  # Triton is on the GPU host; a CPU machine runs the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def merge_rows_ref(o: torch.Tensor, lse: torch.Tensor, sources_o: Sequence[torch.Tensor],
                   sources_lse: Sequence[torch.Tensor], kind: torch.Tensor, src: torch.Tensor) -> None:
    """Torch math of :func:`merge_rows`, in place: o [B, H, D], lse [B, H] fp32; sources_o[k] [B', H, D],
    sources_lse[k] [B', H]; kind, src int [B]."""
    kind = kind.long()
    src = src.long()
    for k, (so, sl) in enumerate(zip(sources_o, sources_lse)):
        rows = (kind == k + 1).nonzero().flatten()                       # [n] rows merging source k
        if rows.numel() == 0:
            continue
        po = so.index_select(0, src[rows]).float()                        # [n, H, D]
        pl = sl.index_select(0, src[rows]).float()                        # [n, H]
        ol, oo = lse[rows].float(), o[rows].float()
        m = torch.maximum(ol, pl)
        m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
        w1, w2 = torch.exp2(ol - m), torch.exp2(pl - m)                     # [n, H]
        tot = w1 + w2
        o[rows] = ((oo * w1[..., None] + po * w2[..., None]) / tot[..., None]).to(o.dtype)
        lse[rows] = (m + torch.log2(tot)).to(lse.dtype)


if triton is not None:
    @triton.jit
    def _merge_rows_kernel(o_ptr, lse_ptr, s0_o, s0_l, s1_o, s1_l, s2_o, s2_l, s3_o, s3_l, kind_ptr, src_ptr,
                           H, D: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        k = tl.load(kind_ptr + r)
        if k > 0:
            p = tl.load(src_ptr + r).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            row = r.to(tl.int64) * H + h
            prow = p * H + h
            po = tl.load(s0_o + prow * D + d, mask=dm & (k == 1), other=0.0).to(tl.float32)
            po += tl.load(s1_o + prow * D + d, mask=dm & (k == 2), other=0.0).to(tl.float32)
            po += tl.load(s2_o + prow * D + d, mask=dm & (k == 3), other=0.0).to(tl.float32)
            po += tl.load(s3_o + prow * D + d, mask=dm & (k == 4), other=0.0).to(tl.float32)
            pl = tl.load(s0_l + prow, mask=k == 1, other=0.0)
            pl += tl.load(s1_l + prow, mask=k == 2, other=0.0)
            pl += tl.load(s2_l + prow, mask=k == 3, other=0.0)
            pl += tl.load(s3_l + prow, mask=k == 4, other=0.0)
            ol = tl.load(lse_ptr + row)
            oo = tl.load(o_ptr + row * D + d, mask=dm, other=0.0).to(tl.float32)
            m = tl.maximum(ol, pl)
            m = tl.where(m == float("-inf"), 0.0, m)
            w1 = tl.exp2(ol - m)
            w2 = tl.exp2(pl - m)
            tot = w1 + w2
            tl.store(o_ptr + row * D + d, ((oo * w1 + po * w2) / tot).to(o_ptr.dtype.element_ty), mask=dm)
            tl.store(lse_ptr + row, m + tl.log2(tot))


def merge_rows(o: torch.Tensor, lse: torch.Tensor, sources_o: Sequence[torch.Tensor],
               sources_lse: Sequence[torch.Tensor], kind: torch.Tensor, src: torch.Tensor) -> None:
    """In place (module doc): o [B, H, D] contiguous, lse [B, H] fp32; up to MAX_SOURCES sources of
    [B', H, D] / [B', H] (contiguous, o's dtype / fp32); kind, src int32 [B] on o's device. One launch on
    CUDA, capturable in a CUDA graph (reads only device tensors)."""
    if not 1 <= len(sources_o) == len(sources_lse) <= MAX_SOURCES:
        raise ValueError(f"merge_rows: 1..{MAX_SOURCES} sources with an lse each, got {len(sources_o)} / "
                         f"{len(sources_lse)}")
    if not o.is_cuda or triton is None:
        merge_rows_ref(o, lse, sources_o, sources_lse, kind, src)
        return
    b, h, d = o.shape
    so = list(sources_o) + [sources_o[0]] * (MAX_SOURCES - len(sources_o))     # unused slots: never read
    sl = list(sources_lse) + [sources_lse[0]] * (MAX_SOURCES - len(sources_lse))
    _merge_rows_kernel[(b, h)](o, lse, so[0], sl[0], so[1], sl[1], so[2], sl[2], so[3], sl[3], kind, src, h, d,
                               triton.next_power_of_2(d))


if triton is not None:
    @triton.jit
    def _gather_rows_kernel(dst, src, dst_idx, src_idx, count_ptr, row_elems, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        n = tl.load(count_ptr)
        if i < n:
            s = tl.load(src_idx + i).to(tl.int64)
            t = tl.load(dst_idx + i).to(tl.int64)
            for off in range(0, row_elems, BLOCK):
                e = off + tl.arange(0, BLOCK)
                m = e < row_elems
                tl.store(dst + t * row_elems + e, tl.load(src + s * row_elems + e, mask=m), mask=m)


def gather_rows(dst: torch.Tensor, src: torch.Tensor, dst_idx: torch.Tensor, src_idx: torch.Tensor,
                count: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for i < count[0] (module doc). dst [S, ...], src [C, ...] with
    equal row shapes, contiguous; dst_idx / src_idx int32 [capacity]; count int32 [1], all on src's device."""
    if dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"gather_rows: row shapes differ, dst {tuple(dst.shape)} vs src {tuple(src.shape)}")
    if not src.is_cuda or triton is None:
        n = int(count[0])
        dst.index_copy_(0, dst_idx[:n].long(), src.index_select(0, src_idx[:n].long()))
        return
    row = src[0].numel()
    _gather_rows_kernel[(dst_idx.numel(),)](dst, src, dst_idx, src_idx, count, row, min(1024, triton.next_power_of_2(row)))
