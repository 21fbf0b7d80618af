"""Storage-layer microbenchmark (CPU): COLD alloc+free per decode step, prefix match, HOT alloc/free.

    python -m runners.kv_bench [--out FILE.json] [--repeats N]

Targets (issue 2, on a 2-core CPU): COLD alloc+free of 256 single-token requests per decode
step < 50 us; match over a 16K-token prefix < 1 ms. Prints a table; --out also saves the
numbers with provenance.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from granikv.kv import ColdPool, HotPool, KVCache, PrefixIndex
from granikv.rawio import provenance, write_json


def _time_us(fn, repeats: int) -> dict:
    for _ in range(min(50, repeats)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    return {"median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (len(samples) - 1))],
            "min_us": samples[0], "repeats": repeats}


def bench_cold(repeats: int, capacity: int = 1_000_000, batch: int = 256) -> dict:
    pool = ColdPool(capacity)
    pool.alloc(capacity // 2)  # a half-full pool, as under load

    def step():  # one decode step: one new slot for each of `batch` requests, then give them back
        ids = pool.alloc(batch)
        pool.free(ids)
    out = {"batched_alloc_free": _time_us(step, repeats)}

    def per_request():  # the same, one alloc(1) call per request (how a naive engine would do it)
        got = [pool.alloc(1) for _ in range(batch)]
        pool.free(torch.cat(got))
    out["per_request_alloc_free"] = _time_us(per_request, max(20, repeats // 20))
    return out


def bench_match(repeats: int, prefix_len: int = 16384) -> dict:
    kv = KVCache(1, 4 * prefix_len, 1, 1, hot_fraction=0.5)
    idx = PrefixIndex(kv.hot_pool, kv.cold_pool)
    rng = random.Random(0)
    prefix = [rng.randrange(128_000) for _ in range(prefix_len)]
    slab = kv.hot_pool.alloc(prefix_len)
    idx.insert(prefix, torch.arange(slab.start, slab.end), slab=slab)
    for j in range(64):  # 64 cached requests hanging off the prefix
        suffix = [rng.randrange(128_000) for _ in range(32)]
        idx.insert(prefix + suffix, torch.cat((torch.arange(slab.start, slab.end), kv.cold_pool.alloc(32))))
    query = prefix + [rng.randrange(128_000) for _ in range(64)]
    res = _time_us(lambda: idx.match(query), repeats)
    res["matched"] = idx.match(query).length
    return res


def bench_hot(repeats: int) -> dict:
    pool = HotPool(1 << 20)
    rng = random.Random(0)
    live = [pool.alloc(rng.choice((512, 2048, 8192))) for _ in range(40)]  # fragmented by frees
    for s in live[::2]:
        pool.free(s)

    def cycle():
        s = pool.alloc(4096)
        pool.free(s)
    return _time_us(cycle, repeats)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default=None, help="also save the numbers (JSON, with provenance)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"cold": bench_cold(args.repeats), "match_16k": bench_match(max(50, args.repeats // 10)),
           "hot_alloc_free": bench_hot(args.repeats), "torch_threads": 1}
    rows = [("COLD alloc+free, 256 requests/step (one batched call)", res["cold"]["batched_alloc_free"], 50.0),
            ("COLD alloc+free, 256 requests/step (256 alloc(1) calls)", res["cold"]["per_request_alloc_free"], None),
            (f"match, 16K-token prefix (+64 tokens, {res['match_16k']['matched']} matched)", res["match_16k"], 1000.0),
            ("HOT alloc(4096)+free, fragmented pool", res["hot_alloc_free"], None)]
    print(f"{'benchmark':62s} {'median us':>10s} {'p90 us':>10s} {'target us':>10s}")
    for name, r, target in rows:
        verdict = "" if target is None else ("  ok" if r["median_us"] < target else "  MISSED")
        print(f"{name:62s} {r['median_us']:10.1f} {r['p90_us']:10.1f} {target or '-':>10}{verdict}")
    if args.out:
        write_json(args.out, {"provenance": provenance(), "results": res})
        print(f"saved {args.out}")
    return res


if __name__ == "__main__":
    main()
