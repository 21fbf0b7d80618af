"""GraniKV as an SGLang plugin: the ``granikv`` radix cache backend (HOT slabs + COLD tokens
in SGLang's own token pool). The attention backend comes later (see DESIGN.md).

Importing this package never imports SGLang; :func:`load` does, and only where SGLang is
installed. SGLang finds :func:`load` through the entry point ``granikv`` of the group
``sglang.srt.plugins`` (``pyproject.toml``) and calls it in its launcher and scheduler
processes, before it parses its arguments (``SGLANG_PLUGINS=granikv`` restricts SGLang to it).

Using it::

    GRANIKV_HOT_FRACTION=0.2 python -m sglang.launch_server ... --radix-cache-backend granikv

(``--attention-backend granikv`` once the attention backend is registered; until then any of
SGLang's, e.g. ``flashinfer``, reads the HOT slabs through the same ``req_to_token`` rows.)

Settings (environment variables of the server, read when the scheduler builds its cache):

- ``GRANIKV_HOT_FRACTION`` (default 0.2): the share of SGLang's token pool
  (``max_total_num_tokens``) taken as the HOT region, in [0, 1). The region is slots
  ``1..floor(size * fraction)`` of the pool; those slots are no longer the allocator's, so
  COLD (everything else) has the rest. 0: no region, every prefix COLD (the paged baseline).
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
:mod:`.cache` (the SGLang adapter; imports SGLang).
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


def load() -> None:
    """SGLang's entry point: register the ``granikv`` radix cache backend when SGLang is
    importable; otherwise do nothing (a debug-level log line says so)."""
    if importlib.util.find_spec("sglang") is None:
        logger.debug("granikv.sglang_plugin.load: sglang is not installed; nothing registered")
        return
    from granikv.sglang_plugin.cache import register

    if register():
        logger.info("granikv: registered radix cache backend 'granikv'")
