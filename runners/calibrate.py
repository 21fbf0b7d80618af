"""Fit the dispatcher's decision table on this GPU: ``python -m runners.calibrate [hardware=h200]``.

Sweeps Lp x B_class (one prefix class, Meff = B_class * Hq/Hkv) per attention shape and times the
three per-class options (paged, per-class cascade, dense-HOT) with runners.kernel_bench's
machinery, in both step kinds the engine runs:

- graph: CUDA-graph replay of one layer's attention (``time_ms_<option>``; eager when the capture
  failed, as kernel_bench records it);
- eager: the same call without a graph (``time_ms_eager_<option>``: CUDA-event device time of one
  eager call) plus the host time of its launches (``host_ms_eager_<option>``: wall time of one
  eager run() on the host, the GPU idle before it; 0 on CPU, where run() is synchronous and its
  whole time is already the eager time). An eager decode step launches every layer from the host,
  and above the graph limit the engine's eager steps are host-bound (Qwen2.5-14B TP=2, B=511: 25 ms
  per step for 48 layers): an option's extra launches then cost as much as its device time, which
  the device time alone does not show (there the per-layer eager device times favour cascade while
  the engine's eager steps ran slower with it). Eager cost = device time + host launch time.

Steps of several prefix classes (``num_classes`` k > 1): k classes of B_class adjacent rows each (the
engine orders decode rows by class), all at one Lp, over ``class_prefix_lens`` x ``class_batches``
(k * B_class <= ``max_batch``). The options are then k dense calls per layer, ONE batched cascade
call for all k classes, or paged: a one-class calibration cannot see that k small dense calls cost
more than one batched call. Each k is fitted on its own, and its rules carry the class-count range
(``classes_min`` / ``classes_max``) that the dispatcher matches against the step's class count.

Measurements: ``<results_dir>/calibration/<shape>-lp<Lp>-b<B>[-k<k>]/`` (kind ``calibration``; a cell
measured before the eager host times were recorded is measured again), plus ``fit-<shape>/``
holding the fitted rules and the points they came from. ``reuse_from``: other calibration folders
whose finished cells of the same id, measured on the same GPU model, are read instead of measured again (their folders stay as
they are; the fit and its ``fit-<shape>`` cell are this run's). The fitted table goes to
``conf/hardware/<hw>.yaml`` under the key ``decision_table`` (only that key is rewritten; the rest of
the file is kept as is).

Fit (``fit``, a pure function of the points), per step kind:
- the no-regression guard: at each measured (Lp, Meff) the fastest option wins, but an option other
  than paged only when it beats paged by more than ``margin`` (default 0: strictly faster; ties go to
  paged);
- a dense point also gets the path for a class whose prefix is not in HOT (``cold``): the guarded
  best of cascade and paged (written only when it is paged; the dispatcher's default is cascade);
- Lp buckets split at the geometric midpoints between measured Lp values; along Meff, equal
  consecutive choices are merged and two different non-paged choices split at the geometric
  midpoint, but where paged won on one side, paged covers the whole gap up to the other option's
  measured point (off the grid, a split path is only trusted where it was measured to win);
- when the graph and eager rules come out the same, they are written once without a ``graph`` key;
  otherwise the graph rules (``graph: true``) then the eager ones (``graph: false``).
Every rule names the GPU and the shape, so one file can hold tables for several shapes.
"""
from __future__ import annotations

import math
import re
import statistics
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from granikv import rawio
from granikv.attention.bench import Shape, build_cell, measure_peaks, sync
from granikv.attention.dispatch import check_table
from runners.kernel_bench import BenchSpec, bench_decode_cell, make_variant, merge_preset

OPTIONS = {"paged": "paged", "granikv_cascade": "cascade", "dense": "dense"}
MARGIN = 0.0        # fit(): a split option must beat paged by more than this fraction (0: strictly faster)


def resolve(cfg: Any) -> tuple[BenchSpec, dict]:
    from omegaconf import OmegaConf

    merged = merge_preset(OmegaConf.to_container(cfg, resolve=True), "calibrate")
    hw = merged["hardware"]
    own = {k: merged.pop(k, None) for k in ("hardware_yaml", "write_table", "num_classes", "class_prefix_lens",
                                            "class_batches", "max_batch", "reuse_from")}
    if own["hardware_yaml"] is None:
        own["hardware_yaml"] = str(Path(__file__).resolve().parents[1] / "conf" / "hardware" / f"{hw}.yaml")
    spec = BenchSpec(num_prefixes=[1], backends=list(OPTIONS), layout_batch=1, layout_prefix_lens=[1], layout=False,
                     dispatch_cost=False, **merged)
    own["num_classes"] = list(own["num_classes"] or [1])
    own["class_prefix_lens"] = list(own["class_prefix_lens"] or spec.prefix_lens)
    own["class_batches"] = list(own["class_batches"] or spec.batches)
    own["max_batch"] = own["max_batch"] or max(spec.batches)
    own["reuse_from"] = list(own["reuse_from"] or [])
    for key in ("num_classes", "class_prefix_lens", "class_batches"):
        vals = own[key]
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals):
            raise ValueError(f"calibrate.{key}: must be a list of positive ints, got {vals!r}")
    if not isinstance(own["max_batch"], int) or own["max_batch"] < 1:
        raise ValueError(f"calibrate.max_batch: must be a positive int (or null: the largest of batches), "
                         f"got {own['max_batch']!r}")
    if spec.sweep_name in own["reuse_from"]:
        raise ValueError(f"calibrate.reuse_from: lists sweep_name '{spec.sweep_name}' itself; name the OTHER "
                         "calibration folders whose finished cells this run reads instead of measuring")
    return spec, own


def grid(spec: BenchSpec, own: dict) -> list[tuple[int, int, int]]:
    """(Lp, B_class, k) of every cell: k=1 over prefix_lens x batches; k > 1 (k classes of B_class
    adjacent rows each, one Lp) over class_prefix_lens x class_batches with k * B_class <= max_batch."""
    cells = []
    for k in own.get("num_classes") or [1]:
        lps, bs = (spec.prefix_lens, spec.batches) if k == 1 else \
            (own.get("class_prefix_lens") or spec.prefix_lens, own.get("class_batches") or spec.batches)
        cells += [(lp, b, k) for lp in lps for b in bs if k == 1 or k * b <= (own.get("max_batch") or max(spec.batches))]
    return cells


def cell_name(shape: Shape, lp: int, b: int, k: int) -> str:
    """A calibration cell's id: ``<shape>-lp<Lp>-b<B_class>``, plus ``-k<k>`` for k > 1 classes."""
    return f"{shape.name}-lp{lp}-b{b}" + (f"-k{k}" if k > 1 else "")


def _cuts(xs: list[int]) -> list[int]:
    """Geometric midpoints between consecutive sorted values, each in (a, b] (so a stays below it)."""
    return [min(max(int(round(math.sqrt(a * b))), a + 1), b) for a, b in zip(xs, xs[1:])]


def guarded_best(times: dict[str, float], margin: float = MARGIN) -> str:
    """The no-regression guard at one point: the fastest of ``times`` {choice: ms}, where a choice other
    than paged wins only when it is faster than paged by more than ``margin`` (ties: paged, then
    table order)."""
    others = {c: t for c, t in times.items() if c != "paged"}
    if not others:
        return "paged"
    best = min(others, key=others.get)
    paged = times.get("paged")
    return best if paged is None or others[best] * (1.0 + margin) < paged else "paged"


def eager_costs(point: dict) -> dict[str, float]:
    """An eager step's cost per option at a point: device time + host launch time (see module doc)."""
    host = point.get("host_eager") or {}
    return {c: t + host.get(c, 0.0) for c, t in point["times_eager"].items()}


def _fit_kind(points: list[dict], costs, margin: float) -> list[dict]:
    """Range rules (lp/meff bounds, choice, cold) of one step kind; ``costs(point)`` -> {choice: ms}."""
    lps = sorted({p["prefix_len"] for p in points})
    lp_cuts = _cuts(lps)
    rules = []
    for i, lp in enumerate(lps):
        pts = sorted((p for p in points if p["prefix_len"] == lp), key=lambda p: p["meff"])
        meffs = [p["meff"] for p in pts]
        keys = []
        for p in pts:
            t = costs(p)
            best = guarded_best(t, margin)
            cold = None
            if best == "dense" and "cascade" in t:
                cold = guarded_best({c: t[c] for c in ("paged", "cascade") if c in t}, margin)
            keys.append((best, cold))
        m_cuts = _cuts(meffs)
        for j in range(len(pts) - 1):     # paged covers the gap between a paged point and a split one
            a, b = keys[j][0], keys[j + 1][0]
            if a == "paged" and b != "paged":
                m_cuts[j] = meffs[j + 1]
            elif a != "paged" and b == "paged":
                m_cuts[j] = meffs[j] + 1
        lo_lp = 0 if i == 0 else lp_cuts[i - 1]
        hi_lp = None if i == len(lps) - 1 else lp_cuts[i]
        j = 0
        while j < len(pts):
            k = j
            while k + 1 < len(pts) and keys[k + 1] == keys[j]:
                k += 1
            r = {"lp_min": lo_lp, "meff_min": 0 if j == 0 else m_cuts[j - 1], "choice": keys[j][0]}
            if hi_lp is not None:
                r["lp_max"] = hi_lp
            if k < len(pts) - 1:
                r["meff_max"] = m_cuts[k]
            if keys[j][1] == "paged":     # the dispatcher's default cold path is cascade
                r["cold"] = "paged"
            rules.append(r)
            j = k + 1
    return rules


def fit(points: list[dict], gpu: str, shape: Shape, margin: float = MARGIN) -> list[dict]:
    """Rules from measured points ``{prefix_len, meff, times: {choice: ms}}`` (graph-replayed step
    times), optionally with ``times_eager`` and ``host_eager`` (same keys: eager device time and host
    launch time, ms), and ``classes`` (k prefix classes in the step, each of ``meff``; default 1).
    Without eager times the rules are for both step kinds (no ``graph`` key). With points at more
    than one k, each k is fitted on its own and its rules get ``classes_min`` / ``classes_max`` (k
    buckets split at the geometric midpoints, as Lp). See the module doc for the guard and the cuts."""
    eager_pts = any("times_eager" in p for p in points)
    if eager_pts:
        missing = [(p["prefix_len"], p["meff"], p.get("classes", 1)) for p in points if "times_eager" not in p]
        if missing:
            raise ValueError(f"calibrate.fit: points {missing} have no times_eager (every point needs both kinds)")
    ks = sorted({p.get("classes", 1) for p in points})
    k_cuts = _cuts(ks)
    graph, eager = [], []
    for i, k in enumerate(ks):
        pts = [p for p in points if p.get("classes", 1) == k]
        bounds = {}
        if len(ks) > 1:
            if i > 0:
                bounds["classes_min"] = k_cuts[i - 1]
            if i < len(ks) - 1:
                bounds["classes_max"] = k_cuts[i]
        graph += [{**r, **bounds} for r in _fit_kind(pts, lambda p: p["times"], margin)]
        if eager_pts:
            eager += [{**r, **bounds} for r in _fit_kind(pts, eager_costs, margin)]
    kinds = [(None, graph)] if not eager_pts or eager == graph else [(True, graph), (False, eager)]
    rules = []
    for kind, rs in kinds:
        for r in rs:
            out = {"gpu": gpu, "num_q_heads": shape.hq, "num_kv_heads": shape.hkv, "head_dim": shape.d, **r}
            if kind is not None:
                out["graph"] = kind
            rules.append(out)
    return check_table(rules, "calibrate.fit")


def host_launch_ms(spec: BenchSpec, shape: Shape, lp: int, b: int, k: int = 1) -> dict[str, float]:
    """Per option (OPTIONS' keys): median host wall time of one eager run() of a planned cell (``b``
    requests over ``k`` classes of adjacent rows), the GPU idle before each call (the launches, and any
    host sync a path has inside run()). On CPU: 0.0, as run() computes synchronously and
    kernel_bench's eager time already holds all of it."""
    if spec.device != "cuda":
        return {v: 0.0 for v in OPTIONS}
    dev = torch.device(spec.device)
    kc, vc, batch = build_cell(shape, lp, b, k, spec.suffix_len, spec.torch_dtype, dev, spec.seed, blocked=k > 1)
    q = torch.randn(b, shape.hq, shape.d, device=dev).to(spec.torch_dtype)
    out = {}
    for v in OPTIONS:
        be = make_variant(spec, shape, v, cuda_graph=False)
        be.plan(batch)
        for _ in range(spec.warmup + 1):
            be.run(q, kc, vc)
        ts = []
        for _ in range(spec.reps):
            sync(dev)
            t0 = time.perf_counter()
            be.run(q, kc, vc)
            ts.append((time.perf_counter() - t0) * 1e3)
        sync(dev)
        out[v] = statistics.median(ts)
        del be
    return out


def _current(d: Path) -> bool:
    """A finished cell that holds every time the fit reads (cells of older runs lack the eager host times)."""
    if rawio.cell_state(d) != "done":
        return False
    m = rawio.read_json(d / "metrics.json")
    return all(f"{k}_{v}" in m for v in OPTIONS for k in ("time_ms", "time_ms_eager", "host_ms_eager"))


def _gpu_of(d: Path):
    """The GPU a cell was measured on (its provenance)."""
    return (rawio.read_json(d / "config.json").get("provenance") or {}).get("gpu_name")


def point_of(m: dict, lp: int, meff: int, k: int = 1) -> dict:
    """The fit's point from a calibration cell's metrics.json (``k`` classes of ``meff`` each)."""
    return {"prefix_len": lp, "meff": meff, **({"classes": k} if k > 1 else {}),
            "times": {c: m[f"time_ms_{v}"] for v, c in OPTIONS.items()},
            "times_eager": {c: m[f"time_ms_eager_{v}"] for v, c in OPTIONS.items()},
            "host_eager": {c: m[f"host_ms_eager_{v}"] for v, c in OPTIONS.items()}}


def write_table(path: Path, rules: list[dict], shapes: list[Shape], gpu: str) -> None:
    """Replace the rules of (gpu, shapes) under the top-level ``decision_table`` key; keep everything else."""
    import yaml

    text = path.read_text() if path.exists() else f"# created by runners.calibrate (decision_table only)\nname: {path.stem}\n"
    existing = (yaml.safe_load(text) or {}).get("decision_table") or []
    ours = {(gpu, s.hq, s.hkv, s.d) for s in shapes}
    kept = [r for r in existing if (r.get("gpu"), r.get("num_q_heads"), r.get("num_kv_heads"), r.get("head_dim")) not in ours]
    block = yaml.safe_dump({"decision_table": kept + rules}, sort_keys=False, default_flow_style=None)
    # drop the old key: the `decision_table:` line and its indented / list continuation lines
    text = re.sub(r"(?m)^decision_table:.*\n(?:(?:[ \t-].*)?\n)*", "", text)
    if text and not text.endswith("\n"):
        text += "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    rawio._atomic_write(path, text + block)


def run(spec: BenchSpec, own: dict) -> dict:
    t0 = time.monotonic()
    root = Path(spec.results_dir) / spec.sweep_name
    reuse = [Path(spec.results_dir) / name for name in own.get("reuse_from") or []]
    gpu = spec.gpu_name or (torch.cuda.get_device_name(0) if spec.device == "cuda" else "cpu")
    peaks = measure_peaks(torch.device(spec.device), spec.torch_dtype)
    prov = rawio.provenance()
    report = {"done": 0, "skipped": 0, "reused": 0, "failed": 0, "left": 0, "stale": 0, "tables": {}}
    all_rules = []
    cells = grid(spec, own)
    for shape in spec.shapes:
        points = []
        complete = True
        for lp, b, k in cells:
            cid = cell_name(shape, lp, b, k)
            d = root / cid
            meff = b * shape.hq // shape.hkv
            # measured by an earlier run on this GPU model (another model's cells are measured here again)
            found = next((r / cid for r in reuse if _current(r / cid) and _gpu_of(r / cid) == prov.get("gpu_name")),
                         None)
            if found is not None and not spec.force:
                report["reused"] += 1
                points.append(point_of(rawio.read_json(found / "metrics.json"), lp, meff, k))
                continue
            if spec.force or not _current(d):
                stale = not spec.force and rawio.cell_state(d) == "done"   # no eager host times yet
                if stale:   # raw cells are never overwritten by a plain run: a new folder, or force
                    raise ValueError(f"{d} is a calibration cell of an older run (no eager host times): "
                                     f"calibrate into a new folder (sweep_name={spec.sweep_name}_eager; the old "
                                     "cells stay as they are) or pass force=true to measure it again in place")
                if spec.time_budget_s and time.monotonic() - t0 > spec.time_budget_s:
                    report["left"] += 1
                    complete = False
                    continue
                # batch: the step's requests (k * B_class), as kernel_bench names them; meff: per class
                cell = {"cell_id": cid, "kind": "calibration", "shape": asdict(shape), "prefix_len": lp,
                        "batch": k * b, "batch_class": b, "meff": meff, "suffix_len": spec.suffix_len,
                        "num_prefixes": k, "class_rows": "blocked" if k > 1 else "one_class"}
                rawio.write_json(d / "config.json", {**asdict(spec), "cell": cell, "peaks": peaks, "provenance": prov})
                try:
                    kspec = replace(spec, class_rows="blocked") if k > 1 else spec
                    rows, metrics = bench_decode_cell(kspec, shape, lp, k * b, k, peaks)
                    host = host_launch_ms(spec, shape, lp, k * b, k)
                    for r in rows:
                        r["host_ms_eager"] = host[r["backend"]]
                    eager = {f"{m}_{r['backend']}": r[m] for r in rows for m in ("time_ms_eager", "host_ms_eager")}
                    eager.update({f"graph_replayed_{r['backend']}": r["graph"] for r in rows})
                    rawio.write_jsonl(d / "kernel.jsonl", rows)
                    rawio.write_json(d / "metrics.json", {"cell_id": cid, "meff": meff, "num_prefixes": k,
                                                          **metrics, **eager})
                    report["done"] += 1
                    report["stale"] += stale
                except Exception as e:  # noqa: BLE001
                    rawio.write_json(d / "failure.json", {"cell_id": cid, "error": f"{type(e).__name__}: {e}",
                                                          "traceback": traceback.format_exc(), "config": cell})
                    report["failed"] += 1
                    complete = False
                    continue
            else:
                report["skipped"] += 1
            points.append(point_of(rawio.read_json(d / "metrics.json"), lp, meff, k))
        if not complete or not points:
            continue
        rules = fit(points, gpu, shape)
        all_rules += rules
        fd = root / f"fit-{shape.name}"
        rawio.write_json(fd / "config.json", {**asdict(spec), "cell": {"cell_id": fd.name, "kind": "calibration_fit",
                                                                      "shape": asdict(shape)},
                                              "reuse_from": [str(r) for r in reuse], "provenance": prov})
        rawio.write_jsonl(fd / "kernel.jsonl", points)
        rawio.write_json(fd / "metrics.json", {"cell_id": fd.name, "gpu": gpu, "decision_table": rules,
                                               "num_points": len(points), "margin": MARGIN,
                                               "eager_cost": "time_ms_eager + host_ms_eager",
                                               "kind_specific": any("graph" in r for r in rules),
                                               "class_specific": any("classes_min" in r or "classes_max" in r
                                                                     for r in rules)})
        report["tables"][shape.name] = rules
    if own["write_table"] and all_rules:
        write_table(Path(own["hardware_yaml"]), all_rules, [s for s in spec.shapes if s.name in report["tables"]], gpu)
    return report


def _main(cfg) -> None:
    spec, own = resolve(cfg)
    rep = run(spec, own)
    for name, rules in rep["tables"].items():
        print(f"{name}:")
        for r in rules:
            kind = {True: "graph", False: "eager"}.get(r.get("graph"), "both")
            cold = f" (COLD prefix: {r['cold']})" if "cold" in r else ""
            ks = (f"  classes [{r.get('classes_min', 0)}, {r.get('classes_max', 'inf')})"
                  if "classes_min" in r or "classes_max" in r else "")
            print(f"  {kind:5s} Lp [{r['lp_min']}, {r.get('lp_max', 'inf')})  Meff [{r['meff_min']}, "
                  f"{r.get('meff_max', 'inf')}){ks} -> {r['choice']}{cold}")
    wrote = f" -> table in {own['hardware_yaml']}" if own["write_table"] and rep["tables"] else " (no table written)"
    print(f"calibrate: {rep['done']} measured, "
          f"{rep['skipped']} already done, {rep['reused']} read from {own['reuse_from']}, {rep['failed']} failed, "
          f"{rep['left']} left for the next run{wrote}")


if __name__ == "__main__":
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name="calibrate", version_base=None)(_main)()
