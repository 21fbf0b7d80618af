"""Attention-layer microbenchmark: ``python -m runners.kernel_bench [hardware=h200] [overrides]``.

One attention layer of a model's shape per TP rank, over shape x Lp x B x k (prefix classes) x
backend. One folder per cell ``<results_dir>/<sweep_name>/<cell_id>/`` (granikv.rawio schema,
kind ``kernel``): ``config.json`` (resolved config, cell, measured peaks, provenance),
``kernel.jsonl`` (one row per backend / variant), ``metrics.json`` (the cell summary).

kernel.jsonl row (decode cells ``<shape>-lp<Lp>-b<B>-k<k>``):
  backend, time_ms (median; CUDA-graph replay on GPU when capturable, else eager), time_ms_mean,
  time_ms_min, time_ms_eager, graph (bool), graph_error, plan_ms (host wall time of the first plan(),
  wrapper set built), plan_us_eager / plan_us_graph (steady-state host time of one step's plan on the
  eager / graph-mode wrapper set: median over ``plan_reps``, granikv.attention.bench.plan_host_time;
  with ``profile_plan`` = n > 0 also plan_profile_eager / _graph, its n costliest functions; with
  ``plan_busy_ms`` > 0 also plan_us_busy_eager / _graph, planned while the GPU is busy that long, as in
  the engine's overlap schedule: a plan that waits for the device shows there), flops, bytes, tflops, tbps, tflops_frac_peak, tbps_frac_peak, max_abs_err, decisions; with
  ``profile_kernels=true`` also kernels (each kernel of one eager call: name, us_per_call,
  launches_per_call; torch.profiler, granikv.attention.bench.kernel_profile) and kernels_us_per_call
  (their sum: the GPU busy time of a call); layout rows too.
Variant dense_unsplit: the dense backend as one plain single-prefill call (before the KV chunks).
Variants dense_s<n> (n = 1, 2, 4 ... 64): the dense backend over exactly n interleaved KV chunks
  (opt-in: backends=[dense,dense_s1,dense_s2,...] searches the chunk count the SM-filling rule picks).
Variants dense_cudnn, dense_fa2 (and _s<n>): the dense backend with its prefix call on torch's fused
  attention (cuDNN, FlashAttention-2; GQA-packed, granikv.attention.sdpa_ops) instead of FlashInfer's
  single prefill (opt-in; on CPU the same reference path as dense).
Variant cascade_composed: the batch-global cascade (SGLang-Cascade) on the per-class cascade path
  (FlashInfer batch prefill over the common prefix + tensor-core decode + merge) instead of
  FlashInfer's MultiLevelCascadeAttentionWrapper (variant cascade); opt-in (not in the default list).
metrics.json: time_ms_<backend>, fastest_backend, fastest_time_ms, dispatch_choice (granikv's
  per-class decisions), granikv_vs_fastest (time ratio), dispatch_within_3pct, peaks.
Layout cells ``layout-<shape>-lp<Lp>-b<B>``: variant contiguous_dense (one non-causal attention of
  all B queries over the HOT slab view; contiguous_dense_split: the same as the dense backend runs
  it, over interleaved KV chunks, GPU only) vs paged_unique_prefill / paged_unique_decode (each request
  its own prefix copy, page size 1); metrics: speedup_vs_paged_unique_*; with ``ncu=true`` on a GPU,
  dram_pct / sm_pct of each variant's longest kernel from Nsight Compute, and every kernel of the
  call (name, time_us, dram_pct, sm_pct; first shape, largest layout Lp only, to bound the time;
  ncu_error when it could not run, e.g. no counters on a gVisor host).
Dispatch-cost cell ``dispatch_cost``: host microseconds per step for Dispatcher.choose over k
  classes and for a whole DecodeAttention.plan() with the granikv policy (CPU tensors).
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
import timeit
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from granikv import rawio
from granikv.attention import reference as R
from granikv.attention.bench import (Shape, attention_flops, build_cell, capture_graph, kernel_profile, kv_bytes,
                                    measure_peaks, plan_host_time, sync, time_fn)
from granikv.attention.decode import make_backend
from granikv.attention.dispatch import Dispatcher, check_table
from granikv.config import DENSE_KERNELS, HardwareConfig

VARIANTS = ("paged", "cascade", "cascade_composed", "hydragen", "dense", "dense_unsplit", "granikv_cascade", "granikv")
CLASS_ROWS = ("round_robin", "blocked")   # how a decode cell's B requests are spread over its k classes
BATCH_FORMS = ("packed", "slot_table")    # a decode cell's slot lists: packed kv_indices, or slot-table rows
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchSpec:
    """The resolved kernel_bench config (preset + overrides), checked before any work."""

    hardware: str
    device: str
    dtype: str
    shapes: list[Shape]
    prefix_lens: list[int]
    batches: list[int]
    num_prefixes: list[int]
    suffix_len: int
    backends: list[str]
    warmup: int
    reps: int
    layout_batch: int
    layout_prefix_lens: list[int]
    sweep_name: str = "kernel"
    results_dir: str = "results/raw"
    seed: int = 0
    force: bool = False
    time_budget_s: float = 0.0
    cuda_graph: bool = True
    check_error: bool = True
    l2_flush: bool = True
    layout: bool = True
    ncu: bool = False
    profile_kernels: bool = False
    plan_reps: int = 0
    profile_plan: int = 0
    plan_busy_ms: float = 0.0
    class_rows: str = "round_robin"
    batch_form: str = "packed"
    dispatch_cost: bool = True
    decision_table: Optional[list] = None
    gpu_name: Optional[str] = None
    cells: Optional[list[str]] = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"kernel_bench: preset device '{self.device}' must be cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"kernel_bench: hardware={self.hardware} needs a CUDA GPU; use hardware=cpu here")
        if self.dtype not in DTYPES:
            raise ValueError(f"kernel_bench: dtype '{self.dtype}' not in {tuple(DTYPES)}")
        bad = [b for b in self.backends if b not in VARIANTS and dense_variant(b) is None]
        if bad:
            raise ValueError(f"kernel_bench.backends: {bad} not in {VARIANTS} nor dense[_<kernel>][_s<n>] (the dense "
                             f"backend with kernel {DENSE_KERNELS[1:]} instead of FlashInfer's, and / or over n "
                             "interleaved KV chunks, n a power of two from 1 to 64), e.g. dense_s2, dense_cudnn_s4")
        for key in ("prefix_lens", "batches", "num_prefixes", "layout_prefix_lens"):
            vals = getattr(self, key)
            if not vals or any((not isinstance(v, int)) or v < 1 for v in vals):
                raise ValueError(f"kernel_bench.{key}: must be a non-empty list of positive ints, got {vals!r}")
        if self.suffix_len < 1 or self.layout_batch < 1 or self.reps < 1 or self.warmup < 0:
            raise ValueError("kernel_bench: suffix_len, layout_batch, reps must be >= 1 and warmup >= 0")
        if self.class_rows not in CLASS_ROWS:
            raise ValueError(f"kernel_bench.class_rows: '{self.class_rows}' not in {CLASS_ROWS}")
        if self.batch_form not in BATCH_FORMS:
            raise ValueError(f"kernel_bench.batch_form: '{self.batch_form}' not in {BATCH_FORMS}")
        if self.plan_reps < 0 or self.profile_plan < 0 or self.plan_busy_ms < 0:
            raise ValueError(f"kernel_bench: plan_reps ({self.plan_reps}), profile_plan ({self.profile_plan}) and "
                             f"plan_busy_ms ({self.plan_busy_ms}) must be >= 0 (0 = off)")
        self.decision_table = check_table(self.decision_table, "kernel_bench.decision_table") or None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]



def device_preset(c: dict, tool: str) -> tuple[dict, dict]:
    """(the hardware option, ``presets[<its device>]`` overlaid with every non-null top-level key) of a resolved
    config ``c`` whose presets are keyed by device (cpu / cuda): hot_batch_bench and graph_step_bench."""
    c = dict(c)
    hw, presets = c.pop("hardware"), c.pop("presets")
    if hw["device"] not in presets:
        raise ValueError(f"config error at `hardware`: no {tool} preset for device '{hw['device']}' ({sorted(presets)})")
    return hw, {**presets[hw["device"]], **{k: v for k, v in c.items() if v is not None}}


def check_preset_gpu(hw: dict) -> None:
    """Refuse a GPU hardware option on another GPU model (HardwareConfig.check_gpu)."""
    HardwareConfig(**{k: v for k, v in hw.items() if k in HardwareConfig.__dataclass_fields__}).check_gpu(
        torch.cuda.get_device_name(0))


def merge_preset(c: dict, tool: str) -> dict:
    """The ``presets[<hardware name>]`` entry overlaid with every non-null top-level key.

    ``hardware`` is the conf/hardware group option Hydra composed; its ``name`` picks the preset.
    A hardware option without a preset of its own (a copy of h200.yaml for another GPU) takes the
    first preset for its ``device`` (cuda: the H200's shapes and grid, which do not depend on
    the GPU). ``hardware`` in the result stays the option's own name, so calibrate writes the
    fitted table into that option's file. Shared by kernel_bench and calibrate.
    """
    presets = c.pop("presets", {})
    hw_cfg = c.pop("hardware")
    hw = hw_cfg["name"]
    key = hw if hw in presets else next((n for n, p in presets.items() if p.get("device") == hw_cfg.get("device")), None)
    if key is None:
        raise ValueError(f"{tool}.hardware: '{hw}' (device {hw_cfg.get('device')!r}) has no preset and no preset "
                         f"for its device; add presets.{hw} to conf/{tool}.yaml or choose one of {sorted(presets)}")
    if key != hw:
        print(f"[{tool}] hardware '{hw}' has no preset of its own: using presets.{key} (device {hw_cfg.get('device')})")
    merged = {**presets[key], "hardware": hw}
    for k, v in c.items():
        if v is not None or k not in merged:
            merged[k] = v
    merged["shapes"] = [Shape(**s) for s in merged["shapes"]]
    return merged


def resolve(cfg: Any) -> BenchSpec:
    """Merge the hardware preset with the overrides; load conf/hardware/<hw>.yaml's table if present."""
    from omegaconf import OmegaConf

    merged = merge_preset(OmegaConf.to_container(cfg, resolve=True), "kernel_bench")
    hw = merged["hardware"]
    if merged.get("decision_table") is None:
        hw_yaml = Path(__file__).resolve().parents[1] / "conf" / "hardware" / f"{hw}.yaml"
        if hw_yaml.exists():
            merged["decision_table"] = (OmegaConf.to_container(OmegaConf.load(hw_yaml)) or {}).get("decision_table")
            if merged["decision_table"] is not None:
                merged["extra"] = {"decision_table_from": str(hw_yaml.name)}
    return BenchSpec(**merged)


def _dispatcher(spec: BenchSpec, shape: Shape, mode: str = "table") -> Dispatcher:
    name = spec.gpu_name or (torch.cuda.get_device_name(0) if spec.device == "cuda" else "cpu")
    return Dispatcher(shape.hq, shape.hkv, shape.d, name, spec.decision_table, mode)


def dense_variant(variant: str) -> Optional[tuple[str, Optional[int]]]:
    """(kernel, n) of a ``dense[_<kernel>][_s<n>]`` variant other than plain ``dense`` (kernel one of
    DENSE_KERNELS[1:], else flashinfer; n a power of two 1..64, None = the SM-filling rule), else None."""
    m = re.fullmatch(r"dense(?:_(" + "|".join(DENSE_KERNELS[1:]) + r"))?(?:_s(\d+))?", variant)
    if m is None or variant == "dense":
        return None
    n = int(m.group(2)) if m.group(2) else None
    if n is not None and not (1 <= n <= 64 and n & (n - 1) == 0):
        return None
    return m.group(1) or "flashinfer", n


def make_variant(spec: BenchSpec, shape: Shape, variant: str, cuda_graph: bool):
    """A backend for one benchmark variant (granikv_cascade = granikv forced to per-class cascade;
    dense_unsplit = dense as one plain single-prefill call, without the interleaved KV chunks;
    dense_s<n> = dense over exactly n KV chunks, to search the split the SM-filling rule picks;
    dense_cudnn / dense_fa2 [_s<n>] = dense with torch's fused kernel, granikv.attention.sdpa_ops)."""
    dev, dt = spec.device, spec.torch_dtype
    if variant == "dense_unsplit":
        return make_backend("dense", shape.hq, shape.hkv, shape.d, dev, dt, cuda_graph=cuda_graph, dense_kv_splits=1)
    if dense_variant(variant):
        kernel, n = dense_variant(variant)
        return make_backend("dense", shape.hq, shape.hkv, shape.d, dev, dt, cuda_graph=cuda_graph, dense_kv_splits=n,
                            dense_kernel=kernel)
    if variant == "cascade_composed":
        return make_backend("cascade", shape.hq, shape.hkv, shape.d, dev, dt, cuda_graph=cuda_graph,
                            cascade_impl="composed")
    if variant in ("granikv", "granikv_cascade"):
        disp = _dispatcher(spec, shape, "table" if variant == "granikv" else "cascade_only")
        return make_backend("granikv", shape.hq, shape.hkv, shape.d, dev, dt, dispatcher=disp, cuda_graph=cuda_graph)
    return make_backend(variant, shape.hq, shape.hkv, shape.d, dev, dt, cuda_graph=cuda_graph)


def plan_row(spec: BenchSpec, plan, dev: torch.device, kind: str) -> dict:
    """``plan_us_<kind>`` (and ``plan_us_min_<kind>``, ``plan_profile_<kind>``) of ``plan`` when ``plan_reps`` > 0."""
    if not spec.plan_reps:
        return {}
    t = plan_host_time(plan, dev, reps=spec.plan_reps, warmup=min(spec.warmup, 5), profile_top=spec.profile_plan,
                       busy_ms=spec.plan_busy_ms)
    out = {f"plan_us_{kind}": t["plan_us"], f"plan_us_min_{kind}": t["plan_us_min"], "plan_reps": t["plan_reps"]}
    if "plan_us_busy" in t:
        out.update({f"plan_us_busy_{kind}": t["plan_us_busy"], "plan_busy_ms": t["busy_ms"]})
    if "plan_profile" in t:
        out[f"plan_profile_{kind}"] = t["plan_profile"]
    return out


def profile_row(spec: BenchSpec, fn, dev: torch.device) -> dict:
    """``kernels`` / ``kernels_us_per_call`` of one eager call of ``fn`` when ``profile_kernels`` is on."""
    if not spec.profile_kernels:
        return {}
    ks = kernel_profile(fn, dev, calls=min(spec.reps, 10), l2_flush=spec.l2_flush)
    return {"kernels": ks, "kernels_us_per_call": sum(k["us_per_call"] for k in ks)}


def bench_decode_cell(spec: BenchSpec, shape: Shape, lp: int, b: int, k: int, peaks: dict) -> tuple[list, dict]:
    dev = torch.device(spec.device)
    kc, vc, batch = build_cell(shape, lp, b, k, spec.suffix_len, spec.torch_dtype, dev, spec.seed,
                               blocked=spec.class_rows == "blocked", slot_table=spec.batch_form == "slot_table")
    q = torch.randn(b, shape.hq, shape.d, device=dev, generator=None).to(spec.torch_dtype)
    ref = None
    if spec.check_error:
        ref, _ = R.paged_decode_ref(q.float(), kc.float(), vc.float(), batch.kv_indptr, batch.all_slots())
    flops = attention_flops(shape, batch)
    elt = kc.element_size()
    rows = []
    for variant in spec.backends:
        be = make_variant(spec, shape, variant, cuda_graph=False)
        t0 = time.perf_counter()
        be.plan(batch)
        sync(dev)
        plan_ms = (time.perf_counter() - t0) * 1e3
        out = be.run(q, kc, vc)
        err = float((out.float() - ref).abs().max()) if ref is not None else None
        eager = time_fn(lambda: be.run(q, kc, vc), dev, spec.warmup, spec.reps, spec.l2_flush)
        row = {"backend": variant, **eager, "time_ms_eager": eager["time_ms"], "graph": False, "graph_error": None,
               "plan_ms": plan_ms, "max_abs_err": err, "decisions": be.last_decisions,
               **profile_row(spec, lambda: be.run(q, kc, vc), dev), **plan_row(spec, lambda: be.plan(batch), dev, "eager")}
        if spec.device == "cuda" and spec.cuda_graph:
            try:
                gbe = make_variant(spec, shape, variant, cuda_graph=True)
                gbe.plan(batch)
                g, gout = capture_graph(lambda: gbe.run(q, kc, vc))
                g.replay()
                sync(dev)
                gerr = float((gout.float() - ref).abs().max()) if ref is not None else None
                gt = time_fn(g.replay, dev, spec.warmup, spec.reps, spec.l2_flush)
                row.update({**gt, "graph": True, "max_abs_err_graph": gerr,
                            **plan_row(spec, lambda: gbe.plan(batch), dev, "graph")})
                del g, gbe
            except Exception as e:  # noqa: BLE001 - recorded, eager time stays the measurement
                row["graph_error"] = f"{type(e).__name__}: {e}"
        nbytes = kv_bytes(shape, batch, be.last_decisions, elt)
        row.update({"flops": flops, "bytes": nbytes, "tflops": flops / (row["time_ms"] * 1e-3) / 1e12,
                    "tbps": nbytes / (row["time_ms"] * 1e-3) / 1e12})
        row["tflops_frac_peak"] = row["tflops"] / peaks["peak_tflops"]
        row["tbps_frac_peak"] = row["tbps"] / peaks["peak_tbps"]
        rows.append(row)
        del be
    times = {r["backend"]: r["time_ms"] for r in rows}
    # the options the dispatcher chooses between (per class): paged, per-class cascade, dense
    options = {v: times[v] for v in ("paged", "granikv_cascade", "dense") if v in times}
    metrics = {f"time_ms_{v}": t for v, t in times.items()}
    fastest = min(times, key=times.get)
    metrics.update({"fastest_backend": fastest, "fastest_time_ms": times[fastest], **peaks,
                    "max_abs_err_max": max((r["max_abs_err"] or 0.0) for r in rows)})
    if "granikv" in times and options:
        best = min(options.values())
        metrics.update({"dispatch_choice": next(r["decisions"] for r in rows if r["backend"] == "granikv"),
                        "fastest_option": min(options, key=options.get),
                        "granikv_vs_fastest": times["granikv"] / best,
                        "dispatch_within_3pct": times["granikv"] <= 1.03 * best})
    return rows, metrics


def layout_bytes(variant: str, lp: int, b: int, kv_token_bytes: int, qo_bytes: int) -> int:
    """Bytes a layout variant must move: the slab once for the contiguous variants (one call, or its
    interleaved chunks), every request's own copy for the paged-unique ones; plus q in and o out."""
    return (lp if variant.startswith("contiguous_dense") else b * lp) * kv_token_bytes + qo_bytes


def bench_layout_cell(spec: BenchSpec, shape: Shape, lp: int, b: int, peaks: dict) -> tuple[list, dict]:
    """Same prefix attention from a contiguous slab vs from B private copies (paged-unique)."""
    dev, dt = torch.device(spec.device), spec.torch_dtype
    q = torch.randn(b, shape.hq, shape.d, device=dev).to(dt)
    slab_k = torch.randn(lp, shape.hkv, shape.d, device=dev).to(dt)
    slab_v = torch.randn(lp, shape.hkv, shape.d, device=dev).to(dt)
    uk = slab_k.repeat(b, 1, 1)                        # [B*Lp, Hkv, D]: request i's copy at rows i*Lp..
    uv = slab_v.repeat(b, 1, 1)
    indptr = (torch.arange(b + 1, device=dev) * lp)
    indices = torch.arange(b * lp, device=dev)
    ref = R.attention_ref(q.float(), slab_k.float(), slab_v.float())[0] if spec.check_error else None
    fns = layout_fns(spec, shape, q, slab_k, slab_v, uk, uv, indptr, indices)
    tok = 2 * shape.hkv * shape.d * slab_k.element_size()
    flops = 4 * shape.hq * shape.d * b * lp
    rows = []
    for name, fn in fns.items():
        out = fn()
        err = float((out.float() - ref).abs().max()) if ref is not None else None
        t = time_fn(fn, dev, spec.warmup, spec.reps, spec.l2_flush)
        nbytes = layout_bytes(name, lp, b, tok, 2 * b * shape.hq * shape.d * slab_k.element_size())
        tf, tb = flops / (t["time_ms"] * 1e-3) / 1e12, nbytes / (t["time_ms"] * 1e-3) / 1e12
        rows.append({"backend": name, **t, "flops": flops, "bytes": nbytes, "tflops": tf, "tbps": tb,
                     "tflops_frac_peak": tf / peaks["peak_tflops"], "tbps_frac_peak": tb / peaks["peak_tbps"],
                     "max_abs_err": err, **profile_row(spec, fn, dev)})
    times = {r["backend"]: r["time_ms"] for r in rows}
    metrics = {f"time_ms_{k}": v for k, v in times.items()}
    for k in times:
        if k != "contiguous_dense":
            metrics[f"speedup_vs_{k}"] = times[k] / times["contiguous_dense"]
    metrics.update(peaks)
    return rows, metrics


def layout_fns(spec, shape, q, slab_k, slab_v, uk, uv, indptr, indices) -> dict:
    """The layout experiment's variants as zero-argument callables (planned already)."""
    if spec.device == "cpu":
        return {"contiguous_dense": lambda: R.attention_ref(q, slab_k, slab_v)[0],
                "paged_unique_decode": lambda: R.paged_decode_ref(q, uk, uv, indptr, indices)[0]}
    from granikv.attention import flashinfer_ops as fo

    dt, ws = spec.torch_dtype, fo.workspace(q.device)
    b = q.shape[0]
    scale = R.default_scale(shape.d)
    pre = fo.make_prefill_paged_wrapper(ws)
    fo.plan_prefill_paged(pre, torch.arange(b + 1, dtype=torch.int32), indptr.cpu().int(), indices, shape.hq,
                          shape.hkv, shape.d, causal=False, sm_scale=scale, q_dtype=dt, kv_dtype=dt)
    dec = fo.make_decode_wrapper(ws, fo.use_tensor_cores(shape.hq, shape.hkv, dt))
    fo.plan_decode(dec, indptr.cpu().int(), indices.int(), torch.ones(b, dtype=torch.int32, device=q.device),
                   shape.hq, shape.hkv, shape.d, dt, dt, scale)
    kv = fo.paged(uk, uv)
    splits = fo.dense_kv_splits(b, shape.hq, slab_k.shape[0], torch.cuda.get_device_properties(q.device).multi_processor_count)
    return {"contiguous_dense": lambda: fo.single_prefill(q, slab_k, slab_v, scale)[0],
            # the dense backend's call: the same kernel over interleaved KV chunks that fill the SMs
            "contiguous_dense_split": lambda: fo.single_prefill_split(q, slab_k, slab_v, scale, splits)[0],
            "paged_unique_prefill": lambda: pre.run(q, kv),
            "paged_unique_decode": lambda: dec.run(q, kv)}


NCU_METRICS = ("gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,"
               "sm__throughput.avg.pct_of_peak_sustained_elapsed")


def ncu_kernel(m: dict) -> dict:
    """One kernel of an ncu CSV record set: name, duration (us; ncu reports ns), DRAM / SM throughput %."""
    return {"name": m.get("name", "")[:200], "time_us": m.get("gpu__time_duration.sum", 0.0) / 1e3,
            "dram_pct": m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
            "sm_pct": m.get("sm__throughput.avg.pct_of_peak_sustained_elapsed")}


def ncu_layout(spec: BenchSpec, shape: Shape, lp: int, b: int) -> dict:
    """DRAM / SM throughput % of the longest kernel of each layout variant, via ncu (GPU host only)."""
    import csv
    import io
    import shutil

    exe = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
    if exe is None:
        return {"ncu_error": "ncu not found on PATH or /usr/local/cuda/bin"}
    out = {}
    for variant in ("contiguous_dense", "contiguous_dense_split", "paged_unique_prefill", "paged_unique_decode"):
        cmd = [exe, "--csv", "--profile-from-start", "off", "--clock-control", "none", "--metrics", NCU_METRICS, sys.executable, "-m",
               "runners.kernel_bench", "--probe", shape.name, str(shape.hq), str(shape.hkv), str(shape.d), str(lp), str(b),
               variant, spec.dtype]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith('"')]
            recs = list(csv.DictReader(io.StringIO("\n".join(lines))))
            by_kernel: dict[str, dict] = {}
            for r in recs:
                by_kernel.setdefault(r["ID"], {"name": r.get("Kernel Name", "")})[r["Metric Name"]] = \
                    float(r["Metric Value"].replace(",", ""))
            if not by_kernel:
                out[variant] = {"ncu_error": (p.stderr or p.stdout)[-500:]}
                continue
            ks = sorted(by_kernel.values(), key=lambda m: -m.get("gpu__time_duration.sum", 0.0))
            out[variant] = {"kernel": ks[0]["name"][:120],
                            "dram_pct": ks[0].get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                            "sm_pct": ks[0].get("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                            "kernels": [ncu_kernel(m) for m in ks]}
        except Exception as e:  # noqa: BLE001 - a measurement that could not be made is reported as such
            out[variant] = {"ncu_error": f"{type(e).__name__}: {e}"}
    return out


def dispatch_cost_rows(spec: BenchSpec) -> tuple[list, dict]:
    """Host cost of dispatch per step (k classes), and of a whole plan() on CPU tensors."""
    shape = spec.shapes[0]
    rows = []
    for k in (1, 4, 16, 64):
        d = Dispatcher(shape.hq, shape.hkv, shape.d, "bench", [{"meff_min": 256, "choice": "dense"},
                                                               {"choice": "cascade"}])
        classes = [(2048, 256 // k)] * k
        choose_many = d.choose_many

        def step():                        # what GranikvPolicy.choose asks per step
            return choose_many(classes)

        n = 20000
        us = min(timeit.repeat(step, number=n, repeat=5)) / n * 1e6
        rows.append({"backend": "dispatcher", "num_classes": k, "us_per_step": us})
        be = make_backend("granikv", shape.hq, shape.hkv, shape.d, dispatcher=d)
        _, _, batch = build_cell(shape, 64, 256, k, 4, torch.float32, torch.device("cpu"))
        m = 20
        us_plan = min(timeit.repeat(lambda: be.plan(batch), number=m, repeat=3)) / m * 1e6
        rows.append({"backend": "granikv_plan_cpu", "num_classes": k, "batch": 256, "us_per_step": us_plan})
        choose_us = []                     # the dispatcher's share of plan(), as the engine records it per step
        for _ in range(200):
            be.plan(batch)
            choose_us.append(be.last_choose_us)
        rows.append({"backend": "granikv_choose_in_plan", "num_classes": k, "batch": 256,
                     "us_per_step": statistics.median(choose_us)})
    metrics = {f"{r['backend']}_k{r['num_classes']}_us": r["us_per_step"] for r in rows}
    metrics["dispatcher_under_5us"] = all(r["us_per_step"] < 5 for r in rows if r["backend"] == "dispatcher")
    metrics["choose_in_plan_under_5us"] = all(r["us_per_step"] < 5 for r in rows
                                              if r["backend"] == "granikv_choose_in_plan")
    return rows, metrics


def cell_list(spec: BenchSpec) -> list[tuple[str, tuple]]:
    cells = []
    for s in spec.shapes:
        for lp in spec.prefix_lens:
            for b in spec.batches:
                for k in spec.num_prefixes:
                    if k <= b:
                        tail = "-blocked" if spec.class_rows == "blocked" and k > 1 else ""
                        cells.append((f"{s.name}-lp{lp}-b{b}-k{k}{tail}", ("decode", s, lp, b, k)))
        if spec.layout:
            for lp in spec.layout_prefix_lens:
                cells.append((f"layout-{s.name}-lp{lp}-b{spec.layout_batch}", ("layout", s, lp, spec.layout_batch)))
    if spec.dispatch_cost:
        cells.append(("dispatch_cost", ("dispatch",)))
    if spec.cells:
        unknown = set(spec.cells) - {c for c, _ in cells}
        if unknown:
            raise ValueError(f"kernel_bench.cells: {sorted(unknown)} are not cells of this grid")
        cells = [c for c in cells if c[0] in spec.cells]
    return cells


def run(spec: BenchSpec) -> dict:
    """Run every cell not yet done; returns {'done': [...], 'skipped': [...], 'failed': [...], 'left': [...]}."""
    t_start = time.monotonic()
    root = Path(spec.results_dir) / spec.sweep_name
    cells = cell_list(spec)
    gpu = torch.cuda.get_device_name(0) if spec.device == "cuda" else None
    rawio.refuse_other_gpu(root, [cid for cid, _ in cells], gpu, "kernel_bench")   # a cell id names no GPU model
    todo = [(cid, c) for cid, c in cells if spec.force or rawio.cell_state(root / cid) != "done"]
    todo_ids = {cid for cid, _ in todo}
    report = {"done": [], "skipped": [c for c, _ in cells if c not in todo_ids], "failed": [], "left": []}
    if not todo:
        return report
    torch.manual_seed(spec.seed)
    peaks = measure_peaks(torch.device(spec.device), spec.torch_dtype)
    prov = rawio.provenance()
    spec_d = asdict(spec)
    for cid, c in todo:
        if spec.time_budget_s and time.monotonic() - t_start > spec.time_budget_s:
            report["left"].append(cid)
            continue
        d = root / cid
        cell = {"cell_id": cid, "kind": c[0]}
        if c[0] == "decode":
            cell.update({"shape": asdict(c[1]), "prefix_len": c[2], "batch": c[3], "num_prefixes": c[4],
                         "suffix_len": spec.suffix_len, "class_rows": spec.class_rows, "batch_form": spec.batch_form})
        elif c[0] == "layout":
            cell.update({"shape": asdict(c[1]), "prefix_len": c[2], "batch": c[3]})
        rawio.write_json(d / "config.json", {**spec_d, "cell": cell, "peaks": peaks, "provenance": prov})
        try:
            if c[0] == "decode":
                rows, metrics = bench_decode_cell(spec, c[1], c[2], c[3], c[4], peaks)
            elif c[0] == "layout":
                rows, metrics = bench_layout_cell(spec, c[1], c[2], c[3], peaks)
                if spec.ncu and spec.device == "cuda" and c[1] == spec.shapes[0] and c[2] == max(spec.layout_prefix_lens):
                    metrics["ncu"] = ncu_layout(spec, c[1], c[2], c[3])
            else:
                rows, metrics = dispatch_cost_rows(spec)
            rawio.write_jsonl(d / "kernel.jsonl", rows)
            rawio.write_json(d / "metrics.json", {"cell_id": cid, **metrics})
            if (d / "failure.json").exists():
                (d / "failure.json").unlink()
            report["done"].append(cid)
        except Exception as e:  # noqa: BLE001 - a failed cell is recorded and the sweep goes on
            rawio.write_json(d / "failure.json", {"cell_id": cid, "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc(), "config": cell})
            report["failed"].append(cid)
        finally:
            if spec.device == "cuda":
                torch.cuda.empty_cache()
    return report


def summary(spec: BenchSpec) -> str:
    """One line per decode cell: each backend's time and the dispatcher's standing."""
    root = Path(spec.results_dir) / spec.sweep_name
    lines = [f"{'cell':34s} " + " ".join(f"{b[:10]:>10s}" for b in spec.backends) + "  fastest     gk/best"]
    for cid, c in cell_list(spec):
        if c[0] != "decode" or rawio.cell_state(root / cid) != "done":
            continue
        m = rawio.read_json(root / cid / "metrics.json")
        ts = " ".join(f"{m.get(f'time_ms_{b}', float('nan')):10.4f}" for b in spec.backends)
        lines.append(f"{cid:34s} {ts}  {m['fastest_backend'][:10]:10s} {m.get('granikv_vs_fastest', float('nan')):7.3f}")
    return "\n".join(lines)


def _main(cfg) -> None:
    spec = resolve(cfg)
    rep = run(spec)
    root = Path(spec.results_dir) / spec.sweep_name
    print(summary(spec))
    print(f"kernel_bench: wrote {len(rep['done'])} cells, {len(rep['failed'])} failed, "
          f"{len(rep['skipped'])} already done, {len(rep['left'])} left for the next run (time budget) -> {root}")


def probe(argv: list[str]) -> None:
    """``--probe name hq hkv d lp b variant dtype``: run one layout variant inside a profiler range (for ncu)."""
    name, hq, hkv, d, lp, b, variant, dtype = argv
    shape = Shape(name, int(hq), int(hkv), int(d))
    lp, b = int(lp), int(b)
    spec = BenchSpec(hardware="probe", device="cuda", dtype=dtype, shapes=[shape], prefix_lens=[lp], batches=[b],
                     num_prefixes=[1], suffix_len=1, backends=["paged"], warmup=0, reps=1, layout_batch=b,
                     layout_prefix_lens=[lp])
    dev, dt = torch.device("cuda"), DTYPES[dtype]
    q = torch.randn(b, shape.hq, shape.d, device=dev).to(dt)
    sk = torch.randn(lp, shape.hkv, shape.d, device=dev).to(dt)
    sv = torch.randn(lp, shape.hkv, shape.d, device=dev).to(dt)
    fn = layout_fns(spec, shape, q, sk, sv, sk.repeat(b, 1, 1), sv.repeat(b, 1, 1), torch.arange(b + 1, device=dev) * lp,
                    torch.arange(b * lp, device=dev))[variant]
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe(sys.argv[2:])
        sys.exit(0)
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name="kernel_bench", version_base=None)(_main)()
