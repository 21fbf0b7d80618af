"""Prefix backends: paged / cascade / dense / hydragen / granikv, each planned per step, run per layer.

All five share one decomposition of a decode step (exact, by the LSE merge):

    attention(q_i, prefix_i + rest_i) = merge(attention(q_i, prefix_i), attention(q_i, rest_i))

Requests are grouped into prefix *classes* (equal ``prefix_id``). For each class the backend picks
how its prefix is attended (``ClassPlan.choice``):

- ``paged``    the prefix is not split off: the request's full slot list goes to the paged decode;
- ``cascade``  the class's queries attend its prefix slots through a paged batch prefill
               (FlashInfer cascade level 0, page size 1), non-causal;
- ``dense``    the class's queries are the rows of one non-causal attention over the contiguous
               HOT slab view ``k_cache[hot_start : hot_start+Lp]`` (GQA folded by FlashInfer:
               Meff = B_class * Hq/Hkv rows per kv head);
- ``hydragen`` the same dense math, after gathering the prefix slots into a contiguous scratch
               (every step and every layer: HydraGen on paged storage).

Every request's remaining slots (all of them for ``paged``) go to ONE batch decode over page-size-1
KV (tensor cores per SGLang's rule), and the prefix states are merged in. The batch-global
``cascade`` backend (SGLang-Cascade) runs FlashInfer's MultiLevelCascadeAttentionWrapper on GPU.

Device paths: ``device.type == 'cpu'`` -> torch reference math (granikv.attention.reference);
``cuda`` -> FlashInfer (granikv.attention.flashinfer_ops). CUDA graphs: with ``cuda_graph=True``
plan() writes into persistent buffers owned by a wrapper set per ``graph_key()``; run() is then
capturable and replayable for every later step with the same key (see graph_key()); a step
planned with ``graph=False`` (run eagerly by the caller) uses the one eager wrapper set instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from granikv.attention import reference
from granikv.attention.batch import DecodeBatch, to_device
from granikv.config import CASCADE_IMPLS

CHOICES = ("paged", "cascade", "dense", "hydragen")


@dataclass(slots=True)
class ClassPlan:
    """One prefix class of a step: its rows (request indices), prefix and chosen prefix path."""

    prefix_id: int
    rows: list[int]
    prefix_len: int
    hot_start: int                        # first HOT row of the prefix, -1 if not one HOT run
    choice: str = "paged"
    meff: int = 0                         # B_class * Hq/Hkv (query rows per kv head)
    n_real: int = 0                       # rows that are requests (not CUDA-graph pad rows): decisions use it
    row_start: int = -1                   # rows == range(row_start, row_start + B_class), else -1 (gathered)
    slots: Optional[torch.Tensor] = None    # int64 [Lp] prefix slot ids on the device (view of kv_indices)


@dataclass
class StepPlan:
    """Everything run() needs, built once per step by plan()."""

    batch_size: int
    classes: list[ClassPlan]
    rest_indptr: torch.Tensor             # int32 [B+1] (device)
    rest_indices: torch.Tensor            # int32 [nnz_rest] (device)
    rest_indptr_host: torch.Tensor        # int32 [B+1] (cpu copy, for FlashInfer's plan)
    extra: dict = field(default_factory=dict)


def group_classes(batch: DecodeBatch) -> list[ClassPlan]:
    """Group requests by ``prefix_id`` (>= 0 and prefix_len > 0); check members agree on the prefix."""
    by_id: dict[int, ClassPlan] = {}
    for i, (pid, lp, hs) in enumerate(zip(batch.prefix_ids, batch.prefix_lens, batch.hot_starts)):
        if pid < 0 or lp <= 0:
            continue
        c = by_id.get(pid)
        if c is None:
            by_id[pid] = ClassPlan(pid, [i], int(lp), int(hs))
        else:
            if c.prefix_len != lp or c.hot_start != hs:
                raise ValueError(f"DecodeBatch: requests {c.rows[0]} and {i} share prefix_id={pid} but have "
                                 f"prefix_len {c.prefix_len} vs {lp} / hot_start {c.hot_start} vs {hs}; "
                                 "equal prefix_id must mean identical prefix slots")
            c.rows.append(i)
    return list(by_id.values())


class PrefixAttentionBackend:
    """Base of all prefix backends (PrefixBackend protocol of granikv.attention.batch).

    plan(DecodeBatch) once per step; run(q [B, Hq, D], k_cache [C, Hkv, D], v_cache) -> o [B, Hq, D]
    once per layer. Subclasses only decide ``ClassPlan.choice`` per class (``_choose``).

    ``graph_safe``: with ``cuda_graph=True`` on the FlashInfer path, run() only reads buffers that
    plan() rewrites in place, so a graph captured after one plan() replays correctly after any
    later plan() with the same ``graph_key()`` (checked by tests/test_attention_gpu.py on the GPU
    host). The torch path (CPU) reads host values and is never captured.
    """

    name = "base"
    graph_safe = True

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, tensor_core_decode: str = "auto", sm_scale: Optional[float] = None,
                 cuda_graph: bool = False, impl: Optional[str] = None, dense_kv_splits: Optional[int] = None,
                 cascade_impl: str = "multilevel"):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"{self.name}: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.hq, self.hkv, self.d = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.device = torch.device(device)
        self.dtype = dtype
        self.sm_scale = reference.default_scale(head_dim) if sm_scale is None else sm_scale
        self.tensor_core_decode = tensor_core_decode
        self.cuda_graph = cuda_graph
        # capacity of the graph-mode rest-decode index buffer, ONE buffer shared by every graph-mode
        # wrapper set (gpu_paths.GpuPaths): set by the engine to largest graph batch x longest possible
        # row (min(max_position_embeddings, KV pool)), as SGLang sizes its one CUDA-graph kv_indices
        # buffer (max_bs x context length), so a graph never depends on how many KV slots the batch's
        # rows hold (a paged row counts its shared prefix again: 256 rows x 8K exceed a 157K-token pool).
        # None = the next power of two of each step's count (every new bucket was a new graph,
        # captured inside measured steps: H200 cells before 7094569 and the a100_40gb cells of 1e93c7b)
        self.rest_capacity: Optional[int] = None
        # FlashInfer path: the dense/HydraGen prefix attention's interleaved KV chunks (None = auto:
        # flashinfer_ops.dense_kv_splits fills the GPU's SMs; 1 = one plain single-prefill call)
        if dense_kv_splits is not None and int(dense_kv_splits) < 1:
            raise ValueError(f"{self.name}: dense_kv_splits must be >= 1 or None (auto), got {dense_kv_splits}")
        self.dense_kv_splits = None if dense_kv_splits is None else int(dense_kv_splits)
        # FlashInfer path of the batch-global cascade: "multilevel" = FlashInfer's
        # MultiLevelCascadeAttentionWrapper as shipped; "composed" = the per-class cascade path
        # (one batch prefill for the common prefix, the tensor-core decode for the rest, merge)
        if cascade_impl not in CASCADE_IMPLS:
            raise ValueError(f"{self.name}: cascade_impl must be one of {CASCADE_IMPLS}, got {cascade_impl!r}")
        self.cascade_impl = cascade_impl
        self.last_decisions: list[dict] = []
        self.last_choose_us = 0.0
        self._plan: Optional[StepPlan] = None
        # impl: "torch" (reference math) or "flashinfer"; default by device
        self.impl = impl or ("flashinfer" if self.device.type == "cuda" else "torch")
        if self.impl not in ("torch", "flashinfer"):
            raise ValueError(f"{self.name}: impl must be torch or flashinfer, got {impl!r}")
        self._gpu = None
        if self.impl == "flashinfer":
            from granikv.attention.gpu_paths import GpuPaths

            self._gpu = GpuPaths(self)

    # ---- decisions ------------------------------------------------------------------------
    def _choose(self, classes: list[ClassPlan], batch_size: int) -> None:
        raise NotImplementedError

    # ---- plan -----------------------------------------------------------------------------
    def plan(self, batch: DecodeBatch, graph: Optional[bool | Callable[[tuple], bool]] = None) -> None:
        """Group classes, choose a path per class, build the rest-of-request slot lists, plan kernels.

        ``graph`` (FlashInfer path only): False = the caller runs this step eagerly (no CUDA graph),
        so one shared eager wrapper set is used even when ``cuda_graph=True``; None = ``cuda_graph``;
        a callable gets this step's graph_key() and returns that bool (``last_plan_graph`` keeps it).
        Pad rows (the last ``batch.num_pad``) do not count in path decisions; in a class that goes
        ``paged`` they skip the prefix (1-token rows, as SGLang pads), their outputs being unused.
        """
        b = batch.batch_size
        if batch.kv_indptr.numel() != b + 1:
            raise ValueError(f"{self.name}.plan: kv_indptr has {batch.kv_indptr.numel()} entries for {b} requests")
        if not (len(batch.prefix_ids) == len(batch.hot_starts) == b):
            raise ValueError(f"{self.name}.plan: prefix_lens/prefix_ids/hot_starts must all have {b} entries")
        if not 0 <= batch.num_pad <= b:
            raise ValueError(f"{self.name}.plan: num_pad={batch.num_pad} must be in [0, batch size {b}]")
        if batch.kv_indptr_host is not None:
            if batch.kv_indptr_host.device.type != "cpu" or batch.kv_indptr_host.numel() != b + 1:
                raise ValueError(f"{self.name}.plan: kv_indptr_host must be a host tensor of {b + 1} entries "
                                 "(a copy of kv_indptr), or None")
            indptr_h = batch.kv_indptr_host.to(torch.int64)           # [B+1] host, no device sync
        else:
            indptr_h = batch.kv_indptr.to("cpu", torch.int64)         # [B+1] (a device->host copy: a sync on GPU)
        real = b - batch.num_pad                                      # rows >= real are padding
        classes = group_classes(batch)
        for c in classes:
            c.meff = len(c.rows) * self.group
            c.n_real = sum(1 for r in c.rows if r < real)
            # rows ascend (batch order): contiguous iff they span exactly B_class rows; the FlashInfer
            # path then reads q / writes o as slices instead of gathering and scattering
            c.row_start = c.rows[0] if c.rows[-1] - c.rows[0] + 1 == len(c.rows) else -1
        t_choose = time.perf_counter()
        self._choose(classes, b)
        self.last_choose_us = (time.perf_counter() - t_choose) * 1e6   # the dispatcher's CPU time this step
        # host lists, one tensor at the end: per-class tensor ops cost ~5 us each (k=64 classes)
        skip_l = [0] * b
        ip = indptr_h.tolist()
        for c in classes:
            if c.choice not in CHOICES:
                raise ValueError(f"{self.name}: unknown prefix path '{c.choice}' for prefix_id={c.prefix_id}")
            if c.choice == "dense" and c.hot_start < 0:
                raise ValueError(f"{self.name}: prefix_id={c.prefix_id} chose dense but has no HOT run (hot_start=-1)")
            if c.choice == "paged" and c.n_real < len(c.rows):
                for r in c.rows[c.n_real:]:                            # pad rows (last in the class): 1-token rows
                    skip_l[r] = c.prefix_len
            if c.choice != "paged":
                for r in c.rows:
                    skip_l[r] = c.prefix_len
                s0 = ip[c.rows[0]]
                c.slots = batch.kv_indices[s0:s0 + c.prefix_len]
        skip = torch.tensor(skip_l, dtype=torch.int64)
        dev = batch.kv_indptr.device
        lens = indptr_h[1:] - indptr_h[:-1]
        if bool((lens < skip).any()):
            raise ValueError(f"{self.name}.plan: a request has fewer KV slots than its prefix_len")
        if not bool(skip.any()):
            rest_indptr, rest_indices = batch.kv_indptr.int(), batch.kv_indices.int()
            rest_indptr_h = indptr_h
        else:
            rest_lens = lens - skip
            rest_indptr_h = torch.zeros(b + 1, dtype=torch.int64)
            torch.cumsum(rest_lens, 0, out=rest_indptr_h[1:])
            nnz = int(rest_indptr_h[-1])
            # one async host->device copy (no stream sync: the overlap schedule plans while a step runs)
            packed = to_device(torch.cat([indptr_h[:-1] + skip - rest_indptr_h[:-1], rest_lens, rest_indptr_h]), dev)
            shift, rest_lens_d, rest_indptr_d = packed.split([b, b, b + 1])          # [B], [B], [B+1]
            pos = torch.repeat_interleave(shift, rest_lens_d, output_size=nnz) + torch.arange(nnz, device=dev)
            rest_indices = batch.kv_indices[pos].int()
            rest_indptr = rest_indptr_d.int()
        self._plan = StepPlan(b, classes, rest_indptr, rest_indices, rest_indptr_h.int())
        self.last_decisions = [
            {"prefix_id": c.prefix_id, "batch": len(c.rows), "meff": c.meff, "prefix_len": c.prefix_len,
             "hot": c.hot_start >= 0, "backend": c.choice} for c in classes]
        nopfx = b - sum(len(c.rows) for c in classes)
        if nopfx:
            self.last_decisions.append({"prefix_id": -1, "batch": nopfx, "meff": nopfx * self.group,
                                        "prefix_len": 0, "hot": False, "backend": "paged"})
        if callable(graph):   # the caller decides from this step's graph key (runner: capture policy)
            graph = bool(graph(self.graph_key()))
        self.last_plan_graph = graph
        if self._gpu is not None:
            self._gpu.plan(self._plan, graph)

    def graph_key_has_classes(self) -> bool:
        """Whether the planned step's graph_key() holds split-off prefix classes (a step structure that
        can change at one batch size), not only the batch size (valid after plan())."""
        return any(c.choice != "paged" for c in self._require_plan().classes)

    def graph_key(self) -> tuple:
        """Hashable of what a captured CUDA graph of run() depends on (valid after plan()).

        Batch size, the rest-decode index capacity (rest_bucket) and, per split-off class,
        (choice, B_class, Lp, hot_start, row_start): the dense path bakes the HOT slab address and,
        for a class whose rows are contiguous, their slice into the graph.
        """
        p = self._require_plan()
        cls = tuple((c.choice, len(c.rows), c.prefix_len, c.hot_start, c.row_start)
                    for c in p.classes if c.choice != "paged")
        return (self.name, p.batch_size, self.rest_bucket(p.rest_indices.numel()), cls)

    def rest_bucket(self, n: int) -> int:
        """Rest-decode index capacity of a graph-mode wrapper set for a step with ``n`` rest indices:
        ``rest_capacity`` (the shared buffer) when it holds them, else the next power of two (a set of
        its own; cannot happen when the engine sized ``rest_capacity``, kept for direct backend use)."""
        return self.rest_capacity if self.rest_capacity and n <= self.rest_capacity else _pow2(n)

    def release_graph(self, key: tuple) -> None:
        """Free what a captured graph of ``key`` (a graph_key()) pinned: its wrapper set's buffers."""
        if self._gpu is not None:
            self._gpu.release(key)

    def _require_plan(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError(f"{self.name}.run called before plan()")
        return self._plan

    # ---- run ------------------------------------------------------------------------------
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Decode attention of the planned step for one layer: q [B, Hq, D] -> o [B, Hq, D]."""
        p = self._require_plan()
        if q.shape[0] != p.batch_size:
            raise ValueError(f"{self.name}.run: q has {q.shape[0]} rows, plan has batch {p.batch_size}")
        if self._gpu is not None:
            return self._gpu.run(p, q, k_cache, v_cache)
        return self._run_cpu(p, q, k_cache, v_cache)

    def _run_cpu(self, p: StepPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        o, lse = reference.paged_decode_ref(q, k_cache, v_cache, p.rest_indptr, p.rest_indices, self.sm_scale)
        for c in p.classes:
            if c.choice == "paged":
                continue
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


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class PagedBackend(PrefixAttentionBackend):
    """SGLang default: one batch decode over every request's prefix+suffix slots (page size 1)."""

    name = "paged"

    def _choose(self, classes, batch_size):
        for c in classes:
            c.choice = "paged"


class CascadeBackend(PrefixAttentionBackend):
    """SGLang-Cascade: level 0 = the prefix common to EVERY request of the batch; none -> paged.

    Common prefix = all B requests are in one class (same prefix_id); any request outside it, or
    two classes, makes the batch-global common prefix empty and the step runs the paged path.
    """

    name = "cascade"

    def _choose(self, classes, batch_size):
        common = len(classes) == 1 and len(classes[0].rows) == batch_size
        for c in classes:
            c.choice = "cascade" if common else "paged"


class DenseBackend(PrefixAttentionBackend):
    """Dense-HOT for every class whose prefix is one HOT run; other classes paged (no dispatcher)."""

    name = "dense"

    def _choose(self, classes, batch_size):
        for c in classes:
            c.choice = "dense" if c.hot_start >= 0 else "paged"


class HydragenBackend(PrefixAttentionBackend):
    """HydraGen on paged storage: every class's prefix gathered to a scratch, then the dense math."""

    name = "hydragen"

    def _choose(self, classes, batch_size):
        for c in classes:
            c.choice = "hydragen"


class GranikvBackend(PrefixAttentionBackend):
    """GraniKV: per class dense / cascade / paged as the dispatcher says.

    A class whose prefix is not one HOT run (admission fell back to COLD) cannot go dense: a dense
    choice becomes cascade for it (the paged fallback, served the cascade/paged way).
    """

    name = "granikv"

    def __init__(self, *args, dispatcher=None, **kwargs):
        if dispatcher is None:
            raise ValueError("granikv backend needs a dispatcher (granikv.attention.dispatch.Dispatcher)")
        self.dispatcher = dispatcher
        super().__init__(*args, **kwargs)

    def _choose(self, classes, batch_size):
        # real rows only: CUDA-graph pad rows in the class must not change the decision (a class of
        # pad rows only is paged: the dispatcher answers batch_class 0 so). One lookup per class and
        # no intermediate lists: this loop is the dispatcher's per-step cost.
        decide = self.dispatcher.decisions          # (Lp, n_real) -> choice, decided on first sight
        for c in classes:
            choice = decide[(c.prefix_len, c.n_real)]
            c.choice = "cascade" if (choice == "dense" and c.hot_start < 0) else choice


BACKEND_CLASSES = {"paged": PagedBackend, "cascade": CascadeBackend, "dense": DenseBackend,
                   "hydragen": HydragenBackend, "granikv": GranikvBackend}


def make_backend(system_cfg: Any, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, dispatcher: Any = None,
                 cuda_graph: bool = False, dense_kv_splits: Optional[int] = None,
                 cascade_impl: str = "multilevel") -> PrefixAttentionBackend:
    """The prefix backend of ``system_cfg.backend`` for heads per TP rank.

    Names: paged | cascade | hydragen | granikv (the SystemConfig backends) and dense (dense-HOT for
    every HOT class without a dispatcher; the kernel bench's variant; in the engine the same is
    ``granikv`` with ``dispatch=dense_only``).

    ``system_cfg``: a granikv.config.SystemConfig (or anything with ``backend``, ``dispatch``,
    ``tensor_core_decode``; ``cascade_impl`` when it has one, else the argument). For ``granikv``
    without an explicit dispatcher, a Dispatcher in ``system_cfg.dispatch`` mode is built with the
    paper's A100 rule as table (use granikv.attention.dispatch.Dispatcher.from_hardware to pass the
    fitted table).
    """
    name = getattr(system_cfg, "backend", system_cfg)
    if name not in BACKEND_CLASSES:
        raise ValueError(f"system.backend: '{name}' is not one of {tuple(BACKEND_CLASSES)}")
    tc = getattr(system_cfg, "tensor_core_decode", "auto")
    kw = dict(device=device, dtype=dtype, tensor_core_decode=tc, cuda_graph=cuda_graph, dense_kv_splits=dense_kv_splits,
              cascade_impl=getattr(system_cfg, "cascade_impl", cascade_impl))
    if name == "granikv":
        if dispatcher is None:
            from granikv.attention.dispatch import Dispatcher

            dispatcher = Dispatcher(num_q_heads, num_kv_heads, head_dim, gpu_name="", table=None,
                                    mode=getattr(system_cfg, "dispatch", "table"))
        return GranikvBackend(num_q_heads, num_kv_heads, head_dim, dispatcher=dispatcher, **kw)
    return BACKEND_CLASSES[name](num_q_heads, num_kv_heads, head_dim, **kw)
