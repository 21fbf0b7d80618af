"""The plugin's pure core against a model of SGLang's allocator and radix cache: the HOT region
carved out of the token pool, HOT-first admission with the COLD fallback, eviction that never
touches a locked slab and returns a slab only whole, the pool's accounting, and a seeded random
workload checked after every step (no slot owned twice, free + used = capacity, slabs
contiguous, KV rows where the index says they are)."""
from __future__ import annotations
import random

import pytest
import torch

from granikv.kv import eviction
from granikv.sglang_plugin.hot_region import GONE_ATTR, RETIRED_ATTR, SLAB_ATTR, HotColdTree, HotRegion
from granikv.sglang_plugin.settings import PluginSettings
from test_sglang_plugin_model import ModelAllocator, ModelRadixCache, ModelReq


def toks(start, n):
    return list(range(start, start + n))


def check(c: ModelRadixCache, running=()):
    """Every invariant the plugin promises, over allocator + region + index + running requests."""
    a, region = c.allocator, c.region
    private = [c.req_to_token[r.req_pool_idx, r.cache_protected_len:r.fill_len].to(torch.int64) for r in running]
    nodes = c.nodes()
    cold = [n.value for n in nodes if getattr(n, SLAB_ATTR, None) is None]
    retired = c.hot.retired_slots(nodes)   # promoted nodes' old COLD slots, still in running requests' rows
    assert sum(len(r) for r in retired) == c.hot.retired_tokens
    assert all(n.lock_ref > 0 for n in nodes if getattr(n, RETIRED_ATTR, None) is not None)
    owned = torch.cat([a.free_slots(), region.slots()] + cold + private + retired)
    assert sorted(owned.tolist()) == list(range(1, a.size + 1)), "a slot is owned twice or by no one"
    # the region: free + used = capacity, slabs disjoint and contiguous, every HOT node inside its slab
    assert region.free_tokens + region.used_tokens == region.capacity
    slabs = region.pool.slabs
    for s, t in zip(slabs, slabs[1:]):
        assert s.end <= t.start
    assert all(region.start <= s.start and s.end <= region.end for s in slabs)
    by_slab: dict[int, list] = {}
    for n in nodes:
        slab = getattr(n, SLAB_ATTR, None)
        if slab is not None:
            v = n.value
            assert torch.equal(v, torch.arange(int(v[0]), int(v[0]) + len(v))), "a HOT node is not contiguous"
            assert slab.start <= int(v[0]) and int(v[-1]) < slab.end
            by_slab.setdefault(slab.start, []).append(n)
    assert sorted(by_slab) == [s.start for s in slabs], "a live slab without nodes, or nodes of a freed slab"
    for start, group in by_slab.items():  # a slab's nodes are one chain covering it exactly
        assert sorted(int(x) for g in group for x in g.value) == list(range(start, start + len(torch.cat([g.value for g in group]))))
        assert sum(len(g.value) for g in group) == region.pool._live[start]
    # SGLang's pool check: available + evictable + protected + held by running requests == size
    assert a.available_size() + c.evictable_size() + c.protected_size() + sum(len(p) for p in private) == a.size
    assert c.evictable_size() == c.hot.cold_evictable(c.root_node) + c.hot.shrinkable
    # KV: every cached token's row holds (token, position); so does every running request's row
    stack = [(ch, 0) for ch in c.root_node.children.values()]
    while stack:
        n, depth = stack.pop()
        want = torch.stack((torch.tensor(n.key, dtype=torch.float32),
                            torch.arange(depth, depth + len(n.key), dtype=torch.float32)), 1)
        assert torch.equal(a.k[n.value], want), f"KV rows of {n} are not its tokens'"
        stack.extend((ch, depth + len(n.key)) for ch in n.children.values())
    for r in running:
        row = c.req_to_token[r.req_pool_idx, : r.fill_len].to(torch.int64)
        ids = (r.origin_input_ids + r.output_ids)[: r.fill_len]
        assert torch.equal(a.k[row, 0], torch.tensor(ids, dtype=torch.float32))
        assert torch.equal(a.k[row, 1], torch.arange(r.fill_len, dtype=torch.float32))


def prefill(c, req, chunk=None):
    """Schedule and prefill ``req`` (in chunks of ``chunk`` tokens), then cache it unfinished."""
    c.schedule(req)
    total = len(req.origin_input_ids)
    while req.fill_len < total:
        step = total - req.fill_len if chunk is None else min(chunk, total - req.fill_len)
        assert c.extend(req, step)
        if req.fill_len < total:
            c.cache_unfinished_req(req, chunked=True)
    c.cache_unfinished_req(req)


def finish(c, req, out=2):
    for i in range(out):
        assert c.decode(req, 10_000 + i)
    c.cache_finished_req(req)


# ---------------------------------------------------------------------- the region
def test_region_is_carved_from_the_head_of_a_fresh_allocator():
    a = ModelAllocator(100)
    r = HotRegion(a, 20)
    assert (r.start, r.end, r.capacity) == (1, 21, 20)
    assert a.available_size() == 80
    assert int(a.alloc(80).min()) == 21 and a.alloc(1) is None  # the allocator never hands out a HOT slot
    assert r.contains(torch.tensor([0, 1, 20, 21])).tolist() == [False, True, True, False]


def test_region_refuses_a_fragmented_free_list_and_gives_the_slots_back():
    a = ModelAllocator(10)
    x = a.alloc(10)
    a.free(x[[3, 1, 2]])  # free list 4, 2, 3: not one ascending range
    with pytest.raises(RuntimeError, match="contiguous"):
        HotRegion(a, 3)
    assert a.available_size() == 3
    with pytest.raises(RuntimeError, match="fewer"):
        HotRegion(a, 4)


def test_region_slabs_are_first_fit_whole_only_and_keep_their_slots():
    a = ModelAllocator(100)
    r = HotRegion(a, 30)
    s1, s2, s3 = r.alloc(10), r.alloc(5), r.alloc(10)
    assert [s.start for s in (s1, s2, s3)] == [1, 11, 16]
    assert r.alloc(6) is None  # 5 free at the end: no extent of 6
    with pytest.raises(ValueError, match="only whole"):
        r.free(type(s1)(s1.start, 4))
    r.free(s2)
    assert r.alloc(6) is None and r.alloc(5).start == 11  # first fit: the hole of 5
    assert a.available_size() == 70  # slabs come and go inside the region
    starts, lens, ids = r.table()
    assert starts.tolist() == [1, 11, 16] and lens.tolist() == [10, 5, 10]
    assert ids.tolist() == [0, 3, 2]  # ids are never reused
    with pytest.raises(RuntimeError, match="still live"):
        r.release()


def test_region_release_and_recarve_after_the_allocator_is_cleared():
    a = ModelAllocator(50)
    r = HotRegion(a, 10)
    r.alloc(4)
    a.clear()  # SGLang's clear(): every slot free again, the region's too
    r.recarve_after_clear()
    assert (r.start, r.end, r.used_tokens) == (1, 11, 0) and a.available_size() == 40
    r.release()
    assert a.available_size() == 50 and r.capacity == 0 and r.alloc(1) is None


def test_hot_fraction_sizes_the_region():
    assert HotRegion.tokens_for(1000, 0.2) == 200 and HotRegion.tokens_for(7, 0.5) == 3
    with pytest.raises(ValueError):
        HotRegion.tokens_for(10, 1.0)


# ---------------------------------------------------------------------- admission
def test_a_named_prefix_is_admitted_hot_and_its_cold_slots_go_back():
    a = ModelAllocator(200)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25)  # HOT slots 1..50
    r = ModelReq(toks(0, 30) + toks(500, 5), prefix_len=30)
    prefill(c, r)
    assert c.last_admit.where == "hot" and c.last_admit.slab.start == 1
    row = c.req_to_token[r.req_pool_idx, :35].to(torch.int64)
    assert row[:30].tolist() == list(range(1, 31))  # the request now reads its prefix from the slab
    assert int(row[30:].min()) > 50  # its suffix stays COLD
    assert a.available_size() == 150 - 5  # the 30 COLD copies went back
    check(c, [r])
    finish(c, r)
    check(c)


def test_a_second_request_shares_the_slab_and_frees_its_duplicates():
    a = ModelAllocator(200)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25)
    r1 = ModelReq(toks(0, 30) + [900], prefix_len=30)
    prefill(c, r1)
    r2 = ModelReq(toks(0, 30) + [901, 902], prefix_len=30)
    prefill(c, r2)  # matched the slab at schedule time: only its suffix was computed
    assert r2.cache_protected_len == 32 and c.hot.counts == {"hit": 1, "hot": 1, "cold": 0, "promoted": 0}
    assert c.req_to_token[r2.req_pool_idx, :30].tolist() == list(range(1, 31))
    check(c, [r1, r2])
    # prefilled together (both missed at schedule time): the second one's prefix is a duplicate
    r3 = ModelReq(toks(100, 20) + [1], prefix_len=20)
    r4 = ModelReq(toks(100, 20) + [2], prefix_len=20)
    c.schedule(r3), c.schedule(r4)
    assert c.extend(r3, 21) and c.extend(r4, 21)
    c.cache_unfinished_req(r3)
    c.cache_unfinished_req(r4)
    assert c.req_to_token[r4.req_pool_idx, :20].tolist() == list(range(31, 51))
    check(c, [r1, r2, r3, r4])
    for r in (r1, r2, r3, r4):
        finish(c, r)
    check(c)


def test_no_extent_means_the_prefix_stays_cold():
    a = ModelAllocator(200)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.1)  # HOT 20 slots
    big = ModelReq(toks(0, 25) + [1], prefix_len=25)
    prefill(c, big)
    assert c.last_admit.where == "cold"  # longer than the whole region
    assert int(c.req_to_token[big.req_pool_idx, :25].min()) > 20
    r1 = ModelReq(toks(100, 15) + [1], prefix_len=15)
    prefill(c, r1)  # HOT, and locked by its running request
    r2 = ModelReq(toks(200, 10) + [1], prefix_len=10)
    prefill(c, r2)  # 5 HOT slots free, the only slab locked: COLD
    assert c.last_admit.where == "cold" and c.hot.counts["cold"] == 2
    check(c, [big, r1, r2])


def test_an_unlocked_slab_is_evicted_whole_to_make_room_and_a_locked_one_never():
    a = ModelAllocator(300)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.1)  # HOT 30 slots: 1..30
    live = ModelReq(toks(0, 10) + [1], prefix_len=10)
    prefill(c, live)  # slab [1, 11), stays locked
    done = ModelReq(toks(100, 10) + [1], prefix_len=10)
    prefill(c, done)  # slab [11, 21)
    finish(c, done)  # unlocked now: stale
    old_row = c.req_to_token[live.req_pool_idx, :10].clone()
    new = ModelReq(toks(200, 20) + [1], prefix_len=20)  # needs 20 contiguous: only [11, 31) can be made
    prefill(c, new)
    assert c.last_admit.where == "hot" and c.last_admit.slab.start == 11
    assert c.hot.evicted_hot_tokens == 10 and c.match_prefix(toks(100, 10))[0].numel() == 0
    assert torch.equal(c.req_to_token[live.req_pool_idx, :10], old_row)  # the locked slab did not move
    check(c, [live, new])
    blocked = ModelReq(toks(300, 5) + [1], prefix_len=5)
    prefill(c, blocked)  # every slab locked and no slot free: COLD, nothing evicted
    assert c.last_admit.where == "cold" and c.hot.evicted_hot_tokens == 10
    check(c, [live, new, blocked])


def test_cold_eviction_never_frees_hot_slots_and_reaches_cold_above_hot():
    a = ModelAllocator(100)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.2)  # HOT 20, COLD 80
    # slab A [0, 10), a COLD [10, 15) below it, then a prefix naming [0, 25): its head is part HOT,
    # part COLD (not promoted), so its tail [15, 25) goes to slab B below the COLD node
    r0 = ModelReq(toks(0, 10) + [7], prefix_len=10)
    prefill(c, r0)
    finish(c, r0)
    r0b = ModelReq(toks(0, 15) + [6])
    prefill(c, r0b)
    finish(c, r0b)
    r1 = ModelReq(toks(0, 15) + toks(500, 10) + [8], prefix_len=25)
    prefill(c, r1)
    assert c.last_admit.where == "hot" and c.last_admit.cached == 15 and c.last_admit.promoted == 0
    finish(c, r1)
    check(c)
    (slab_a,) = [n for n in c.nodes() if getattr(n, SLAB_ATTR, None) is not None and len(n.value) == 10
                 and n.parent is c.root_node]
    hot_before = c.region.used_tokens
    # fill COLD: the allocator's shortfall is evicted from COLD leaves first, never from HOT
    rs = [ModelReq(toks(1000 + 100 * i, 20)) for i in range(3)]
    for r in rs:
        prefill(c, r)
    check(c, rs)
    assert c.region.used_tokens == hot_before
    for r in rs:
        finish(c, r, out=0)
    # asking for every evictable COLD token reaches the COLD node above the slab: it goes with it
    want = c.evictable_size()
    assert c.evict(want) == want
    assert c.evictable_size() == 0 and c.region.used_tokens == 10 and c.nodes() == [slab_a]   # slab B went with it
    check(c)


def test_cold_pressure_leaves_an_unlocked_slab_that_nothing_cold_sits_above():
    a = ModelAllocator(100)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.2)
    r = ModelReq(toks(0, 12) + toks(50, 6), prefix_len=12)
    prefill(c, r)
    finish(c, r, out=3)  # cached: HOT [0, 12), COLD suffix and decoded tokens below it
    assert c.evict(10_000) == 9  # the COLD tail (6 + 3 decoded) goes; its HOT parent is a leaf now but frees no allocator slot
    assert c.region.used_tokens == 12 and c.hot.evicted_hot_tokens == 0
    assert c.match_prefix(toks(0, 12))[0].tolist() == list(range(1, 13))
    check(c)


def test_a_locked_hot_node_is_never_evicted_by_cold_pressure():
    a = ModelAllocator(60)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25)  # HOT 15, COLD 45
    live = ModelReq(toks(0, 15) + toks(50, 10), prefix_len=15)
    prefill(c, live)
    done = ModelReq(toks(500, 30))
    prefill(c, done)
    finish(c, done, out=0)
    assert c.evict(10_000) == 30  # all it can: the unlocked COLD node, none of the running request's
    assert getattr(live.last_node, GONE_ATTR, False) is False
    assert c.match_prefix(toks(0, 15))[0].tolist() == list(range(1, 16))
    check(c, [live])


def test_a_chunked_prefix_is_cached_cold_chunk_by_chunk_then_promoted_whole():
    a = ModelAllocator(400)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25)
    r = ModelReq(toks(0, 64) + [5, 6], prefix_len=64)
    c.schedule(r)
    assert c.extend(r, 16)
    c.cache_unfinished_req(r, chunked=True)
    (node,) = c.nodes()                      # the first chunk, COLD: a request arriving now shares it
    assert getattr(node, SLAB_ATTR, None) is None and len(node.value) == 16
    check(c, [r])
    late = ModelReq(toks(0, 64) + [9], prefix_len=64)
    assert c.schedule(late) and late.fill_len == 16
    old = c.req_to_token[late.req_pool_idx, :16].to(torch.int64).clone()
    while r.fill_len < 66:
        assert c.extend(r, min(16, 66 - r.fill_len))
        if r.fill_len < 66:
            c.cache_unfinished_req(r, chunked=True)
    c.cache_unfinished_req(r)
    assert c.last_admit.where == "hot" and c.last_admit.promoted == 64 and c.last_admit.slab.length == 64
    row = c.req_to_token[r.req_pool_idx, :64].to(torch.int64)   # the request reads one HOT run now
    assert torch.equal(row, torch.arange(c.last_admit.slab.start, c.last_admit.slab.end))
    # the old slots of the chunks only r held went back when r's lock moved; `late` still reads the first
    assert c.hot.retired_tokens == 16 and torch.equal(c.req_to_token[late.req_pool_idx, :16].to(torch.int64), old)
    check(c, [r, late])
    finish(c, r)
    check(c, [late])
    assert c.hot.retired_tokens == 16
    assert c.extend(late, 65 - late.fill_len)
    c.cache_unfinished_req(late)
    assert c.last_admit.where == "hit"
    finish(c, late)
    check(c)
    assert c.hot.retired_tokens == 0 and c.hot.hot_locked == 0


def test_the_default_prefix_length_names_every_long_enough_prompt():
    a = ModelAllocator(200)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25, prefix_len=12)
    r = ModelReq(toks(0, 12) + [1, 2])
    prefill(c, r)
    assert c.last_admit.where == "hot"
    short = ModelReq(toks(300, 5))
    c._hot_len = 0
    prefill(c, short)
    assert c.hot.counts["hot"] == 1 and c.region.used_tokens == 12
    check(c, [r, short])


def test_flush_empties_the_index_and_takes_the_region_again():
    a = ModelAllocator(100)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.2)
    r = ModelReq(toks(0, 10) + [1], prefix_len=10)
    prefill(c, r)
    finish(c, r)
    c.reset()  # Scheduler.flush_cache: tree_cache.reset(), req_to_token_pool.clear(), allocator.clear()
    a.clear()
    assert c.region.used_tokens == 0 and a.available_size() == 80
    check(c)
    r = ModelReq(toks(0, 10) + [1], prefix_len=10)
    prefill(c, r)
    assert c.last_admit.where == "hot" and c.last_admit.slab.start == 1
    check(c, [r])


def test_hot_fraction_zero_is_the_paged_baseline():
    a = ModelAllocator(100)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.0)
    r = ModelReq(toks(0, 10) + [1], prefix_len=10)
    prefill(c, r)
    assert c.last_admit.where == "cold" and c.region.capacity == 0 and a.available_size() == 89
    check(c, [r])


def test_the_core_refuses_to_evict_a_locked_node():
    a = ModelAllocator(50)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.2)
    r = ModelReq(toks(0, 5) + [1], prefix_len=5)
    prefill(c, r)
    with pytest.raises(AssertionError, match="locked"):
        eviction.drop_subtree(c.hot, r.last_node)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("split", ["static", "dynamic"])
def test_random_workload_keeps_every_invariant(seed, split):
    rnd = random.Random(seed)
    a = ModelAllocator(rnd.choice([160, 240]), need_sort=bool(seed % 2))
    frac = rnd.choice([0.15, 0.3])
    c = ModelRadixCache(a, 16, 128, settings=PluginSettings(frac, 0, hot_split=split, hot_min_fraction=0.05,
                                                            hot_max_fraction=0.6, cold_watermark=0.05))
    prefixes = [toks(1000 * (i + 1), rnd.randint(4, 40)) for i in range(8)]
    running: list[ModelReq] = []
    pending: dict = {}                       # requests mid chunked prefill (others run meanwhile) -> chunk
    for step in range(60):
        op = rnd.random()
        done = [r for r in running if r not in pending]
        if pending and op < 0.15:            # the next chunk of a prefill left half-way
            req = rnd.choice(list(pending))
            total = len(req.origin_input_ids)
            if a.available_size() + c.evictable_size() > pending[req] + 2:
                assert c.extend(req, min(pending[req], total - req.fill_len))
                if req.fill_len < total:
                    c.cache_unfinished_req(req, chunked=True)
                else:
                    c.cache_unfinished_req(req)
                    del pending[req]
        elif op < 0.25 and len(running) < 6:  # a chunked prefill that stops after its first chunk
            p = rnd.choice(prefixes)
            req = ModelReq(p + toks(rnd.randint(0, 10 ** 6) * 10, rnd.randint(1, 6)), prefix_len=len(p))
            chunk = rnd.choice([4, 8])
            if a.available_size() + c.evictable_size() < len(req.origin_input_ids) + 8 or not c.schedule(req):
                continue
            running.append(req)
            if req.fill_len + chunk >= len(req.origin_input_ids):
                assert c.extend(req, len(req.origin_input_ids) - req.fill_len)
                c.cache_unfinished_req(req)
            else:
                assert c.extend(req, chunk)
                c.cache_unfinished_req(req, chunked=True)
                pending[req] = chunk
        elif op < 0.45 and len(running) < 6:
            p = rnd.choice(prefixes)
            cut = rnd.choice([len(p), len(p), rnd.randint(1, len(p))])  # sometimes a shorter shared part
            req = ModelReq(p + toks(rnd.randint(0, 10 ** 6) * 10, rnd.randint(1, 6)),
                           prefix_len=rnd.choice([cut, cut, None]))
            need = len(req.origin_input_ids)
            if a.available_size() + c.evictable_size() < need + 8:
                continue  # the scheduler would not admit it (rem_total_tokens)
            locked_hot = {getattr(n, SLAB_ATTR).start: n for r in running for n in _path(r.last_node)
                          if getattr(n, SLAB_ATTR, None) is not None}
            prefill(c, req, chunk=rnd.choice([None, 8, 16]))
            running.append(req)
            for start, node in locked_hot.items():  # a locked slab was neither evicted nor moved
                assert not getattr(node, GONE_ATTR, False) and getattr(node, SLAB_ATTR).start == start
        elif op < 0.75 and done:
            req = rnd.choice(done)
            if a.available_size() + c.evictable_size() > 2:
                assert c.decode(req, rnd.randint(0, 99))
        elif done:
            req = rnd.choice(done)
            running.remove(req)
            c.cache_finished_req(req, is_insert=rnd.random() < 0.9)
        elif rnd.random() < 0.2:
            c.evict(rnd.randint(1, 40))
        check(c, running)
    for req in [r for r in running if r not in pending]:
        c.cache_finished_req(req)
    left = list(pending)
    while left:                               # the rest of each prefill where there is room, else an abort
        req = left.pop()
        if c.extend(req, len(req.origin_input_ids) - req.fill_len):
            c.cache_unfinished_req(req)
        check(c, [req, *left])
        c.cache_finished_req(req)
    check(c)
    assert c.hot.hot_locked == 0 and c.hot.retired_tokens == 0
    assert c.hot.counts["hot"] > 0


def _path(node):
    while node is not None and node.parent is not None:
        yield node
        node = node.parent


def test_hot_cold_tree_refuses_a_node_that_does_not_fill_its_slab():
    a = ModelAllocator(20)
    t = HotColdTree(HotRegion(a, 10), free_cold=a.free, delete_leaf=lambda n: None)
    slab = t.region.alloc(4)
    node = type("N", (), {})()
    node.value = torch.arange(1, 4)
    with pytest.raises(ValueError, match="holds 3 slots"):
        t.register(node, slab)


# ---------------------------------------------------------------------- the dynamic split
def dynamic(a, frac=0.1, lo=0.05, hi=0.6, wm=0.05, **kw):
    return ModelRadixCache(a, 16, 256, settings=PluginSettings(frac, 0, hot_split="dynamic", hot_min_fraction=lo,
                                                               hot_max_fraction=hi, cold_watermark=wm), **kw)


def test_region_grows_only_over_the_allocators_next_free_slots_and_shrinks_only_over_free_ones():
    a = ModelAllocator(100)
    r = HotRegion(a, 10)                               # slots 1..10
    assert r.grow(5) and (r.start, r.end, r.capacity, r.tail_free) == (1, 16, 15, 15)
    assert a.available_size() == 85
    held = a.alloc(3)                                  # 16, 17, 18: the rows above HOT are in use
    assert held.tolist() == [16, 17, 18]
    assert not r.grow(2) and r.end == 16 and a.available_size() == 82   # refused, the slots went back
    slab = r.alloc(12)                                 # [1, 13)
    assert r.tail_free == 3
    with pytest.raises(ValueError, match="free rows at its end"):
        r.shrink(4)                                    # would take a slot of the slab
    assert r.end == 16
    r.shrink(3)
    assert (r.end, r.capacity, r.tail_free) == (13, 12, 0) and 13 in a.free_slots().tolist()
    r.free(slab)
    r.shrink(12)                                       # down to nothing; it grows again from its start
    assert r.capacity == 0
    a2 = ModelAllocator(50)
    empty = HotRegion(a2, 0)
    assert empty.grow(4) and (empty.start, empty.end) == (1, 5)
    with pytest.raises(ValueError, match="positive int"):
        empty.grow(0)


def test_a_prefix_larger_than_the_free_hot_extent_grows_the_region_instead_of_going_cold():
    a = ModelAllocator(400, need_sort=True)            # freed slots are merged back in order when short
    c = dynamic(a, frac=0.05)                          # 20 HOT slots: 1..20
    assert c.region.capacity == 20
    # the usual case: the request's own prefill took the slots above HOT (SGLang's allocator hands
    # out the lowest free slots first), so HOT cannot grow: refused, the prefix stays COLD
    r0 = ModelReq(toks(0, 60) + [7], prefix_len=60)
    prefill(c, r0)
    assert c.hot.counts["cold"] == 1 and c.hot.moves == {"grown": 0, "grow_refused": 1, "shrunk": 0}
    finish(c, r0)
    c.evict(10_000)                                    # its COLD prefix goes: the slots above HOT are free
    a.merge_and_sort_free()
    held = a.alloc(70)                                 # another request holds the slots above HOT ...
    r = ModelReq(toks(500, 60) + [7], prefix_len=60)
    c.schedule(r)
    assert c.extend(r, 61)                             # ... so this one's KV lies above them
    a.free(held)                                       # it finishes: the slots above HOT are free, first
    a.merge_and_sort_free()
    c.cache_unfinished_req(r)
    assert c.hot.counts["hot"] == 1 and c.hot.moves["grown"] == 40 and c.region.capacity == 60
    check(c, [r])
    finish(c, r)
    check(c)
    # the same prefix with the static split: no extent, the paged fallback
    a2 = ModelAllocator(400)
    c2 = ModelRadixCache(a2, 16, 256, hot_fraction=0.05)
    r2 = ModelReq(toks(0, 60) + [7], prefix_len=60)
    prefill(c2, r2)
    assert c2.hot.counts["cold"] == 1 and c2.region.capacity == 20


def test_growth_stops_at_hot_max_and_at_the_cold_watermark():
    a = ModelAllocator(200)
    c = dynamic(a, frac=0.05, hi=0.2)                 # 10 HOT slots, at most 40
    r = ModelReq(toks(0, 50) + [7], prefix_len=50)    # 50 > hot_max: stays COLD, nothing moves
    prefill(c, r)
    assert c.hot.counts["cold"] == 1 and c.hot.moves["grown"] == 0 and c.region.capacity == 10
    check(c, [r])
    a = ModelAllocator(200)
    c = dynamic(a, frac=0.05, hi=0.9, wm=0.4)          # growth must leave 2 x 80 COLD slots free
    r = ModelReq(toks(0, 40) + [7], prefix_len=40)
    prefill(c, r)
    assert c.hot.moves["grown"] == 0 and c.hot.counts["cold"] == 1


def test_cold_pressure_takes_free_hot_end_slots_before_any_cached_cold_prefix():
    a = ModelAllocator(200)
    c = dynamic(a, frac=0.5, lo=0.1, wm=0.02)          # 100 HOT slots, free
    cold = ModelReq(toks(5000, 30) + [1])             # no named prefix: cached COLD when done
    prefill(c, cold)
    finish(c, cold)
    cached_cold = c.hot.cold_evictable(c.root_node)
    assert cached_cold > 0
    assert c.evictable_size() == cached_cold + 80      # HOT may give 100 - hot_min (20) slots
    big = ModelReq(toks(9000, 120) + [2])
    prefill(c, big)                                    # needs more than the allocator has free
    assert c.hot.moves["shrunk"] > 0 and c.hot.cold_evictable(c.root_node) == cached_cold   # COLD kept
    assert c.region.capacity >= 20
    check(c, [big])


def test_a_reader_of_promoted_slots_moving_its_lock_reads_the_slab_after():
    """A request that matched a chunk before its prefix was promoted, then caches a chunk of its own:
    the lock move inside ``cache_unfinished_req`` takes the last lock off the head and gives its old
    slots back, so the request's row must be rewritten over the head too (SGLang rewrites only past
    what it had matched), or it would read slots the next allocation hands out."""
    a = ModelAllocator(200)
    c = ModelRadixCache(a, 8, 256, hot_fraction=0.25)
    r = ModelReq(toks(0, 32) + [5], prefix_len=32)
    c.schedule(r)
    assert c.extend(r, 16)
    c.cache_unfinished_req(r, chunked=True)
    late = ModelReq(toks(0, 32) + toks(600, 20), prefix_len=32)
    assert c.schedule(late) and late.fill_len == 16
    assert c.extend(r, 17)
    c.cache_unfinished_req(r)                 # promoted; `late` alone holds the first chunk's old slots
    finish(c, r)
    assert c.hot.retired_tokens == 16
    assert c.extend(late, 8)
    c.cache_unfinished_req(late, chunked=True)
    assert c.hot.retired_tokens == 0          # given back at the lock move
    other = ModelReq(toks(900, a.available_size()))
    prefill(c, other)                         # every free slot, the ones just given back among them
    check(c, [late, other])                   # `late`'s row still reads its own tokens
