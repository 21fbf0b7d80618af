"""Distance to the hardware limit (issue 29): each system's full-batch decode step at the headline and
synthetic-grid cells as a multiple of the step's limit on its GPU, and where it goes (profiler).

Per row (table headline | grid, config, Lp, B, system, GPU; repetitions averaged):

- ``step_ms``: the measured full-batch decode step, ``decode_full_p50_ms`` of
  ``analysis.headline_steps.cell_steps`` (p50 of the decode steps with batch >= 90% of B, steps.jsonl;
  uninstrumented cells only).
- ``gemm_floor_ms``: the GEMM floor of that step, measured by ``python -m runners.kernel_bench_gemm_floor``
  (cells ``<model>-tp<tp>-m<M>``, row ``backend=step``: every weight GEMM of one decode step of one TP
  shard, QKV + O + gate/up + down per layer x layers + LM head, as one CUDA graph), at M = B, for the
  row's model, TP degree and GPU (``provenance.gpu_name`` equal). CPU cells (``cell.device=cpu``) and
  eager timings (``graph`` false) are never used. Where no such cell exists the entry says
  ``not measured``: no number is estimated in its place.
- ``attn_roofline_ms``: the attention limit of the best possible system at that Lp and B, per TP rank::

      bytes_kv  = 2 * (Lp + B * s) * (Hkv / tp) * D * e     K and V: the shared prefix once, plus every
                                                            request's own suffix KV, once
      flops     = 4 * (Hq / tp) * D * B * (Lp + s)          QK^T and PV over each request's whole context
      attn_roofline_ms = L * max(bytes_kv / BW, flops / PEAK) * 1e3

  with L layers, Hq / Hkv / D the model's query heads, KV heads and head dim, e the KV element size
  (2 bytes for bf16), and ``s`` the mean suffix KV length of a decode step's requests, weighted by
  decode tokens: ``s = sum_r (o_r - 1) * (p_r - Lp_r + o_r / 2) / sum_r (o_r - 1)`` over the cell's
  requests (workload.jsonl: prompt length p_r, shared prefix length Lp_r, output length o_r; the
  decode step that produces token j of a request reads p_r + j - 1 KV rows, j = 2..o_r). PEAK and BW
  are the cell's ``hardware.peak_tflops`` / ``peak_tbps`` when set (> 0), else the GPU vendor's
  datasheet values in ``VENDOR_PEAKS`` (H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e).
  ``attn_bound`` says which of the two terms is larger. It is a model of the hardware, not a
  measurement; Q / O traffic and the all-reduce of TP > 1 are not in it.
- ``limit_ms = gemm_floor_ms + attn_roofline_ms`` and ``multiple = step_ms / limit_ms`` (1 = at the limit).
  The limit is taken at the configured B, while the p50 full-batch step may hold 0.9 B..B requests:
  the limit of a smaller batch is no larger, so the multiple is never overstated.

Breakdown (``prof_*``, ms per decode step), from a torch.profiler trace of the same configuration:
the analysis expects ``<cell>/trace.json.gz`` (or ``trace.json``) of a serving cell run with
``profile_steps > 0`` (e.g. ``python -m runners.run sweep=profiler workload.prefix_len=16384``), whose
steps are marked by ``decode_step`` GPU annotations (``gpu_user_annotation``, as the engine writes
them). Kernels inside the steps are summed per class: ``prof_gemm_ms`` (cuBLAS / nvjet / CUTLASS GEMMs),
``prof_attention_ms`` (FlashInfer decode / prefill / merge kernels: prefix + suffix + merge),
``prof_prefix_attn_ms`` and ``prof_suffix_merge_ms`` (the attention kernels inside / outside
``prefix_attention*`` annotations; ``not measured`` when the trace has none: kernel names alone do not
tell a prefix from a suffix. The engine's FlashInfer path marks each prefix call it launches eagerly
(granikv.attention.gpu_paths.prefix_mark); a replayed CUDA graph carries no range inside it, so the
split needs a trace of eager steps: ``hardware.cuda_graph_max_bs=0``), ``prof_other_ms`` (norms, RoPE, activation, sampling, copies), and
``prof_host_gap_ms`` = the step period (start to start of consecutive steps) minus the time some
kernel ran (GPU idle: the host's share). Profiled cells are instrumented runs of their own; their
breakdown stands beside the uninstrumented step time, it is not subtracted from it. A configuration
without such a trace says ``not measured``.

Writes tables/distance_to_limit.{csv,md} and figures/distance_to_limit.{png,pdf} (multiple vs Lp, headline).
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from functools import lru_cache
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import grid as grid_mod
from analysis import headline as headline_mod
from analysis.common import (GRID_B, LPS, NOT_MEASURED, PAPER_CONFIG_LABELS, placeholder_figure, select, sort_rows,
                             with_derived, write_table)
from analysis.headline_steps import cell_steps
from analysis.load import Results, SchemaError
from analysis.profiler import eager_steps
from granikv.config import SYSTEMS
from granikv.rawio import exists as rawio_exists
from granikv.rawio import read_jsonl

NAME = "distance_to_limit"
FIGURES = (NAME,)
# GPU vendor datasheet peaks (dense, no sparsity), used where the cell's hardware preset leaves
# peak_tflops / peak_tbps unset (0.0). Not measurements.
#   NVIDIA H200 SXM (H200 datasheet): 989 TFLOP/s BF16 dense tensor core (1,979 with sparsity), 4.8 TB/s HBM3e.
#   NVIDIA A100 SXM4 40GB (A100 datasheet): 312 TFLOP/s BF16 dense tensor core, 1,555 GB/s HBM2.
H200_PEAK_TFLOPS, H200_PEAK_TBPS = 989.0, 4.8
A100_40GB_PEAK_TFLOPS, A100_40GB_PEAK_TBPS = 312.0, 1.555
VENDOR_PEAKS = {"NVIDIA H200": (H200_PEAK_TFLOPS, H200_PEAK_TBPS),
                "NVIDIA A100-SXM4-40GB": (A100_40GB_PEAK_TFLOPS, A100_40GB_PEAK_TBPS)}
ELT = {"bfloat16": 2, "float16": 2, "float32": 4}
# the two grids of rows: (table, sweep folder prefix, selection, workload kind, expected Lp, expected B): the headline sweeps
# (headline_<model>_tp<tp>) and the synthetic grid (synthetic_grid_<model>_tp<tp>); other sweeps whose
# cells match the selection (sharegpt_matrix, limitation, dispatch_trace, runners.engine_bench, ...) are
# not these tables' cells
SOURCES = (("headline", "headline_", headline_mod.SELECT, "sharegpt", LPS, (256,)),
           ("grid", "synthetic_grid_", grid_mod.SELECT, "synthetic", LPS, GRID_B))
# sweep: cells of two sweep folders (another runner, e.g. runners.engine_bench, or a rerun) are never pooled
KEYS = ["table", "config", "workload.prefix_len", "workload.batch", "system", "gpu", "sweep"]
VALUES = ["step_ms", "suffix_kv_mean", "gemm_floor_ms", "attn_roofline_ms", "attn_bound", "limit_ms", "multiple"]
SPLIT = ["prof_prefix_attn_ms", "prof_suffix_merge_ms"]
PROF = ["prof_step_ms", "prof_gemm_ms", "prof_attention_ms", "prof_prefix_attn_ms", "prof_suffix_merge_ms",
        "prof_other_ms", "prof_host_gap_ms"]
DIGITS = {"step_ms": 2, "suffix_kv_mean": 1, "gemm_floor_ms": 3, "attn_roofline_ms": 3, "limit_ms": 3, "multiple": 2,
          **{c: 3 for c in PROF}}
FLOOR_CMD = "python -m runners.kernel_bench_gemm_floor hardware=h200"
# kernel classes of a trace (attention first: FlashInfer's sm90 kernels carry cutlass types in their names)
# FlashInfer's decode / prefill / merge kernels; torch's fused attention (granikv.attention.sdpa_ops):
# FlashAttention-2's flash_fwd*, cuDNN's *sdpa* / *flash_fprop*
ATTENTION_KERNEL = re.compile(r"Decode|Prefill|MergeState|merge_state|[Aa]ttention|[Cc]ascade|fmha|flash_?attn|"
                              r"flash_fwd|flash_fprop|sdpa", re.ASCII)
GEMM_KERNEL = re.compile(r"gemm|Gemm|GEMM|nvjet|cutlass|cublas|xmma|splitKreduce", re.ASCII)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_ANNOTATION, PREFIX_ANNOTATION = "decode_step", "prefix_attention"


# ---- the limit ----------------------------------------------------------------------------------------

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
    from analysis.gemm_floor import frame as floor_frame
    t = floor_frame(res)
    t = t[t["part"] == "step"].rename(columns={"time_ms": "gemm_floor_ms", "n": "n_floor"})
    return t[["model", "tp", "m", "gpu", "gemm_floor_ms", "n_floor"]].reset_index(drop=True)


# ---- the profiler breakdown -----------------------------------------------------------------------------

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


# ---- the table ------------------------------------------------------------------------------------------

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
        out["why"] = f"no gemm_floor cell {c['model.name']}-tp{tp}-m{b} on {gpu or 'a GPU'} ({FLOOR_CMD})"
    return out


def frame(res: Results) -> pd.DataFrame:
    """Every expected row of both grids (plus measured rows outside them), numbers as floats (NaN where
    not measured) and ``status``."""
    floors, prof = gemm_floors(res), profiled(res)
    rows, seen = [], set()
    base = with_derived(res.cells)
    for table, sweep, sel, kind, lps, bs in SOURCES:
        cells = select(base, {**sel, "instrumented": "=False", "kind": "=serving"}) if not base.empty else base
        if not cells.empty:
            cells = cells[cells["system"].isin(SYSTEMS) & cells["sweep"].astype(str).str.startswith(sweep)]
        per = [{"table": table, "sweep": c["sweep"], "config": c["config"], "workload.prefix_len": int(c["workload.prefix_len"]),
                "workload.batch": int(c["workload.batch"]), "system": c["system"], "workload.kind": kind,
                **cell_row(res, c, floors)} for _, c in cells.iterrows()]
        if per:
            d = pd.DataFrame(per)
            for col in VALUES:
                if col not in d.columns:
                    d[col] = np.nan
            g = d.groupby(KEYS, sort=True, dropna=False)
            agg = g[["step_ms", "suffix_kv_mean", "gemm_floor_ms", "attn_roofline_ms"]].mean()
            agg["n"] = g.size()
            agg["attn_bound"] = g["attn_bound"].agg(lambda v: ",".join(sorted({x for x in v if isinstance(x, str)})))
            agg["why"] = g["why"].agg(lambda v: next((x for x in v if isinstance(x, str)), None))
            agg = agg.reset_index()
            agg["limit_ms"] = agg["gemm_floor_ms"] + agg["attn_roofline_ms"]
            agg["multiple"] = agg["step_ms"] / agg["limit_ms"]
            for r in agg.to_dict("records"):
                r["status"] = "measured" if np.isfinite(r["multiple"]) else \
                    f"{NOT_MEASURED}: {r['why'] or 'no full-batch decode step'}"
                mine = cells[(cells["sweep"] == r["sweep"]) & (cells["config"] == r["config"])
                             & (cells["system"] == r["system"]) & (cells["workload.prefix_len"] == r["workload.prefix_len"])
                             & (cells["workload.batch"] == r["workload.batch"])]
                r.update(breakdown_of(prof, {**r, "workload.kind": kind}, mine))
                rows.append(r)
                seen.add((table, r["config"], r["workload.prefix_len"], r["workload.batch"], r["system"]))
        for cfg, lp, b, s in product(PAPER_CONFIG_LABELS, lps, bs, SYSTEMS):
            if (table, cfg, lp, b, s) not in seen:
                r = {"table": table, "config": cfg, "workload.prefix_len": lp, "workload.batch": b, "system": s,
                     "n": 0, "status": NOT_MEASURED}
                r.update(breakdown_of(prof, {**r, "workload.kind": kind}, None))
                rows.append(r)
    cols = KEYS + ["n"] + VALUES + PROF + ["prof_source", "status"]
    return sort_rows(pd.DataFrame(rows, columns=cols), KEYS)


def shown(t: pd.DataFrame) -> pd.DataFrame:
    """The table as written: every missing value of a measured or derived column says ``not measured``."""
    out = t.copy()
    for col in VALUES + PROF + ["prof_source"]:
        out[col] = out[col].astype(object).where(out[col].notna() & (out[col] != ""), NOT_MEASURED)
    out["gpu"] = out["gpu"].astype(object).where(out["gpu"].notna(), "")
    return out.rename(columns={"workload.prefix_len": "Lp", "workload.batch": "B"})


NOTE = ("step_ms: p50 full-batch decode step (batch >= 90% of B, steps.jsonl; repetitions averaged). "
        "multiple = step_ms / limit_ms, limit_ms = gemm_floor_ms + attn_roofline_ms. gemm_floor_ms: every weight GEMM "
        "of one decode step of one TP shard (QKV, O, gate+up, down x layers + LM head) at M = B, one CUDA graph, "
        f"measured on the row's GPU ({FLOOR_CMD}; 'not measured' until those cells exist). attn_roofline_ms = "
        "L x max(bytes_kv / BW, flops / PEAK) per TP rank, bytes_kv = 2 (K,V) x (Lp + B x s) x Hkv/tp x D x 2 B "
        "(the shared prefix read once plus every request's own suffix), flops = 4 x Hq/tp x D x B x (Lp + s), "
        "s = suffix_kv_mean (decode-token-weighted mean suffix KV length of the cell's requests); PEAK / BW: "
        "hardware.peak_* when set, else the vendor's datasheet (H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s); "
        "all-reduce and Q/O traffic not included. prof_*: ms per decode step from a torch.profiler trace of the "
        "same configuration (an instrumented run; prefix/suffix split only where the trace marks prefix_attention), "
        "prof_host_gap_ms: step period minus GPU busy time.")


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/distance_to_limit.{csv,md} (and the figure unless ``figures`` is False); return the table."""
    t = frame(res)
    text = shown(t)
    # every column given a precision: write_table's integer check per value is slow on wide tables
    digits = {**{c: 0 for c in text.columns}, **DIGITS}
    write_table(text, NAME, out, digits, title="Distance to the hardware limit: full-batch decode step / "
                "(GEMM floor + attention roofline)", note=NOTE)
    if not figures:
        return text
    m = t[(t["table"] == "headline") & (t["status"] == "measured")]
    if m.empty:
        placeholder_figure(NAME, out, "no headline cell with a measured GEMM floor (gemm_floor cells not measured)")
        return text
    from analysis.plots import gpu_names, lines_vs
    lines_vs(m.assign(multiple=m["multiple"].astype(float)), NAME, out, "workload.prefix_len", ["config"],
             value="multiple", ylabel="decode step / (GEMM floor + attention roofline)", hline=1.0,
             gpu=gpu_names(select(res.cells, headline_mod.SELECT)),
             title="Headline (B=256): full-batch decode step over its hardware limit")
    return text


def _span(v: pd.Series) -> str:
    lo, hi = f"{v.min():.2f}", f"{v.max():.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


def lines(t: pd.DataFrame) -> list[str]:
    """The REPORT's lines on the rows with a profiler breakdown: step, limit and where the step goes."""
    if t.empty:
        return []
    m = t[(t["status"] == "measured") & t["prof_gemm_ms"].notna()]
    if m.empty:
        return [f"- Profiler breakdown: {NOT_MEASURED} (no torch.profiler trace matches a measured row)."]
    L = ["Full-batch decode step over its limit (GEMM floor + attention roofline), and where a profiled step of "
         "the same configuration goes, ms per step (tables/distance_to_limit.md; prefix / suffix split from "
         "eager-step traces where present):", "",
         "| config | Lp | B | system | step | limit | multiple | GEMMs | attention | prefix attn | suffix + merge | other | host gap |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, nd=2):
        return NOT_MEASURED if pd.isna(v) else f"{v:.{nd}f}"
    for _, r in m.iterrows():
        L.append(f"| {r['config']} | {int(r['workload.prefix_len'])} | {int(r['workload.batch'])} | {r['system']} | "
                 f"{f(r['step_ms'])} | {f(r['limit_ms'])} | {f(r['multiple'])} | {f(r['prof_gemm_ms'])} | {f(r['prof_attention_ms'])} | "
                 f"{f(r['prof_prefix_attn_ms'])} | {f(r['prof_suffix_merge_ms'])} | {f(r['prof_other_ms'])} | "
                 f"{f(r['prof_host_gap_ms'])} |")
    under = m[m["prof_gemm_ms"] < m["gemm_floor_ms"]]
    if not under.empty:
        L += ["", f"In {len(under)} of these rows the GEMM kernels of a profiled step take less time than the GEMM floor "
                  f"timed alone ({_span(under['prof_gemm_ms'])} ms against {_span(under['gemm_floor_ms'])} ms): "
                  "there the floor is not a "
                  "lower bound, and the multiple understates the distance to the hardware."]
    return L
