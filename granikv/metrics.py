"""Serving metrics with the vLLM / SGLang benchmark definitions (DESIGN.md "Metrics").

Per request (times from the engine's streaming per-token clock):
  TTFT = first output token time - arrival
  E2E  = last output token time - arrival
  TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with > 1 output token
  ITL  = every gap between consecutive output tokens, pooled over requests
Per cell: duration = last finish - first arrival; output throughput = output tokens /
duration; total throughput = (input + output tokens) / duration; request throughput =
requests / duration. Warm-up records are excluded. Statistics are mean, p50, p90, p99
(``numpy.percentile``, linear interpolation, as vLLM). A statistic with no sample (no
requests; TPOT when every output is one token; a zero duration) is ``None``, never 0.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import numpy as np

from granikv.request import RequestRecord

STATS = ("mean", "p50", "p90", "p99")


def _stats(name: str, xs_s: list[float]) -> dict[str, Optional[float]]:
    """{name_mean_ms, name_p50_ms, ...} from samples in seconds."""
    if not xs_s:
        return {f"{name}_{s}_ms": None for s in STATS}
    a = np.asarray(xs_s, dtype=np.float64) * 1e3
    return {f"{name}_mean_ms": float(a.mean()),
            **{f"{name}_p{q}_ms": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def per_request(r: RequestRecord) -> dict[str, Optional[float]]:
    """TTFT, TPOT, E2E (seconds) of one served request; TPOT None with one output token."""
    if not r.token_times_s:
        raise ValueError(f"request {r.rid}: no output token times recorded")
    ttft = r.first_token_s - r.arrival_s
    e2e = r.finish_s - r.arrival_s
    n = len(r.token_times_s)
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else None}


def dispatch_counts(steps: Iterable[dict]) -> dict[str, int]:
    """How many (step, prefix class) decisions went to each backend: a step's ``decisions``
    (list of dicts with ``backend`` or ``choice``, the engine's form), ``backends`` (per-class
    dict or list) or ``backend`` (one string) is counted."""
    c: Counter = Counter()
    for s in steps:
        if "decisions" in s:
            c.update(str(d.get("backend", d.get("choice", "?"))) for d in s["decisions"])
            continue
        b = s.get("backends", s.get("backend"))
        if isinstance(b, dict):
            c.update(str(v) for v in b.values())
        elif isinstance(b, (list, tuple)):
            c.update(str(v) for v in b)
        elif b is not None:
            c[str(b)] += 1
    return dict(sorted(c.items()))


def summarize(records: list[RequestRecord], steps: Iterable[dict] = (), stats: Optional[dict] = None) -> dict:
    """The metrics.json summary of a cell (key names: granikv.rawio.SERVING_METRICS).

    ``stats``: the engine's run stats; the engine serves warm-up requests in a pass of their own and
    returns no record of them, so ``num_warmup_requests`` comes from ``stats["warmup"]["requests"]``
    when given (plus any records flagged ``warmup``)."""
    recs = [r for r in records if not r.warmup]
    n_warm = len(records) - len(recs) + int(((stats or {}).get("warmup") or {}).get("requests", 0))
    per = [per_request(r) for r in recs]
    n_in = sum(r.prompt_len for r in recs)
    n_out = sum(len(r.token_times_s) for r in recs)
    duration = (max(r.finish_s for r in recs) - min(r.arrival_s for r in recs)) if recs else None
    rate = (lambda x: x / duration) if duration else (lambda x: None)
    itl = [b - a for r in recs for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    out = {
        "num_requests": len(recs),
        "num_warmup_requests": n_warm,
        "num_input_tokens": n_in,
        "num_output_tokens": n_out,
        "duration_s": duration,
        "output_throughput_tok_s": rate(n_out),
        "total_throughput_tok_s": rate(n_in + n_out),
        "request_throughput_req_s": rate(len(recs)),
    }
    out |= _stats("ttft", [p["ttft_s"] for p in per])
    out |= _stats("tpot", [p["tpot_s"] for p in per if p["tpot_s"] is not None])
    out |= _stats("itl", itl)
    out |= _stats("e2e", [p["e2e_s"] for p in per])
    out["dispatch_counts"] = dispatch_counts(steps)
    return out
