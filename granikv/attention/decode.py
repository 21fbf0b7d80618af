"""Decode attention of one system: plan once per step, run once per layer (FlashInfer's split).

    plan(batch)            policy -> StepPlan (granikv.attention.plan), then kernels planned on it
    run(q, k_cache, v_cache) -> o      per layer: q [B, Hq, D], k/v_cache [C, Hkv, D], o [B, Hq, D]

``plan`` is ``make_plan`` (host: the policy's paths, the rest-of-request slots) then ``load``
(FlashInfer's plan on a wrapper set); a caller that decides on CUDA graphs per step (the engine's
runner) calls the two itself, asking ``graph_key(step)`` in between.

Execution by ``impl``: ``torch`` (default on CPU) runs the reference math below (one paged decode
over the rest, exact attention per split class, LSE merge); ``flashinfer`` (default on CUDA) runs
granikv.attention.gpu_paths. CUDA graphs (``cuda_graph=True``, FlashInfer path): a step loaded with
graph=True writes into persistent buffers owned by a wrapper set per ``graph_key``; run() is then
capturable and replays for every later step with the same key. ``graph_safe``: run() reads only
buffers that load() rewrites in place (checked by tests/test_attention_gpu.py on the GPU host).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from granikv.attention import reference
from granikv.attention.batch import DecodeBatch
from granikv.attention.flashinfer_ops import use_tensor_cores
from granikv.attention.gpu_paths import GpuPaths, KernelSpec, rest_bucket
from granikv.attention.plan import StepPlan, build_plan
from granikv.attention.policy import POLICIES, PrefixPolicy, make_policy
from granikv.config import CASCADE_IMPLS, DECODE_PLANS, DENSE_KERNELS


class DecodeAttention:
    """A prefix policy and the execution of its step plans, for the heads of one TP rank.

    ``last_decisions`` (per class, for the step trace) and ``last_choose_us`` (the policy's host
    time) describe the last loaded plan. ``rest_capacity``: size of the ONE graph-mode rest-decode
    index buffer, set by the engine to largest graph batch x longest possible row, as SGLang sizes
    its CUDA-graph kv_indices (max_bs x context length), so a graph key never depends on how many
    KV slots the rows hold; None = the next power of two of each step's count.
    """

    graph_safe = True

    def __init__(self, policy: PrefixPolicy, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 tensor_core_decode: str = "auto", sm_scale: Optional[float] = None, cuda_graph: bool = False,
                 impl: Optional[str] = None, dense_kv_splits: Optional[int] = None,
                 cascade_impl: str = "multilevel", decode_plan: str = "flashinfer", dense_kernel: str = "flashinfer"):
        self.policy = policy
        name = policy.name
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{name}: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.hq, self.hkv, self.d = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.device = torch.device(device)
        self.dtype = dtype
        self.sm_scale = reference.default_scale(head_dim) if sm_scale is None else sm_scale
        self.cuda_graph = cuda_graph
        self.rest_capacity: Optional[int] = None
        # FlashInfer path: the dense/HydraGen prefix attention's interleaved KV chunks (None = auto:
        # flashinfer_ops.dense_kv_splits fills the GPU's SMs; 1 = one plain single-prefill call)
        if dense_kv_splits is not None and int(dense_kv_splits) < 1:
            raise ValueError(f"{name}: dense_kv_splits must be >= 1 or None (auto), got {dense_kv_splits}")
        # FlashInfer path of the batch-global cascade: "multilevel" = FlashInfer's
        # MultiLevelCascadeAttentionWrapper as shipped; "composed" = the per-class cascade path
        # (one batch prefill for the common prefix, the tensor-core decode for the rest, merge)
        if cascade_impl not in CASCADE_IMPLS:
            raise ValueError(f"{name}: cascade_impl must be one of {CASCADE_IMPLS}, got {cascade_impl!r}")
        # FlashInfer path, how a decode wrapper is re-planned each step: "flashinfer" = its plan();
        # "fast" = FlashInfer's fast_decode_plan after the first plan() (flashinfer_ops.plan_decode)
        if decode_plan not in DECODE_PLANS:
            raise ValueError(f"{name}: decode_plan must be one of {DECODE_PLANS}, got {decode_plan!r}")
        # FlashInfer path, the kernel of the dense prefix call: "flashinfer" = its single prefill; "cudnn" /
        # "fa2" = torch's fused attention (granikv.attention.sdpa_ops); HydraGen's call stays FlashInfer's
        if dense_kernel not in DENSE_KERNELS:
            raise ValueError(f"{name}: dense_kernel must be one of {DENSE_KERNELS}, got {dense_kernel!r}")
        self.impl = impl or ("flashinfer" if self.device.type == "cuda" else "torch")
        if self.impl not in ("torch", "flashinfer"):
            raise ValueError(f"{name}: impl must be torch or flashinfer, got {impl!r}")
        self.last_decisions: list[dict] = []
        self.last_choose_us = 0.0
        self.last_plan_graph: Optional[bool] = None
        self._plan: Optional[StepPlan] = None
        self._gpu: Optional[GpuPaths] = None
        if self.impl == "flashinfer":
            self._gpu = GpuPaths(KernelSpec(
                num_q_heads, num_kv_heads, head_dim, dtype, self.device, self.sm_scale,
                tensor_cores=use_tensor_cores(num_q_heads, num_kv_heads, dtype, tensor_core_decode),
                dense_kv_splits=None if dense_kv_splits is None else int(dense_kv_splits),
                multilevel_cascade=policy.batch_global and cascade_impl == "multilevel",
                fast_decode_plan=decode_plan == "fast", dense_kernel=dense_kernel))

    @property
    def name(self) -> str:
        return self.policy.name

    # ---- plan (once per step) ----------------------------------------------------------------
    def make_plan(self, batch: DecodeBatch) -> StepPlan:
        """This step's StepPlan: the policy's path per class and the rest-of-request slots (host work
        and one async host->device copy; no kernel planned yet)."""
        return build_plan(batch, self.policy, self.group)

    def load(self, step: StepPlan, graph: Optional[bool] = None) -> None:
        """Make ``step`` the plan run() executes; on the FlashInfer path, plan its kernels.

        ``graph``: False = the caller runs this step eagerly (no CUDA graph), so the one shared eager
        wrapper set is used even when ``cuda_graph=True``; None = ``cuda_graph``.
        """
        self._plan = step
        self.last_choose_us = step.choose_us
        self.last_decisions = step.decisions(self.group)
        self.last_plan_graph = graph
        if self._gpu is not None:
            graph_mode = self.cuda_graph if graph is None else (bool(graph) and self.cuda_graph)
            self._gpu.plan(step, self.graph_key(step) if graph_mode else None, self.rest_capacity)

    def plan(self, batch: DecodeBatch, graph: Optional[bool] = None) -> StepPlan:
        """``make_plan`` then ``load``: the whole per-step plan; returns the StepPlan."""
        step = self.make_plan(batch)
        self.load(step, graph)
        return step

    def graph_key(self, step: Optional[StepPlan] = None) -> tuple:
        """Hashable of what a captured CUDA graph of run() depends on (default: the loaded plan).

        (system, batch size, rest-decode index capacity, StepPlan.structure()): plans with equal keys
        run on one wrapper set and replay one graph.
        """
        p = step if step is not None else self._require_plan()
        return (self.name, p.batch_size, self.rest_bucket(p.rest_indices.numel()), p.structure())

    def rest_bucket(self, n: int) -> int:
        """Rest-decode index capacity of a graph-mode wrapper set for a step with ``n`` rest indices."""
        return rest_bucket(n, self.rest_capacity)

    def release_graph(self, key: tuple) -> None:
        """Free what a captured graph of ``key`` (a graph_key()) pinned: its wrapper set's buffers."""
        if self._gpu is not None:
            self._gpu.release(key)

    def _require_plan(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError(f"{self.name}.run called before plan()")
        return self._plan

    # ---- run (once per layer) ----------------------------------------------------------------
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Decode attention of the loaded step for one layer: q [B, Hq, D] -> o [B, Hq, D]."""
        p = self._require_plan()
        if q.shape[0] != p.batch_size:
            raise ValueError(f"{self.name}.run: q has {q.shape[0]} rows, plan has batch {p.batch_size}")
        if self._gpu is not None:
            return self._gpu.run(q, k_cache, v_cache)
        return self._run_torch(p, q, k_cache, v_cache)

    def _run_torch(self, p: StepPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        o, lse = reference.paged_decode_ref(q, k_cache, v_cache, p.rest_indptr, p.rest_indices, self.sm_scale)
        for c in p.split:
            if c.choice == "dense":        # straight from the contiguous HOT slab view
                kp = k_cache[c.hot_start:c.hot_start + c.prefix_len]
                vp = v_cache[c.hot_start:c.hot_start + c.prefix_len]
            else:                          # cascade / hydragen: read the prefix's slots
                kp, vp = k_cache[c.slots], v_cache[c.slots]
            rows = torch.tensor(c.rows, dtype=torch.int64, device=q.device)
            oc, lc = reference.attention_ref(q[rows], kp, vp, self.sm_scale)
            om, lm = reference.merge_state(o[rows], lse[rows], oc, lc)
            o[rows], lse[rows] = om, lm
        return o


def make_backend(system_cfg: Any, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, dispatcher: Any = None,
                 cuda_graph: bool = False, dense_kv_splits: Optional[int] = None,
                 cascade_impl: str = "multilevel", dense_kernel: str = "flashinfer") -> DecodeAttention:
    """The DecodeAttention of ``system_cfg.backend`` for heads per TP rank.

    Names: paged | cascade | hydragen | granikv (the SystemConfig backends) and dense (dense-HOT for
    every HOT class without a dispatcher; the kernel bench's variant; in the engine the same is
    ``granikv`` with ``dispatch=dense_only``).

    ``system_cfg``: a granikv.config.SystemConfig (or anything with ``backend``, ``dispatch``,
    ``tensor_core_decode``; ``cascade_impl`` when it has one, else the argument), or a bare name. For
    ``granikv`` without an explicit dispatcher, a Dispatcher in ``system_cfg.dispatch`` mode is built
    with the paper's A100 rule as table (use granikv.attention.dispatch.Dispatcher.from_hardware to
    pass the fitted table).
    """
    name = getattr(system_cfg, "backend", system_cfg)
    if name not in POLICIES:
        raise ValueError(f"system.backend: '{name}' is not one of {tuple(POLICIES)}")
    if name == "granikv" and dispatcher is None:
        from granikv.attention.dispatch import Dispatcher

        dispatcher = Dispatcher(num_q_heads, num_kv_heads, head_dim, gpu_name="", table=None,
                                mode=getattr(system_cfg, "dispatch", "table"))
    return DecodeAttention(make_policy(name, dispatcher), num_q_heads, num_kv_heads, head_dim, device=device,
                           dtype=dtype, tensor_core_decode=getattr(system_cfg, "tensor_core_decode", "auto"),
                           cuda_graph=cuda_graph, dense_kv_splits=dense_kv_splits,
                           cascade_impl=getattr(system_cfg, "cascade_impl", cascade_impl),
                           decode_plan=getattr(system_cfg, "decode_plan", "flashinfer"),
                           dense_kernel=getattr(system_cfg, "dense_kernel", dense_kernel))
