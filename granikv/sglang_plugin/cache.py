"""The SGLang adapter of the ``granikv`` radix cache backend (imports SGLang: load it only
where SGLang is installed; :func:`granikv.sglang_plugin.load` does).

Written against SGLang 0.5.17 (``sglang/srt/mem_cache/radix_cache.py``, ``registry.py``,
``allocator/token.py``, ``memory_pool.py``). Thin on purpose: every decision is made by the
pure core in :mod:`granikv.sglang_plugin.hot_region`, which is tested without SGLang.

Overridden ``RadixCache`` methods: ``__init__``, ``reset``, ``insert``, ``cache_unfinished_req``,
``cache_finished_req``, ``evict``, ``inc_lock_ref``, ``dec_lock_ref``, ``_split_node``,
``evictable_size``, ``protected_size``. The allocator's ``clear`` is wrapped on the instance.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import move_kv_cache_native
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

from granikv.sglang_plugin.hot_region import HotColdTree, HotRegion
from granikv.sglang_plugin.settings import PluginSettings, shared_prefix_len

logger = logging.getLogger(__name__)

BACKEND_NAME = "granikv"


class GraniKVRadixCache(RadixCache):
    """SGLang's radix index over SGLang's token pool, with shared prefixes in a HOT region.

    At construction ``floor(size * hot_fraction)`` slots are taken out of the token allocator
    (slots ``1..H`` of a fresh pool). A request that names a shared prefix of ``n`` tokens
    (``custom_params["granikv_prefix_len"]``, or ``GRANIKV_PREFIX_LEN``) has it admitted when it
    is cached: its uncached tail is copied from its COLD slots into one slab, cached there, and
    its COLD slots freed (by ``RadixCache.cache_(un)finished_req`` itself, since ``insert``
    reports them as already cached); the request's ``req_to_token`` row is rewritten to the
    slab by ``cache_unfinished_req`` as usual. No extent: the prefix stays COLD.

    A prefix longer than one prefill chunk is cached COLD chunk by chunk, as SGLang caches it
    (a request arriving meanwhile shares the chunks done), and promoted whole into one slab when
    the prefill is done (:meth:`HotColdTree.admit_prefix` with ``promote``): the old COLD slots of
    its head stay allocated until the last request that may read them lets go of the head.
    """

    def __init__(self, params: CacheInitParams, settings: PluginSettings):
        alloc = params.token_to_kv_pool_allocator
        if params.disable:
            raise ValueError("--radix-cache-backend granikv needs the radix cache: drop --disable-radix-cache")
        if params.page_size != 1 or not isinstance(alloc, TokenToKVPoolAllocator):
            raise ValueError("--radix-cache-backend granikv needs --page-size 1 and SGLang's TokenToKVPoolAllocator, "
                             f"got page_size={params.page_size}, {type(alloc).__name__}")
        if params.is_eagle:
            raise ValueError("--radix-cache-backend granikv does not support EAGLE speculative decoding (bigram keys)")
        kv = alloc.get_kvcache()
        if not isinstance(getattr(kv, "k_buffer", None), list) or getattr(kv, "use_hnd", False):
            raise ValueError(f"--radix-cache-backend granikv needs per-layer NHD k_buffer/v_buffer, got {type(kv).__name__}")
        self.settings = settings
        self._hot_len = 0  # the shared-prefix length of the request being cached (0: none)
        self._promoted = False  # the last admission moved a cached COLD head into its slab
        self.region = HotRegion(alloc, HotRegion.tokens_for(alloc.size, settings.hot_fraction), align=settings.dense_fold)
        self.hot = HotColdTree(self.region, free_cold=lambda v: alloc.free_segment(v, start_pos=0),
                               delete_leaf=self._evict_leaf, split=settings.split_policy(alloc.size))
        super().__init__(params)  # calls self.reset()
        orig_clear = alloc.clear

        def clear():  # /flush_cache and resize() re-list every slot as free: take the region again
            orig_clear()
            self.region.recarve_after_clear(HotRegion.tokens_for(alloc.size, self.settings.hot_fraction))

        alloc.clear = clear
        logger.info("granikv radix cache: HOT region slots [%d, %d) of %d (hot_fraction=%s, %s split)",
                    self.region.start, self.region.end, alloc.size, settings.hot_fraction, settings.hot_split)

    # ------------------------------------------------------------------ structure
    def reset(self):
        super().reset()
        self.hot.reset()

    def _split_node(self, key, child, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        self.hot.on_split(new_node, child)
        return new_node

    def _evict_leaf(self, node) -> None:
        self._delete_leaf(node)
        self._record_remove_event(node)

    # ------------------------------------------------------------------ admission
    def _prefix_len(self, req) -> int:
        return shared_prefix_len(req.sampling_params.custom_params, len(req.origin_input_ids), self.settings)

    def cache_unfinished_req(self, req, chunked=False, **kwargs):
        n = 0 if self.disable else self._prefix_len(req)
        if chunked:
            # A middle chunk: cached COLD, as SGLang caches it, so that requests arriving meanwhile
            # share it (no copy: under the overlap schedule this chunk's forward may still be
            # running). A named prefix is admitted, or promoted into one slab, once the request's
            # prefill is done (the call without ``chunked``, after its forward).
            n = 0
        self._hot_len = n
        self._promoted = False
        retired = self.hot.retired_tokens > 0
        try:
            out = super().cache_unfinished_req(req, chunked=chunked, **kwargs)
        finally:
            self._hot_len = 0
        if self._promoted or retired:
            # SGLang rewrites the row only past the part it had matched. When a head moved to a slab
            # (here, or earlier while this request held its old slots, which the lock move above may
            # just have given back), the row is rewritten from the fresh match, head included.
            self.req_to_token_pool.write((req.req_pool_idx, slice(0, len(req.prefix_indices))),
                                         req.prefix_indices.to(torch.int32))
            self._promoted = False
        return out

    def cache_finished_req(self, req, is_insert: bool = True, **kwargs):
        self._hot_len = 0 if self.disable else self._prefix_len(req)
        try:
            return super().cache_finished_req(req, is_insert, **kwargs)
        finally:
            self._hot_len, self._promoted = 0, False

    def insert(self, params: InsertParams) -> InsertResult:
        n, self._hot_len = self._hot_len, 0  # the prefix's own insert below must not admit again
        if n and not self.disable and params.value is not None and not params.key.is_bigram:
            res = self.hot.admit_prefix(
                params.key, params.value, n,
                match=self._match_for_admit,
                insert=lambda k, v: super(GraniKVRadixCache, self).insert(
                    InsertParams(key=k, value=v, priority=params.priority)).last_device_node,
                lock=self.inc_lock_ref, unlock=self.dec_lock_ref, copy_rows=self._copy_rows, promote=True)
            self._promoted = res.promoted > 0
        return super().insert(params)

    def _match_for_admit(self, prefix):
        m = self.match_prefix(MatchPrefixParams(key=prefix))
        return m.device_indices, m.last_device_node

    def _copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        kv = self.token_to_kv_pool_allocator.get_kvcache()
        move_kv_cache_native(kv.k_buffer, kv.v_buffer, dst, src)
        if getattr(kv, "k_scale_buffer", None) is not None:  # quantised KV keeps per-row scales too
            move_kv_cache_native(kv.k_scale_buffer, kv.v_scale_buffer, dst, src)

    # ------------------------------------------------------------------ eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        given = self.hot.relieve(params.num_tokens)     # dynamic split: free HOT end slots first
        n = given + self.hot.evict_cold(params.num_tokens - given, list(self.evictable_leaves), self.root_node,
                                        priority=self.eviction_strategy.get_priority)
        self.update_eviction_metrics(n, start)
        return EvictResult(num_tokens_evicted=n)

    def inc_lock_ref(self, node):
        if not self.disable:
            self.hot.before_lock(node)
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node, params: Optional[DecLockRefParams] = None):
        if not self.disable:
            self.hot.before_unlock(node)
        out = super().dec_lock_ref(node, params)
        if not self.disable:
            self.hot.after_unlock(node)   # a promoted node's old slots, once no request holds them
        return out

    # ------------------------------------------------------------------ accounting
    # SGLang's check: allocator.available_size() + evictable_size() + protected_size() (+ what
    # running requests hold) == the pool's size. Evicting a HOT slab frees no allocator slot,
    # so only COLD tokens are evictable; the HOT region, used or free, counts as protected, but
    # for the free slots at its end a dynamic split would give the allocator (``evict`` does).
    def evictable_size(self):
        return self.evictable_size_ - self.hot.hot_evictable + self.hot.shrinkable

    def protected_size(self):
        return (self.protected_size_ - self.hot.hot_locked + self.region.capacity - self.hot.shrinkable
                + self.hot.retired_tokens)   # retired COLD slots: in running requests' rows, in no node

    def slab_table(self, device: Any = None):
        """The live slab table ``(start, length, slab_id)`` for the attention backend."""
        return self.region.table(self.device if device is None else device)


def make_factory(settings: PluginSettings | None = None):
    """The factory ``register_radix_cache_backend`` gets; settings are read from the environment
    of the process that builds the cache (the scheduler) unless given."""

    def factory(ctx: TreeCacheBuildContext) -> GraniKVRadixCache:
        for flag, on in (("a hybrid SWA model", ctx.is_hybrid_swa), ("a hybrid SSM model", ctx.is_hybrid_ssm),
                         ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache),
                         ("--disable-radix-cache", ctx.disable_radix_cache)):
            if on:
                raise ValueError(f"--radix-cache-backend {BACKEND_NAME} does not support {flag}")
        return GraniKVRadixCache(ctx.params, settings or PluginSettings.from_env())

    return factory


def register() -> bool:
    """Register the backend ``granikv`` (once per process); returns whether it registered now."""
    if get_radix_cache_factory(BACKEND_NAME) is not None:
        return False
    register_radix_cache_backend(BACKEND_NAME, make_factory())
    return True
