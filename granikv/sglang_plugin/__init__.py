"""GraniKV as an SGLang plugin: the ``granikv`` radix cache backend (HOT slabs + COLD tokens in
SGLang's own token pool) and three attention backends, one per prefix policy (``granikv``: the
calibrated dense / cascade / paged dispatch; ``granikv_cascade``: SGLang-Cascade; ``hydragen``).

Importing this package never imports SGLang; :func:`load` does, and only where SGLang is
installed. SGLang finds :func:`load` through the entry point ``granikv`` of the group
``sglang.srt.plugins`` (``pyproject.toml``) and calls it in its launcher and scheduler
processes, before it parses its arguments (``SGLANG_PLUGINS=granikv`` restricts SGLang to it).

Using it::

    pip install -e '.[sglang]'
    GRANIKV_HOT_FRACTION=0.2 python -m sglang.launch_server ... \
        --attention-backend granikv --radix-cache-backend granikv

With SGLang's default full decode CUDA graphs the whole decode step replays from one graph per batch
size, the per-step plan written into the graph's buffers before each replay (see :mod:`.attention`);
``--cuda-graph-backend-decode breakable`` also works (each layer's attention then runs eagerly at a
graph break). The two baselines in SGLang: ``--attention-backend granikv_cascade`` or ``hydragen``
with SGLang's own radix cache.

Settings (environment variables of the server, read when the scheduler builds its cache):

- ``GRANIKV_HOT_FRACTION`` (default 0.2): the share of SGLang's token pool
  (``max_total_num_tokens``) taken as the HOT region, in [0, 1). The region is slots
  ``1..floor(size * fraction)`` of the pool; those slots are no longer the allocator's, so
  COLD (everything else) has the rest. 0: no region, every prefix COLD (the paged baseline).
- ``GRANIKV_HARDWARE`` (default ``auto``): the ``granikv`` attention backend's decision table:
  the ``conf/hardware`` preset whose ``gpu_name`` is this GPU's, a preset name, or a YAML path.
- ``GRANIKV_STATS_FILE`` (default unset): the attention backends write their path counters
  (steps by path, classes and rows by path, host time of the plan and of the dispatcher) there
  as JSON.
- ``GRANIKV_CASCADE_IMPL`` (default ``composed``): the GPU path of ``granikv_cascade``'s batch-global
  cascade: ``composed`` (FlashInfer batch prefill over the common prefix + tensor-core decode of the
  rest + merge, the engine baseline's) or ``multilevel`` (FlashInfer's MultiLevelCascadeAttentionWrapper).
- ``GRANIKV_DECODE_PLAN`` (default ``fast``): how the three attention backends re-plan FlashInfer's
  decode wrappers each step: ``fast`` (FlashInfer's ``fast_decode_plan`` after a wrapper's first
  ``plan()``, as SGLang's own FlashInfer backend re-plans its decode graphs) or ``flashinfer`` (the
  wrapper's ``plan()`` every step, which in FlashInfer 0.6.x costs about a millisecond per step at
  B=256 in Python-level work).
- ``GRANIKV_HOT_SPLIT`` (default ``static``): ``dynamic`` lets the HOT region move between
  ``GRANIKV_HOT_MIN_FRACTION`` (0.0) and ``GRANIKV_HOT_MAX_FRACTION`` (0.5) of the pool, by the rules
  of :class:`granikv.kv.SplitPolicy`: under COLD pressure (SGLang's ``evict`` for an allocation's
  shortfall) it gives free slots at its end to the allocator before a cached COLD prefix is
  evicted, keeping ``GRANIKV_COLD_WATERMARK`` (0.05) of the pool free; on a HOT miss it grows into
  the slots just above it, but only when they are the allocator's next free slots. SGLang's
  allocator (``TokenToKVPoolAllocator.alloc`` / ``free`` in ``mem_cache/allocator/token.py``) hands
  out the lowest slots of its free list first and appends freed ones, so those slots are usually a
  running request's: growth is rare (counted as ``grow_refused``), and making it reliable would need
  an allocator that keeps them free, which SGLang has no extension point for.
- ``GRANIKV_DISPATCH`` (default ``table``): the ``granikv`` backend's dispatcher: the calibrated
  table, or an ablation sending every prefix class one way (``dense_only``, ``cascade_only``,
  ``paged_only``), as the engine's ``system.dispatch``.
- ``GRANIKV_GRAPH_GROUPS`` (8), ``GRANIKV_GRAPH_CASCADES`` (8), ``GRANIKV_DENSE_FOLD`` (2),
  ``GRANIKV_DENSE_FOLD_MIN_LEN`` (12288), ``GRANIKV_DENSE_BACKEND`` (``auto``), ``GRANIKV_HYDRAGEN_SCRATCH``
  (65536): what a captured decode step holds (:class:`.settings.PluginSettings` says each).
- ``GRANIKV_PREFIX_LEN`` (default 0): the shared-prefix length of a request that names none
  (for a workload whose requests all share one prefix of that many tokens); applies to a
  request whose prompt is at least that long. 0: such requests have no shared prefix.

How a request names its shared prefix: ``sampling_params.custom_params`` (SGLang's JSON-safe
per-request dict, passed through to the scheduler) with the key ``granikv_prefix_len``, the
number of leading prompt tokens shared with other requests, e.g. for ``POST /generate``::

    {"input_ids": [...], "sampling_params": {"max_new_tokens": 64,
                                             "custom_params": {"granikv_prefix_len": 8192}}}

It wins over ``GRANIKV_PREFIX_LEN``; a malformed value is ignored (with a warning).

What happens to a named prefix: when the request is cached after its prefill, the part of
its prefix not yet cached is admitted HOT-first: one contiguous slab (first-fit; unlocked
slabs evicted whole, least recently used first, to make an extent when none is free), its KV
rows copied there from the request's COLD slots, which go back to the allocator. A slab is
never demoted or moved while cached; eviction returns it only whole. When no extent can be
had, the prefix stays in its COLD slots (the paged fallback). A prefix prefilled in chunks is
kept with its request (not cached) until its prefill is done, then admitted whole. SGLang's
``--radix-eviction-policy`` orders COLD eviction; HOT eviction is LRU.

Parts: :mod:`.settings` (these settings), :mod:`.hot_region` (the pure core: HOT region,
admission, eviction), :mod:`.slab_groups` (a batch's requests grouped by slab),
:mod:`.step_prefixes` (each request's prefix class and HOT start, off the radix tree),
:mod:`.path_stats` (counters, decision table), :mod:`.bcg_outputs` (SGLang's breakable decode
graphs taught to hold a step's logits output), :mod:`.cache` and :mod:`.attention` (the SGLang
adapters; they import SGLang).
"""
from __future__ import annotations

import importlib.util
import logging

from granikv.sglang_plugin.settings import (
    ENV_HOT_FRACTION,
    ENV_PREFIX_LEN,
    PREFIX_PARAM,
    PluginSettings,
    shared_prefix_len,
)

logger = logging.getLogger(__name__)

__all__ = ["load", "PluginSettings", "shared_prefix_len", "ENV_HOT_FRACTION", "ENV_PREFIX_LEN",
           "PREFIX_PARAM"]


ATTENTION_BACKENDS = ("granikv", "granikv_cascade", "hydragen")
INIT_NEW_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


def load() -> None:
    """SGLang's entry point: register the ``granikv`` radix cache backend, the attention backends
    :data:`ATTENTION_BACKENDS` (and their ``--attention-backend`` choices) and the hook that stages
    each decode batch's prefixes, when SGLang is importable; otherwise do nothing (a debug-level
    log line says so). Safe to call twice in one process."""
    if importlib.util.find_spec("sglang") is None:
        logger.debug("granikv.sglang_plugin.load: sglang is not installed; nothing registered")
        return
    from granikv.sglang_plugin.cache import register

    if register():
        logger.info("granikv: registered radix cache backend 'granikv'")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS as REGISTRY
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from granikv.sglang_plugin import bcg_outputs
    from granikv.sglang_plugin.attention import make_backend_factory, stage_step_prefixes

    new = [n for n in ATTENTION_BACKENDS if n not in REGISTRY]
    for name in new:
        register_attention_backend(name)(make_backend_factory(name))
    add_attention_backend_choices([n for n in ATTENTION_BACKENDS if n not in ATTENTION_BACKEND_CHOICES])
    if new:
        HookRegistry.register(INIT_NEW_TARGET, stage_step_prefixes, HookType.AFTER)
        for target, hook in bcg_outputs.HOOKS.items():   # breakable decode graphs of an LM's logits output
            HookRegistry.register(target, hook, HookType.AROUND)
        logger.info("granikv: registered attention backends %s", ", ".join(new))
