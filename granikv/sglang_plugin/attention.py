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

CUDA graphs. A step's plan has a structure (classes, paths, slabs) that changes from step to step,
which one captured graph per batch size cannot follow. With ``--cuda-graph-backend-decode
breakable`` (what the plugin needs) SGLang captures the decode step in segments broken at each
layer's attention: the attention runs on every replay as an eager break
(``eager_on_graph``), after ``init_forward_metadata_out_graph`` planned the step on the host,
and everything else replays from the graphs. With the default ``full`` decode graphs, replayed
steps run SGLang's paged path (correct, no gain: counted as ``full_graph_replay``) and only steps
above ``--cuda-graph-max-bs`` run the plugin's paths; a warning says so at start-up.
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
from granikv.attention.policy import make_policy
from granikv.sglang_plugin.path_stats import PathStats, StatsWriter, describe, load_hardware
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
            dispatcher = Dispatcher.from_hardware(hw, hq, hkv, d, gpu_name=gpu)
            logger.info("granikv attention: decision table from %s", describe(hw))
        self.decode = DecodeAttention(make_policy(policy_name, dispatcher), hq, hkv, d, device=model_runner.device,
                                      dtype=model_runner.dtype, sm_scale=mc.head_dim ** -0.5, impl="flashinfer",
                                      cascade_impl=self.settings.cascade_impl if policy_name == "cascade"
                                      else "multilevel", decode_plan=self.settings.decode_plan)
        self.stats = PathStats(backend_name, policy_name)
        self._writer = StatsWriter(self.settings.stats_file)
        self._staged: Optional[StepPrefixes] = None
        self.prefix_memo = PrefixMemo()    # last step's requests: an unchanged one is not read again
        self._step = None                  # the StepPlan this decode step runs, None: SGLang's paged path
        self._raw_bs = 0
        self._breakable = check_cuda_graph_backend(Phase.DECODE, Backend.BREAKABLE)
        self._attend_break = eager_on_graph(True)(self._attend)
        if not self._breakable and not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
            logger.warning("granikv attention (%s): decode CUDA graphs are not 'breakable': graph-replayed "
                           "decode steps run SGLang's paged path. Pass --cuda-graph-backend-decode breakable.",
                           backend_name)
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
        mode = forward_batch.forward_mode
        self.decode.policy.graph_step = False          # an eager step: the table's eager rules
        if mode.is_decode() and self._plan(forward_batch, forward_batch.batch_size):
            self.forward_metadata = DecodeMetadata(self.decode_wrappers)
            return
        super().init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Graph capture and replay. Breakable decode graphs: plan the replayed step (the attention
        runs as an eager break); otherwise SGLang's graph wrappers, as FlashInfer does."""
        self._step = None
        decode = forward_batch.forward_mode.is_decode()
        if decode and not in_capture and not self._breakable:
            self._paged("full_graph_replay")
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

    # ---- run (per layer) -------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if k is not None and save_kv_cache:        # the KV write stays in the captured segment
            cache_loc = forward_batch.out_cache_loc
            swa = getattr(self.forward_metadata, "swa_out_cache_loc", None)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(cache_loc, swa), k, v, *self._kv_write_scales(layer))
        if is_in_breakable_cuda_graph():
            return self._attend_break(q, layer, forward_batch)
        if torch.cuda.is_current_stream_capturing():   # a full decode graph: SGLang's wrappers
            return super().forward_decode(q, None, None, layer, forward_batch, save_kv_cache=False)
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
