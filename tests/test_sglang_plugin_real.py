"""The adapter (granikv.sglang_plugin.cache) on SGLang's own code, on CPU: built through SGLang's
registry (``create_tree_cache``) over SGLang's ``TokenToKVPoolAllocator``, ``MHATokenToKVPool``
and ``ReqToTokenPool``, driven through ``RadixCache``'s request API as the scheduler drives it
(``match_prefix``, ``inc_lock_ref``, ``evict_from_tree_cache``, ``cache_unfinished_req``,
``cache_finished_req``), its accounting checked by SGLang's own pool invariant.

Runs only where SGLang imports (skipped otherwise): on the GPU host, or on a CPU box with
SGLang's source on the path. No model, no forward pass, no CUDA: KV rows are written by hand.
"""
from __future__ import annotations
import os
import random
from array import array
from types import SimpleNamespace
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker  # noqa: E402
from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import evict_from_tree_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
import granikv.sglang_plugin as plugin  # noqa: E402
from granikv.sglang_plugin.cache import GraniKVRadixCache  # noqa: E402
from granikv.sglang_plugin.hot_region import GONE_ATTR, SLAB_ATTR  # noqa: E402


class Req:
    """The fields of schedule_batch.Req that RadixCache and ReqToTokenPool read."""

    def __init__(self, tokens, prefix_len=None):
        self.origin_input_ids = array("q", tokens)
        self.output_ids = array("q")
        self.sampling_params = SimpleNamespace(
            custom_params=None if prefix_len is None else {"granikv_prefix_len": prefix_len})
        self.extra_key = None
        self.priority = 0
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.inflight_middle_chunks = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0
        self.fill_len = 0

    def get_fill_ids(self):
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]


class Server:
    """SGLang's pools and the granikv cache, built as kv_cache_builder builds them."""

    def __init__(self, size=200, hot_fraction=0.25, max_reqs=8, max_len=256, need_sort=False, monkeypatch=None,
                 env=None):
        monkeypatch.setenv("GRANIKV_HOT_FRACTION", str(hot_fraction))
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        self.kv = MHATokenToKVPool(size, 1, torch.float32, 1, 2, 2, "cpu", False)
        self.alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", self.kv, need_sort)
        self.r2t = ReqToTokenPool(max_reqs, max_len, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                 page_size=1)
        plugin.load()
        server_args = SimpleNamespace(radix_cache_backend="granikv", enable_session_radix_cache=False,
                                      enable_streaming_session=False)
        ctx = TreeCacheBuildContext(server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                                    enable_hierarchical_cache=False, disable_radix_cache=False,
                                    effective_chunked_prefill_size=None, tp_worker=None, model_config=None,
                                    tp_size=1, tp_rank=0, tp_group=None)
        self.cache = create_tree_cache(ctx)
        assert isinstance(self.cache, GraniKVRadixCache)
        self.size = size
        self.running: list[Req] = []

    # the scheduler's side
    def schedule(self, req):
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids)))
        req.prefix_indices, req.last_node = m.device_indices, m.last_device_node
        req.cache_protected_len = req.fill_len = len(m.device_indices)
        self.cache.inc_lock_ref(req.last_node)
        self.r2t.alloc([req])
        self.r2t.write((req.req_pool_idx, slice(0, req.fill_len)), m.device_indices.to(torch.int32))
        self.running.append(req)

    def extend(self, req, n):
        evict_from_tree_cache(self.cache, n)
        slots = self.alloc.alloc(n)
        assert slots is not None, "out of memory"
        start = req.fill_len
        self.r2t.write((req.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        ids = (req.origin_input_ids + req.output_ids)[start:start + n]
        k = torch.stack((torch.tensor(list(ids), dtype=torch.float32), torch.arange(start, start + n).float()), 1)
        self.kv.k_buffer[0][slots] = k.reshape(n, 1, 2)
        self.kv.v_buffer[0][slots] = k.flip(1).reshape(n, 1, 2)
        req.fill_len += n
        req.kv_committed_len = req.fill_len

    def prefill(self, req, chunk=None):
        self.schedule(req)
        total = len(req.origin_input_ids)
        while req.fill_len < total:
            self.extend(req, total - req.fill_len if chunk is None else min(chunk, total - req.fill_len))
            if req.fill_len < total:
                self.cache.cache_unfinished_req(req, chunked=True)
        self.cache.cache_unfinished_req(req)

    def finish(self, req, out=2, is_insert=True):
        for i in range(out):
            req.output_ids.append(7000 + i)
            self.extend(req, 1)
        self.cache.cache_finished_req(req, is_insert, kv_len_to_handle=req.fill_len)
        self.r2t.free(req)
        self.running.remove(req)

    # checks
    def nodes(self):
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check(self):
        c, a, region = self.cache, self.alloc, self.cache.region
        private = [self.r2t.req_to_token[r.req_pool_idx, r.cache_protected_len:r.fill_len].to(torch.int64)
                   for r in self.running]
        nodes = self.nodes()
        cold = [n.value for n in nodes if getattr(n, SLAB_ATTR, None) is None]
        retired = c.hot.retired_slots(nodes)       # promoted nodes' old slots, in running requests' rows
        assert sum(len(r) for r in retired) == c.hot.retired_tokens
        owned = torch.cat([a.free_pages, a.release_pages, region.slots()] + cold + private + retired)
        assert sorted(owned.tolist()) == list(range(1, self.size + 1)), "a slot is owned twice or by no one"
        assert region.free_tokens + region.used_tokens == region.capacity
        for n in nodes:
            slab = getattr(n, SLAB_ATTR, None)
            if slab is not None:
                v = n.value
                assert torch.equal(v, torch.arange(int(v[0]), int(v[0]) + len(v)))
                assert slab.start <= int(v[0]) and int(v[-1]) < slab.end
        # SGLang's own pool check (Scheduler's mem check): available + evictable + protected + uncached == total
        ps = SchedulerPoolStatsObserver._get_token_info(SimpleNamespace(
            token_to_kv_pool_allocator=a, tree_cache=c, max_total_num_tokens=self.size))
        checker = SimpleNamespace(is_hybrid_swa=False, is_hybrid_ssm=False, tree_cache=c, max_total_num_tokens=self.size,
                                  token_to_kv_pool_allocator=a, server_args=SimpleNamespace(),
                                  pool_stats_observer=SimpleNamespace(session_held_tokens=lambda: 0),
                                  _check_pool_invariant=SchedulerInvariantChecker._check_pool_invariant)
        leak, msg = SchedulerInvariantChecker._check_full_pool(checker, ps, uncached=sum(len(p) for p in private))
        assert not leak, msg
        # KV rows: (token, position) for every cached token and every running request's row
        stack = [(ch, 0) for ch in c.root_node.children.values()]
        while stack:
            n, d = stack.pop()
            want = torch.stack((torch.tensor(list(n.key.token_ids), dtype=torch.float32),
                                torch.arange(d, d + len(n.key)).float()), 1)
            assert torch.equal(self.kv.k_buffer[0][n.value, 0], want)
            assert torch.equal(self.kv.v_buffer[0][n.value, 0], want.flip(1))
            stack.extend((ch, d + len(n.key)) for ch in n.children.values())
        for r in self.running:                 # every running request's row reads its own tokens
            row = self.r2t.req_to_token[r.req_pool_idx, : r.fill_len].to(torch.int64)
            ids = (r.origin_input_ids + r.output_ids)[: r.fill_len]
            assert torch.equal(self.kv.k_buffer[0][row, 0, 0], torch.tensor(list(ids), dtype=torch.float32))
            assert torch.equal(self.kv.k_buffer[0][row, 0, 1], torch.arange(r.fill_len).float())


def toks(start, n):
    return list(range(start, start + n))


def test_registered_and_built_through_sglangs_registry(monkeypatch):
    s = Server(monkeypatch=monkeypatch, hot_fraction=0.25)
    assert (s.cache.region.start, s.cache.region.end) == (1, 51) and s.alloc.available_size() == 150
    s.check()


def test_admission_sharing_fallback_and_eviction_on_sglangs_radix_cache(monkeypatch):
    s = Server(size=200, hot_fraction=0.2, monkeypatch=monkeypatch)  # HOT 40
    r1 = Req(toks(0, 30) + [901, 902], prefix_len=30)
    s.prefill(r1)
    assert s.r2t.req_to_token[r1.req_pool_idx, :30].tolist() == list(range(1, 31))  # rewritten to the slab
    assert s.cache.hot.counts["hot"] == 1
    s.check()
    r2 = Req(toks(0, 30) + [903], prefix_len=30)
    s.prefill(r2)  # a hit: shares the slab
    assert s.r2t.req_to_token[r2.req_pool_idx, :30].tolist() == list(range(1, 31))
    s.check()
    r3 = Req(toks(500, 20) + [1], prefix_len=20)  # 10 HOT slots free, the slab locked: COLD
    s.prefill(r3)
    assert s.cache.hot.counts["cold"] == 1 and int(s.r2t.req_to_token[r3.req_pool_idx, 0]) > 40
    s.check()
    for r in (r1, r2):
        s.finish(r)
    s.check()
    r4 = Req(toks(800, 35) + [1], prefix_len=35)  # the stale slab is evicted whole to make room
    s.prefill(r4)
    assert s.cache.hot.counts["hot"] == 2 and s.cache.hot.evicted_hot_tokens == 30
    assert s.r2t.req_to_token[r4.req_pool_idx, :35].tolist() == list(range(1, 36))
    s.check()
    s.finish(r3)
    s.finish(r4)
    s.check()


def test_cold_pressure_never_gives_hot_slots_to_the_allocator(monkeypatch):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s = Server(size=100, hot_fraction=0.2, monkeypatch=monkeypatch)
    r = Req(toks(0, 12) + toks(50, 6), prefix_len=12)
    s.prefill(r)
    s.finish(r, out=3)  # cached: HOT [0, 12), COLD suffix and decoded tokens below it
    res = s.cache.evict(EvictParams(num_tokens=10_000))
    assert res.num_tokens_evicted == 9 and s.cache.region.used_tokens == 12  # the slab stays, in the region
    s.check()
    # a COLD prefix with a HOT extension below it: asking for every evictable token reaches it
    r0 = Req(toks(200, 10) + [1])
    s.prefill(r0)
    s.finish(r0, out=0)
    r1 = Req(toks(200, 25) + [2], prefix_len=25)
    s.prefill(r1)
    s.finish(r1, out=0)
    want = s.cache.evictable_size()
    assert s.cache.evict(EvictParams(num_tokens=want)).num_tokens_evicted == want
    assert s.cache.evictable_size() == 0
    s.check()


def test_dynamic_split_gives_free_hot_end_slots_to_cold_pressure_first(monkeypatch):
    """On SGLang's own allocator and radix cache: with GRANIKV_HOT_SPLIT=dynamic a COLD shortfall is met
    with free slots from HOT's end (down to its minimum) before any cached COLD prefix is evicted, and
    SGLang's pool check holds throughout."""
    s = Server(size=200, hot_fraction=0.5, monkeypatch=monkeypatch,
               env={"GRANIKV_HOT_SPLIT": "dynamic", "GRANIKV_HOT_MIN_FRACTION": "0.1", "GRANIKV_COLD_WATERMARK": "0.02"})
    assert s.cache.region.capacity == 100 and s.cache.hot.split is not None
    r0 = Req(toks(500, 30) + [1])
    s.prefill(r0)
    s.finish(r0, out=0)
    cached = s.cache.evictable_size_
    assert s.cache.evictable_size() == cached + 80
    s.check()
    big = Req(toks(900, 120) + [2])
    s.prefill(big)
    assert s.cache.hot.moves["shrunk"] > 0 and s.cache.region.capacity >= 20
    assert s.cache.evictable_size_ == cached                   # the cached COLD prefix stayed
    s.check()
    s.finish(big, out=1)
    s.check()


def test_chunked_prefill_then_flush(monkeypatch):
    s = Server(size=300, hot_fraction=0.3, monkeypatch=monkeypatch)
    r = Req(toks(0, 70) + [5, 6, 7], prefix_len=70)
    s.schedule(r)
    s.extend(r, 32)
    s.cache.cache_unfinished_req(r, chunked=True)
    (node,) = s.nodes()                       # the first chunk, cached COLD as SGLang caches it
    assert getattr(node, SLAB_ATTR, None) is None and len(node.value) == 32 and r.prefix_indices.numel() == 32
    s.check()
    s.extend(r, 32)
    s.cache.cache_unfinished_req(r, chunked=True)
    s.extend(r, 9)
    s.cache.cache_unfinished_req(r)
    assert s.cache.hot.counts["hot"] == 1 and s.cache.hot.counts["promoted"] == 1
    assert s.r2t.req_to_token[r.req_pool_idx, :70].tolist() == list(range(1, 71))
    s.check()
    s.finish(r)
    s.check()
    # Scheduler.flush_cache
    s.cache.reset()
    s.r2t.clear()
    s.alloc.clear()
    assert s.cache.region.used_tokens == 0 and s.alloc.available_size() == 300 - 90
    s.check()


def test_a_request_arriving_mid_chunked_prefill_shares_the_first_chunk(monkeypatch):
    s = Server(size=400, hot_fraction=0.3, monkeypatch=monkeypatch)
    r1 = Req(toks(0, 70) + [5, 6], prefix_len=70)
    s.schedule(r1)
    s.extend(r1, 32)
    s.cache.cache_unfinished_req(r1, chunked=True)
    r2 = Req(toks(0, 70) + [8], prefix_len=70)
    s.schedule(r2)
    assert r2.fill_len == 32          # what SGLang's own RadixCache gives (checked there by the same steps)
    s.check()


def test_a_chunked_prefix_is_promoted_whole_into_one_slab_and_its_old_slots_wait_for_their_readers(monkeypatch):
    """Chunk by chunk COLD, then, once the prefill is done, one HOT run: the head's nodes point at
    the slab, the first request's row is rewritten to it, and the head's old slots stay allocated
    while a request that matched them mid-prefill runs (its row still reads them), then go back."""
    s = Server(size=400, hot_fraction=0.3, monkeypatch=monkeypatch)
    r1 = Req(toks(0, 70) + [5, 6], prefix_len=70)
    s.schedule(r1)
    s.extend(r1, 32)
    s.cache.cache_unfinished_req(r1, chunked=True)
    old_head = s.r2t.req_to_token[r1.req_pool_idx, :32].to(torch.int64).clone()
    r2 = Req(toks(0, 70) + [8], prefix_len=70)        # arrives mid-prefill: shares the first chunk
    s.schedule(r2)
    s.extend(r1, 40)
    s.cache.cache_unfinished_req(r1)                  # r1's prefill done: the prefix goes HOT, whole
    s.check()
    row = s.r2t.req_to_token[r1.req_pool_idx, :70].to(torch.int64)
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 70))            # one contiguous run
    assert s.cache.region.start <= int(row[0]) and int(row[-1]) < s.cache.region.end
    assert s.cache.hot.counts["promoted"] == 1 and s.cache.hot.retired_tokens == 32
    assert torch.equal(s.r2t.req_to_token[r2.req_pool_idx, :32].to(torch.int64), old_head)   # r2 reads the old
    free_before = s.alloc.available_size()
    s.finish(r1)
    s.check()
    assert s.cache.hot.retired_tokens == 32           # r2 still holds them
    s.extend(r2, len(r2.origin_input_ids) - r2.fill_len)
    s.cache.cache_unfinished_req(r2)
    s.finish(r2)
    s.check()
    assert s.cache.hot.retired_tokens == 0 and s.alloc.available_size() > free_before
    r3 = Req(toks(0, 70) + [9], prefix_len=70)        # a later request: the whole prefix, HOT
    s.schedule(r3)
    got = s.r2t.req_to_token[r3.req_pool_idx, :70].to(torch.int64)
    assert r3.fill_len == 70 and torch.equal(got, row)
    s.check()


@pytest.mark.parametrize("seed", range(int(os.environ.get("GRANIKV_FUZZ_SEEDS", "6"))))
def test_random_workload_on_sglangs_radix_cache(monkeypatch, seed):
    rnd = random.Random(seed)
    s = Server(size=240, hot_fraction=rnd.choice([0.15, 0.3]), max_reqs=12, max_len=128,
               need_sort=bool(seed % 2), monkeypatch=monkeypatch)
    prefixes = [toks(1000 * (i + 1), rnd.randint(4, 40)) for i in range(8)]
    pending: dict = {}                        # requests mid chunked prefill -> their chunk size
    for _ in range(50):
        op = rnd.random()
        if pending and op < 0.2:              # the next chunk of a prefill left half-way (others ran meanwhile)
            req = rnd.choice(list(pending))
            if s.alloc.available_size() + s.cache.evictable_size() > pending[req] + 2:
                total = len(req.origin_input_ids)
                s.extend(req, min(pending[req], total - req.fill_len))
                if req.fill_len < total:
                    s.cache.cache_unfinished_req(req, chunked=True)
                else:
                    s.cache.cache_unfinished_req(req)
                    del pending[req]
        elif op < 0.3 and len(s.running) < 6:   # a chunked prefill that stops after its first chunk
            p = rnd.choice(prefixes)
            req = Req(p + toks(rnd.randint(0, 10 ** 6) * 10, rnd.randint(1, 6)), prefix_len=len(p))
            chunk = rnd.choice([4, 8])
            if s.alloc.available_size() + s.cache.evictable_size() < len(req.origin_input_ids) + 8:
                continue
            s.schedule(req)
            if req.fill_len + chunk >= len(req.origin_input_ids):
                s.extend(req, len(req.origin_input_ids) - req.fill_len)
                s.cache.cache_unfinished_req(req)
            else:
                s.extend(req, chunk)
                s.cache.cache_unfinished_req(req, chunked=True)
                pending[req] = chunk
        elif op < 0.55 and len(s.running) < 6:
            p = rnd.choice(prefixes)
            req = Req(p + toks(rnd.randint(0, 10 ** 6) * 10, rnd.randint(1, 6)),
                      prefix_len=rnd.choice([len(p), len(p), rnd.randint(1, len(p)), None]))
            if s.alloc.available_size() + s.cache.evictable_size() < len(req.origin_input_ids) + 8:
                continue
            locked = [n for r in s.running for n in _path(r.last_node) if getattr(n, SLAB_ATTR, None) is not None]
            starts = [getattr(n, SLAB_ATTR).start for n in locked]
            s.prefill(req, chunk=rnd.choice([None, 8, 16]))
            assert [getattr(n, SLAB_ATTR).start for n in locked] == starts
            assert not any(getattr(n, GONE_ATTR, False) for n in locked)
        elif op < 0.75 and [r for r in s.running if r not in pending]:
            req = rnd.choice([r for r in s.running if r not in pending])
            if s.alloc.available_size() + s.cache.evictable_size() > 2:
                req.output_ids.append(rnd.randint(0, 99))
                s.extend(req, 1)
        elif [r for r in s.running if r not in pending]:
            s.finish(rnd.choice([r for r in s.running if r not in pending]), out=0, is_insert=rnd.random() < 0.9)
        s.check()
    for r in [r for r in s.running if r not in pending]:
        s.finish(r, out=0)
    for req in list(pending):                 # finish the prefills left half-way
        s.extend(req, len(req.origin_input_ids) - req.fill_len)
        s.cache.cache_unfinished_req(req)
        s.check()
    for r in list(s.running):
        s.finish(r, out=0)
    s.check()
    assert s.cache.hot.hot_locked == 0 and s.cache.protected_size() == s.cache.region.capacity


def _path(node):
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
