"""Three row kernels of a captured decode step: merge prefix states found at permuted rows, gather the
step's queries in that row order (and repeated for a KV-folded launch), and copy KV rows to a scratch up to
a count held on the device. Each is one launch on CUDA.

merge_rows.

A captured decode step (granikv.attention.graph_step) computes the prefix state of its split rows in a
permuted row order (each prefix launch reads one run of rows). Row ``r`` of the output then merges the
state found at row ``src[r]`` of source ``kind[r] - 1`` (``kind[r] == 0``: no prefix, row untouched):

    o[r], lse[r] = merge((o[r], lse[r]), (sources_o[k][src[r]], sources_lse[k][src[r]]))     k = kind[r] - 1

with FlashInfer's convention: lse in base 2. Rows of a source that no row names may hold anything
(NaN included): they are never read into the result. A source of a KV-folded launch (fold F) holds F
sub-states per head (head ``f * H + j`` is sub-state f of head j); they are merged first, in the same launch.
One program per row: a row without a prefix state costs one load, so a step in which nothing splits pays
little for the launch.

gather_q. ``qp[p] = q[perm[p]]`` and ``qn[p, f*H + j] = q[perm[p], j]``: the queries every prefix launch
of the step reads, in one pass (a folded launch's queries are the heads repeated F times). Gated by a device
flag: a step in which nothing splits skips the copy.

``merge_rows`` runs one Triton kernel on CUDA (at most :data:`MAX_SOURCES` sources) and the same math
in torch elsewhere; ``merge_rows_ref`` is that torch math, the reference of the GPU test.

gather_rows. ``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count[0]``: the index buffers have a fixed
capacity (a captured graph reads them) and only the first ``count`` pairs, written per step, are live
(HydraGen's prefix gather into its scratch). The grid is fixed, a few programs per SM
(:data:`GATHER_PROGRAMS_PER_SM`), never the capacity: each program strides over the live pairs in tiles of
:data:`GATHER_ROWS` rows, so a launch's size does not grow with the capacity (65,536 pairs for HydraGen's
scratch) and a step whose count is small pays for one small launch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

MAX_SOURCES = 4
GATHER_ROWS = 8               # gather_rows: rows per tile of one program
GATHER_PROGRAMS_PER_SM = 8    # gather_rows: the fixed grid, per streaming multiprocessor

try:  # Triton is on the GPU host; a CPU machine runs the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


def _fold_state(so: torch.Tensor, sl: torch.Tensor, fold: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A source of ``fold`` sub-states per row (head ``f * h + j`` holds sub-state f of head j) merged into one:
    so [n, fold*h, D], sl [n, fold*h] -> [n, h, D] fp32, [n, h]."""
    po, pl = so[:, :h].float(), sl[:, :h].float()
    for f in range(1, fold):
        qo, ql = so[:, f * h:(f + 1) * h].float(), sl[:, f * h:(f + 1) * h].float()
        po, pl = _merge2(po, pl, qo, ql)
    return po, pl


def _merge2(oo, ol, po, pl):
    """Two attention states merged (lse base 2): oo / po [n, H, D] fp32, ol / pl [n, H]."""
    m = torch.maximum(ol, pl)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w1, w2 = torch.exp2(ol - m), torch.exp2(pl - m)                         # [n, H]
    tot = w1 + w2
    return (oo * w1[..., None] + po * w2[..., None]) / tot[..., None], m + torch.log2(tot)


def merge_rows_ref(o: torch.Tensor, lse: torch.Tensor, sources_o: Sequence[torch.Tensor],
                   sources_lse: Sequence[torch.Tensor], kind: torch.Tensor, src: torch.Tensor,
                   folds: Optional[Sequence[int]] = None) -> None:
    """Torch math of :func:`merge_rows`, in place: o [B, H, D], lse [B, H] fp32; sources_o[k] [B', F_k*H, D],
    sources_lse[k] [B', F_k*H] (``folds[k]`` = F_k sub-states per row, default 1); kind, src int [B]."""
    kind = kind.long()
    src = src.long()
    h = o.shape[1]
    for k, (so, sl) in enumerate(zip(sources_o, sources_lse)):
        rows = (kind == k + 1).nonzero().flatten()                       # [n] rows merging source k
        if rows.numel() == 0:
            continue
        po, pl = _fold_state(so.index_select(0, src[rows]), sl.index_select(0, src[rows]),
                             folds[k] if folds else 1, h)                 # [n, H, D], [n, H]
        oo, ol = _merge2(o[rows].float(), lse[rows].float(), po, pl)
        o[rows] = oo.to(o.dtype)
        lse[rows] = ol.to(lse.dtype)


if triton is not None:
    @triton.jit
    def _merge_states(ao, al, bo, bl):
        """Two attention states (lse base 2) merged: ao / bo [BLOCK_H, BLOCK_D] fp32, al / bl [BLOCK_H]."""
        m = tl.maximum(al, bl)
        m = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp2(al - m)
        w2 = tl.exp2(bl - m)
        tot = w1 + w2
        return (ao * w1[:, None] + bo * w2[:, None]) / tot[:, None], m + tl.log2(tot)

    @triton.jit
    def _source_state(so, sl, p, H, h, d, hm, m2, D: tl.constexpr, F: tl.constexpr):
        """Row ``p`` of a source of F sub-states per head (head f*H + j: sub-state f of head j), merged:
        ([BLOCK_H, BLOCK_D] fp32, [BLOCK_H])."""
        base = p * (F * H)
        pl = tl.load(sl + base + h, mask=hm, other=float("-inf"))
        po = tl.load(so + (base + h)[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        for f in tl.static_range(1, F):
            ql = tl.load(sl + base + f * H + h, mask=hm, other=float("-inf"))
            qo = tl.load(so + (base + f * H + h)[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            po, pl = _merge_states(po, pl, qo, ql)
        return po, pl

    @triton.jit
    def _merge_rows_kernel(o_ptr, lse_ptr, s0_o, s0_l, s1_o, s1_l, s2_o, s2_l, s3_o, s3_l, kind_ptr, src_ptr,
                           H, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr):
        r = tl.program_id(0)                       # one program per row, every head: a row without a prefix
        k = tl.load(kind_ptr + r)                  # state (kind 0) costs one load
        if k > 0:
            p = tl.load(src_ptr + r).to(tl.int64)
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            hm = h < H
            m2 = hm[:, None] & (d < D)[None, :]
            if k == 1:
                po, pl = _source_state(s0_o, s0_l, p, H, h, d, hm, m2, D, F0)
            elif k == 2:
                po, pl = _source_state(s1_o, s1_l, p, H, h, d, hm, m2, D, F1)
            elif k == 3:
                po, pl = _source_state(s2_o, s2_l, p, H, h, d, hm, m2, D, F2)
            else:
                po, pl = _source_state(s3_o, s3_l, p, H, h, d, hm, m2, D, F3)
            row = r.to(tl.int64) * H + h
            ol = tl.load(lse_ptr + row, mask=hm, other=0.0)
            oo = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            out, lo = _merge_states(oo, ol, po, pl)
            tl.store(o_ptr + row[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=m2)
            tl.store(lse_ptr + row, lo, mask=hm)

    @triton.jit
    def _gather_q_kernel(q, perm, out1, outn, live, ROW: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                         GATED: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        go = True
        if GATED:
            go = tl.load(live) != 0
        if go:
            r = tl.load(perm + p).to(tl.int64)
            for off in tl.static_range(0, ROW, BLOCK):          # a query row: H*D elements
                e = off + tl.arange(0, BLOCK)
                m = e < ROW
                x = tl.load(q + r * ROW + e, mask=m)
                tl.store(out1 + p * ROW + e, x, mask=m)
                for f in tl.static_range(N):
                    tl.store(outn + (p * N + f) * ROW + e, x, mask=m)


def merge_rows(o: torch.Tensor, lse: torch.Tensor, sources_o: Sequence[torch.Tensor],
               sources_lse: Sequence[torch.Tensor], kind: torch.Tensor, src: torch.Tensor,
               folds: Optional[Sequence[int]] = None) -> None:
    """In place (module doc): o [B, H, D] contiguous, lse [B, H] fp32; up to MAX_SOURCES sources of
    [B', F*H, D] / [B', F*H] (contiguous, o's dtype / fp32; ``folds`` F per source, default 1: a source of a
    KV-folded launch holds F sub-states per head, merged here); kind, src int32 [B] on o's device. One launch
    on CUDA (one program per row), capturable in a CUDA graph (reads only device tensors)."""
    if not 1 <= len(sources_o) == len(sources_lse) <= MAX_SOURCES:
        raise ValueError(f"merge_rows: 1..{MAX_SOURCES} sources with an lse each, got {len(sources_o)} / "
                         f"{len(sources_lse)}")
    folds = list(folds) if folds else [1] * len(sources_o)
    if len(folds) != len(sources_o) or any(f < 1 for f in folds):
        raise ValueError(f"merge_rows: folds needs one count >= 1 per source, got {folds}")
    if not o.is_cuda or triton is None:
        merge_rows_ref(o, lse, sources_o, sources_lse, kind, src, folds)
        return
    b, h, d = o.shape
    so = list(sources_o) + [sources_o[0]] * (MAX_SOURCES - len(sources_o))     # unused slots: never read
    sl = list(sources_lse) + [sources_lse[0]] * (MAX_SOURCES - len(sources_lse))
    fs = folds + [1] * (MAX_SOURCES - len(folds))
    _merge_rows_kernel[(b,)](o, lse, so[0], sl[0], so[1], sl[1], so[2], sl[2], so[3], sl[3], kind, src, h, d,
                             triton.next_power_of_2(h), triton.next_power_of_2(d), *fs,
                             num_warps=8 if h * d >= 2048 else 4)


def gather_q(q: torch.Tensor, perm: torch.Tensor, fold: int,
             live: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The permuted queries, and the same repeated ``fold`` times along the heads (a KV-folded launch's
    queries): q [B, H, D] contiguous, perm int [B] -> qp [B, H, D], qn [B, fold*H, D] with qn[p, f*H + j] =
    q[perm[p], j]. One launch on CUDA (read once, both written); qn is qp itself when fold is 1.
    ``live`` int32 [1] on q's device: on CUDA, when ``live[0] == 0`` the launch returns at once and qp / qn
    are left unset (a captured step in which no row merges a prefix state reads neither)."""
    if fold < 1:
        raise ValueError(f"gather_q: fold must be >= 1, got {fold}")
    if not q.is_cuda or triton is None:
        qp = q.index_select(0, perm)
        return qp, (qp.repeat(1, fold, 1) if fold > 1 else qp)
    b, h, d = q.shape
    qp = torch.empty_like(q)
    qn = torch.empty(b, fold * h, d, dtype=q.dtype, device=q.device) if fold > 1 else qp
    row = h * d
    _gather_q_kernel[(b,)](q, perm, qp, qn, perm if live is None else live, row, fold if fold > 1 else 0,
                           min(4096, triton.next_power_of_2(row)), live is not None)
    return qp, qn


if triton is not None:
    @triton.jit
    def _gather_rows_kernel(dst, src, dst_idx, src_idx, count_ptr, row_elems, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):
        n = tl.load(count_ptr)
        for base in range(tl.program_id(0) * ROWS, n, tl.num_programs(0) * ROWS):   # this program's tiles
            r = base + tl.arange(0, ROWS)                                          # [ROWS] pair indices
            mr = r < n
            s = tl.load(src_idx + r, mask=mr, other=0).to(tl.int64)
            t = tl.load(dst_idx + r, mask=mr, other=0).to(tl.int64)
            for off in range(0, row_elems, BLOCK):
                e = off + tl.arange(0, BLOCK)                                       # [BLOCK] row elements
                m = mr[:, None] & (e < row_elems)[None, :]
                x = tl.load(src + s[:, None] * row_elems + e[None, :], mask=m)
                tl.store(dst + t[:, None] * row_elems + e[None, :], x, mask=m)


def gather_programs(sms: int, capacity: int) -> int:
    """gather_rows' fixed grid on a GPU of ``sms`` streaming multiprocessors: GATHER_PROGRAMS_PER_SM per SM, no
    more than the tiles of ``capacity`` pairs (so never a program per pair)."""
    return max(1, min(GATHER_PROGRAMS_PER_SM * sms, -(-capacity // GATHER_ROWS)))


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
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    _gather_rows_kernel[(gather_programs(sms, dst_idx.numel()),)](
        dst, src, dst_idx, src_idx, count, row, GATHER_ROWS, min(1024, triton.next_power_of_2(row)))
