"""Arrival processes: burst, Poisson at rate r, gamma with burstiness (vLLM's benchmark rule).

vLLM ``benchmark_serving``: the first request is sent at t=0 and each next one after an
inter-arrival gap drawn from Gamma(shape=burstiness, scale=1/(rate*burstiness)), so the mean
rate is ``rate`` for every burstiness; burstiness=1 is a Poisson process, < 1 is burstier,
> 1 is more regular. ``rate = inf`` sends everything at t=0 (a burst).
"""
from __future__ import annotations

import math

import numpy as np

ARRIVALS = ("burst", "poisson", "gamma")


def arrival_times(n: int, kind: str, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """``n`` non-decreasing arrival times in seconds, the first at 0.0."""
    if n < 0:
        raise ValueError(f"config error at `workload.num_requests`: must be >= 0, got {n}")
    if kind not in ARRIVALS:
        raise ValueError(f"config error at `workload.arrival`: '{kind}' not in {ARRIVALS}")
    if not rate > 0:
        raise ValueError(f"config error at `workload.rate`: must be > 0, got {rate} "
                         "(use workload.arrival=burst for all-at-once)")
    if not burstiness > 0:
        raise ValueError(f"config error at `workload.burstiness`: must be > 0, got {burstiness}")
    if n == 0:
        return []
    if kind == "burst" or math.isinf(rate):
        return [0.0] * n
    shape = 1.0 if kind == "poisson" else float(burstiness)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)  # mean 1/rate
    return [0.0] + np.cumsum(gaps).tolist()
