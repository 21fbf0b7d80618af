"""A captured CUDA graph's body that runs at replay only when a device flag says so (a CUDA-graph IF node).

The captured decode step of the SGLang plugin (:mod:`granikv.attention.graph_step`) runs its prefix launches and
row merge in every replay, also in a step in which no row splits a prefix off (every class paged): ~30 us per
layer of launches whose outputs nobody reads (``runners.graph_step_bench``, ``fixed_us``). Under CUDA 12.4+ a
graph can hold a conditional node whose body runs only when a device predicate is true; torch exposes it on
the graph being captured (``CUDAGraph.begin_capture_to_if_node`` / ``end_capture_to_conditional_node``).

:func:`run_if_any` wraps a body so that, while the current stream captures a torch CUDA graph and the torch build
has that API, the body becomes such a node, predicated on ``flags.any()`` (computed in the parent graph at
replay); otherwise (eager runs, capture warm-ups, CPU, an older torch) the body simply runs. The body must
write its results into tensors that exist before it (a conditional body's outputs are not seen otherwise).
"""
from __future__ import annotations

from typing import Callable

import torch


def conditional_capture_available() -> bool:
    """Whether this torch build can capture a conditional (IF) node into a CUDA graph."""
    g = getattr(torch.cuda, "CUDAGraph", None)
    return (torch.cuda.is_available() and g is not None and hasattr(g, "get_currently_capturing_graph")
            and hasattr(g, "begin_capture_to_if_node") and hasattr(g, "end_capture_to_conditional_node"))


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def run_if_any(flags: torch.Tensor, body: Callable[[], None]) -> bool:
    """Run ``body()``; while a graph is being captured (and conditional capture is available), as an IF node
    run at replay only when any element of ``flags`` (a device tensor) is non-zero. Returns whether the body
    was captured as a conditional node."""
    if not (capturing() and conditional_capture_available()):
        body()
        return False
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    pred = flags.any()                       # 0-d bool on the device, written at each replay before the node
    graph.begin_capture_to_if_node(pred)
    try:
        body()
    finally:
        graph.end_capture_to_conditional_node()
    return True
