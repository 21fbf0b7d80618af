"""Measurement primitives shared by runners.kernel_bench and runners.calibrate.

- ``time_fn``: do_bench-style timing (warm-up, optional L2 flush before every repetition, CUDA
  events on GPU / perf_counter on CPU, median and mean in ms).
- ``kernel_profile``: the kernels of one call of ``fn`` (torch.profiler): name, time and launches
  per call, to split a backend's time into its kernels.
- ``plan_host_time``: host time of a backend's per-step plan in the steady state (median us over
  repetitions), with an optional cProfile breakdown of where that host time goes.
- ``measure_peaks``: the device's achievable bf16 (fp32 on CPU) matmul TFLOP/s and copy TB/s,
  measured in the run (not datasheet numbers).
- ``build_cell``: a KV cache and a DecodeBatch for one (shape, Lp, B, k, suffix) cell: k prefix
  classes of Lp tokens, each one contiguous HOT run, B requests round-robin over the classes (or in
  adjacent blocks, one per class, as the engine orders a decode batch),
  each with ``suffix_len`` own slots (the current token last) scattered over the COLD rows.
- ``attention_flops`` / ``kv_bytes``: the work model of a step (see their docstrings).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from granikv.attention.batch import DecodeBatch


@dataclass
class Shape:
    """Attention shape per TP rank."""

    name: str
    hq: int
    hkv: int
    d: int

    def __post_init__(self):
        if self.hq <= 0 or self.hkv <= 0 or self.d <= 0 or self.hq % self.hkv:
            raise ValueError(f"shape '{self.name}': need positive hq, hkv, d with hq % hkv == 0, got "
                             f"hq={self.hq} hkv={self.hkv} d={self.d}")


def capture_graph(fn: Callable[[], object]) -> tuple["torch.cuda.CUDAGraph", object]:
    """``fn`` captured as one CUDA graph, after one warm-up run on a side stream (as torch requires);
    returns (graph, the captured run's output: the buffers each replay rewrites)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 5, reps: int = 30,
            l2_flush: bool = True, flush_bytes: int = 256 << 20) -> dict:
    """Median / mean / min time of ``fn()`` in ms over ``reps`` runs after ``warmup`` runs."""
    device = torch.device(device)
    flush = torch.empty(flush_bytes if device.type == "cuda" else (8 << 20), dtype=torch.uint8, device=device) \
        if l2_flush else None
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if flush is not None:
                flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"time_ms": statistics.median(times), "time_ms_mean": statistics.fmean(times),
            "time_ms_min": min(times), "reps": reps, "warmup": warmup, "l2_flush": bool(l2_flush)}


def _profiled(fn: Callable[[], object], device: torch.device, calls: int, flush) -> dict[str, list[float]]:
    """{event name: [total us, count]} over ``calls`` calls of ``fn`` (each after ``flush.zero_()``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            if flush is not None:
                flush.zero_()
            fn()
        sync(device)
    out: dict[str, list[float]] = {}
    for e in prof.key_averages():
        us = ((getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)) if cuda
              else e.self_cpu_time_total) or 0.0
        if us > 0:
            out[e.key] = [float(us), float(e.count)]
    return out


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 10, l2_flush: bool = True,
                   flush_bytes: int = 256 << 20) -> list[dict]:
    """The kernels one call of ``fn`` launches, longest first: ``{"name", "us_per_call",
    "launches_per_call"}``, from a torch.profiler trace of ``calls`` eager calls (after one untraced
    call). On CUDA: device time of each kernel (and memcpy / memset), measured as ``time_fn`` measures,
    with the L2 flush before each call; the flush's own kernels (traced alone first) are left out. On
    CPU (tests): self CPU time of each aten op. Sum the ``us_per_call`` for the kernels' busy time;
    what a timed call adds over it is launch gaps.
    """
    device = torch.device(device)
    if calls < 1:
        raise ValueError(f"kernel_profile: calls must be >= 1, got {calls}")
    flush = torch.empty(flush_bytes if device.type == "cuda" else (8 << 20), dtype=torch.uint8, device=device) \
        if l2_flush else None
    flush_names = set(_profiled(lambda: None, device, 2, flush)) if flush is not None else set()
    rows = [{"name": name[:200], "us_per_call": us / calls, "launches_per_call": n / calls}
            for name, (us, n) in _profiled(fn, device, calls, flush).items() if name not in flush_names]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """``torch.cuda._sleep`` cycles per millisecond on ``device``, timed with CUDA events."""
    torch.cuda._sleep(1_000_000)                                  # warm-up
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / max(a.elapsed_time(b), 1e-3)


def plan_host_time(plan: Callable[[], object], device: torch.device, reps: int = 50, warmup: int = 5,
                   profile_top: int = 0, busy_ms: float = 0.0) -> dict:
    """Host time of ``plan()`` (one decode step's plan: make_plan + load) in the steady state.

    Each repetition first waits for the device (untimed, as the engine waits for the previous plan's
    copies before re-planning), then times ``plan()`` alone on the host: ``plan_us`` (median),
    ``plan_us_min``, ``plan_reps``. ``busy_ms`` > 0 (CUDA): a third set of repetitions keeps the
    stream busy for that long before each plan (``torch.cuda._sleep``), as the engine's overlap
    schedule plans while the previous step runs; any plan() call that waits for the device then
    shows in ``plan_us_busy`` (median) as up to ``busy_ms`` of extra host time. ``profile_top`` > 0 adds ``plan_profile``: the functions with the
    most own host time per plan under cProfile (``fn``, ``us_per_plan``, ``calls_per_plan``), from a
    second, profiled set of repetitions (cProfile slows Python calls, so the shares are indicative and
    ``plan_us`` comes from the unprofiled set).
    """
    device = torch.device(device)
    if reps < 1 or warmup < 0:
        raise ValueError(f"plan_host_time: reps must be >= 1 and warmup >= 0, got {reps}, {warmup}")
    for _ in range(warmup):
        plan()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        plan()
        times.append((time.perf_counter() - t0) * 1e6)
    sync(device)
    out = {"plan_us": statistics.median(times), "plan_us_min": min(times), "plan_reps": reps}
    if busy_ms > 0 and device.type == "cuda":
        cycles = int(busy_ms * _sleep_cycles_per_ms(device))
        busy = []
        for _ in range(reps):
            sync(device)
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            plan()
            busy.append((time.perf_counter() - t0) * 1e6)
        sync(device)
        out.update({"plan_us_busy": statistics.median(busy), "busy_ms": busy_ms})
    if profile_top > 0:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for _ in range(reps):
            sync(device)
            prof.enable()
            plan()
            prof.disable()
        sync(device)
        st = pstats.Stats(prof).stats            # {(file, line, fn): (cc, nc, tottime, cumtime, callers)}
        top = sorted(st.items(), key=lambda kv: -kv[1][2])[:profile_top]
        out["plan_profile"] = [{"fn": f"{Path(f).name}:{line}:{fn}", "us_per_plan": tt / reps * 1e6,
                                "calls_per_plan": nc / reps} for (f, line, fn), (cc, nc, tt, ct, _) in top]
    return out


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict:
    """Achievable matmul TFLOP/s (n=8192 on GPU, 1024 on CPU) and copy TB/s (read+write bytes)."""
    device = torch.device(device)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = time_fn(lambda: torch.mm(a, b), device, warmup=3, reps=10 if device.type == "cuda" else 3, l2_flush=False)
    tflops = 2 * n ** 3 / (t["time_ms"] * 1e-3) / 1e12
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t2 = time_fn(lambda: dst.copy_(src), device, warmup=3, reps=10 if device.type == "cuda" else 3, l2_flush=False)
    tbps = 2 * nbytes / (t2["time_ms"] * 1e-3) / 1e12
    del a, b, src, dst
    return {"peak_tflops": tflops, "peak_tbps": tbps, "peak_matmul_n": n, "peak_copy_bytes": nbytes,
            "peak_dtype": str(dtype).replace("torch.", "")}


def build_cell(shape: Shape, lp: int, b: int, k: int, suffix_len: int, dtype: torch.dtype, device: torch.device,
               seed: int = 0, blocked: bool = False, slot_table: bool = False) -> tuple[torch.Tensor, torch.Tensor, DecodeBatch]:
    """k_cache/v_cache [C, Hkv, D] and the DecodeBatch of one cell (see module doc). ``blocked``: each
    class's requests are adjacent rows (as the engine orders a decode batch), else round-robin.
    ``slot_table``: the slot lists as rows of a slot table (the engine's form: every backend's plan
    then gathers the lists it runs), else packed into kv_indices."""
    if k > b:
        raise ValueError(f"num_prefixes={k} > batch={b}: every prefix class needs at least one request")
    if lp < 1 or suffix_len < 1:
        raise ValueError(f"prefix_len ({lp}) and suffix_len ({suffix_len}) must be >= 1")
    g = torch.Generator(device="cpu").manual_seed(seed)
    hot = k * lp
    cap = hot + b * suffix_len
    k_cache = torch.randn(cap, shape.hkv, shape.d, device=device, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(cap, shape.hkv, shape.d, device=device, dtype=torch.float32).to(dtype)
    cold = hot + torch.randperm(b * suffix_len, generator=g)                     # scattered COLD slots
    cls = [i * k // b for i in range(b)] if blocked else [i % k for i in range(b)]
    idx = torch.empty(b, lp + suffix_len, dtype=torch.int64)
    for i in range(b):
        idx[i, :lp] = torch.arange(cls[i] * lp, (cls[i] + 1) * lp)
        idx[i, lp:] = cold[i * suffix_len:(i + 1) * suffix_len]
    indptr = torch.arange(b + 1, dtype=torch.int64) * (lp + suffix_len)
    # the host copy of the indptr, as the engine and the plugin give it: plan() then never reads it back
    # from the device (a device->host copy would wait for whatever the GPU is running)
    if slot_table:                                                           # idx [B, Lp+S] is a slot table
        batch = DecodeBatch(indptr.to(device), None, [lp] * b, cls, [c * lp for c in cls],
                            kv_indptr_host=indptr.clone(), slot_table=idx.to(device), slot_rows=torch.arange(b))
    else:
        batch = DecodeBatch(indptr.to(device), idx.reshape(-1).to(device), [lp] * b, cls, [c * lp for c in cls],
                            kv_indptr_host=indptr.clone())
    return k_cache, v_cache, batch


def attention_flops(shape: Shape, batch: DecodeBatch) -> int:
    """4 * Hq * D per (query, key) pair (QK^T and PV, 2 flops per MAC), summed over the step."""
    nnz = int(batch.kv_indptr[-1])
    return 4 * shape.hq * shape.d * nnz


def kv_bytes(shape: Shape, batch: DecodeBatch, decisions: list[dict], elt: int) -> int:
    """Bytes a backend must read for one layer: the K+V tokens its algorithm reads (+ q and o).

    Per class: paged reads the prefix once per request; cascade / dense read it once;
    hydragen reads it, writes the scratch and reads the scratch (3x). Every request's own
    slots are read once. Index bytes are not counted. This is what the kernel asks for, not
    what DRAM serves: requests of one launch that read the same prefix pages hit the L2 cache
    for part of them, so bytes / time can pass the measured bandwidth peak (paged over a
    shared prefix).
    """
    tok = 2 * shape.hkv * shape.d * elt
    nnz = int(batch.kv_indptr[-1])
    prefix_total = sum(d["batch"] * d["prefix_len"] for d in decisions)
    moved = nnz - prefix_total
    for d in decisions:
        if d["backend"] == "paged":
            moved += d["batch"] * d["prefix_len"]
        elif d["backend"] == "hydragen":
            moved += 3 * d["prefix_len"]
        else:
            moved += d["prefix_len"]
    return moved * tok + 2 * batch.batch_size * shape.hq * shape.d * elt
