"""Prefix policies: which path each prefix class of a decode step takes, one policy per system.

A policy sees the step's prefix classes (granikv.attention.plan.ClassPlan: prefix length,
B_class, real rows, HOT start) and the batch size, and sets each class's ``choice`` to a path:

    paged     the prefix stays in the request's slot list (one batch decode over prefix+suffix)
    cascade   the class's queries attend its prefix slots in one batch prefill (cascade level 0)
    dense     one non-causal attention over the contiguous HOT slab (needs hot_start >= 0)
    hydragen  the dense math after gathering the prefix slots into a scratch

The systems differ in ``choose`` alone, in one line each; how a path runs is
granikv.attention.decode's business. Policies hold no tensors and do no device work: the
engine and the SGLang plugin ask the same objects. ``choose`` writes each class's choice in place:
its host time (lookups and writes) is the dispatch cost each step records (``dispatch_us``).

Step kind: ``graph_step`` (True by default) says whether the step being planned will be replayed
from a CUDA graph (True) or run eagerly (False: above ``hardware.cuda_graph_max_bs``, or any step
that is not replayed). The caller sets it before each plan (granikv.engine.runner does, per step;
a caller that never sets it plans every step as a graph step, as before). Only GranikvPolicy reads
it: its dispatcher's table may hold separate rules per step kind, because a path's eager cost
(device time plus the host time of its launches) differs from its replayed cost.

No-regression guard (GranikvPolicy): the policy takes a class off the paged path only where the
calibrated table's rule for this step kind says so, and the calibrator (``runners.calibrate.fit``)
writes an option other than paged only at points where it was measured faster than paged in that
step kind (paged covering the unmeasured gap next to any point where paged won).
For a class whose prefix is not one HOT run the table's dense becomes the rule's ``cold`` path
(the faster of cascade and paged as calibrated; cascade in a table without ``cold``, as before).
When every class goes paged in a step without CUDA-graph pad rows (every eager step), the step plan
is the paged baseline's (no split class: one rest decode over every request's whole slot list), so
plan() does the baseline's work at that batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

from granikv.attention.dispatch import Dispatcher

PATHS = ("paged", "cascade", "dense", "hydragen")


class PrefixPolicy:
    """Base of the policies: ``choose(classes, batch_size)`` sets ``choice`` of every class.

    ``splits``: whether the policy can take a class off the paged path (the runner then pads a
    single-class batch inside the class). ``batch_global``: the one split class, when there is one,
    covers every row of the batch (the step may run as FlashInfer's two-level cascade).
    """

    name = "base"
    splits = True
    batch_global = False
    graph_step = True       # the kind of the step being planned (see the module doc): set by the caller

    def choose(self, classes: Sequence, batch_size: int) -> None:
        """Set ``c.choice`` (one of PATHS) of every ClassPlan ``c`` of this step's ``classes``."""
        raise NotImplementedError


class PagedPolicy(PrefixPolicy):
    """SGLang default: every prefix stays on the paged path (page size 1)."""

    name = "paged"
    splits = False

    def choose(self, classes, batch_size):
        for c in classes:
            c.choice = "paged"


class BatchCascadePolicy(PrefixPolicy):
    """SGLang-Cascade: cascade when ONE class holds every request of the batch, else paged.

    Any request outside the class, or two classes, leaves no prefix common to the batch.
    """

    name = "cascade"
    batch_global = True

    def choose(self, classes, batch_size):
        common = len(classes) == 1 and len(classes[0].rows) == batch_size
        for c in classes:
            c.choice = "cascade" if common else "paged"


class DenseHotPolicy(PrefixPolicy):
    """Dense for every class whose prefix is one HOT run, paged otherwise (no dispatcher)."""

    name = "dense"

    def choose(self, classes, batch_size):
        for c in classes:
            c.choice = "dense" if c.hot_start >= 0 else "paged"


class HydragenPolicy(PrefixPolicy):
    """HydraGen on paged storage: every class's prefix gathered to a scratch, then the dense math."""

    name = "hydragen"

    def choose(self, classes, batch_size):
        for c in classes:
            c.choice = "hydragen"


class GranikvPolicy(PrefixPolicy):
    """GraniKV: per class, what the dispatcher's table says for (Lp, real B_class) in this step's kind
    (``graph_step``: CUDA-graph replayed or eager) and, where the table has rules per class count, at
    the step's count of prefix classes (classes with a prefix and a real request): k classes on the
    dense path are k calls per layer, on the cascade path one batched call.

    A class whose prefix is not one HOT run (admission fell back to COLD) cannot go dense: its dense
    choice becomes the rule's cold path (cascade or paged; cascade when the table does not say: the
    paged fallback, served the cascade/paged way). Real rows only: CUDA-graph pad rows never change a
    decision (a class of pad rows only is paged). Per class one dict lookup (two for a dense class
    whose prefix is COLD); nothing is decided twice for a (Lp, B_class, step kind).
    """

    name = "granikv"

    def __init__(self, dispatcher: Optional[Dispatcher]):
        if dispatcher is None:
            raise ValueError("granikv backend needs a dispatcher (granikv.attention.dispatch.Dispatcher)")
        self.dispatcher = dispatcher

    def choose(self, classes, batch_size):
        d = self.dispatcher
        decide = d.decisions_for(self.graph_step)   # (Lp, n_real, k) -> path, decided on first sight
        k = sum(1 for c in classes if c.n_real) if d.class_specific else 1   # classes hold prefixed rows only
        for c in classes:
            key = (c.prefix_len, c.n_real, k)
            path = decide[key]
            if path == "dense" and c.hot_start < 0:
                path = d.cold_decisions_for(self.graph_step)[key]
            c.choice = path


POLICIES: dict[str, type[PrefixPolicy]] = {"paged": PagedPolicy, "cascade": BatchCascadePolicy,
                                           "dense": DenseHotPolicy, "hydragen": HydragenPolicy,
                                           "granikv": GranikvPolicy}


def make_policy(name: str, dispatcher: Optional[Dispatcher] = None) -> PrefixPolicy:
    """The policy of ``system.backend`` ``name``; ``granikv`` needs its ``dispatcher``."""
    if name not in POLICIES:
        raise ValueError(f"system.backend: '{name}' is not one of {tuple(POLICIES)}")
    return GranikvPolicy(dispatcher) if name == "granikv" else POLICIES[name]()
