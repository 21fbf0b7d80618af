"""GPU check of the GraniKV SGLang plugin: one served batch, the plugin's decode against SGLang's own.

    python -m runners.plugin_check --out DIR [--system sglang_server_granikv] [--prefix-len 4096]
           [--batch 32] [--steps 4] [--fast-start none|ref|both] [--together] [override ...]

Two servers of the same cell config, one after the other: the reference ``system=sglang_server``
(SGLang's FlashInfer backend, its default full decode CUDA graphs) and the plugin system (its
attention backend, the same full decode graphs unless the system's extra arguments ask for breakable ones). Each gets the same traffic: one
request that caches the shared prefix, then ``batch`` requests sharing it, all at once, greedy,
``steps + 1`` output tokens, asking SGLang for the log-probabilities of a fixed set of 64 token ids
at every output position (``token_ids_logprob``).

Per request and decode step (output positions 1..steps, computed by decode; position 0 comes from
prefill), while both servers' outputs so far agree, the relative logit error is
``max |d - mean(d)| / max |r - mean(r)|`` with ``r`` the reference's log-probs over the 64 ids
and ``d`` the difference (log-probs are logits minus a per-step constant, removed by the means).
Pass: every compared step below 0.05 (the engine GPU tests' tolerance), at least one step compared
per request, and the plugin's own counters (``GRANIKV_STATS_FILE``) show the expected path:
for ``granikv``, dense classes and no ``full_graph_replay``; under full decode graphs, split steps
replayed from them (``graph_steps``). Writes ``DIR/plugin_check.json`` (with
the provenance every raw result carries, and each server's start and serve seconds); exit code 0 on
pass, 1 on a failed check, 2 when it could not run.

``--fast-start ref`` (or ``both``) skips SGLang's prefill CUDA-graph capture
(``--cuda-graph-backend-prefill disabled``) on the reference server (or on both): prefill is
SGLang's FlashInfer path in both, and the check is about decode. With ``none`` or ``ref`` the
plugin server is the one a sweep of the same cell config starts, and ``GRANIKV_SGLANG_KEEP=1``
leaves it running for the next command to adopt.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

TOL = 0.05
N_IDS = 64


def compose(overrides: list[str]):
    """The cell's RunConfig (conf/ composed with ``overrides``), B as the concurrency cap (runners.run.resolve)."""
    from granikv.config import run_config
    from runners.run import resolve

    return resolve(run_config(overrides))


def traffic(prefix_len: int, batch: int, vocab: int, seed: int = 0) -> tuple[list[int], list[list[int]], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab - 10) for _ in range(prefix_len)]
    suffixes = [[rng.randrange(10, vocab - 10) for _ in range(16)] for _ in range(batch + 1)]
    ids = sorted(rng.sample(range(10, vocab - 10), N_IDS))
    return prefix, suffixes, ids


async def serve(url: str, prompts: list[list[int]], prefix_len: int, out_len: int, ids: list[int],
                together: bool = False) -> list[dict]:
    import aiohttp

    async def one(session, p):
        body = {"input_ids": p, "return_logprob": True, "token_ids_logprob": ids,
                "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0.0,
                                    "custom_params": {"granikv_prefix_len": prefix_len}}}
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"POST /generate: HTTP {r.status}: {(await r.text())[:300]}")
            return await r.json()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        if together:      # the batch arrives while the first request's (chunked) prefill runs
            return list(await asyncio.gather(*(one(s, p) for p in prompts)))[1:]
        await one(s, prompts[0])                                   # caches the shared prefix
        return list(await asyncio.gather(*(one(s, p) for p in prompts[1:])))


def position_logprobs(resp: dict, ids: list[int]) -> list[list[float]]:
    """Per output position, the log-probs of ``ids`` (in that order) from SGLang's meta_info."""
    rows = resp["meta_info"].get("output_token_ids_logprobs") or []
    out = []
    for pos in rows:
        by_id = {int(e[1]): float(e[0]) for e in pos}
        out.append([by_id[i] for i in ids])
    return out


def compare(ref: list[dict], got: list[dict], ids: list[int], steps: int) -> dict:
    import torch

    per_req, worst = [], 0.0
    for a, b in zip(ref, got):
        ta, tb = a["output_ids"], b["output_ids"]
        la, lb = position_logprobs(a, ids), position_logprobs(b, ids)
        errs = []
        for pos in range(1, min(steps + 1, len(la), len(lb))):
            if ta[:pos] != tb[:pos]:          # the contexts differ from here on: nothing to compare
                break
            r, g = torch.tensor(la[pos], dtype=torch.float64), torch.tensor(lb[pos], dtype=torch.float64)
            d = g - r
            scale = (r - r.mean()).abs().max().item()
            errs.append((d - d.mean()).abs().max().item() / max(scale, 1e-12))
        worst = max([worst, *errs])
        per_req.append({"compared_steps": len(errs), "rel_err": errs, "same_tokens": ta == tb})
    return {"worst_rel_err": worst, "requests": per_req,
            "requests_with_no_step": sum(1 for r in per_req if r["compared_steps"] == 0),
            "requests_same_tokens": sum(1 for r in per_req if r["same_tokens"])}


def run_one(rc, fast_start: bool, prompts, prefix_len, out_len, ids, stop: bool,
            together: bool = False) -> tuple[list[dict], dict, dict]:
    from granikv.serving import server as srvmod
    from granikv.serving.session import server_packages

    spec = srvmod.server_spec(rc)
    if fast_start:
        spec = replace(spec, argv=(*spec.argv, "--cuda-graph-backend-prefill", "disabled"))
    stats_path = dict(spec.env).get("GRANIKV_STATS_FILE")
    if stats_path:
        Path(stats_path).unlink(missing_ok=True)
    pool = srvmod.POOL
    t0 = time.monotonic()
    srv = pool.acquire(spec)
    print(f"plugin_check: {rc.system.name} server {'adopted' if srv.adopted else 'started'}, ready after "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    info = {"argv": list(spec.argv), "env": dict(spec.env), "start_s": srv.started_s, "adopted": srv.adopted,
            "packages": server_packages(spec)}   # SGLang's, FlashInfer's, torch's versions as the server imports them
    try:
        t1 = time.monotonic()
        out = asyncio.run(serve(srv.url, prompts, prefix_len, out_len, ids, together))
        info["serve_s"] = time.monotonic() - t1   # a cold JIT build of a path's kernels lands here
        print(f"plugin_check: {rc.system.name} served {len(prompts)} requests in {info['serve_s']:.0f} s", flush=True)
        stats = None
        if stats_path:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not Path(stats_path).exists():
                time.sleep(0.5)
            time.sleep(2.5)                    # past the write interval, then one step: every step is counted
            asyncio.run(step_once(srv.url))
            time.sleep(0.5)
            stats = json.loads(Path(stats_path).read_text()) if Path(stats_path).exists() else None
        info["log_tail"] = srv.log_tail()[-20:]
        return out, stats, info
    finally:
        if stop:
            pool.close(keep=False)


async def step_once(url: str) -> None:
    """One short request (a prefill and one decode step). The plugin writes its counters at a step, at most
    every 2 s: a step after that interval makes the file hold every step served before it."""
    import aiohttp

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(url + "/generate", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"POST /generate: HTTP {r.status}: {(await r.text())[:300]}")
            await r.read()


class Interrupted(Exception):
    """SIGTERM (a time limit's ``timeout``) arrived before the check finished."""


def _on_sigterm(signum, frame):
    raise Interrupted("interrupted by SIGTERM before the check finished (a time limit? a cold server start "
                      "takes minutes)")


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)   # so the servers it started are stopped and the report written
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--system", default="sglang_server_granikv")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fast-start", choices=("none", "ref", "both"), default="none")
    ap.add_argument("--together", action="store_true",
                    help="send the first request with the batch: with --prefix-len over one prefill chunk "
                         "(hardware.chunked_prefill_size) requests arrive mid-prefill and share its chunks, "
                         "which checks the plugin's promotion of a chunked prefix into one slab")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of both servers' cell, e.g. hardware=h200")
    a = ap.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = ["sweep=headline", *a.overrides]
    report: dict = {"system": a.system, "prefix_len": a.prefix_len, "batch": a.batch, "steps": a.steps,
                    "fast_start": a.fast_start, "together": a.together, "tolerance": TOL,
                    "overrides": list(a.overrides)}
    from granikv.rawio import provenance

    report["provenance"] = provenance(cuda_probe=False)   # no CUDA context here: the servers own the GPU
    try:
        ref_rc = compose([*base, "system=sglang_server"])
        rc = compose([*base, f"system={a.system}"])
        prefix, suffixes, ids = traffic(a.prefix_len, a.batch, rc.model.vocab_size)
        prompts = [prefix + s for s in suffixes]
        ref, _, ref_info = run_one(ref_rc, a.fast_start != "none", prompts, a.prefix_len, a.steps + 1, ids, stop=True,
                                   together=a.together)
        import os
        keep = os.environ.get("GRANIKV_SGLANG_KEEP") == "1"
        got, stats, info = run_one(rc, a.fast_start == "both", prompts, a.prefix_len, a.steps + 1, ids, stop=not keep,
                                   together=a.together)
    except Exception as e:  # a server that would not start, a failed request: the check was not made
        report.update(status="not_run", error=f"{type(e).__name__}: {e}")
        details = getattr(e, "details", None)
        if callable(details):
            report["details"] = details()
        (out_dir / "plugin_check.json").write_text(json.dumps(report, indent=1, default=str))
        print(f"plugin_check: NOT RUN: {report['error']}", file=sys.stderr)
        return 2
    cmp = compare(ref, got, ids, a.steps)
    backend = rc.system.server.attention_backend
    want = {"granikv": "dense", "granikv_cascade": "cascade", "hydragen": "hydragen"}[backend]
    problems = []
    if cmp["worst_rel_err"] >= TOL:
        problems.append(f"decode log-probs differ from SGLang's FlashInfer by {cmp['worst_rel_err']:.4f} (>= {TOL})")
    if cmp["requests_with_no_step"]:
        problems.append(f"{cmp['requests_with_no_step']} requests had no comparable decode step")
    if stats is None:
        problems.append("the plugin server wrote no path counters (GRANIKV_STATS_FILE)")
    else:
        if not stats["classes"].get(want):
            problems.append(f"no prefix class took the {want} path (classes by path: {stats['classes']})")
        if stats["paged_steps"].get("full_graph_replay"):
            problems.append(f"{stats['paged_steps']['full_graph_replay']} steps were full-graph replays (paged)")
        breakable = "breakable" in rc.system.server.extra_args
        if not breakable and not stats.get("graph_steps"):
            problems.append("no split step replayed from a full decode CUDA graph (graph_steps = 0)")
    report.update(status="pass" if not problems else "fail", problems=problems, comparison=cmp,
                  path_stats=stats, reference_server=ref_info, plugin_server=info)
    (out_dir / "plugin_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"plugin_check {a.system}: {report['status'].upper()}: worst rel err {cmp['worst_rel_err']:.4f}, "
          f"{cmp['requests_same_tokens']}/{a.batch} requests with identical tokens; "
          f"paths {None if stats is None else stats['classes']}; {'; '.join(problems)}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
