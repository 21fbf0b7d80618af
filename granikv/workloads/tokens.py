"""Random token ids for shared prefixes and per-request suffixes (weights are random too).

Every generator takes a ``numpy.random.Generator``; the workload builders derive separate
streams for prefixes, suffixes, lengths and arrivals from the run seed, so changing e.g. the
arrival rate does not change the token ids.
"""
from __future__ import annotations

import numpy as np


def streams(seed: int) -> dict[str, np.random.Generator]:
    """Independent seeded generators by purpose."""
    names = ("prefix", "suffix", "lengths", "arrival")
    return {n: np.random.default_rng([int(seed), i]) for i, n in enumerate(names)}


def distinct_first_tokens(k: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """``k`` distinct token ids (first tokens of k distinct prefixes: no two share a token)."""
    if k > vocab:
        raise ValueError(f"config error at `workload.num_prefixes`: {k} prefixes need distinct "
                         f"first tokens but the vocabulary has only {vocab}")
    return rng.choice(vocab, size=k, replace=False).tolist()


def prefix_ids(length: int, first: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """A prefix of ``length`` ids in [0, vocab) starting with ``first``."""
    if length <= 0:
        return []
    return [int(first)] + rng.integers(0, vocab, size=length - 1).tolist()


def suffix_ids(lengths: list[int], vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """One random suffix per request. First tokens are distinct across requests while the
    vocabulary allows, so the prefix index matches exactly the shared prefix and no more."""
    n = len(lengths)
    firsts = rng.choice(vocab, size=n, replace=n > vocab)
    return [([int(f)] + rng.integers(0, vocab, size=L - 1).tolist()) if L > 0 else []
            for f, L in zip(firsts, lengths)]
