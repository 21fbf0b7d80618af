"""Synthetic shared-prefix workload: B requests = shared prefix of Lp tokens + unique suffix.

The building block ``shared_prefix_requests`` also serves multi-prefix (k classes, requests
assigned round-robin) and ShareGPT (per-request suffix and output lengths).
"""
from __future__ import annotations

from granikv.config import WorkloadConfig
from granikv.request import Request
from granikv.workloads.arrivals import arrival_times
from granikv.workloads.tokens import distinct_first_tokens, prefix_ids, streams, suffix_ids


def shared_prefix_requests(class_lens: list[int], suffix_lens: list[int], output_lens: list[int],
                           vocab: int, seed: int, arrival: str, rate: float,
                           burstiness: float) -> list[Request]:
    """Request i carries prefix class i % k (k = len(class_lens)), then its own suffix.

    class_lens[c]: tokens of shared prefix c (0 = no shared prefix: prefix_class -1);
    suffix_lens[i], output_lens[i]: per request (all lists of length n).
    """
    n, k = len(suffix_lens), len(class_lens)
    rng = streams(seed)
    firsts = distinct_first_tokens(k, vocab, rng["prefix"])
    prefixes = [prefix_ids(L, f, vocab, rng["prefix"]) for L, f in zip(class_lens, firsts)]
    suffixes = suffix_ids(suffix_lens, vocab, rng["suffix"])
    arrivals = arrival_times(n, arrival, rate, burstiness, rng["arrival"])
    out = []
    for i in range(n):
        c = i % k
        p = prefixes[c]
        out.append(Request(rid=i, prompt_ids=p + suffixes[i], output_len=int(output_lens[i]),
                           arrival_s=float(arrivals[i]), shared_len=len(p),
                           prefix_class=c if p else -1))
    return out


def synthetic_requests(w: WorkloadConfig, vocab: int, seed: int) -> list[Request]:
    """B requests sharing one prefix of ``prefix_len`` tokens, ``suffix_len`` unique tokens
    each, exactly ``output_len`` output tokens; arrivals per ``w.arrival``."""
    n = w.batch
    return shared_prefix_requests([w.prefix_len], [w.suffix_len] * n, [w.output_len] * n,
                                  vocab, seed, w.arrival, w.rate, w.burstiness)
