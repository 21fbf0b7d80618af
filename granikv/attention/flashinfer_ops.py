"""Thin wrappers over FlashInfer (0.7.2.post1) with SGLang's settings. Imported lazily: GPU only.

Settings matched to SGLang's FlashInfer backend (python/sglang/srt/layers/attention/flashinfer_backend.py):
- one shared float workspace of 384 MiB (SGLANG_FLASHINFER_WORKSPACE_SIZE default);
- KV layout NHD, page size 1 (k_cache [C, Hkv, D] is passed as pages ``[C, 1, Hkv, D]``);
- decode tensor cores on when Hq/Hkv >= 4 for fp16/bf16 KV (``should_use_tensor_core``);
- CUDA graphs: wrappers built with ``use_cuda_graph=True`` and caller-owned index buffers, one
  wrapper per captured batch size (a graph-mode wrapper cannot change its batch size).
LSE from every call is base 2, ``[tokens, heads]`` fp32 (see granikv.attention.reference).
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import torch

WORKSPACE_BYTES = 384 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}
# Optional modules FlashInfer imports inside every eager decode plan(): with backend="auto" its
# cudnn/utils.py calls ``import cudnn`` twice per plan (cudnn_frontend_version). Python does not
# remember a failed import, so where the module is absent each plan searches every sys.path entry
# again (14 find_spec calls, 110-130 us of host time per plan under cProfile, SGLang default's path
# included). ``remember_absent`` records such a module as absent in sys.modules, after which the
# import fails at once with the same ModuleNotFoundError; an installed module is left alone.
ABSENT_PROBES = ("cudnn",)


def remember_absent(names=ABSENT_PROBES) -> list[str]:
    """Record each of ``names`` that is not installed as absent (``sys.modules[name] = None``, which
    Python's import system reads as "not importable"); return the names recorded."""
    out = []
    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None
            out.append(name)
    return out


def fi():
    """The flashinfer module, with a clear error where it is not installed."""
    try:
        import flashinfer  # type: ignore
    except ImportError as e:  # pragma: no cover - CPU machines
        raise RuntimeError("FlashInfer is not importable: the GPU paths need flashinfer-python==0.7.2.post1 "
                           "(runners/gpu/attention.sh puts it on PYTHONPATH); use device=cpu for the torch paths") from e
    global _probed
    if not _probed:
        remember_absent()
        _probed = True
    return flashinfer


_probed = False


def available() -> bool:
    """True when CUDA and flashinfer are both usable."""
    if not torch.cuda.is_available():
        return False
    try:
        fi()
        return True
    except RuntimeError:
        return False


def workspace(device: torch.device) -> torch.Tensor:
    """The shared float workspace for ``device`` (allocated once, zeroed, like SGLang's global buffer)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _workspaces:
        nbytes = WORKSPACE_BYTES if device.type == "cuda" else 1024      # cpu: only for tests with a stand-in
        _workspaces[device] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return _workspaces[device]


def use_tensor_cores(num_q_heads: int, num_kv_heads: int, kv_dtype: torch.dtype, mode: str = "auto") -> bool:
    """SGLang's rule: fp8 KV -> on; fp16/bf16 -> on iff Hq/Hkv >= 4; else off. ``mode`` on/off overrides."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    if kv_dtype in (torch.float16, torch.bfloat16):
        return num_q_heads // num_kv_heads >= 4
    return False


def paged(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[C, Hkv, D] buffers as FlashInfer NHD pages of size 1: ``[C, 1, Hkv, D]`` views."""
    return k_cache.unsqueeze(1), v_cache.unsqueeze(1)


def make_decode_wrapper(ws: torch.Tensor, tensor_cores: bool, graph_bufs: Optional[dict] = None):
    """BatchDecodeWithPagedKVCacheWrapper; ``graph_bufs`` (indptr [B+1], indices [N], last_page_len [B]) = CUDA-graph mode."""
    f = fi()
    if graph_bufs is None:
        return f.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    return f.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=graph_bufs["indptr"], paged_kv_indices_buffer=graph_bufs["indices"],
        paged_kv_last_page_len_buffer=graph_bufs["last_page_len"])


def plan_decode(wrapper, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, hq: int, hkv: int,
                d: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, sm_scale: float, fast: bool = False) -> str:
    """Plan one decode step, page size 1: ``indptr`` int32 [B+1] (host), ``indices`` int32 [nnz]
    (device), ``last_page_len`` int32 [B] all ones (host). Returns which plan ran: ``plan`` or ``fast``.

    ``fast`` (a wrapper's second and later plans): FlashInfer's ``fast_decode_plan``, as SGLang's
    FlashInfer backend re-plans its graph-mode decode wrappers. It reuses the kernel module the first
    ``plan()`` picked and takes the host indptr as given, so it skips what ``plan()`` re-derives per
    step; in FlashInfer 0.6.x that includes the longest KV length, found with Python's builtin ``max()``
    over a per-request tensor (about a millisecond at B=256). It writes no graph-mode input buffer,
    so this function copies the indptr and indices into them first (``last_page_len`` stays the ones
    the buffer was made with). FlashInfer without ``fast_decode_plan``, or a wrapper not yet planned,
    takes ``plan()``.
    """
    f = fi()
    if fast and getattr(wrapper, "_cached_module", None) is not None and hasattr(f, "fast_decode_plan"):
        if wrapper.is_cuda_graph_enabled:
            n = indices.numel()
            if n > wrapper._paged_kv_indices_buf.numel():
                raise ValueError(f"decode plan: {n} KV indices exceed the graph-mode buffer "
                                 f"({wrapper._paged_kv_indices_buf.numel()})")
            wrapper._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)
            wrapper._paged_kv_indices_buf[:n].copy_(indices, non_blocking=True)
            dev_indptr, dev_indices, dev_lpl = (wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf,
                                                wrapper._paged_kv_last_page_len_buf)
        else:
            dev = indices.device
            dev_indptr, dev_indices = indptr.to(dev, non_blocking=True), indices
            dev_lpl = last_page_len.to(dev, non_blocking=True)
        f.fast_decode_plan(wrapper, dev_indptr, dev_indices, dev_lpl, hq, hkv, d, 1, q_data_type=q_dtype,
                           kv_data_type=kv_dtype, sm_scale=sm_scale, global_override_indptr_cpu=indptr)
        return "fast"
    wrapper.plan(indptr, indices, last_page_len, hq, hkv, d, 1, q_data_type=q_dtype, kv_data_type=kv_dtype,
                 sm_scale=sm_scale)
    return "plan"


def make_prefill_paged_wrapper(ws: torch.Tensor, graph_bufs: Optional[dict] = None):
    """BatchPrefillWithPagedKVCacheWrapper (NHD); ``graph_bufs`` (qo_indptr, indptr, indices, last_page_len) = graph mode."""
    f = fi()
    if graph_bufs is None:
        return f.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    return f.BatchPrefillWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=graph_bufs["qo_indptr"],
        paged_kv_indptr_buf=graph_bufs["indptr"], paged_kv_indices_buf=graph_bufs["indices"],
        paged_kv_last_page_len_buf=graph_bufs["last_page_len"])


def plan_prefill_paged(wrapper, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, hq: int,
                       hkv: int, d: int, causal: bool, sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                       last_page_len: Optional[torch.Tensor] = None) -> None:
    """Plan a ragged prefill over page-size-1 KV (causal = bottom-right aligned, as SGLang's extend)."""
    if last_page_len is None:
        last_page_len = torch.ones(kv_indptr.numel() - 1, dtype=torch.int32)      # host tensor: no sync in plan
    wrapper.plan(qo_indptr.int(), kv_indptr.int(), kv_indices.int(), last_page_len, hq, hkv, d, 1, causal=causal,
                 sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)


# FlashInfer prefill backends whose run() reads the KV slot ids from ``_paged_kv_indices_buf`` and whose
# plan derives nothing else from them (fa2 / fa3: prefill.py, BatchPrefillWithPagedKVCacheWrapper); the
# others (trtllm-gen, cudnn, cute-dsl) build block tables from the ids inside plan().
SCHEDULE_ONLY_BACKENDS = ("fa2", "fa3")


def keeps_prefill_schedule(wrapper) -> bool:
    """Whether ``set_prefill_indices`` may stand in for a re-plan of this (planned) prefill wrapper."""
    return getattr(wrapper, "_backend", None) in SCHEDULE_ONLY_BACKENDS


def set_prefill_indices(wrapper, kv_indices: torch.Tensor) -> None:
    """Point a planned BatchPrefillWithPagedKVCacheWrapper at new KV slot ids ``kv_indices`` [nnz]
    (device) for the SAME qo / kv indptrs as its last ``plan()``: FlashInfer's prefill schedule (its
    plan info, the kv-length buffer) is a function of the indptrs alone, so only the ids the kernel
    reads change. The analogue of what ``fast_decode_plan`` skips for decode, done the way plan()
    stores them: graph mode copies into the wrapper's indices buffer (a captured graph reads it),
    eager mode keeps the int32 tensor. The caller guarantees the indptrs are unchanged."""
    n = kv_indices.numel()
    if wrapper.is_cuda_graph_enabled:
        if n > wrapper._paged_kv_indices_buf.numel():
            raise ValueError(f"prefill indices: {n} slot ids exceed the graph-mode buffer "
                             f"({wrapper._paged_kv_indices_buf.numel()})")
        wrapper._paged_kv_indices_buf[:n].copy_(kv_indices, non_blocking=True)
    else:
        wrapper._paged_kv_indices_buf = kv_indices.int()


def make_cascade_wrapper(ws: torch.Tensor, num_levels: int = 2, graph_bufs: Optional[dict] = None):
    """MultiLevelCascadeAttentionWrapper (NHD); ``graph_bufs`` holds per-level buffer lists for graph mode."""
    f = fi()
    if graph_bufs is None:
        return f.MultiLevelCascadeAttentionWrapper(num_levels, ws, "NHD")
    return f.MultiLevelCascadeAttentionWrapper(
        num_levels, ws, "NHD", use_cuda_graph=True, qo_indptr_buf_arr=graph_bufs["qo_indptr"],
        paged_kv_indptr_buf_arr=graph_bufs["indptr"], paged_kv_indices_buf_arr=graph_bufs["indices"],
        paged_kv_last_page_len_buf_arr=graph_bufs["last_page_len"])


def plan_cascade(wrapper, qo_indptrs: list, kv_indptrs: list, kv_indices: list, hq: int, hkv: int, d: int,
                 sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Plan a multi-level cascade, page size 1, non-causal at every level (decode)."""
    lpl = [torch.ones(p.numel() - 1, dtype=torch.int32) for p in kv_indptrs]
    wrapper.plan([p.int() for p in qo_indptrs], [p.int() for p in kv_indptrs], [x.int() for x in kv_indices], lpl,
                 hq, hkv, d, 1, causal=False, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)


def single_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                   causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q [N, Hq, D] over contiguous k/v [L, Hkv, D] (GQA folded into rows) -> (o, lse)."""
    return fi().single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout="NHD", sm_scale=sm_scale,
                                             return_lse=True)


# FlashInfer's Hopper single prefill (include/flashinfer/attention/hopper/prefill_sm90.cuh,
# SingleTileScheduler) launches a grid of ceil(qo_len / CTA_Q) x num_qo_heads CTAs, CTA_Q = 128 for
# head_dim 128 non-causal, and never splits the KV: at B=256, Hq=32 that is 64 CTAs on the H200's 132
# SMs, half the GPU idle while the dense prefix GEMM runs.
SINGLE_PREFILL_CTA_Q = 128


def dense_kv_splits(qo_len: int, num_qo_heads: int, kv_len: int, num_sms: int, max_splits: int = 16,
                    min_chunk: int = 128, target: float = 0.8) -> int:
    """How many interleaved KV chunks the dense prefix attention is split into (1 = one plain call).

    The smallest power of two n (<= ``max_splits``, dividing ``kv_len``, chunks >= ``min_chunk`` keys)
    whose n x ceil(qo_len/128) x Hq CTAs fill the ``num_sms`` SMs' waves to >= ``target``; else the n
    that fills them best. ``num_sms`` <= 0 (CPU) -> 1. Pure host arithmetic (graph-safe).
    """
    if num_sms <= 0 or qo_len <= 0:
        return 1
    ctas = -(-qo_len // SINGLE_PREFILL_CTA_Q) * num_qo_heads
    best, best_eff, n = 1, 0.0, 1
    while n <= max_splits and kv_len % n == 0 and (n == 1 or kv_len // n >= min_chunk):
        c = ctas * n
        eff = c / (-(-c // num_sms) * num_sms)
        if eff >= target:
            return n
        if eff > best_eff + 1e-9:
            best, best_eff = n, eff
        n *= 2
    return best


def single_prefill_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                         splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense non-causal attention of q [N, Hq, D] over contiguous k/v [L, Hkv, D] as ONE FlashInfer
    single prefill over ``splits`` interleaved KV chunks, then one ``merge_states``.

    Key t = splits * t' + c of kv head h becomes key t' of kv head c*Hkv + h: ``k.view(L/splits,
    splits*Hkv, D)``, a free view of the contiguous slab. Query head c*Hq + j is q head j
    (``q.repeat(1, splits, 1)``, [N, splits*Hq, D]), so FlashInfer's GQA map (q head // group) sends
    it to chunk c of its own kv head. Attention is order-free over keys (RoPE is already in the cached
    K), so merging the chunk states (base-2 LSE) is exact. -> (o [N, Hq, D], lse [N, Hq] fp32).
    """
    if splits == 1:
        return single_prefill(q, k, v, sm_scale)
    n, hq, d = q.shape
    L, hkv, dv = v.shape
    if L % splits or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"single_prefill_split: kv_len={L} must be divisible by splits={splits} and k/v contiguous")
    qn = q.repeat(1, splits, 1)                                   # [N, splits*Hq, D]
    kn = k.view(L // splits, splits * hkv, k.shape[-1])           # [L/splits, splits*Hkv, D]
    vn = v.view(L // splits, splits * hkv, dv)
    o, s = single_prefill(qn, kn, vn, sm_scale)                   # [N, splits*Hq, D], [N, splits*Hq]
    return fi().merge_states(o.view(n, splits, hq, dv), s.view(n, splits, hq))


def merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer merge of two states (base-2 LSE) -> (v, s)."""
    return fi().merge_state(v_a, s_a, v_b, s_b)


def merge_state_in_place(v, s, v_other, s_other, mask: Optional[torch.Tensor] = None) -> None:
    """FlashInfer in-place merge ``(v, s) <- merge((v, s), (v_other, s_other))``."""
    fi().merge_state_in_place(v, s, v_other, s_other, mask)
