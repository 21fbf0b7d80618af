"""A model of SGLang 0.5.17's token allocator and radix cache, for the plugin's CPU tests, and
tests that pin the model to what SGLang's code does.

``ModelAllocator`` follows ``sglang/srt/mem_cache/allocator/token.py`` (TokenToKVPoolAllocator)
and ``allocator/base.py`` line for line: free slots ``1..size`` (slot 0 is the padding slot),
``alloc`` takes the head of ``free_pages``, ``free`` appends (or goes to ``release_pages`` with
``need_sort``, merged and sorted when an ``alloc`` runs short), free groups, no checks (a double
free is not caught: the tests' own invariants catch it).

``ModelRadixCache`` follows ``sglang/srt/mem_cache/radix_cache.py`` (RadixCache) for page size 1:
children keyed by the first token, ``_split_node`` makes a new upper node and keeps the old
object as the lower part, ``inc_lock_ref`` / ``dec_lock_ref`` walk to the root moving tokens
between ``evictable_size_`` and ``protected_size_``, ``evictable_leaves``,
``cache_unfinished_req`` / ``cache_finished_req`` (insert, free the duplicates, rewrite the
request's row from a fresh match, move the lock). The plugin's hooks sit where
``granikv.sglang_plugin.cache.GraniKVRadixCache`` puts them.
"""
from __future__ import annotations
import itertools

import torch

from granikv.kv import eviction
from granikv.sglang_plugin.hot_region import HotColdTree, HotRegion
from granikv.sglang_plugin.settings import PluginSettings, shared_prefix_len

_clock = itertools.count(1)


class ModelAllocator:
    """sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator, page size 1."""

    def __init__(self, size: int, need_sort: bool = False, kv_width: int = 2):
        self.size = size
        self.page_size = 1
        self.need_sort = need_sort
        self.device = "cpu"
        # the KV of slot s (both "k" and "v"): [size + 1, kv_width], slot 0 the padding row
        self.k = torch.zeros(size + 1, kv_width)
        self.v = torch.zeros(size + 1, kv_width)
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64)
        self.is_not_in_free_group = True
        self.free_group = []
        self.release_pages = torch.empty((0,), dtype=torch.int64)

    def available_size(self):
        return len(self.free_pages) + len(self.release_pages)

    def merge_and_sort_free(self):
        if len(self.release_pages) > 0:
            self.free_pages = torch.cat((self.free_pages, self.release_pages))
            self.free_pages, _ = torch.sort(self.free_pages)
            self.release_pages = torch.empty((0,), dtype=self.release_pages.dtype)

    def alloc(self, need_size: int):
        if self.need_sort and need_size > len(self.free_pages):
            self.merge_and_sort_free()
        if need_size > len(self.free_pages):
            return None
        select_index = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return select_index

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if self.is_not_in_free_group:
            if self.need_sort:
                self.release_pages = torch.cat((self.release_pages, free_index))
            else:
                self.free_pages = torch.cat((self.free_pages, free_index))
        else:
            self.free_group.append(free_index)

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self):
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))

    def free_segment(self, free_index, *, start_pos: int):
        self.free(free_index)

    def free_segments(self, segments):
        for free_index, start_pos in segments:
            if free_index.numel():
                self.free_segment(free_index, start_pos=start_pos)

    def free_slots(self) -> torch.Tensor:
        return torch.cat((self.free_pages, self.release_pages))


class ModelNode:
    """sglang.srt.mem_cache.radix_cache.TreeNode, the fields the radix cache uses."""

    def __init__(self):
        self.children = {}
        self.parent = None
        self.key: tuple = ()
        self.value = None
        self.lock_ref = 0
        self.last_access_time = next(_clock)

    def __repr__(self):
        return f"ModelNode(len={len(self.key)}, lock={self.lock_ref}, hot={getattr(self, 'granikv_slab', None)})"


class ModelReq:
    """The fields of sglang.srt.managers.schedule_batch.Req that the radix cache reads."""

    _ids = itertools.count()

    def __init__(self, tokens, prefix_len=None):
        self.rid = next(self._ids)
        self.origin_input_ids = list(tokens)
        self.output_ids: list[int] = []
        self.custom_params = None if prefix_len is None else {"granikv_prefix_len": prefix_len}
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.cache_protected_len = 0
        self.fill_len = 0  # tokens whose KV is in the row (SGLang: extend_range.end)

    def get_fill_ids(self):
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]


class ModelRadixCache:
    """RadixCache (page size 1, no EAGLE, no events) with GraniKVRadixCache's hooks and overrides."""

    def __init__(self, allocator: ModelAllocator, max_reqs: int, max_len: int, hot_fraction: float = 0.2,
                 prefix_len: int = 0, settings: PluginSettings | None = None):
        self.allocator = allocator
        self.settings = settings or PluginSettings(hot_fraction, prefix_len)
        hot_fraction = self.settings.hot_fraction
        self.req_to_token = torch.zeros(max_reqs + 1, max_len, dtype=torch.int32)
        self.free_req_slots = list(range(1, max_reqs + 1))
        self.region = HotRegion(allocator, HotRegion.tokens_for(allocator.size, hot_fraction))
        self.hot = HotColdTree(self.region, free_cold=lambda v: allocator.free_segment(v, start_pos=0),
                               delete_leaf=self._delete_leaf, split=self.settings.split_policy(allocator.size))
        self.evictable_leaves = set()
        self._hot_len = 0
        self._promoted = False
        self.reset()
        orig_clear = allocator.clear

        def clear():
            orig_clear()
            self.region.recarve_after_clear(HotRegion.tokens_for(allocator.size, hot_fraction))

        allocator.clear = clear

    # -------------------------------------------------- RadixCache
    def reset(self):
        self.root_node = ModelNode()
        self.root_node.value = torch.empty(0, dtype=torch.int64)
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves.clear()
        self.hot.reset()

    def match_prefix(self, key):
        key = tuple(key)
        if len(key) == 0:
            return torch.empty(0, dtype=torch.int64), self.root_node
        value, node = [], self.root_node
        t = next(_clock)
        node.last_access_time = t
        while len(key) > 0 and key[0] in node.children:
            child = node.children[key[0]]
            child.last_access_time = t
            n = _common(child.key, key)
            if n < len(child.key):
                new = self._split_node(child, n)
                value.append(new.value)
                node = new
                break
            value.append(child.value)
            node = child
            key = key[n:]
        return (torch.cat(value) if value else torch.empty(0, dtype=torch.int64)), node

    def _split_node(self, child, split_len):
        new = ModelNode()
        new.children = {child.key[split_len]: child}
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key = child.key[:split_len]
        new.value = child.value[:split_len].clone()
        new.last_access_time = child.last_access_time
        child.parent = new
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        new.parent.children[new.key[0]] = new
        self.hot.on_split(new, child)  # GraniKVRadixCache._split_node
        return new

    def _raw_insert(self, key, value):
        key = tuple(key)
        node = self.root_node
        t = next(_clock)
        node.last_access_time = t
        total = 0
        while len(key) > 0 and key[0] in node.children:
            node = node.children[key[0]]
            node.last_access_time = t
            n = _common(node.key, key)
            total += n
            key, value = key[n:], value[n:]
            if n < len(node.key):
                node = self._split_node(node, n)
        if len(key):
            new = ModelNode()
            new.parent = node
            new.key = key
            new.value = value.clone()
            node.children[key[0]] = new
            self.evictable_size_ += len(key)
            self._update_leaf_status(node)
            self._update_leaf_status(new)
            node = new
        return total, node

    def insert(self, key, value):  # GraniKVRadixCache.insert
        n, self._hot_len = self._hot_len, 0
        if n:
            self.last_admit = self.hot.admit_prefix(
                key, value, n, match=self.match_prefix, insert=lambda k, v: self._raw_insert(k, v)[1],
                lock=self.inc_lock_ref, unlock=self.dec_lock_ref, copy_rows=self._copy_rows, promote=True)
            self._promoted = self.last_admit.promoted > 0
        return self._raw_insert(key, value)

    def _copy_rows(self, dst, src):
        self.allocator.k[dst] = self.allocator.k[src]
        self.allocator.v[dst] = self.allocator.v[src]

    def inc_lock_ref(self, node):
        self.hot.before_lock(node)
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent

    def dec_lock_ref(self, node):
        self.hot.before_unlock(node)
        start = node
        while node is not self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            self._update_leaf_status(node)
            node = node.parent
        self.hot.after_unlock(start)  # GraniKVRadixCache.dec_lock_ref

    def _delete_leaf(self, node):
        v = node.parent.children.pop(node.key[0], None)
        assert v is node, "parent does not have the child"
        self.evictable_size_ -= len(node.key)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(node.parent)

    def _update_leaf_status(self, node):
        if node.lock_ref > 0 or node.value is None:
            self.evictable_leaves.discard(node)
            return
        if node.children:
            self.evictable_leaves.discard(node)
            return
        self.evictable_leaves.add(node)

    def evict(self, num_tokens):  # GraniKVRadixCache.evict
        given = self.hot.relieve(num_tokens)
        return given + self.hot.evict_cold(num_tokens - given, list(self.evictable_leaves), self.root_node)

    def evictable_size(self):  # GraniKVRadixCache.evictable_size
        return self.evictable_size_ - self.hot.hot_evictable + self.hot.shrinkable

    def protected_size(self):  # GraniKVRadixCache.protected_size
        return (self.protected_size_ - self.hot.hot_locked + self.region.capacity - self.hot.shrinkable
                + self.hot.retired_tokens)

    # -------------------------------------------------- requests (the scheduler's side)
    def _prefix_len(self, req):
        return shared_prefix_len(req.custom_params, len(req.origin_input_ids), self.settings)

    def cache_unfinished_req(self, req, chunked=False):
        n = 0 if chunked else self._prefix_len(req)   # a middle chunk: cached COLD (GraniKVRadixCache)
        self._promoted = False
        retired = self.hot.retired_tokens > 0
        self._hot_len = n
        token_ids = req.get_fill_ids()
        kv = self.req_to_token[req.req_pool_idx, : len(token_ids)]
        values = kv.to(torch.int64, copy=True)
        new_prefix_len, _ = self.insert(token_ids, values)
        self.allocator.free_segment(kv[req.cache_protected_len:new_prefix_len].to(torch.int64),
                                    start_pos=req.cache_protected_len)
        new_indices, new_last = self.match_prefix(token_ids)
        assert len(new_indices) == len(token_ids)
        self.req_to_token[req.req_pool_idx, req.cache_protected_len:len(new_indices)] = \
            new_indices[req.cache_protected_len:].to(torch.int32)
        req.cache_protected_len = len(new_indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last)
        req.prefix_indices = new_indices
        req.last_node = new_last
        if self._promoted or retired:   # GraniKVRadixCache: the row from the fresh match, head included
            self.req_to_token[req.req_pool_idx, : len(new_indices)] = new_indices.to(torch.int32)
            self._promoted = False

    def cache_finished_req(self, req, is_insert=True):
        n = self._prefix_len(req)
        self._hot_len = n if is_insert else 0
        token_ids = req.get_fill_ids()
        kv = self.req_to_token[req.req_pool_idx, : len(token_ids)].to(torch.int64)
        if is_insert:
            prefix_len, _ = self.insert(token_ids, kv.clone())
        else:
            self._hot_len = 0
            prefix_len = len(token_ids)
        self.allocator.free_segments([(kv[req.cache_protected_len:prefix_len], req.cache_protected_len),
                                      (kv[len(token_ids):], len(token_ids))])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self.free_req_slots.append(req.req_pool_idx)
        req.req_pool_idx = None

    # -------------------------------------------------- the scheduler's steps
    def schedule(self, req) -> bool:
        """match, lock, take a req slot: SGLang's init_next_round_input + PrefillAdder."""
        slots, node = self.match_prefix(req.origin_input_ids)
        req.prefix_indices, req.last_node = slots, node
        req.cache_protected_len = len(slots)
        req.fill_len = len(slots)
        self.inc_lock_ref(node)
        req.req_pool_idx = self.free_req_slots.pop(0)
        self.req_to_token[req.req_pool_idx, : len(slots)] = slots.to(torch.int32)
        return True

    def extend(self, req, n_tokens: int) -> bool:
        """Allocate and 'compute' the KV of the next ``n_tokens`` (alloc_for_extend + forward);
        evicts the shortfall first (evict_from_tree_cache). False: out of memory."""
        avail = self.allocator.available_size()
        if avail < n_tokens:
            self.evict(n_tokens - avail)
        slots = self.allocator.alloc(n_tokens)
        if slots is None:
            return False
        toks = (req.origin_input_ids + req.output_ids)
        start = req.fill_len
        self.req_to_token[req.req_pool_idx, start:start + n_tokens] = slots.to(torch.int32)
        pos = torch.arange(start, start + n_tokens, dtype=torch.float32)
        tok = torch.tensor(toks[start:start + n_tokens], dtype=torch.float32)
        self.allocator.k[slots] = torch.stack((tok, pos), 1)  # KV of (token, position): checkable
        self.allocator.v[slots] = torch.stack((pos, tok), 1)
        req.fill_len += n_tokens
        return True

    def decode(self, req, token: int) -> bool:
        req.output_ids.append(token)
        return self.extend(req, 1)

    # -------------------------------------------------- checks
    def nodes(self):
        return eviction.subtree(self.root_node)[1:]


def _common(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------- the model is SGLang's
def test_model_allocator_hands_out_the_head_of_its_free_list_like_sglang():
    a = ModelAllocator(10)
    assert a.available_size() == 10
    x = a.alloc(3)
    assert x.tolist() == [1, 2, 3] and a.available_size() == 7
    a.free(torch.tensor([2]))
    assert a.alloc(7).tolist() == [4, 5, 6, 7, 8, 9, 10] and a.alloc(1).tolist() == [2]
    assert a.alloc(1) is None


def test_model_allocator_need_sort_merges_released_slots_when_short():
    a = ModelAllocator(6, need_sort=True)
    a.alloc(6)
    a.free(torch.tensor([5, 2]))
    assert a.available_size() == 2 and len(a.free_pages) == 0
    assert a.alloc(2).tolist() == [2, 5]  # merged and sorted


def test_model_allocator_free_group_frees_at_the_end():
    a = ModelAllocator(4)
    x = a.alloc(4)
    a.free_group_begin()
    a.free(x[:2])
    assert a.available_size() == 0
    a.free_group_end()
    assert a.available_size() == 2


def test_model_radix_cache_splits_and_locks_like_sglang():
    a = ModelAllocator(50)
    c = ModelRadixCache(a, 4, 64, hot_fraction=0.0)
    c._raw_insert((1, 2, 3, 4), torch.tensor([11, 12, 13, 14]))
    slots, node = c.match_prefix((1, 2, 9))
    assert slots.tolist() == [11, 12] and node.key == (1, 2) and list(node.children) == [3]
    assert node.children[3].key == (3, 4)  # the lower part is the old object
    c.inc_lock_ref(node)
    assert c.protected_size_ == 2 and c.evictable_size_ == 2
    c.dec_lock_ref(node)
    assert c.protected_size_ == 0 and c.evictable_size_ == 4
