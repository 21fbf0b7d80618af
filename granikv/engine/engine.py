"""The serving engine: builds model, KV cache and system from a RunConfig, and runs the step loop.

    engine = Engine(cfg)                      # validates, builds everything
    result = engine.run(requests, on_step=None)
    result.records  # RequestRecord per request: output ids, one wall time per token (streaming)
    result.steps    # one dict per step: the dispatch trace
    result.stats    # dispatch counts, HOT/COLD capacity and peaks, evictions, graphs, ...

Requests arrive at ``arrival_s`` after the start of ``run()`` (real wall clock; the loop sleeps
when idle). Under tensor parallelism every rank runs the same loop; rank 0's clock is broadcast
whenever an admission decision depends on it, so all ranks take identical steps.

Overlap schedule (``hardware.overlap_schedule``, SGLang's default): decode step t+1 is launched
before step t's tokens are read back, so the host's scheduling and planning of t+1 run while the
GPU computes t. Nothing the host decides needs the token values (output lengths are fixed by the
workload; input ids are gathered on the device); a token's time is when the host reads it, as a
streaming server would send it. A prefill step first reads back the step in flight.
"""
from __future__ import annotations

import gc
import itertools
import os
import time
from collections import Counter

import torch
import torch.distributed as dist

from granikv.config import RunConfig
from granikv.engine.fused import resolve_fused
from granikv.engine.model import CausalLM, TPGroup, generate_reference
from granikv.engine.runner import PLAN_SCOPE, ModelRunner
from granikv.engine.scheduler import Scheduler, Seq, Storage, check_fits
from granikv.engine.systems import build_backend, validate
from granikv.kv import KVCache, SplitPolicy
from granikv.request import Request, RequestRecord, RunResult  # noqa: F401 - RunResult: engine.RunResult
from granikv.workloads import warmup_requests

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


STALE_GPU_BYTES = 2 << 30   # allocated beyond this engine's own tensors at budget time: an earlier engine's


def kv_budget_tokens(cfg: RunConfig, bytes_per_token: int, device: torch.device, own_bytes: int = 0) -> int:
    """KV slots: fixed ``kv_budget_tokens``, else the per-model preset, else mem_fraction of GPU memory.

    ``own_bytes``: what this engine holds already (weights). A GPU budget is taken from free memory,
    so memory still held by an earlier engine of the same process (a sweep runs its cells in one
    process; reference cycles free an engine only at the next garbage collection) would shrink this
    cell's budget: seen 2026-11-30, budgets of one multi-prefix sweep ranged 384K-870K tokens. The
    garbage is collected first, and memory still held beyond ``own_bytes`` + 2 GiB is an error."""
    hw = cfg.hardware
    if hw.kv_budget_tokens is not None:
        return int(hw.kv_budget_tokens)
    if hw.kv_budget_per_model:
        if cfg.model.name not in hw.kv_budget_per_model:
            raise ValueError(f"config error at `hardware.kv_budget_per_model`: no budget for model "
                             f"'{cfg.model.name}' in preset '{hw.name}' (has {sorted(hw.kv_budget_per_model)})")
        return int(hw.kv_budget_per_model[cfg.model.name])
    if device.type != "cuda":
        raise ValueError("config error at `hardware.kv_budget_tokens`: required on CPU (there is no "
                         "free GPU memory to take a mem_fraction of); e.g. hardware.kv_budget_tokens=4096")
    torch.cuda.synchronize()
    gc.collect()              # an earlier engine of this process, freed only through a reference cycle
    torch.cuda.empty_cache()  # the weights' fp32 staging copies are cached, not used
    held = torch.cuda.memory_allocated(device)
    stuck = torch.cuda.memory_reserved(device) - held   # cached, yet not releasable: segments shared with live blocks
    if held > own_bytes + STALE_GPU_BYTES:
        raise RuntimeError(f"{held / 2**30:.1f} GiB of GPU memory are allocated before the KV pool, "
                           f"{(held - own_bytes) / 2**30:.1f} GiB beyond this engine's weights: an earlier "
                           f"engine of this process is still referenced, and the KV budget (hardware.mem_fraction "
                           f"of free memory) would be smaller than its neighbours'. Run the cell in a fresh process.")
    if stuck > STALE_GPU_BYTES:
        raise RuntimeError(f"{stuck / 2**30:.1f} GiB of GPU memory stay cached after empty_cache(): freed blocks "
                           f"share segments with live ones (an earlier engine's segments now holding this one's "
                           f"tensors), so the KV budget (hardware.mem_fraction of free memory) would be smaller "
                           f"than its neighbours'. Run the cell in a fresh process.")
    if cfg.tp > 1:
        # NCCL allocates its buffers at a communicator's first collective, outside torch's allocator:
        # take them before reading free memory (SGLang's NCCL communicator warms up at its init), else
        # the first cell of a TP sweep process counts them as KV memory (seen at TP=4, 2026-11-30: the
        # first cell's budget 2% above the later cells')
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    avail = free - total * (1.0 - hw.mem_fraction)  # SGLang's mem_fraction_static rule
    n = int(avail // bytes_per_token)
    if cfg.tp > 1:
        t = torch.tensor([n], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        n = int(t.item())
    if n <= 0:
        raise ValueError(f"config error at `hardware.mem_fraction`: no GPU memory left for KV after the "
                         f"weights (free {free / 2**30:.1f} GiB of {total / 2**30:.1f}); raise mem_fraction or tp")
    return n


def graph_rest_capacity(graph_sizes: list[int], max_position_embeddings: int, pool_tokens: int) -> int | None:
    """Int32 entries of the shared graph-mode rest-decode index buffer: largest graph batch x longest
    possible row, a row holding at most min(max_position_embeddings, KV pool) slots (SGLang: max_bs x
    context length). Every step a graph can replay fits, so graph keys never hold a slot count.
    None when no batch is replayed from a graph. Llama-3.1-8B, 256 rows: 256 x 131072 x 4 B = 128 MiB."""
    if not graph_sizes:
        return None
    return max(graph_sizes) * min(int(max_position_embeddings), int(pool_tokens))


class Engine:
    """A compact serving engine (nano-vllm sized) running one system of ``cfg`` on one TP rank.

    ``pad_batches`` pads decode batches to the CUDA-graph sizes even without graphs (CPU tests
    of the padding path); None = pad exactly when graphs are used.
    """

    def __init__(self, cfg: RunConfig, pad_batches: bool | None = None):
        m, hw, system = cfg.model, cfg.hardware, cfg.system
        if m.arch not in ("llama", "qwen2"):
            raise ValueError(f"config error at `model.arch`: unknown model architecture '{m.arch}' "
                             f"(model '{m.name}'); use llama or qwen2")
        validate(system)
        if hw.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("config error at `hardware.device`: cuda requested but no GPU is visible; use hardware=cpu")
        if hw.device == "cuda":
            hw.check_gpu(torch.cuda.get_device_name(0))
        if hw.device == "cpu" and hw.kv_budget_tokens is None and not hw.kv_budget_per_model:
            raise ValueError("config error at `hardware.kv_budget_tokens`: required on CPU; "
                             "e.g. hardware.kv_budget_tokens=4096")
        self.cfg = cfg
        if hw.device == "cuda" and cfg.tp > 1 and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # torchrun: one GPU per rank
        self.tp = TPGroup(cfg.tp)
        self.device = torch.device(hw.device, torch.cuda.current_device()) if hw.device == "cuda" else torch.device("cpu")
        self.dtype = DTYPES[hw.dtype]
        if hw.allreduce == "symm_one_shot":   # before the KV budget: its staging buffer takes GPU memory
            self.tp.use_symm_one_shot(self.device, self.dtype, int(hw.allreduce_symm_max_mib * 2 ** 20))
        self.fused_ops = resolve_fused(hw.fused_ops, self.device)
        # backends that split prefix classes off get each class's decode rows consecutive, so their
        # FlashInfer path slices q / o instead of gathering and scattering per class and layer; the
        # SGLang baselines keep the scheduler's order (SGLang does not reorder its batch)
        self.group_rows = cfg.system.backend in ("hydragen", "granikv")
        if self.device.type == "cuda":
            # Return an earlier engine's cached blocks to the driver BEFORE the weights are allocated: the
            # caching allocator would otherwise carve the weights out of its freed 50-GiB KV segments, and
            # those segments could never be released again: each later KV budget was smaller (seen on
            # the H200, 2026-11-30: budgets of one sweep at 1, 3/4, 1/2, 1/3 of the first cell's)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)   # gpu_peak_allocated_gib: this engine's peak
        self.model = CausalLM(m, self.tp, cfg.seed, self.device, self.dtype, fused_ops=self.fused_ops)
        hkv, hq = m.num_kv_heads // cfg.tp, m.num_heads // cfg.tp
        bytes_per_token = 2 * m.num_layers * hkv * m.head_dim * self.model.embed.element_size()
        own = sum(t.numel() * t.element_size() for t in itertools.chain(self.model.parameters(), self.model.buffers()))
        budget = kv_budget_tokens(cfg, bytes_per_token, self.device, own_bytes=own)
        self._alloc_at_budget = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        dynamic = system.hot_split == "dynamic"   # the HOT/COLD boundary moves (granikv.kv.dynamic_split)
        self.kv = KVCache(m.num_layers, budget, hkv, m.head_dim, system.hot_fraction, self.dtype, self.device,
                          cold_order="highest_first" if dynamic else "fifo")
        if self.kv.capacity_tokens - self.kv.hot_tokens < 2:
            raise ValueError(f"config error at `hardware.kv_budget_tokens`: {budget} tokens leave no COLD slots")
        policy = SplitPolicy.from_system(system, self.kv.capacity_tokens) if dynamic else None
        self.storage = Storage(self.kv, enable_hot=system.hot_fraction > 0 or dynamic, split=policy)
        use_graphs = hw.device == "cuda" and hw.cuda_graph_max_bs > 0
        self.backend = build_backend(system, m, hw, cfg.tp, self.device, self.dtype, cuda_graph=use_graphs)
        from granikv.attention.prefill import PrefillAttention
        self.prefill_attn = PrefillAttention(hq, hkv, m.head_dim, self.device, self.dtype)
        self.group = hq // hkv
        self.runner = ModelRunner(self.model, self.kv, self.storage, self.backend, self.prefill_attn,
                                  max_rows=hw.max_running_requests, max_len=1,
                                  cuda_graph_max_bs=hw.cuda_graph_max_bs, use_graphs=use_graphs,
                                  pad=bool(pad_batches), max_graphs=hw.cuda_graph_max_graphs,
                                  capture_at=hw.cuda_graph_capture_at)
        # graph keys independent of how many KV slots the rows hold: one shared index buffer of
        # (largest graph batch) x (longest possible row) int32, as SGLang's max_bs x context length
        self.backend.rest_capacity = graph_rest_capacity(self.runner.sizes, m.max_position_embeddings,
                                                         self.kv.capacity_tokens)

    # ------------------------------------------------------------------ checks
    def validate(self, requests: list[Request]) -> None:
        """Clear errors for requests that could never be served, before any work."""
        m = self.cfg.model
        seen = set()
        for r in requests:
            if r.rid in seen:
                raise ValueError(f"request rid={r.rid} appears twice; rids must be unique")
            seen.add(r.rid)
            total = len(r.prompt_ids) + r.output_len
            if total > m.max_position_embeddings:
                raise ValueError(f"config error at `workload`: request {r.rid} has prompt {len(r.prompt_ids)} + "
                                 f"output {r.output_len} = {total} tokens, longer than model '{m.name}' "
                                 f"max_position_embeddings={m.max_position_embeddings}; shorten prefix_len/suffix_len/output_len")
            if not r.prompt_ids:
                raise ValueError(f"request {r.rid} has an empty prompt")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= m.vocab_size:
                raise ValueError(f"request {r.rid} has token ids outside [0, vocab_size={m.vocab_size})")
            check_fits(r, self.storage)

    # ------------------------------------------------------------------ run
    def run(self, requests: list[Request], on_step=None) -> RunResult:
        """Serve ``requests`` (arrivals relative to now); warm-up requests first, excluded from results."""
        self.validate(requests)
        warm = None
        if self.cfg.warmup_requests > 0:
            # the warm-up captures every step structure at its first step (its purpose: the measured run
            # replays graphs); the measured run captures class structures at their capture_at-th step
            self.runner.capture_at = 1
            try:
                warm = self._serve(warmup_requests(requests, self.cfg.warmup_requests,
                                                   self.cfg.model.max_position_embeddings), None)
            finally:
                self.runner.capture_at = self.cfg.hardware.cuda_graph_capture_at
        result = self._serve(requests, on_step)
        if warm is not None:
            result.stats["warmup"] = {"requests": len(warm.records), "steps": len(warm.steps),
                                      "duration_s": warm.stats["duration_s"]}
        return result

    def _serve(self, requests: list[Request], on_step) -> RunResult:
        self.storage.reset()
        self.runner.resize(max((len(r.prompt_ids) + r.output_len for r in requests), default=1))
        self.runner.eager_reasons = {}
        sched = Scheduler(self.storage, self.cfg.hardware, max_rows=self.runner.pad_row)
        sched.add([Seq(r, i) for i, r in enumerate(requests)])
        steps, t0 = [], time.perf_counter()
        capture0 = self.runner.capture_s
        overlap = self.cfg.hardware.overlap_schedule
        inflight = None              # (seqs, PendingTokens) of the launched decode step not read back yet

        def read_back():
            nonlocal inflight
            seqs, pending = inflight
            inflight = None
            toks = pending.get()
            sched.after_decode(seqs, toks, time.perf_counter() - t0)

        while not sched.idle or inflight is not None:
            now = self._clock(t0, need_sync=bool(sched.pending))
            for s in sched.admit_arrived(now):
                self.runner.set_row(s)
            chunks = sched.prefill_chunks()
            if chunks and inflight is not None:
                read_back()          # a prefill step starts from a drained pipeline
            decode = [] if chunks else sched.decode_seqs()
            if decode and self.group_rows:   # each prefix class's rows consecutive (stable: FCFS within a class)
                decode.sort(key=lambda s: s.prefix_id)
            if not chunks and not decode:
                if inflight is not None:
                    read_back()      # its requests may finish and free KV / rows
                    continue
                nxt = sched.next_arrival()
                if nxt is None or nxt <= now:
                    raise RuntimeError("engine stalled: arrived requests cannot be admitted and nothing runs "
                                       "(KV budget or max_running_requests too small)")
                time.sleep(min(nxt - now, 0.05))
                continue
            start = time.perf_counter()
            with torch.profiler.record_function("prefill_step" if chunks else "decode_step"):
                if chunks:
                    toks = self.runner.prefill(chunks)
                    info = {}
                else:
                    pending, info = self.runner.decode(decode)
                    sched.launched_decode(decode)
                    if inflight is not None:
                        read_back()  # overlap: step t-1's tokens are read while step t runs on the GPU
                    inflight = (decode, pending)
                    if not overlap:
                        read_back()
            end = time.perf_counter()
            if chunks:
                sched.after_prefill(chunks, toks, end - t0)
            self.storage.observe()
            rec = self._step_record(len(steps), chunks, decode, info, start - t0, end - start)
            steps.append(rec)
            if on_step is not None:
                on_step(rec)
        duration = time.perf_counter() - t0
        records = [self._record(s) for s in sorted(sched.done, key=lambda s: s.order)]
        return RunResult(records, steps, self._stats(steps, duration, self.runner.capture_s - capture0))

    def _clock(self, t0: float, need_sync: bool) -> float:
        now = time.perf_counter() - t0
        if self.tp.size > 1 and need_sync:  # all ranks must admit the same requests
            # a host tensor over the group's gloo side: no wait on the GPU stream, so the overlap
            # schedule survives (as SGLang broadcasts requests on a CPU group); over NCCL, .item()
            # would wait for every queued kernel first
            t = torch.tensor([now], dtype=torch.float64, device=self.tp.host_device)
            dist.broadcast(t, src=0)
            now = float(t.item())
        return now

    def _step_record(self, i, chunks, decode, info, start_s, dt) -> dict:
        if chunks:
            return {"step": i, "kind": "prefill", "batch_size": len(chunks),
                    "num_tokens": sum(c.end - c.start for c in chunks), "meff": {}, "decisions": [],
                    "t_start_s": start_s, "step_time_s": dt}
        per_class = Counter(s.req.prefix_class for s in decode if s.req.shared_len > 0)
        npad = info.get("padded_bs", len(decode)) - len(decode)
        decisions = []
        for d in getattr(self.backend, "last_decisions", []):
            d = dict(d)
            if npad and d.get("prefix_id") == info.get("pad_class", -1):  # CUDA-graph pad rows are not requests
                d["batch"] -= npad
                d["meff"] = d["batch"] * self.group
                if d["batch"] <= 0:
                    continue
            decisions.append(d)
        return {"step": i, "kind": "decode", "batch_size": len(decode), "num_tokens": len(decode),
                "meff": {str(c): n * self.group for c, n in sorted(per_class.items())},
                "decisions": decisions,
                "padded_bs": info.get("padded_bs", len(decode)), "cuda_graph": info.get("graph", False),
                **({"eager_reason": info["eager_reason"]} if "eager_reason" in info else {}),
                # host CPU of this step's backend plan() and, inside it, of the dispatcher's choices
                "plan_us": info.get("plan_us"), "dispatch_us": info.get("dispatch_us"),
                "t_start_s": start_s, "step_time_s": dt}

    def _record(self, s: Seq) -> RequestRecord:
        return RequestRecord(rid=s.req.rid, arrival_s=s.req.arrival_s, prompt_len=s.prompt_len,
                             output_ids=list(s.output_ids), token_times_s=list(s.token_times),
                             cached_len=s.reused, prefix_class=s.req.prefix_class, prefix_where=s.where)

    def _memory_stats(self) -> dict:
        """GPU memory (GiB): allocated when the KV budget was taken (weights and the like) and the
        peak since this engine was built (warm-up included). Empty on CPU."""
        if self.device.type != "cuda":
            return {}
        return {"gpu_allocated_at_kv_budget_gib": self._alloc_at_budget / 2**30,
                "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                "gpu_total_gib": torch.cuda.get_device_properties(self.device).total_memory / 2**30}

    def _stats(self, steps: list[dict], duration: float, capture_s: float) -> dict:
        counts: Counter = Counter()
        for st in steps:
            for d in st["decisions"]:
                counts[str(d.get("backend", d.get("choice", "?")))] += 1
        st, kv = self.storage, self.kv
        return {
            "dispatch_counts": dict(counts), "duration_s": duration,
            "kv_budget_tokens": kv.capacity_tokens, "hot_capacity_tokens": kv.hot_tokens,
            "cold_capacity_tokens": kv.capacity_tokens - kv.hot_tokens,
            "hot_peak_tokens": st.peak_hot, "cold_peak_tokens": st.peak_cold,
            "evicted_tokens": st.index.evicted_tokens, "admissions": dict(st.admission.counts),
            "cuda_graph_sizes_captured": sorted({k[0] for k in self.runner.graphs}),
            "cuda_graphs_captured": self.runner.graphs_captured, "cuda_graph_capture_s": capture_s,
            "cuda_graphs_held": len(self.runner.graphs), "cuda_graphs_evicted": self.runner.graphs_evicted, "cuda_graph_max_graphs": self.runner.max_graphs,
            **self._memory_stats(),
            "eager_decode_reasons": dict(self.runner.eager_reasons),
            "num_steps": len(steps), "num_decode_steps": sum(s["kind"] == "decode" for s in steps),
            "tp": self.tp.size, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "fused_ops": self.fused_ops, "overlap_schedule": bool(self.cfg.hardware.overlap_schedule),
            "decode_plan_scope": PLAN_SCOPE,                         # what each step's plan_us covers
            **(st.split.stats() if st.split is not None else {}),   # dynamic split only: boundary range, moves
        }

    # ------------------------------------------------------------------ oracle
    def generate_reference(self, prompt_ids: list[int], n: int) -> list[int]:
        """Greedy tokens from a plain full-sequence forward with no KV cache (the correctness oracle)."""
        return generate_reference(self.model, prompt_ids, n)[0]
