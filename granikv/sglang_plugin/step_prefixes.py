"""Which shared prefix each request of a decode step carries, read from SGLang's radix tree on the host.

Pure Python over objects of SGLang's ``TreeNode`` shape (``parent``, ``value``, ``id``; the slab a
node's slots lie in, if any, as the attribute :data:`granikv.sglang_plugin.hot_region.SLAB_ATTR`),
so it runs without SGLang and without touching a device tensor: no host sync in a decode launch.

A request's cached path is the chain of nodes from the root's child down to ``req.last_node``
(the node its prompt ends in, locked while it runs). Its declared shared prefix is the first
``n`` prompt tokens (:func:`granikv.sglang_plugin.settings.shared_prefix_len`). Two requests
whose paths pass through the same node at depth ``n`` (the node that holds position ``n - 1``)
have the same KV slots for positions ``0..n-1``: that node's id and ``n`` name the prefix class.
The prefix is one contiguous HOT run when every node from the root's child down to that node lies
in one slab (the slab then starts at position 0: its slots are ``slab.start + position``); such a
class is named by its slab's start and ``n`` instead, which no later split of the radix tree changes.

Per step, a request already seen with the same ``last_node`` is not read again (:class:`PrefixMemo`):
while it runs its path is locked, so its slab can be neither evicted nor moved. A step whose requests and
their ``last_node`` are last step's, in the same order (no request joined or left), takes last step's lists
whole: two identity checks at C speed instead of a Python pass over the batch.
"""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from granikv.sglang_plugin.hot_region import SLAB_ATTR
from granikv.sglang_plugin.settings import PluginSettings, shared_prefix_len


def _slab_of(node) -> Any:
    return getattr(node, SLAB_ATTR, None)


HOT_TAG = 1 << 62   # prefix ids of HOT classes: HOT_TAG | slab start << 24 | n (n < 2**24)


def request_prefix(last_node, n: int, slab_of: Callable[[Any], Any] = _slab_of) -> tuple[int, int]:
    """``(prefix_id, hot_start)`` of a request whose cached path ends at ``last_node`` and whose
    declared shared prefix is ``n`` tokens; ``(-1, -1)`` when it has none (``n`` 0, no path, or a
    path shorter than ``n``: the prefix is not cached). ``hot_start`` is -1 unless the prefix is
    one HOT run (see the module docstring). ``prefix_id`` is ``HOT_TAG | start << 24 | n`` for a
    HOT run, else ``(node id << 32) | n``."""
    if n <= 0 or last_node is None:
        return -1, -1
    path = []
    node = last_node
    while node is not None and node.parent is not None:   # the root (parent None) holds no token
        path.append(node)
        node = node.parent
    depth = 0
    for i in range(len(path) - 1, -1, -1):                # root's child first
        nd = path[i]
        depth += len(nd.value)
        if depth >= n:
            slab = slab_of(path[-1])
            hot = slab is not None and slab.length >= n and all(slab_of(path[j]) is slab for j in range(i, len(path)))
            if hot:
                return HOT_TAG | (int(slab.start) << 24) | int(n), int(slab.start)
            return (int(nd.id) << 32) | int(n), -1
    return -1, -1


@dataclass
class StepPrefixes:
    """The host lists a decode step's plan needs, one entry per request (``B`` of them).

    ``prefix_ids`` ``[B]`` (equal id <=> identical prefix slots; -1 none), ``prefix_lens`` ``[B]``
    (declared shared tokens, 0 where the id is -1), ``hot_starts`` ``[B]`` (first HOT slot of a
    prefix that is one HOT run, else -1). ``host_us``: the host time taken to read them.
    """

    prefix_ids: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    hot_starts: list[int] = field(default_factory=list)
    host_us: float = 0.0

    @property
    def batch_size(self) -> int:
        return len(self.prefix_ids)

    @property
    def any_prefix(self) -> bool:
        return any(p >= 0 for p in self.prefix_ids)


class PrefixMemo:
    """What :func:`step_prefixes` read last step, per request: ``id(req) -> (req, last_node, pid, n, hs)``;
    and the whole step (``last``: its requests, their nodes, its :class:`StepPrefixes`). Holds only the last
    step's requests (each step replaces it), so an id is never reused stale. ``whole``: steps taken whole."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}
        self.last: Optional[tuple[list, list, StepPrefixes]] = None
        self.hits = 0
        self.misses = 0
        self.whole = 0


_LAST_NODE = operator.attrgetter("last_node")


def _nodes(reqs: list) -> list:
    """Each request's ``last_node`` (None where a request has none)."""
    try:
        return list(map(_LAST_NODE, reqs))
    except AttributeError:
        return [getattr(r, "last_node", None) for r in reqs]


def step_prefixes(reqs: Iterable[Any], settings: PluginSettings,
                  slab_of: Callable[[Any], Any] = _slab_of, memo: Optional[PrefixMemo] = None) -> StepPrefixes:
    """The :class:`StepPrefixes` of a decode batch's requests (SGLang ``Req`` objects: their
    ``sampling_params.custom_params``, ``origin_input_ids`` and ``last_node``), in batch order.
    ``memo``: requests seen last step with the same ``last_node`` are taken from it, and a step of last step's
    requests and nodes takes last step's lists whole (shared: callers never change them)."""
    t0 = time.perf_counter()
    reqs = reqs if isinstance(reqs, list) else list(reqs)
    nodes = _nodes(reqs)
    if memo is not None and memo.last is not None:
        last_reqs, last_nodes, last = memo.last
        if (len(last_reqs) == len(reqs) and all(map(operator.is_, last_reqs, reqs))
                and all(map(operator.is_, last_nodes, nodes))):
            memo.hits += len(reqs)
            memo.whole += 1
            return StepPrefixes(last.prefix_ids, last.prefix_lens, last.hot_starts,
                                (time.perf_counter() - t0) * 1e6)
    out = StepPrefixes()
    old = memo.entries if memo is not None else {}
    new: dict[int, tuple] = {}
    ids, lens, hots = out.prefix_ids, out.prefix_lens, out.hot_starts
    misses = 0
    for req, node in zip(reqs, nodes):
        e = old.get(id(req))
        if e is None or e[0] is not req or e[1] is not node:       # new, or its path changed: read it
            sp = getattr(req, "sampling_params", None)
            n = shared_prefix_len(getattr(sp, "custom_params", None), len(req.origin_input_ids), settings)
            pid, hs = request_prefix(node, n, slab_of)
            e = (req, node, pid, n if pid >= 0 else 0, hs)
            misses += 1
        new[id(req)] = e
        ids.append(e[2])
        lens.append(e[3])
        hots.append(e[4])
    if memo is not None:
        memo.misses += misses
        memo.hits += len(reqs) - misses
        memo.entries = new
        memo.last = (reqs.copy(), nodes, out)
    out.host_us = (time.perf_counter() - t0) * 1e6
    return out


def staged_for(staged: Optional[StepPrefixes], batch_size: int) -> Optional[StepPrefixes]:
    """``staged`` when it describes a batch of ``batch_size`` requests, else None (the step then
    runs SGLang's paged path: a prefix list that does not match the batch is never guessed at)."""
    if staged is None or staged.batch_size != batch_size:
        return None
    return staged
