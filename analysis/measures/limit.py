"""Distance to the hardware limit per cell: GEMM floor plus attention roofline, and a trace's breakdown."""
from __future__ import annotations
import bisect
import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, VENDOR_PEAKS, with_derived
from analysis.load import Results
from analysis.measures.gemm import floor_frame
from analysis.measures.steps import cell_steps
from analysis.measures.traces import eager_steps
from granikv.rawio import SchemaError, exists as rawio_exists, read_jsonl



ELT = {"bfloat16": 2, "float16": 2, "float32": 4}


# kernel classes of a trace (attention first: FlashInfer's sm90 kernels carry cutlass types in their names)
# FlashInfer's decode / prefill / merge kernels; torch's fused attention (granikv.attention.sdpa_ops):
# FlashAttention-2's flash_fwd*, cuDNN's *sdpa* / *flash_fprop*
ATTENTION_KERNEL = re.compile(r"Decode|Prefill|MergeState|merge_state|[Aa]ttention|[Cc]ascade|fmha|flash_?attn|"
                              r"flash_fwd|flash_fprop|sdpa", re.ASCII)


GEMM_KERNEL = re.compile(r"gemm|Gemm|GEMM|nvjet|cutlass|cublas|xmma|splitKreduce", re.ASCII)


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def suffix_kv_mean(rows: list[dict]) -> float:
    """Decode-token-weighted mean suffix KV length of a decode step's requests (see the module docstring);
    NaN when no request decodes (every output_len <= 1)."""
    num = den = 0.0
    for r in rows:
        o = int(r["output_len"])
        if o > 1:
            num += (o - 1) * (int(r["prompt_len"]) - int(r["shared_len"]) + o / 2)
            den += o - 1
    return num / den if den else float("nan")


def attention_roofline_ms(lp: float, b: float, s: float, layers: int, hq: int, hkv: int, d: int, tp: int,
                          elt: int, peak_tflops: float, peak_tbps: float) -> tuple[float, str]:
    """(L * max(bytes_kv / BW, flops / PEAK) in ms, 'memory' | 'compute'): the formula of the module docstring."""
    bytes_kv = 2.0 * (lp + b * s) * (hkv / tp) * d * elt
    flops = 4.0 * (hq / tp) * d * b * (lp + s)
    t_mem, t_flop = bytes_kv / (peak_tbps * 1e12), flops / (peak_tflops * 1e12)
    return layers * max(t_mem, t_flop) * 1e3, ("memory" if t_mem >= t_flop else "compute")


def peaks_of(cell: pd.Series, gpu: str | None) -> tuple[float, float] | None:
    """(TFLOP/s, TB/s): the cell's hardware.peak_* when both are set (> 0), else the vendor's for its GPU."""
    pt, pb = (pd.to_numeric(pd.Series([cell.get(f"hardware.peak_{k}")]), errors="coerce").iloc[0]
              for k in ("tflops", "tbps"))
    if np.isfinite(pt) and np.isfinite(pb) and pt > 0 and pb > 0:
        return float(pt), float(pb)
    return VENDOR_PEAKS.get(str(gpu)) if gpu else None


def gemm_floors(res: Results) -> pd.DataFrame:
    """The measured GEMM floors: one row per (model, tp, M, gpu) with ``gemm_floor_ms`` (mean over the
    cells measuring it) and ``n_floor``: the ``step`` rows of analysis.gemm_floor."""
    t = floor_frame(res)
    t = t[t["part"] == "step"].rename(columns={"time_ms": "gemm_floor_ms", "n": "n_floor"})
    return t[["model", "tp", "m", "gpu", "gemm_floor_ms", "n_floor"]].reset_index(drop=True)


def _union_ms(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def trace_breakdown(path: Path) -> dict:
    """The per-step ``prof_*`` values of one torch.profiler trace (see the module docstring), plus
    ``prof_steps`` and ``prof_source``; ``prof_source`` says why when the trace cannot give them."""
    st = Path(path).stat()
    return dict(_trace_breakdown(str(path), st.st_mtime_ns, st.st_size))


@lru_cache(maxsize=64)
def _trace_breakdown(path: str, mtime_ns: int, size: int) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    steps, prefix, gpu = [], [], []
    for e in events:                      # one pass: annotations and GPU activity
        if e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        if cat == "gpu_user_annotation":
            name = str(e.get("name", ""))
            span = (e["ts"], e["ts"] + e.get("dur", 0))
            if name == STEP_ANNOTATION:
                steps.append(span)
            elif name.startswith(PREFIX_ANNOTATION):
                prefix.append(span)
        elif cat in GPU_CATS:
            gpu.append((float(e["ts"]), float(e.get("dur", 0)), cat, str(e.get("name", ""))))
    steps.sort()
    prefix.sort()
    if not gpu:
        return {"prof_source": f"{NOT_MEASURED}: the trace has no GPU kernel events (CPU run)"}
    if not steps:
        return {"prof_source": f"{NOT_MEASURED}: the trace has no `{STEP_ANNOTATION}` GPU annotations"}
    n = len(steps)
    starts = [a for a, _ in steps]
    pstarts = [a for a, _ in prefix]
    sums = {"gemm": 0.0, "attention": 0.0, "prefix": 0.0, "other": 0.0}
    busy = [[] for _ in range(n)]
    klass: dict[str, str] = {}
    for ts, dur, cat, name in gpu:
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts >= steps[i][1]:
            continue            # outside every decode step
        busy[i].append((ts, ts + dur))
        k = klass.get(name) if cat == "kernel" else "other"
        if k is None:
            k = klass[name] = ("attention" if ATTENTION_KERNEL.search(name) else
                               "gemm" if GEMM_KERNEL.search(name) else "other")
        sums[k] += dur
        if k == "attention" and prefix:
            j = bisect.bisect_right(pstarts, ts) - 1
            if j >= 0 and ts < prefix[j][1]:
                sums["prefix"] += dur
    busy_ms = [_union_ms(b) for b in busy]
    if n > 1:
        periods = np.diff(np.asarray(starts)) / 1e3
        gap, period = float(np.mean(periods - np.array(busy_ms[:-1]))), float(np.mean(periods))
    else:
        period = (steps[0][1] - steps[0][0]) / 1e3
        gap = period - busy_ms[0]
    out = {"prof_steps": n, "prof_step_ms": period, "prof_gemm_ms": sums["gemm"] / n / 1e3,
           "prof_attention_ms": sums["attention"] / n / 1e3, "prof_other_ms": sums["other"] / n / 1e3,
           "prof_host_gap_ms": gap, "prof_source": f"torch.profiler, {n} decode steps"}
    if prefix:
        out["prof_prefix_attn_ms"] = sums["prefix"] / n / 1e3
        out["prof_suffix_merge_ms"] = (sums["attention"] - sums["prefix"]) / n / 1e3
    else:
        out["prof_source"] += f" (no `{PREFIX_ANNOTATION}` annotation: prefix / suffix split not measured)"
    return out


# what a trace must share with a row (config, system, Lp, B, workload kind), and, where the row has cells,
# with its cells too (the rest of the workload and the hardware preset)
PROFILE_KEY = ("config", "system", "workload.prefix_len", "workload.batch", "workload.kind")


PROFILE_MATCH = ("workload.num_prefixes", "workload.suffix_len", "workload.output_len", "workload.arrival",
                 "hardware.name")


def _key(c, keys) -> tuple:
    return tuple(None if (v := c.get(k)) is None or (isinstance(v, float) and np.isnan(v)) else
                 (float(v) if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) else str(v))
                 for k in keys)


def profiled(res: Results) -> dict[tuple, list[tuple[tuple, Path, bool]]]:
    """The traces of the profiled serving cells (``profile_steps`` > 0): PROFILE_KEY values ->
    [(PROFILE_MATCH values, trace path, eager)], eager = the cell ran without decode CUDA graphs
    (``hardware.cuda_graph_max_bs`` = 0)."""
    cells = with_derived(res.cells)
    out: dict[tuple, list[tuple[tuple, Path]]] = {}
    if cells.empty or "profile_steps" not in cells.columns:
        return out
    prof = cells[(cells["kind"] == "serving") & (pd.to_numeric(cells["profile_steps"], errors="coerce").fillna(0) > 0)]
    eager = eager_steps(prof)
    for _, r in prof.iterrows():
        p = next((f for f in (Path(res.root) / r["path"] / n for n in ("trace.json.gz", "trace.json")) if f.exists()), None)
        if p is not None:
            out.setdefault(_key(r, PROFILE_KEY), []).append((_key(r, PROFILE_MATCH), p, bool(eager[r.name])))
    return out


def _mean(got: list[dict], keys: list[str]) -> dict:
    return {k: float(np.mean([g[k] for g in got])) for k in keys if got and all(k in g for g in got)}


def breakdown_of(prof: dict, row: dict, cells: pd.DataFrame | None) -> dict:
    """The breakdown of the traces of ``row``'s configuration (where ``cells`` are given, only traces
    whose workload and hardware preset equal theirs), or why there is none; {} without a trace.

    The step as served (period, GEMMs, attention, other, host gap) is the mean over the traces of
    CUDA-graph steps, else over eager ones (said so in ``prof_source``). The prefix / suffix split
    needs eager steps (a replayed graph carries no range): it is the mean over the eager traces that
    mark it, their own kernel times, and ``prof_source`` names them."""
    found = prof.get(_key(row, PROFILE_KEY), [])
    if found and cells is not None and not cells.empty:
        want = {_key(c, PROFILE_MATCH) for _, c in cells.iterrows()}
        found = [f for f in found if f[0] in want]
    if not found:
        return {}
    got = [(trace_breakdown(p), eager) for _, p, eager in found]
    ok = [(g, e) for g, e in got if g["prof_source"].startswith("torch.profiler")]
    if not ok:
        return {"prof_source": got[0][0]["prof_source"]}
    graph = [g for g, e in ok if not e]
    whole = graph or [g for g, _ in ok]
    out = _mean(whole, [k for k in PROF if k not in SPLIT])
    n = sum(g["prof_steps"] for g in whole)
    out["prof_source"] = (f"torch.profiler, {n} decode steps" + ("" if graph else " (eager: no CUDA-graph trace)")
                          + (f" over {len(whole)} traces" if len(whole) > 1 else ""))
    split = [g for g, e in ok if e and all(k in g for k in SPLIT)] or [g for g in whole if all(k in g for k in SPLIT)]
    if split:
        out.update(_mean(split, SPLIT))
        if graph:
            att = np.mean([g["prof_attention_ms"] for g in split])
            out["prof_source"] += (f"; prefix / suffix split from {len(split)} eager-step trace(s), their own "
                                   f"kernel times (attention there {att:.3f} ms per step)")
    else:
        out["prof_source"] += f" (no `{PREFIX_ANNOTATION}` annotation: prefix / suffix split not measured)"
    return out


def _workload_rows(path: Path, shared_len: int) -> list[dict]:
    """The cell's measured requests (workload.jsonl, else requests.jsonl without warm-up rows); a row
    without ``shared_len`` (runners.engine_bench's requests) shares the cell's one prefix of Lp tokens."""
    for name in ("workload.jsonl", "requests.jsonl"):
        if rawio_exists(path / name):
            rows = [{"shared_len": shared_len, **r} for r in read_jsonl(path / name) if not r.get("warmup")]
            for i, r in enumerate(rows, 1):
                for k in ("prompt_len", "output_len"):
                    if k not in r:
                        raise SchemaError(f"{path / name}:{i}: `{k}` is missing (rerun the cell with the current runner)")
            return rows
    raise SchemaError(f"{path / 'workload.jsonl'}: `<file>` is missing (a serving cell records its workload)")


def cell_row(res: Results, c: pd.Series, floors: pd.DataFrame) -> dict:
    """One serving cell's step time, limit and breakdown (NaN / None where not measured)."""
    path = Path(res.root) / c["path"]
    b, lp, tp = int(c["workload.batch"]), float(c["workload.prefix_len"]), int(c["tp"])
    gpu = c.get("provenance.gpu_name")
    gpu = str(gpu) if isinstance(gpu, str) and gpu else None
    out = {"step_ms": cell_steps(path, b)["decode_full_p50_ms"], "gpu": gpu or "cpu",
           "suffix_kv_mean": suffix_kv_mean(_workload_rows(path, int(lp))), "why": None}
    pk = peaks_of(c, gpu)
    s = out["suffix_kv_mean"]
    if pk is not None and np.isfinite(s):
        out["attn_roofline_ms"], out["attn_bound"] = attention_roofline_ms(
            lp, b, s, int(c["model.num_layers"]), int(c["model.num_heads"]), int(c["model.num_kv_heads"]),
            int(c["model.head_dim"]), tp, ELT.get(str(c.get("hardware.dtype")), 2), *pk)
    elif pk is None:
        out["why"] = f"no peak TFLOP/s / TB/s for {gpu or 'a CPU run'} (VENDOR_PEAKS, hardware.peak_*)"
    f = floors[(floors["model"] == c["model.name"]) & (floors["tp"] == tp) & (floors["m"] == b)
               & (floors["gpu"] == gpu)] if gpu else floors.iloc[0:0]
    if not f.empty:
        out["gemm_floor_ms"] = float(f["gemm_floor_ms"].iloc[0])
    elif out["why"] is None:
        out["why"] = (f"no gemm_floor cell {c['model.name']}-tp{tp}-m{b} on {gpu or 'a GPU'} "
                      f"({floor_cmd(c.get('hardware.name'))})")
    return out


SPLIT = ["prof_prefix_attn_ms", "prof_suffix_merge_ms"]


PROF = ["prof_step_ms", "prof_gemm_ms", "prof_attention_ms", "prof_prefix_attn_ms", "prof_suffix_merge_ms",
        "prof_other_ms", "prof_host_gap_ms"]


def floor_cmd(hardware: object) -> str:
    """The command measuring the GEMM floor on the GPU a cell ran on: its own hardware option (each GPU model's
    floors in a folder of their own, conf/kernel_bench_gemm_floor.yaml)."""
    hw = hardware if isinstance(hardware, str) and hardware else "<the cell's hardware option>"
    return f"python -m runners.kernel_bench_gemm_floor hardware={hw}"


FLOOR_CMD = floor_cmd(None)


STEP_ANNOTATION, PREFIX_ANNOTATION = "decode_step", "prefix_attention"
