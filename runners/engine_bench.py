"""End-to-end engine benchmark: one synthetic burst served by each system, plus numerics vs sglang_default.

    python -m runners.engine_bench --model llama3_8b --hardware h200 --prefix-len 8192 --batch 256 \\
        --output-len 128 --out results/raw/engine_bench
    torchrun --nproc_per_node=2 -m runners.engine_bench --model qwen25_14b ...   # TP = world size

``--model``, ``--hardware`` and each of ``--systems`` name options of conf/ (``conf/model/<name>.yaml``, ...):
each system's cell is conf/config.yaml composed by Hydra with them, the hardware flags
(``hardware.kv_budget_tokens``, ``hardware.cuda_graph_max_bs``) and the bench's synthetic burst as
``workload.*``; the systems are those our engine serves (``system.engine=granikv``).

For each system: a warm-up pass of the same workload (FlashInfer JIT, CUDA-graph capture, and a
logit probe of the first decode steps), a measured pass (TTFT / TPOT / ITL / E2E, throughput,
dispatch trace), and a short profiled pass (torch.profiler) from which the share of each decode
step spent outside GPU kernels is read. Then each system's tokens (measured pass) and probed
logits are compared with sglang_default's. Writes one serving cell per system
(``<out>/<system>/{config,metrics}.json, requests.jsonl.gz, steps.jsonl.gz``) and ``<out>/summary.json``.
Used until runners/run.py drives the engine; the metric definitions are DESIGN.md's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from granikv import metrics as metrics_mod
from granikv import rawio
from granikv.config import RunConfig, check_option, run_config
from granikv.engine.engine import Engine
from granikv.engine.runner import LogitProbe
from granikv.request import Request
from runners.run import _engine_stats
from runners.run import init_tp as init_process_group


def cell_config(model: str, hardware: str, system: str, overrides: list[str]) -> RunConfig:
    """The RunConfig of a bench cell: conf/ composed by Hydra (``model=``, ``hardware=``, ``system=``
    and ``overrides``, e.g. ``hardware.kv_budget_tokens=2048``), with TP = the torchrun world size.
    A flag that names no option fails here, naming the flag."""
    for flag, group, name in (("--model", "model", model), ("--hardware", "hardware", hardware),
                              ("--systems", "system", system)):
        check_option(group, name, flag)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    return run_config([f"model={model}", f"hardware={hardware}", f"system={system}", f"tp={tp}", *overrides])


def burst(seed: int, vocab: int, prefix_len: int, batch: int, suffix_len: int, output_len: int) -> list[Request]:
    """One shared prefix of ``prefix_len`` tokens, ``batch`` unique suffixes, all arriving at t=0."""
    rng = random.Random(seed)
    pre = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [Request(i, pre + [rng.randrange(vocab) for _ in range(suffix_len)], output_len, 0.0,
                    shared_len=prefix_len, prefix_class=0 if prefix_len else -1) for i in range(batch)]


def serving_metrics(res) -> dict:
    """metrics.json of a cell, as runners.run writes it: engine stats, then granikv.metrics.summarize
    (DESIGN.md's definitions), plus the median decode step time."""
    m = {**_engine_stats(res.stats), **metrics_mod.summarize(res.records, res.steps, res.stats)}
    dec = [s["step_time_s"] for s in res.steps if s["kind"] == "decode"]
    m["decode_step_p50_ms"] = float(np.median(dec) * 1e3) if dec else None
    return m


def _busy(kern: list[tuple[float, float]], a: float, b: float) -> tuple[float, int]:
    """Union length of kernel intervals clipped to [a, b], and how many kernels overlap it."""
    busy, n, cur_s, cur_e = 0.0, 0, None, None
    for s, e in kern:
        s, e = max(s, a), min(e, b)
        if e <= s:
            continue
        n += 1
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, n


def outside_kernel_share(trace_path: str) -> dict:
    """Share of decode time with no GPU kernel running, from a torch.profiler chrome trace.

    ``loop``: each decode step's window runs from its start to the next step's start, so the
    scheduler and bookkeeping between forwards count (the headline number); ``forward``: the
    ``decode_step`` annotation alone (plan + forward + sampling sync).
    """
    with open(trace_path) as f:
        ev = json.load(f).get("traceEvents", [])
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation"
                   and e.get("name") in ("decode_step", "prefill_step") and "dur" in e)
    kern = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "kernel" and "dur" in e)
    dec = [(i, m) for i, m in enumerate(marks) if m[2] == "decode_step"]
    if not dec or not kern:
        return {"measured": False, "reason": f"trace has {len(dec)} decode_step annotations and {len(kern)} kernels"}
    loop, fwd, n_in = [], [], 0
    for i, (a, b, _) in dec:
        end = marks[i + 1][0] if i + 1 < len(marks) else b
        busy, n = _busy(kern, a, end)
        n_in += n
        loop.append(1.0 - busy / (end - a))
        busy, _ = _busy(kern, a, b)
        fwd.append(1.0 - busy / (b - a))
    if n_in == 0:
        return {"measured": False, "reason": f"no GPU kernel inside {len(dec)} decode steps "
                                             "(graph-launched kernels not recorded by this profiler?)"}
    return {"measured": True, "decode_steps": len(loop), "kernels_in_decode_steps": n_in,
            "outside_kernel_share_mean": float(np.mean(loop)), "outside_kernel_share_p50": float(np.median(loop)),
            "forward_outside_kernel_share_mean": float(np.mean(fwd)),
            "step_us_p50": float(np.median([b - a for _, (a, b, _) in dec]))}


def agreement(base: dict, other: dict) -> dict:
    """Token agreement and max |logit diff| (on steps whose token history agrees) vs the baseline."""
    same = total = ident = 0
    first_div = []
    for ra, rb in zip(base["records"], other["records"]):
        a, b = ra.output_ids, rb.output_ids
        total += len(a)
        same += sum(x == y for x, y in zip(a, b))
        ident += a == b
        first_div.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    outs = {r.rid: r.output_ids for r in base["records"]}
    outs_b = {r.rid: r.output_ids for r in other["records"]}
    diffs = [float((lb - base["logits"][key]).abs().max()) for key, lb in other["logits"].items()
             if key in base["logits"] and outs[key[0]][:key[1]] == outs_b[key[0]][:key[1]]]
    return {"token_agreement": same / total, "identical_requests": ident / len(first_div),
            "first_divergence_mean": float(np.mean(first_div)),
            "max_logit_diff": max(diffs) if diffs else None, "logit_positions_compared": len(diffs)}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def say(msg: str) -> None:
    if _rank() == 0:
        print(msg, flush=True)


def init_tp(cfg: RunConfig) -> int:
    """Joins the process group of ``cfg.tp`` ranks (the torchrun world size) through runners.run.init_tp
    (nccl on GPU, gloo on CPU); returns the TP size."""
    init_process_group(cfg)
    return cfg.tp


def clear_cell(cell: Path) -> None:
    """Before a cell runs (rank 0): drop the done / failed markers of an earlier run, so a failure
    never leaves an old metrics.json (read as done) and a success never an old failure.json."""
    if _rank() == 0:
        for stale in ("metrics.json", "failure.json"):
            (cell / stale).unlink(missing_ok=True)


def bench_overrides(args) -> list[str]:
    """The bench's flags as overrides of conf/: its hardware limits, and the workload it serves
    (burst(): one shared prefix, B requests, recorded in each cell's config.json)."""
    hw = [f"hardware.{k}={v}" for k, v in (("kv_budget_tokens", args.kv_budget_tokens),
                                            ("cuda_graph_max_bs", args.cuda_graph_max_bs)) if v is not None]
    return [*hw, "workload=synthetic", "workload.arrival=burst", f"workload.prefix_len={args.prefix_len}",
            f"workload.batch={args.batch}", f"workload.suffix_len={args.suffix_len}",
            f"workload.output_len={args.output_len}", f"seed={args.seed}", "sweep_name=engine_bench"]


def bench_system(name: str, args, out: Path, prov: dict) -> dict:
    """Warm-up, measured and profiled passes of one system; ``prov``: provenance taken before the run."""
    cfg = cell_config(args.model, args.hardware, name, bench_overrides(args))
    model = cfg.model
    t = time.perf_counter()
    engine = Engine(cfg)
    build_s = time.perf_counter() - t
    reqs = burst(args.seed, model.vocab_size, args.prefix_len, args.batch, args.suffix_len, args.output_len)
    say(f"[{name}] built in {build_s:.1f}s; kv budget {engine.kv.capacity_tokens} tokens")
    engine.runner.logit_probe = LogitProbe(rows=args.probe_rows, steps=args.probe_steps)
    t = time.perf_counter()
    warm = engine.run(reqs)  # warm-up: JIT, graph capture, logit probe
    engine.runner.logit_probe, probe = None, engine.runner.logit_probe
    say(f"[{name}] warm-up pass {time.perf_counter() - t:.1f}s")
    res = engine.run(reqs)
    metrics = serving_metrics(res)
    metrics["build_s"] = build_s
    say(f"[{name}] TPOT p50 {metrics['tpot_p50_ms']:.2f} ms, output {metrics['output_throughput_tok_s']:.0f} tok/s, "
          f"dispatch {metrics['dispatch_counts']}, graphs {metrics['cuda_graph_sizes_captured']}")
    prof = {"measured": False, "reason": "--profile-output-len 0"}
    if args.profile_output_len > 0:
        preqs = burst(args.seed, model.vocab_size, args.prefix_len, args.batch, args.suffix_len, args.profile_output_len)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                        if engine.device.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as p:
            engine.run(preqs)
        with tempfile.TemporaryDirectory() as d:  # every rank parses its own trace; rank 0's is written
            path = os.path.join(d, "trace.json")
            p.export_chrome_trace(path)
            prof = outside_kernel_share(path)
    metrics["profile"] = prof
    kept = {"records": res.records, "logits": probe.kept, "warm_records": warm.records}
    if _rank() == 0:
        write_cell(out / name, cfg, args, res, metrics, prov)
    del engine, warm, res
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"metrics": metrics, **kept}


def write_cell(cell: Path, cfg: RunConfig, args, res, metrics: dict, prov: dict) -> None:
    """The cell's files, metrics.json last (its presence marks the cell done)."""
    conf = {"config": dataclasses.asdict(cfg), "bench": vars(args), "provenance": prov}
    rawio.write_json(cell / "config.json", conf)
    rawio.write_jsonl(cell / "requests.jsonl", [
        {"rid": r.rid, "arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": len(r.output_ids),
         "first_token_s": r.first_token_s, "finish_s": r.finish_s, "cached_len": r.cached_len,
         "prefix_class": r.prefix_class, "prefix_where": r.prefix_where, "output_ids": r.output_ids,
         "token_times_s": r.token_times_s} for r in res.records], compress=True)
    rawio.write_jsonl(cell / "steps.jsonl", res.steps, compress=True)
    rawio.write_json(cell / "metrics.json", metrics)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3_8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--systems", default="sglang_default,sglang_cascade,hydragen,granikv")
    ap.add_argument("--prefix-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile-output-len", type=int, default=12, help="decode steps of the profiled pass (0 = skip)")
    ap.add_argument("--probe-rows", type=int, default=8)
    ap.add_argument("--probe-steps", type=int, default=16)
    ap.add_argument("--kv-budget-tokens", type=int, default=None)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="override (0 = no CUDA graphs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/raw/engine_bench")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:   # unknown names, and systems served by a real SGLang server, fail before any work
        if cell_config(args.model, args.hardware, s, bench_overrides(args)).system.engine != "granikv":
            raise ValueError(f"--systems: '{s}' runs a real SGLang server (system.engine=sglang); this bench "
                             f"serves with our engine: use python -m runners.run system={s}")
    if "sglang_default" not in systems:
        raise ValueError("--systems must include sglang_default (the numerics baseline)")
    base = cell_config(args.model, args.hardware, "sglang_default", bench_overrides(args))
    hw = base.hardware
    args.tp = init_tp(base)
    out = Path(args.out)
    if hw.device == "cuda" and not hw.decision_table:
        say("NOTE: hardware has no decision_table: granikv dispatches by the paper's rule (Meff >= 1024 -> dense)")
    got, failed = {}, {}
    run_prov = rawio.provenance()  # started_at = the start of the bench, not its end
    for s in systems:
        clear_cell(out / s)
        prov = rawio.provenance()  # this cell's start
        try:
            got[s] = bench_system(s, args, out, prov)
        except Exception as e:  # noqa: BLE001 - one system's failure must not lose the others
            import traceback

            failed[s] = f"{type(e).__name__}: {e}"
            print(f"[{s}] rank {_rank()} FAILED: {failed[s]}", flush=True)
            if _rank() == 0:
                rawio.write_json(out / s / "failure.json", {"error": failed[s], "traceback": traceback.format_exc(),
                                                           "bench": vars(args), "provenance": prov})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    base = got.get("sglang_default")
    summary = {"provenance": run_prov, "bench": vars(args), "failed": failed,
               "decision_table": bool(hw.decision_table), "systems": {}}
    for s, g in got.items():
        m = g["metrics"]
        summary["systems"][s] = {
            "tpot_p50_ms": m["tpot_p50_ms"], "output_throughput_tok_s": m["output_throughput_tok_s"],
            "ttft_p50_ms": m["ttft_p50_ms"], "decode_step_p50_ms": m["decode_step_p50_ms"],
            "outside_kernel_share": m["profile"].get("outside_kernel_share_mean"), "profile": m["profile"],
            "dispatch_counts": m["dispatch_counts"], "cuda_graph_sizes_captured": m["cuda_graph_sizes_captured"],
            "eager_decode_reasons": m["eager_decode_reasons"],
            "vs_sglang_default": agreement(base, g) if base else None,
            "warmup_vs_measured_token_agreement": agreement({"records": g["warm_records"], "logits": {}},
                                                            {"records": g["records"], "logits": {}})["token_agreement"]}
    if _rank() == 0:
        rawio.write_json(out / "summary.json", summary)
    say(json.dumps({s: {k: v for k, v in d.items() if k != "profile"} for s, d in summary["systems"].items()},
                   indent=1, default=str))
    say(f"wrote {out}" + (f"; FAILED: {sorted(failed)}" if failed else ""))
    if failed:
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    from runners.run import finish_tp_process
    main(sys.argv[1:])
    finish_tp_process()
