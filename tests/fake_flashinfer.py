"""A CPU stand-in for the slice of FlashInfer's API that granikv uses, computed with the reference.

It checks what FlashInfer 0.7.2.post1 requires of its callers (argument names, int32 indices,
page size 1 views, fixed batch size and buffer capacity in CUDA-graph mode) and, in graph mode,
reads only the caller-provided buffers, so the bookkeeping of granikv's FlashInfer paths
(gpu_paths.py) can be tested without a GPU. It says nothing about FlashInfer's own kernels.
"""
from __future__ import annotations

import types

import torch

from granikv.attention import reference as R


def _kv(paged_kv_cache):
    k, v = paged_kv_cache
    assert k.dim() == 4 and k.shape[1] == 1, "page size 1 NHD pages [C, 1, Hkv, D] expected"
    return k[:, 0], v[:, 0]


def _i32(t, name):
    assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"


class _Paged:
    def __init__(self, graph, bufs):
        self.graph, self.bufs, self.state = graph, bufs, None

    def _store(self, qo, indptr, indices, lpl):
        _i32(indptr, "indptr"); _i32(indices, "indices"); _i32(lpl, "last_page_len")
        assert int(indptr[-1]) == indices.numel(), "indptr[-1] must equal len(indices)"
        assert bool((lpl == 1).all()), "page size 1: last_page_len must be all ones"
        if self.graph:
            assert indptr.numel() == self.bufs["indptr"].numel(), "cudagraph mode: batch size is fixed"
            assert indices.numel() <= self.bufs["indices"].numel(), "indices exceed the cudagraph buffer"
            self.bufs["indptr"].copy_(indptr)
            self.bufs["indices"][:indices.numel()].copy_(indices)
            if qo is not None:
                assert qo.numel() == self.bufs["qo"].numel()
                self.bufs["qo"].copy_(qo)
        else:
            self.state = (qo, indptr.clone(), indices.clone())

    def _get(self):
        if self.graph:
            indptr = self.bufs["indptr"]
            return self.bufs.get("qo"), indptr, self.bufs["indices"][:int(indptr[-1])]
        return self.state


DECODE_WRAPPERS: list = []      # every decode wrapper built (tests check their settings, e.g. tensor cores)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        super().__init__(use_cuda_graph, {"indptr": paged_kv_indptr_buffer, "indices": paged_kv_indices_buffer})
        if use_cuda_graph:
            assert paged_kv_last_page_len_buffer.numel() == paged_kv_indptr_buffer.numel() - 1
        self.use_tensor_cores = use_tensor_cores
        # what FlashInfer's fast_decode_plan reads off a wrapper (its graph-mode buffers, the module
        # the first plan() picked)
        self.is_cuda_graph_enabled = use_cuda_graph
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self._cached_module = None
        self.plans = {"plan": 0, "fast": 0}
        DECODE_WRAPPERS.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *, q_data_type=None,
             kv_data_type=None, sm_scale=None, **kw):
        assert page_size == 1 and not kw, kw
        self.sm_scale = sm_scale
        self._store(None, indptr.int() if indptr.dtype != torch.int32 else indptr, indices, last_page_len)
        self._cached_module = "batch_decode"
        self.plans["plan"] += 1

    def run(self, q, paged_kv_cache, *, return_lse=False, **kw):
        k, v = _kv(paged_kv_cache)
        _, indptr, indices = self._get()
        o, lse = R.paged_decode_ref(q, k, v, indptr, indices, self.sm_scale)
        return (o, lse) if return_lse else o


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, **kw):
        assert kv_layout == "NHD"
        super().__init__(use_cuda_graph, {"indptr": paged_kv_indptr_buf, "indices": paged_kv_indices_buf,
                                          "qo": qo_indptr_buf})
        # what FlashInfer's wrapper keeps where run() reads it (fa2 / fa3 backends): the slot ids
        self.is_cuda_graph_enabled = use_cuda_graph
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._backend = "fa2"
        self.plans = 0

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None, **kw):
        assert page_size == 1 and not kw, kw
        self.causal, self.sm_scale = causal, sm_scale
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        if not self.graph:
            self._paged_kv_indices_buf = self.state[2]
        self.plans += 1

    def _get(self):
        if self.graph:
            return super()._get()
        qo, indptr, _ = self.state            # eager: run() reads the ids the wrapper holds now
        ids = self._paged_kv_indices_buf
        _i32(ids, "indices")
        assert ids.numel() == int(indptr[-1]), "slot ids do not match the planned kv_indptr"
        return qo, indptr, ids

    def run(self, q, paged_kv_cache, *, return_lse=False, **kw):
        k, v = _kv(paged_kv_cache)
        qo, indptr, indices = self._get()
        n = int(qo[-1])
        if self.graph and q.shape[0] > n:      # graph mode: rows past the plan's come back unwritten (NaN here)
            o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
            if n:
                o[:n], lse[:n] = R.prefill_ref(q[:n], k, v, qo, indptr, indices, self.causal, self.sm_scale)
            return (o, lse) if return_lse else o
        o, lse = R.prefill_ref(q, k, v, qo, indptr, indices, self.causal, self.sm_scale)
        return (o, lse) if return_lse else o


class MultiLevelCascadeAttentionWrapper:
    def __init__(self, num_levels, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None):
        g = use_cuda_graph
        self.levels = [BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, g, qo_indptr_buf_arr[i] if g else None,
            paged_kv_indptr_buf_arr[i] if g else None, paged_kv_indices_buf_arr[i] if g else None,
            paged_kv_last_page_len_buf_arr[i] if g else None) for i in range(num_levels)]

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim, page_size, causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None):
        for i, w in enumerate(self.levels):
            w.plan(qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                   num_qo_heads, num_kv_heads, head_dim, page_size, causal=causal if i == len(self.levels) - 1 else False,
                   sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type)

    def run(self, q, paged_kv_cache):
        out, lse = self.levels[-1].run(q, paged_kv_cache, return_lse=True)
        for w in self.levels[:-1]:
            o, s = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, o, s)
        return out


class BatchPrefillWithRaggedKVCacheWrapper:
    """Ragged prefill: segment i's queries q[qo[i]:qo[i+1]] attend keys k[kv[i]:kv[i+1]] (non-causal here).
    In graph mode the batch size is fixed by the indptr buffers, plan() writes them, run() reads only them;
    as in FlashInfer the first plan fixes the most query rows a later plan may cover, and q may hold more
    rows than the plan covers: those come back as NaN (FlashInfer leaves them unwritten)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, backend="auto"):
        assert kv_layout == "NHD"
        if use_cuda_graph:
            assert qo_indptr_buf is not None and kv_indptr_buf is not None and qo_indptr_buf.numel() == kv_indptr_buf.numel()
        self.graph, self.qo_buf, self.kv_buf, self.state = use_cuda_graph, qo_indptr_buf, kv_indptr_buf, None
        self.max_rows = None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None, **kw):
        _i32(qo_indptr, "qo_indptr"); _i32(kv_indptr, "kv_indptr")
        assert not causal and num_qo_heads % num_kv_heads == 0
        assert bool((qo_indptr[1:] >= qo_indptr[:-1]).all()) and bool((kv_indptr[1:] >= kv_indptr[:-1]).all())
        assert int(qo_indptr[0]) == 0 and int(kv_indptr[0]) == 0
        if self.graph:
            assert qo_indptr.numel() == self.qo_buf.numel(), "cudagraph mode: batch size is fixed"
            if self.max_rows is None:
                self.max_rows = int(qo_indptr[-1])
            assert int(qo_indptr[-1]) <= self.max_rows, "cudagraph mode: more rows than the first plan's"
            self.qo_buf.copy_(qo_indptr)
            self.kv_buf.copy_(kv_indptr)
        else:
            self.state = (qo_indptr.clone(), kv_indptr.clone())
        self.heads, self.sm_scale = (num_qo_heads, num_kv_heads), sm_scale

    def run(self, q, k, v, return_lse=False, **kw):
        qo, kv = (self.qo_buf, self.kv_buf) if self.graph else self.state
        rows_ok = q.shape[0] >= int(qo[-1]) if self.graph else q.shape[0] == int(qo[-1])
        assert rows_ok and k.shape[0] == int(kv[-1]) == v.shape[0], "q / k rows must match the indptrs"
        assert (q.shape[1], k.shape[1]) == self.heads
        o = torch.full_like(q, float("nan"))
        o[:int(qo[-1])] = 0
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)
        lse[:int(qo[-1])] = -float("inf")
        for i in range(qo.numel() - 1):
            a, b, c, d = int(qo[i]), int(qo[i + 1]), int(kv[i]), int(kv[i + 1])
            if b > a and d > c:
                o[a:b], lse[a:b] = R.attention_ref(q[a:b], k[c:d], v[c:d], self.sm_scale)
        return (o, lse) if return_lse else o


def single_prefill_with_kv_cache(q, k, v, *, causal=False, kv_layout="NHD", sm_scale=None, return_lse=False, **kw):
    assert kv_layout == "NHD" and not causal and not kw
    assert k.is_contiguous() and v.is_contiguous()
    o, lse = R.attention_ref(q, k, v, sm_scale)
    return (o, lse) if return_lse else o


def merge_state(v_a, s_a, v_b, s_b):
    return R.merge_state(v_a, s_a, v_b, s_b)


def merge_states(v, s):
    """v [N, S, H, D], s [N, S, H] -> merged (v [N, H, D], s [N, H] fp32), as flashinfer.merge_states."""
    assert v.dim() == 4 and s.dim() == 3 and v.shape[:3] == s.shape, "merge_states: v [N,S,H,D], s [N,S,H]"
    o, lse = v[:, 0], s[:, 0].float()
    for i in range(1, v.shape[1]):
        o, lse = R.merge_state(o, lse, v[:, i], s[:, i])
    return o.contiguous(), lse.contiguous()


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    assert v.dtype == v_other.dtype and s.dtype == s_other.dtype == torch.float32
    R.merge_state_in_place(v, s, v_other, s_other, mask)


def fast_decode_plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                     pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type=None,
                     kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
                     non_blocking=True, fixed_split_size=None, disable_split_kv=False, global_override_indptr_cpu=None):
    """FlashInfer's fast_decode_plan as it behaves (0.6.15): it needs the module of a prior plan(), plans
    from the host indptr (``global_override_indptr_cpu``, else ``indptr.cpu()``), and in graph mode
    writes NO input buffer (the kernels then read whatever the caller left there); eagerly it keeps
    the tensors it is given."""
    assert self._cached_module is not None, "fast_decode_plan needs _cached_module from a prior plan()"
    assert page_size == 1
    host = global_override_indptr_cpu if global_override_indptr_cpu is not None else indptr.cpu()
    _i32(host, "indptr")
    assert host.device.type == "cpu", "the plan's indptr must be a host tensor"
    if self.is_cuda_graph_enabled:
        assert len(last_page_len) == self._paged_kv_last_page_len_buf.numel(), "cudagraph mode: batch size is fixed"
        assert len(indices) <= len(self._paged_kv_indices_buf), "indices exceed the cudagraph buffer"
        # the plan is made from the host indptr, the kernels read the device buffer: they must agree
        assert torch.equal(self._paged_kv_indptr_buf.cpu(), host), "graph-mode indptr buffer not written"
    else:
        _i32(indices, "indices")
        assert int(host[-1]) == indices.numel() and torch.equal(indptr.cpu(), host)
        self.state = (None, indptr.clone(), indices.clone())
    self.sm_scale = sm_scale
    self.plans["fast"] += 1


def module(fast_plan: bool = True) -> types.ModuleType:
    """The stand-in module; ``fast_plan=False``: a FlashInfer without ``fast_decode_plan``."""
    m = types.ModuleType("flashinfer")
    m.__version__ = "fake-0.7.2.post1"
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper",
                 "MultiLevelCascadeAttentionWrapper", "single_prefill_with_kv_cache", "merge_state",
                 "merge_states", "merge_state_in_place") + (("fast_decode_plan",) if fast_plan else ()):
        setattr(m, name, globals()[name])
    return m
