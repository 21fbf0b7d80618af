"""The dense prefix path as ONE batched launch against the engine's per-group calls:
``python -m runners.hot_batch_bench [hardware=h100] [overrides]``.

One cell per case (a list of class prefix lengths and a batch B split evenly over the classes, rows in
class order as the engine orders a decode batch). The HOT slabs lie in address order with ``gap``
tokens between them (slots of other classes), in a KV cache of random bf16 keys and values. Variants
(each the prefix state of every class's rows, the suffix decode and the merge left out: they are the same
for both forms):

- ``per_group``: the engine's dense path, one ``flashinfer_ops.single_prefill_split`` per class on its
  slab, with the engine's KV fold per class (``flashinfer_ops.dense_kv_splits``);
- ``batched_<backend>_f<n>``: ``granikv.attention.hot_batch.HotBatch``, one ragged batch prefill over
  the region holding every slab (gaps as empty segments) with KV fold ``n``, for each backend and fold.

Per variant: device time of a CUDA-graph replay (``time_ms``) and of an eager call (``time_ms_eager``),
host time of the eager call's launches (``host_us``: wall time of run() on an idle device), host time of
the step's plan (``plan_us``, batched forms), and the error against an fp32 reference of every class
(``rel_err``). Cells: ``<results_dir>/<sweep_name>/<case>/`` (granikv.rawio schema: config.json with
provenance, kernel.jsonl one row per variant, metrics.json); resumable, a failed cell writes
failure.json and the sweep goes on.
"""
from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from granikv import rawio
from granikv.attention import flashinfer_ops as fo
from granikv.attention import reference as R
from granikv.attention.bench import Shape, capture_graph, plan_host_time, time_fn
from granikv.attention.hot_batch import HotBatch, HotGroup, plan_hot_batch
from runners.kernel_bench import check_preset_gpu, device_preset

TOOL = "hot_batch_bench"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Case:
    """One cell: k classes of the given prefix lengths, ``batch`` rows split evenly over them."""

    name: str
    prefix_lens: list[int]
    batch: int


@dataclass
class HotBatchSpec:
    """The resolved config, checked before any work."""

    hardware: str
    device: str
    dtype: str
    shape: Shape
    cases: list[Case]
    folds: list[int]
    backends: list[str]
    gap: int = 64
    warmup: int = 5
    reps: int = 30
    sweep_name: str = "hot_batch"
    results_dir: str = "results/raw"
    seed: int = 0
    force: bool = False
    cuda_graph: bool = True
    l2_flush: bool = True

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"config error at `{TOOL}.device`: '{self.device}' must be cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"config error at `hardware`: hardware={self.hardware} needs a CUDA GPU; use hardware=cpu")
        if self.dtype not in DTYPES:
            raise ValueError(f"config error at `{TOOL}.dtype`: '{self.dtype}' not in {tuple(DTYPES)}")
        if not self.cases:
            raise ValueError(f"config error at `{TOOL}.cases`: must list at least one {{name, prefix_lens, batch}}")
        for i, c in enumerate(self.cases):
            if not c.prefix_lens or any(lp <= 0 for lp in c.prefix_lens) or c.batch < len(c.prefix_lens):
                raise ValueError(f"config error at `{TOOL}.cases[{i}]`: need positive prefix_lens and batch >= "
                                 f"their count, got {c}")
        if not self.folds or any(f < 1 or f & (f - 1) for f in self.folds):
            raise ValueError(f"config error at `{TOOL}.folds`: powers of two >= 1, got {self.folds}")
        if self.gap < 0:
            raise ValueError(f"config error at `{TOOL}.gap`: must be >= 0, got {self.gap}")


def resolve(cfg: Any) -> HotBatchSpec:
    """Hydra config -> spec: the ``presets[<hardware device>]`` entry overlaid with the non-null keys."""
    from omegaconf import OmegaConf

    hw, merged = device_preset(OmegaConf.to_container(cfg, resolve=True), TOOL)
    merged["shape"] = Shape(**merged["shape"])
    merged["cases"] = [Case(**x) for x in merged["cases"]]
    spec = HotBatchSpec(hardware=hw["name"], **merged)
    if spec.device == "cuda":
        check_preset_gpu(hw)
    return spec


def layout(case: Case, gap: int, align: int) -> list[HotGroup]:
    """The classes' slabs in address order, at least ``gap`` slots apart (starts aligned to ``align``), rows split
    evenly (the first classes take the remainder), one run of the batch in class order."""
    k = len(case.prefix_lens)
    rows = [case.batch // k + (i < case.batch % k) for i in range(k)]
    out, addr, r = [], -(-gap // align) * align, 0
    for lp, b in zip(case.prefix_lens, rows):
        out.append(HotGroup(addr, lp, r, b))
        addr = -(-(addr + lp + gap) // align) * align
        r += b
    return out


def rel_err(states: list[tuple[torch.Tensor, torch.Tensor]], refs: list[torch.Tensor]) -> float:
    num = sum(float((o.float() - r).norm()) ** 2 for (o, _), r in zip(states, refs))
    den = sum(float(r.norm()) ** 2 for r in refs)
    return math.sqrt(num / den)


def bench_case(spec: HotBatchSpec, case: Case, dev: torch.device) -> list[dict]:
    s, dt = spec.shape, DTYPES[spec.dtype]
    align = max(spec.folds + [16])
    gs = layout(case, spec.gap, align)
    cap = -(-(gs[-1].hot_start + gs[-1].prefix_len + spec.gap) // align) * align
    k = torch.randn(cap, s.hkv, s.d, device=dev, dtype=dt)
    v = torch.randn(cap, s.hkv, s.d, device=dev, dtype=dt)
    q = torch.randn(case.batch, s.hq, s.d, device=dev, dtype=dt)
    scale = 1 / math.sqrt(s.d)
    refs = [R.attention_ref(q[g.row_start:g.row_start + g.rows].float(), k[g.hot_start:g.hot_start + g.prefix_len].float(),
                            v[g.hot_start:g.hot_start + g.prefix_len].float(), scale)[0] for g in gs]
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
    ws = fo.workspace(dev)
    variants: list[tuple[str, dict, Callable[[], list], Callable[[], object] | None]] = []

    def per_group():
        return [fo.single_prefill_split(q[g.row_start:g.row_start + g.rows], k[g.hot_start:g.hot_start + g.prefix_len],
                                        v[g.hot_start:g.hot_start + g.prefix_len], scale,
                                        fo.dense_kv_splits(g.rows, s.hq, g.prefix_len, num_sms)) for g in gs]
    splits = [fo.dense_kv_splits(g.rows, s.hq, g.prefix_len, num_sms) for g in gs]
    variants.append(("per_group", {"launches": len(gs), "folds": splits}, per_group, None))
    for backend in spec.backends:
        for n in spec.folds:
            if any(g.prefix_len % n for g in gs):
                continue
            hb = HotBatch(ws, s.hq, s.hkv, s.d, dt, scale, backend=backend,
                          max_segments=2 * len(gs) + 1 if spec.cuda_graph and dev.type == "cuda" else None)
            p = plan_hot_batch(gs, fold=n, max_segments=hb.max_segments, region=(0, cap))

            def run(hb=hb):
                o, lse = hb.run(q, k, v)
                return [(o[g.row_start:g.row_start + g.rows], lse[g.row_start:g.row_start + g.rows]) for g in gs]
            variants.append((f"batched_{backend}_f{n}", {"launches": 1, "folds": [n] * len(gs), "segments": p.segments},
                             run, lambda hb=hb, p=p: hb.plan(p)))
    rows = []
    for name, info, fn, plan in variants:
        row = {"backend": name, **info, "case": case.name, "prefix_lens": case.prefix_lens, "batch": case.batch}
        try:
            if plan is not None:
                plan()
                row["plan_us"] = plan_host_time(plan, dev, reps=spec.reps, warmup=0)["plan_us"]
            row["rel_err"] = rel_err(fn(), refs)
            row.update({f"{key}_eager" if key.startswith("time_ms") else key: val
                        for key, val in time_fn(fn, dev, spec.warmup, spec.reps, spec.l2_flush).items()})
            row["host_us"] = plan_host_time(fn, dev, reps=spec.reps, warmup=0)["plan_us"]   # launches, device idle
            if spec.cuda_graph and dev.type == "cuda":
                g, _ = capture_graph(fn)
                row.update(time_fn(g.replay, dev, spec.warmup, spec.reps, spec.l2_flush))
                row["graph"] = True
            else:
                row["time_ms"], row["graph"] = row["time_ms_eager"], False
        except Exception as e:  # noqa: BLE001 - one variant failing (e.g. a backend's limit) is a row, not a cell
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def metrics_of(rows: list[dict]) -> dict:
    base = next(r for r in rows if r["backend"] == "per_group")
    ok = [r for r in rows if r["backend"] != "per_group" and "time_ms" in r]
    best = min(ok, key=lambda r: r["time_ms"]) if ok else None
    best_eager = min(ok, key=lambda r: r["time_ms_eager"]) if ok else None
    return {"per_group_ms": base.get("time_ms"), "per_group_host_us": base.get("host_us"),
            "best_batched": best and best["backend"], "best_batched_ms": best and best["time_ms"],
            "best_batched_over_per_group": best and best["time_ms"] / base["time_ms"],
            "best_eager_batched": best_eager and best_eager["backend"],
            "variants_failed": [r["backend"] for r in rows if "error" in r]}


def run(spec: HotBatchSpec) -> dict:
    root = Path(spec.results_dir) / spec.sweep_name
    dev = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    prov = rawio.provenance()
    report = {"done": [], "skipped": [], "failed": []}
    for case in spec.cases:
        d = root / case.name
        if not spec.force and rawio.cell_state(d) == "done":
            report["skipped"].append(case.name)
            continue
        cell = {"cell_id": case.name, "kind": "hot_batch", "shape": asdict(spec.shape), **asdict(case)}
        rawio.write_json(d / "config.json", {**asdict(spec), "cell": cell, "provenance": prov})
        try:
            rows = bench_case(spec, case, dev)
            rawio.write_jsonl(d / "kernel.jsonl", rows)
            rawio.write_json(d / "metrics.json", {"cell_id": case.name, **metrics_of(rows)})
            if (d / "failure.json").exists():
                (d / "failure.json").unlink()
            report["done"].append(case.name)
        except Exception as e:  # noqa: BLE001 - a failed cell is recorded and the sweep goes on
            rawio.write_json(d / "failure.json", {"cell_id": case.name, "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc(), "config": cell})
            report["failed"].append(case.name)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _main(cfg) -> None:
    spec = resolve(cfg)
    rep = run(spec)
    root = Path(spec.results_dir) / spec.sweep_name
    for case in spec.cases:
        if rawio.cell_state(root / case.name) == "done":
            for r in rawio.read_jsonl(root / case.name / "kernel.jsonl"):
                print(f"{case.name:14s} {r['backend']:22s} graph {r.get('time_ms', float('nan')):8.4f} ms  eager "
                      f"{r.get('time_ms_eager', float('nan')):8.4f} ms  host {r.get('host_us', float('nan')):7.1f} us  "
                      f"plan {r.get('plan_us', float('nan')):7.1f} us  err {r.get('rel_err', float('nan')):.1e} "
                      f"{r.get('error', '')}")
    print(f"{TOOL}: wrote {len(rep['done'])} cells, {len(rep['failed'])} failed, {len(rep['skipped'])} already done -> {root}")
    if rep["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name=TOOL, version_base=None)(_main)()
