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

Per request, what was read is kept on the request itself (an attribute the memo names) with the ``last_node``
it was read from; a later step takes it again while ``last_node`` is the same: while a request runs its path
is locked, so its slab can be neither evicted nor moved. A request is thus read once, when it joins the
decode batch (or when its path changes), and a step's lists are gathered at C speed (``map`` over attribute
and item getters), with no per-request Python. A step whose requests and their ``last_node`` are last step's,
in the same order, takes last step's lists whole.
"""
from __future__ import annotations

import itertools
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
    """Where :func:`step_prefixes` keeps what it read: per request, the tuple ``(last_node, prefix_id, n,
    hot_start)`` as the request's attribute ``attr`` (one name per memo, so two memos never share a read);
    and the whole last step (``last``: its requests, their nodes, its :class:`StepPrefixes`). Counters:
    requests taken from the memo (``hits``), read off the tree (``misses``), steps taken whole (``whole``)."""

    _names = itertools.count()

    def __init__(self):
        self.attr = f"_granikv_prefix_{next(PrefixMemo._names)}"
        self.entry = operator.attrgetter(self.attr)
        self.last: Optional[tuple[list, list, StepPrefixes]] = None
        self.hits = 0
        self.misses = 0
        self.whole = 0

    def entries(self, reqs: list) -> list:
        """Each request's kept tuple, None where it has none (C speed when every request has one)."""
        try:
            return list(map(self.entry, reqs))
        except AttributeError:
            return [getattr(r, self.attr, None) for r in reqs]


_LAST_NODE = operator.attrgetter("last_node")
_NODE, _PID, _LEN, _HOT = (operator.itemgetter(i) for i in range(4))


def _nodes(reqs: list) -> list:
    """Each request's ``last_node`` (None where a request has none)."""
    try:
        return list(map(_LAST_NODE, reqs))
    except AttributeError:
        return [getattr(r, "last_node", None) for r in reqs]


def _read(req, node, settings: PluginSettings, slab_of) -> tuple:
    """``(node, prefix_id, n, hot_start)`` of one request read off the tree (n 0 where it has no prefix)."""
    sp = getattr(req, "sampling_params", None)
    n = shared_prefix_len(getattr(sp, "custom_params", None), len(req.origin_input_ids), settings)
    pid, hs = request_prefix(node, n, slab_of)
    return node, pid, n if pid >= 0 else 0, hs


def step_prefixes(reqs: Iterable[Any], settings: PluginSettings,
                  slab_of: Callable[[Any], Any] = _slab_of, memo: Optional[PrefixMemo] = None) -> StepPrefixes:
    """The :class:`StepPrefixes` of a decode batch's requests (SGLang ``Req`` objects: their
    ``sampling_params.custom_params``, ``origin_input_ids`` and ``last_node``), in batch order.
    ``memo``: a request read before with the same ``last_node`` is taken from what the memo kept on it, and a
    step of last step's requests and nodes takes last step's lists whole (shared: callers never change them).
    Without a memo every request is read."""
    t0 = time.perf_counter()
    reqs = reqs if isinstance(reqs, list) else list(reqs)
    nodes = _nodes(reqs)
    if memo is None:
        ents = [_read(r, nd, settings, slab_of) for r, nd in zip(reqs, nodes)]
    else:
        if memo.last is not None:
            last_reqs, last_nodes, last = memo.last
            if (len(last_reqs) == len(reqs) and all(map(operator.is_, last_reqs, reqs))
                    and all(map(operator.is_, last_nodes, nodes))):
                memo.hits += len(reqs)
                memo.whole += 1
                return StepPrefixes(last.prefix_ids, last.prefix_lens, last.hot_starts,
                                    (time.perf_counter() - t0) * 1e6)
        ents = memo.entries(reqs)
        misses = 0
        i = -1
        while None in ents:                               # requests that joined: found at C speed
            i = ents.index(None, i + 1)
            ents[i] = _read(reqs[i], nodes[i], settings, slab_of)
            setattr(reqs[i], memo.attr, ents[i])
            misses += 1
        if not all(map(operator.is_, map(_NODE, ents), nodes)):
            for i, (req, node, e) in enumerate(zip(reqs, nodes, ents)):
                if e[0] is not node:                      # its path changed (re-cached): read it again
                    ents[i] = _read(req, node, settings, slab_of)
                    setattr(req, memo.attr, ents[i])
                    misses += 1
        memo.misses += misses
        memo.hits += len(reqs) - misses
    out = StepPrefixes(list(map(_PID, ents)), list(map(_LEN, ents)), list(map(_HOT, ents)))
    if memo is not None:
        memo.last = (reqs.copy(), nodes, out)
    out.host_us = (time.perf_counter() - t0) * 1e6
    return out


def staged_for(staged: Optional[StepPrefixes], batch_size: int) -> Optional[StepPrefixes]:
    """``staged`` when it describes a batch of ``batch_size`` requests, else None (the step then
    runs SGLang's paged path: a prefix list that does not match the batch is never guessed at)."""
    if staged is None or staged.batch_size != batch_size:
        return None
    return staged
