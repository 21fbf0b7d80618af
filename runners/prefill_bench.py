"""Where a prefill step's time goes: the engine's eager prefill of one request of n new tokens.

    python -m runners.prefill_bench --model qwen25_14b --hardware h200 --out results/raw/prefill_host
    torchrun --nproc_per_node=2 -m runners.prefill_bench --model qwen25_14b --hardware h200 ...   # TP = world size

``--model`` and ``--hardware`` name options of conf/; the cell is conf/config.yaml composed by Hydra
with them, ``system=sglang_default`` and the hardware flags (``hardware.kv_budget_tokens``,
``hardware.allreduce``).

The headline's prefill steps (ShareGPT suffixes, 16-2,000 new tokens) run eagerly, as SGLang's
extend batches do. This bench times them in isolation, for each ``n`` in ``--tokens`` (one request,
no cached prefix; ``--reps`` timed runs after ``--warmup`` untimed ones, ranks aligned before each):

- ``step_ms``: ``ModelRunner.prefill`` as the engine calls it (plan, forward, first token to the host);
- ``launch_ms``: the model forward alone until the call returns, the GPU not awaited (host launch
  time; on CPU the work itself);
- ``forward_ms``: the same forward followed by a device synchronize;
- ``allreduce_launch_us`` / ``allreduce_ms``: the forward's all-reduces alone (``2 * num_layers + 1``
  calls on a ``[n, hidden]`` tensor, as DecoderLayer and the vocab-parallel embedding issue them):
  host time per call, and the whole sequence with a synchronize (0 calls at TP=1);
- with ``--allreduce symm_one_shot`` (``hardware.allreduce``): the one-shot result's max abs
  difference from NCCL's on the same tensor, whether the step's first token is the same, and
  (``symm_decode_check``) a small burst served both ways, decode in CUDA graphs: identical outputs?

Medians over the reps. ``launch_ms`` close to ``forward_ms`` means the step is bound by the host.
``host_profile`` (``--profile-tokens``): per rank, one forward under torch.profiler (CPU only), the
ops that take the host's time (``analysis/prefill_host.py`` writes them to tables/prefill_host_ops).
Rank 0 writes ``<out>/<model>_tp<k>/prefill_host.json`` (rows, args, config, provenance): not a
cell folder (the serving analysis skips it); ``analysis/prefill_host.py`` tabulates it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from granikv import rawio
from granikv.engine.engine import Engine
from granikv.engine.runner import _WriteThen
from granikv.engine.scheduler import PrefillChunk, Seq
from granikv.request import Request
from runners.engine_bench import cell_config, init_tp

FILE = "prefill_host.json"


def _align(engine: Engine) -> None:
    """Drain this rank's GPU work, then meet the other ranks (on the host), so each timed run starts together."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    if engine.tp.size > 1:
        dist.all_reduce(torch.zeros(1, device=engine.tp.host_device))


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def time_tokens(engine: Engine, n: int, reps: int, warmup: int, seed: int) -> dict:
    """One row: the timings of a prefill of ``n`` new tokens (see the module doc)."""
    m = engine.cfg.model
    if n + 1 > engine.kv.capacity_tokens - engine.kv.hot_tokens:
        raise ValueError(f"--tokens: {n} tokens do not fit the KV budget's "
                         f"{engine.kv.capacity_tokens - engine.kv.hot_tokens} COLD slots; lower it")
    rng = random.Random(seed + n)
    req = Request(0, [rng.randrange(m.vocab_size) for _ in range(n)], output_len=1)
    seq = Seq(req, 0)
    seq.slots = engine.kv.cold_pool.alloc(n)            # [n] slot ids on the device
    seq.row = 0
    chunk = PrefillChunk(seq, 0, n)
    dev = engine.device
    ids = torch.tensor(req.prompt_ids, dtype=torch.int64, device=dev)  # [n]
    pos = torch.arange(n, device=dev)                                  # [n]
    x = torch.randn(n, m.hidden_size, device=dev, dtype=engine.dtype)  # [n, H], an all-reduce operand
    calls = (2 * m.num_layers + 1) if engine.tp.size > 1 else 0
    check = _symm_check(engine, x, ids, pos, chunk)
    step, launch, fwd, ar_launch, ar = [], [], [], [], []
    with torch.inference_mode():
        for r in range(warmup + reps):
            keep = r >= warmup
            _align(engine)
            t = time.perf_counter()
            engine.runner.prefill([chunk])
            if keep:
                step.append(time.perf_counter() - t)
            # the forward alone, planned as the step plans it
            engine.prefill_attn.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                                     seq.slots)
            hook = _WriteThen(engine.kv, seq.slots, engine.prefill_attn)
            _align(engine)
            t = time.perf_counter()
            engine.model(ids, pos, hook)
            t1 = time.perf_counter()
            _sync(engine)
            t2 = time.perf_counter()
            if keep:
                launch.append(t1 - t)
                fwd.append(t2 - t)
            if calls:
                _align(engine)
                t = time.perf_counter()
                for _ in range(calls):
                    engine.tp.all_reduce(x)
                t1 = time.perf_counter()
                _sync(engine)
                t2 = time.perf_counter()
                if keep:
                    ar_launch.append((t1 - t) / calls)
                    ar.append(t2 - t)
    engine.kv.cold_pool.free(seq.slots)
    return {"tokens": n, "reps": reps, "step_ms": _median_ms(step), "launch_ms": _median_ms(launch),
            "forward_ms": _median_ms(fwd), "allreduce_calls": calls,
            "allreduce_launch_us": _median_ms(ar_launch) * 1e3 if ar_launch else 0.0,
            "allreduce_ms": _median_ms(ar) if ar else 0.0,
            "step_ms_all": [s * 1e3 for s in step], **check}


def host_profile(engine: Engine, n: int, seed: int, top: int = 15) -> dict:
    """Where the host's time goes in one prefill forward of ``n`` new tokens on this rank:
    torch.profiler (CPU activity only) around the forward after one untimed run; ``top`` ops by
    self CPU time, and the forward's wall time under the profiler (which adds its own overhead)."""
    from torch.profiler import ProfilerActivity, profile

    m = engine.cfg.model
    rng = random.Random(seed + 7 * n)
    ids = torch.tensor([rng.randrange(m.vocab_size) for _ in range(n)], dtype=torch.int64, device=engine.device)
    pos = torch.arange(n, device=engine.device)
    slots = engine.kv.cold_pool.alloc(n)                       # [n]
    try:
        with torch.inference_mode():
            engine.prefill_attn.plan(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), slots)
            hook = _WriteThen(engine.kv, slots, engine.prefill_attn)
            engine.model(ids, pos, hook)
            _align(engine)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                engine.model(ids, pos, hook)
                wall = time.perf_counter() - t
            _sync(engine)
    finally:
        engine.kv.cold_pool.free(slots)
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ev)
    return {"tokens": n, "rank": engine.tp.rank, "wall_ms": wall * 1e3, "self_cpu_ms_total": total / 1e3,
            "top": [{"name": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3}
                    for e in ev[:top]]}


def _gather(engine: Engine, obj: dict) -> list[dict]:
    """Every rank's ``obj`` on every rank (a host collective; [obj] at TP=1)."""
    if engine.tp.size == 1:
        return [obj]
    got: list = [None] * engine.tp.size
    dist.all_gather_object(got, obj)
    return got


def _symm_check(engine: Engine, x: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, chunk: PrefillChunk) -> dict:
    """With the one-shot all-reduce on: its result against NCCL's on the same ``x [n, H]`` (max abs
    difference), and whether the prefill step's first token is the same both ways. Empty otherwise."""
    tp = engine.tp
    if getattr(tp, "_symm_buf", None) is None:
        return {}
    with torch.inference_mode():
        a = tp.all_reduce(x.clone())
        saved, tp._symm_buf = tp._symm_buf, None          # this call only: the NCCL path
        try:
            b = tp.all_reduce(x.clone())
            tok_nccl = engine.runner.prefill([chunk])
        finally:
            tp._symm_buf = saved
        tok_symm = engine.runner.prefill([chunk])
    return {"symm_vs_nccl_max_abs_diff": float((a.float() - b.float()).abs().max()),
            "symm_vs_nccl_same_token": tok_symm == tok_nccl}


def decode_check(engine: Engine, seed: int, batch: int = 8, prompt: int = 64, out: int = 8) -> dict:
    """With the one-shot all-reduce on: serve one small burst (``batch`` requests, ``prompt`` tokens,
    ``out`` output tokens; decode in CUDA graphs on the GPU) with it and again with NCCL (graphs
    recaptured for each), and compare the output tokens. Empty without the one-shot path."""
    tp = engine.tp
    if getattr(tp, "_symm_buf", None) is None:
        return {}
    rng = random.Random(seed)
    vocab = engine.cfg.model.vocab_size
    reqs = [Request(i, [rng.randrange(vocab) for _ in range(prompt)], out) for i in range(batch)]
    engine.runner.drop_graphs()
    symm = [r.output_ids for r in engine.run(reqs).records]
    saved, tp._symm_buf = tp._symm_buf, None
    try:
        engine.runner.drop_graphs()
        nccl = [r.output_ids for r in engine.run(reqs).records]
    finally:
        tp._symm_buf = saved
        engine.runner.drop_graphs()
    same = [a == b for a, b in zip(symm, nccl)]
    first = [next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(symm, nccl)]
    return {"requests": batch, "output_len": out, "requests_identical": sum(same),
            "first_difference_min": min(first)}


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--kv-budget-tokens", type=int, default=None, help="hardware.kv_budget_tokens override")
    ap.add_argument("--tokens", default="16,128,512,2048", help="comma-separated new-token counts")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allreduce", default="nccl", help="hardware.allreduce: nccl | symm_one_shot (CUDA, TP > 1)")
    ap.add_argument("--profile-tokens", type=int, default=16,
                    help="new tokens of the one forward profiled per rank (host ops by self CPU time); 0 = none")
    ap.add_argument("--out", default="results/raw/prefill_host")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError as e:
        raise SystemExit(f"--tokens {args.tokens!r}: give whole numbers separated by commas ({e})") from e
    if not tokens or min(tokens) < 1:
        raise SystemExit(f"--tokens {args.tokens!r}: give at least one count >= 1")
    if args.reps < 1 or args.warmup < 0:
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    hw_flags = [f"hardware.allreduce={args.allreduce}"] + (
        [f"hardware.kv_budget_tokens={args.kv_budget_tokens}"] if args.kv_budget_tokens is not None else [])
    cfg = cell_config(args.model, args.hardware, "sglang_default", [*hw_flags, f"seed={args.seed}",
                                                                     "sweep_name=prefill_host"])
    model, hw = cfg.model, cfg.hardware
    tp = init_tp(cfg)
    prov = rawio.provenance()
    engine = Engine(cfg)
    rows = []
    for n in tokens:
        rows.append(time_tokens(engine, n, args.reps, args.warmup, args.seed))
        r = rows[-1]
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[prefill_bench] {model.name} TP={tp} n={n}: step {r['step_ms']:.2f} ms, launch "
                  f"{r['launch_ms']:.2f} ms, forward {r['forward_ms']:.2f} ms, all-reduce "
                  f"{r['allreduce_calls']} x {r['allreduce_launch_us']:.1f} us launch, {r['allreduce_ms']:.2f} ms", flush=True)
    profiles = []
    if args.profile_tokens > 0:
        try:
            profiles = _gather(engine, host_profile(engine, args.profile_tokens, args.seed))
        except Exception as e:  # noqa: BLE001 - the timed rows are kept; the failed profile is recorded
            profiles = [{"error": f"{type(e).__name__}: {e}", "rank": engine.tp.rank}]
    try:
        checked = decode_check(engine, args.seed)
    except Exception as e:  # noqa: BLE001 - the timed rows above are kept; the failed check is recorded
        checked = {"error": f"{type(e).__name__}: {e}"}
    if checked and int(os.environ.get("RANK", "0")) == 0:
        print(f"[prefill_bench] one-shot vs NCCL, decode burst: {checked}", flush=True)
    out = Path(args.out) / (f"{model.name}_tp{tp}" + ("" if hw.allreduce == "nccl" else f"_{hw.allreduce}"))
    if int(os.environ.get("RANK", "0")) == 0:
        rawio.write_json(out / FILE, {"rows": rows, "symm_decode_check": checked, "host_profile": profiles,
                                      "bench": vars(args),
                                      "config": dataclasses.asdict(cfg),
                                      "fused_ops": engine.fused_ops, "provenance": prov})
    return out


if __name__ == "__main__":
    from runners.run import finish_tp_process
    main()
    finish_tp_process()
