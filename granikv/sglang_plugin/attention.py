"""The plugin's attention backends inside SGLang (imports SGLang: load it only where SGLang is
installed; :func:`granikv.sglang_plugin.load` does).

Three backends, one per prefix policy of :mod:`granikv.attention.policy`, over SGLang's own KV
pool and ``req_to_token`` rows:

    --attention-backend granikv          GraniKV: per prefix class, the calibrated decision table
                                         (dense over the HOT slab / cascade / paged)
    --attention-backend granikv_cascade  SGLang-Cascade: batch-global two-level cascade
    --attention-backend hydragen         HydraGen: dense prefix math over a gathered copy

Each is SGLang's ``FlashInferAttnBackend`` (written against SGLang 0.5.17) with the decode step
replaced: per step, the requests' shared prefixes are read off the radix tree on the host
(:mod:`.step_prefixes`, staged by a hook on ``ForwardBatch.init_new``), the policy picks each
class's path, and the engine's :class:`granikv.attention.decode.DecodeAttention` plans once and
runs per layer (prefix path, paged decode of the rest, LSE merge). Prefill/extend, and any decode
step without a split-off class, is SGLang's FlashInfer path unchanged.

CUDA graphs. With SGLang's default full decode graphs the whole decode step, prefix paths included,
replays from one graph per captured batch size (:mod:`granikv.attention.graph_step`): the step's classes,
paths, slabs and row order are data written into fixed buffers before each replay
(``init_forward_metadata_out_graph``, SGLang's replay-metadata hook), the suffix index list is built on
the GPU in one pass with each split row's prefix left out (``kv_start_idx``), and the dispatcher takes the
table's graph rules. Steps above ``--cuda-graph-max-bs``, or with graphs disabled, run the same policy
eagerly with the table's eager rules. ``--cuda-graph-backend-decode breakable`` still works (each layer's
attention runs eagerly at a graph break, planned on the host; eager rules): kept for comparison.
No host sync in a decode launch: the plan reads only host lists, ``seq_lens_cpu`` and device
tensors it indexes asynchronously.
"""
from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import Optional

import torch
from sglang.kernels.ops.attention.utils import create_flashinfer_kv_indices_triton
from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata, FlashInferAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
    eager_on_graph,
    is_in_breakable_cuda_graph,
)
from sglang.srt.runtime_context import get_parallel

from granikv.attention.batch import DecodeBatch, to_device
from granikv.attention.decode import DecodeAttention
from granikv.attention.dispatch import Dispatcher
from granikv.attention.gpu_paths import host_range
from granikv.attention.graph_step import GraphLimits, GraphStep, capture_plan, plan_graph_step, shared_buffers
from granikv.attention.policy import make_policy
from granikv.sglang_plugin.path_stats import GcClock, PathStats, StatsWriter, describe, load_hardware
from granikv.sglang_plugin.settings import PluginSettings
from granikv.sglang_plugin.step_prefixes import PrefixMemo, StepPrefixes, staged_for, step_prefixes

logger = logging.getLogger(__name__)

# --attention-backend name -> granikv.attention.policy name
POLICY_OF = {"granikv": "granikv", "granikv_cascade": "cascade", "hydragen": "hydragen"}

_LIVE: "weakref.WeakSet[GraniKVAttnBackend]" = weakref.WeakSet()   # this process's backends, for the hook


class GraniKVAttnBackend(FlashInferAttnBackend):
    """SGLang's FlashInfer backend whose decode step runs a prefix policy's plan (see the module
    docstring). ``stats``: the :class:`PathStats` of this backend (written to ``GRANIKV_STATS_FILE``).

    Shapes per TP rank: q ``[B, Hq*D]`` in, o ``[B, Hq*D]`` out; K/V buffers ``[C, Hkv, D]`` (NHD).
    """

    def __init__(self, model_runner, backend_name: str, settings: Optional[PluginSettings] = None):
        super().__init__(model_runner, init_new_workspace=model_runner.init_new_workspace)
        if backend_name not in POLICY_OF:
            raise ValueError(f"granikv: unknown attention backend {backend_name!r}; one of {tuple(POLICY_OF)}")
        if self.num_wrappers != 1:
            raise ValueError(f"--attention-backend {backend_name} does not support sliding-window or "
                             "cross-attention models; use --attention-backend flashinfer")
        if self.decode_uses_dequant_workspace or self.is_nvfp4_kvcache:
            raise ValueError(f"--attention-backend {backend_name} needs a bf16/fp16 KV cache; drop --kv-cache-dtype")
        mc = model_runner.model_config
        tp = get_parallel().attn_tp_size
        hq, hkv, d = mc.num_attention_heads // tp, mc.get_num_kv_heads(tp), mc.head_dim
        self.settings = settings or PluginSettings.from_env()
        self.backend_name = backend_name
        policy_name = POLICY_OF[backend_name]
        dispatcher = None
        if policy_name == "granikv":
            gpu = torch.cuda.get_device_name(model_runner.device) if torch.cuda.is_available() else ""
            hw = load_hardware(self.settings.hardware, gpu)
            dispatcher = Dispatcher.from_hardware(hw, hq, hkv, d, mode=self.settings.dispatch, gpu_name=gpu,
                                                  plugin=True)
            logger.info("granikv attention: decision table from %s", describe(hw))
        self.decode = DecodeAttention(make_policy(policy_name, dispatcher), hq, hkv, d, device=model_runner.device,
                                      dtype=model_runner.dtype, sm_scale=mc.head_dim ** -0.5, impl="flashinfer",
                                      cascade_impl=self.settings.cascade_impl if policy_name == "cascade"
                                      else "multilevel", decode_plan=self.settings.decode_plan)
        self.stats = PathStats(backend_name, policy_name)
        self.stats.gc_clock = GcClock()
        self._writer = StatsWriter(self.settings.stats_file)
        self._staged: Optional[StepPrefixes] = None
        self.prefix_memo = PrefixMemo()    # last step's requests: an unchanged one is not read again
        self._step = None                  # the StepPlan this decode step runs, None: SGLang's paged path
        self._raw_bs = 0
        self._breakable = check_cuda_graph_backend(Phase.DECODE, Backend.BREAKABLE)
        self._attend_break = eager_on_graph(True)(self._attend)
        # full decode graphs (SGLang's default): the captured step of each batch size, made at its capture
        self._full = not self._breakable and not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        self.graph_steps: dict[int, GraphStep] = {}
        self._gs: Optional[GraphStep] = None     # the captured step the current decode step runs, None: eager
        self._gs_shared: Optional[dict] = None   # buffers every captured step shares (graph_step.shared_buffers)
        self._graph_plans: dict[int, tuple] = {} # batch size -> (what its last plan was made from, plan, skip)
        _LIVE.add(self)
        atexit.register(self._writer.maybe_write, self.stats, True)

    def _paged(self, reason: str) -> None:
        """Count a decode step that runs SGLang's paged path (and write the counters, as a split
        step does: a run whose every step stays paged must still show in the counter file)."""
        self.stats.paged(reason)
        self._writer.maybe_write(self.stats)

    # ---- the step's prefixes (staged by the ForwardBatch.init_new hook) -------------------------
    def stage(self, prefixes: Optional[StepPrefixes]) -> None:
        self._staged = prefixes

    # ---- plan (once per step, host) --------------------------------------------------------------
    def _plan(self, fb, raw: int) -> bool:
        """Plan this decode step on our paths; False (and the reason counted) when it runs SGLang's.
        Under torch.profiler (SGLang's /start_profile) the plan shows as the range ``granikv_plan``."""
        with host_range("granikv_plan"):
            return self._plan_step(fb, raw)

    def _plan_step(self, fb, raw: int) -> bool:
        staged = staged_for(self._staged, raw)
        if staged is None:
            self._paged("staged_mismatch" if self._staged is not None else "no_prefix")
            return False
        if not staged.any_prefix:
            self._paged("no_prefix")
            return False
        if fb.seq_lens_cpu is None:
            self._paged("no_cpu_seq_lens")
            return False
        t0 = time.perf_counter()
        dev = fb.seq_lens.device
        lens_h = fb.seq_lens_cpu[:raw].to(torch.int64)                        # [raw]
        indptr_h = torch.zeros(raw + 1, dtype=torch.int64)                    # [raw+1] host
        torch.cumsum(lens_h, 0, out=indptr_h[1:])
        indptr_d = to_device(indptr_h.to(torch.int32), dev)                   # [raw+1] async copy
        indices = torch.empty(int(indptr_h[-1]), dtype=torch.int32, device=dev)  # [nnz]
        r2t = self.req_to_token_pool.req_to_token                             # [max_reqs, ctx] int32
        create_flashinfer_kv_indices_triton[(raw,)](r2t, fb.req_pool_indices[:raw], fb.seq_lens[:raw], indptr_d,
                                                    None, indices, r2t.shape[1])
        batch = DecodeBatch(indptr_d, indices, staged.prefix_lens, staged.prefix_ids, staged.hot_starts,
                            kv_indptr_host=indptr_h)
        t1 = time.perf_counter()
        step = self.decode.make_plan(batch)
        t2 = time.perf_counter()
        if not step.split:
            self._paged("no_split")
            return False
        self.decode.load(step, graph=False)
        t3 = time.perf_counter()
        self._step, self._raw_bs = step, raw
        self.stats.split(self.decode.last_decisions, staged.host_us, step.choose_us,
                         (t3 - t0) * 1e6 + staged.host_us, index_us=(t1 - t0) * 1e6, make_us=(t2 - t1) * 1e6,
                         load_us=(t3 - t2) * 1e6)
        self._writer.maybe_write(self.stats)
        return True

    def init_forward_metadata(self, forward_batch):
        """Eager steps (no CUDA graph): our plan for a decode step with a split class, else SGLang's."""
        self._step = None
        self._gs = None
        mode = forward_batch.forward_mode
        self.decode.policy.graph_step = False          # an eager step: the table's eager rules
        if mode.is_decode() and self._plan(forward_batch, forward_batch.batch_size):
            self.forward_metadata = DecodeMetadata(self.decode_wrappers)
            return
        super().init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Graph capture and replay. Full decode graphs: at capture, SGLang's decode wrappers and this batch
        size's :class:`GraphStep`; at replay, the step's plan written into its buffers. Breakable decode
        graphs: plan the replayed step on the host (the attention runs as an eager break)."""
        self._step = None
        self._gs = None
        decode = forward_batch.forward_mode.is_decode()
        if decode and self._full:
            with host_range("granikv_plan"):
                self._replay_metadata(forward_batch, in_capture)
            return
        if decode and not in_capture and self._breakable:
            bs = forward_batch.batch_size
            raw = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
            # the dispatcher is keyed by how the attention runs: eagerly, at the graph's break (the table's
            # eager rules, which count the host's launches), though the rest of the step replays
            self.decode.policy.graph_step = False
            if self._plan(forward_batch, raw):
                return
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self.forward_metadata = DecodeMetadata(self.decode_cuda_graph_metadata[bs])
            return
        super().init_forward_metadata_out_graph(forward_batch, in_capture)

    # ---- full decode graphs ----------------------------------------------------------------------
    def _limits(self, bs: int) -> GraphLimits:
        st = self.settings
        pool = self.token_to_kv_pool.get_key_buffer(0).shape[0]
        scratch = self.backend_name == "hydragen"
        fold = st.dense_fold
        return GraphLimits(batch=bs, folds=(1, fold) if fold > 1 else (1,), fold_min_len=st.dense_fold_min_len,
                           groups=st.graph_groups, cascades=st.graph_cascades,
                           region_len=st.hydragen_scratch if scratch else pool,
                           cascade_slots=pool, scratch=scratch, row_bucket=st.row_bucket)

    def _graph_step(self, bs: int) -> GraphStep:
        gs = self.graph_steps.get(bs)
        if gs is None:
            dec = self.decode
            lim = self._limits(bs)
            if self._gs_shared is None:
                self._gs_shared = shared_buffers(lim, dec.hkv, dec.d, dec.dtype, dec.device)
            # SGLang's float workspace: its decode kernels and these launches run one after another
            gs = GraphStep(lim, dec.hq, dec.hkv, dec.d, dec.dtype, dec.device, dec.sm_scale,
                           backend=self.settings.dense_backend, workspace=self.workspace_buffer,
                           shared=self._gs_shared)
            self.graph_steps[bs] = gs
        return gs

    def _replay_metadata(self, fb, in_capture: bool) -> None:
        """Full decode graphs: write this step into the buffers the captured step of its batch size reads
        (module doc). Host work, async copies, the suffix index list built on the GPU; no sync."""
        bs = fb.batch_size
        r2t = self.req_to_token_pool.req_to_token                              # [R, W] int32
        gs = self._graph_step(bs)
        if in_capture:
            super().init_forward_metadata_out_graph(fb, in_capture=True)       # SGLang's decode wrappers of bs
            gs.load(capture_plan(gs.lim), r2t, fb.req_pool_indices)
            self._gs = gs
            self.stats.paged("capture")
            return
        t0 = time.perf_counter()
        raw = bs - int(getattr(fb, "num_padding", 0) or 0)
        staged = staged_for(self._staged, raw)
        reason = None
        if fb.seq_lens_cpu is None:
            reason = "no_cpu_seq_lens"
        elif staged is None:
            reason = "staged_mismatch" if self._staged is not None else "no_prefix"
        elif not staged.any_prefix:
            reason = "no_prefix"
        self.decode.policy.graph_step = True            # the attention replays in the graph: the graph rules
        if reason is None:
            ids, lens, hots = staged.prefix_ids, staged.prefix_lens, staged.hot_starts
        else:                                           # no prefix to split: every row on the rest decode
            ids, lens, hots = [-1] * raw, [0] * raw, [-1] * raw
        key = (raw, ids, lens, hots)
        last = self._graph_plans.get(bs)
        choose_us = 0.0
        if last is not None and last[0] == key:        # the batch's classes did not change: the same plan
            p, skip_h = last[1], last[2]
        else:
            p = plan_graph_step(ids, lens, hots, gs.lim, self.decode.policy, self.decode.group)
            skip_h = torch.tensor(p.skip, dtype=torch.int32)                   # [bs] host
            self._graph_plans[bs] = (key, p, skip_h)
            choose_us = p.choose_us
        t1 = time.perf_counter()
        gs.load(p, r2t, fb.req_pool_indices)
        t2 = time.perf_counter()
        # the rest decode: SGLang's decode wrappers of bs, each row's slots from its skip on (one Triton pass)
        lens_h = fb.seq_lens_cpu[:bs].to(torch.int32) - skip_h if fb.seq_lens_cpu is not None else None
        lens_d = fb.seq_lens[:bs].to(torch.int32) - gs.skip                    # [bs] rest lengths
        wrapper = self.decode_cuda_graph_metadata[bs][0]
        self.indices_updater_decode.call_begin_forward(
            wrapper, fb.req_pool_indices[:bs], lens_d, int(lens_h.sum()) if lens_h is not None else 0,
            self.kv_indptr[0], gs.skip, None, lens_h, fixed_split_size=None,
            disable_split_kv=self.disable_cuda_graph_kv_split)
        t3 = time.perf_counter()
        prefix_us = staged.host_us if staged is not None else 0.0
        host = (t3 - t0) * 1e6 + prefix_us
        self.stats.replay(host, {"prefix": prefix_us, "make": (t1 - t0) * 1e6, "load": (t2 - t1) * 1e6,
                                 "index": (t3 - t2) * 1e6})
        m = self.prefix_memo
        self.stats.memo(m.hits, m.misses, m.whole)
        if reason is not None or not p.split:
            self._paged(reason or "no_split")
            return
        self.stats.split(p.decisions(self.decode.group, raw), staged.host_us, choose_us, host,
                         index_us=(t3 - t2) * 1e6, make_us=(t1 - t0) * 1e6, load_us=(t2 - t1) * 1e6, graph=True)
        self._writer.maybe_write(self.stats)

    def _attend_graph(self, q, layer, forward_batch):
        """One layer of a full-graph step (captured; replayed with each step's buffers): the rest decode on
        SGLang's wrapper, then the prefix launches and one merge. q ``[bs, Hq*D]`` -> o ``[bs, Hq*D]``."""
        hq, d = layer.tp_q_head_num, layer.head_dim
        q3 = q.contiguous().view(-1, hq, d)                                    # [bs, Hq, D]
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)           # [C, Hkv, D]
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        wrapper = self.forward_metadata.decode_wrappers[0]
        o, lse = wrapper.forward_return_lse(q3, (k_buf, v_buf), sm_scale=layer.scaling,
                                            logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float,
                                            v_scale=layer.v_scale_float)
        self._gs.run(q3, k_buf, v_buf, o, lse)
        return o.view(-1, hq * d)

    # ---- run (per layer) -------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if k is not None and save_kv_cache:        # the KV write stays in the captured segment
            cache_loc = forward_batch.out_cache_loc
            swa = getattr(self.forward_metadata, "swa_out_cache_loc", None)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(cache_loc, swa), k, v, *self._kv_write_scales(layer))
        if is_in_breakable_cuda_graph():
            return self._attend_break(q, layer, forward_batch)
        if self._gs is not None:                       # a full decode graph's capture (and its warm-up runs)
            return self._attend_graph(q, layer, forward_batch)
        return self._attend(q, layer, forward_batch)

    def _attend(self, q, layer, forward_batch):
        """Attention of one layer for the planned step: q ``[bs, Hq*D]`` -> o ``[bs, Hq*D]`` (rows past
        the step's real requests, CUDA-graph padding, are left unwritten)."""
        step = self._step
        if step is None:
            return super().forward_decode(q, None, None, layer, forward_batch, save_kv_cache=False)
        hq, d = layer.tp_q_head_num, layer.head_dim
        q3 = q.contiguous().view(-1, hq, d)                                    # [bs, Hq, D]
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)           # [C, Hkv, D]
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        raw = self._raw_bs
        with host_range("granikv_attend"):
            o = self.decode.run(q3[:raw] if raw < q3.shape[0] else q3, k_buf, v_buf)   # [raw, Hq, D]
        if raw < q3.shape[0]:
            full = torch.empty_like(q3)
            full[:raw] = o
            o = full
        return o.view(-1, hq * d)


def stage_step_prefixes(result, *args, **kwargs):
    """AFTER hook of ``ForwardBatch.init_new(batch, model_runner)``: hand every plugin backend of this
    process the decode batch's prefixes, read from its requests (host only). Returns None (the
    ForwardBatch is unchanged)."""
    if not _LIVE:
        return None
    batch = kwargs.get("batch")
    if batch is None:
        batch = next((a for a in args if hasattr(a, "reqs") and hasattr(a, "forward_mode")), None)
    if batch is None:
        return None
    prefixes = None
    if batch.forward_mode.is_decode() and batch.reqs:
        first = next(iter(_LIVE))
        prefixes = step_prefixes(batch.reqs, first.settings, memo=first.prefix_memo)
    for b in list(_LIVE):
        b.stage(prefixes)
    return None


def make_backend_factory(name: str):
    def create(runner):
        if runner.use_mla_backend:
            raise ValueError(f"--attention-backend {name} does not support MLA models")
        return GraniKVAttnBackend(runner, name)

    return create
