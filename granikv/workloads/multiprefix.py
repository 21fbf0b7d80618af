"""Multi-prefix workload: k distinct system prompts; request i carries prompt i % k.

Uniform: every prompt has ``prefix_len`` tokens (paper B.8: k in {1, 4, 16, 64}, Lp=8K, B=256).
Heterogeneous: ``prefix_lens`` gives one length per prompt (B.8: k=4, k=8). Distinct prompts
start with distinct first tokens, so the prefix index never merges two of them.
"""
from __future__ import annotations

from granikv.config import WorkloadConfig
from granikv.request import Request
from granikv.workloads.synthetic import shared_prefix_requests


def class_lengths(w: WorkloadConfig) -> list[int]:
    """Length of each of the k system prompts."""
    if w.prefix_lens is not None:
        return [int(x) for x in w.prefix_lens]
    return [w.prefix_len] * w.num_prefixes


def multiprefix_requests(w: WorkloadConfig, vocab: int, seed: int) -> list[Request]:
    """B requests over k prefix classes (round-robin), ``suffix_len`` / ``output_len`` each."""
    n = w.batch
    return shared_prefix_requests(class_lengths(w), [w.suffix_len] * n, [w.output_len] * n,
                                  vocab, seed, w.arrival, w.rate, w.burstiness)
