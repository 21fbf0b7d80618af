"""Fit the dispatcher's decision table on this GPU: ``python -m runners.calibrate [hardware=h200]``.

Sweeps Lp x B_class (one prefix class, Meff = B_class * Hq/Hkv) per attention shape and times the
three per-class options (paged, per-class cascade, dense-HOT) with runners.kernel_bench's
machinery. Measurements: ``<results_dir>/calibration/<shape>-lp<Lp>-b<B>/`` (kind ``calibration``),
plus ``fit-<shape>/`` holding the fitted rules. The fitted table goes to ``conf/hardware/<hw>.yaml``
under the key ``decision_table`` (only that key is rewritten; the rest of the file is kept as is).

Fit: at each measured (Lp, Meff) the fastest option wins; Lp buckets and Meff ranges split at the
geometric midpoints between measured points; equal consecutive choices are merged. Every rule
names the GPU and the shape, so one file can hold tables for several shapes.
"""
from __future__ import annotations

import math
import re
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from granikv import rawio
from granikv.attention.bench import Shape, measure_peaks
from granikv.attention.dispatch import check_table
from runners.kernel_bench import BenchSpec, bench_decode_cell, merge_preset

OPTIONS = {"paged": "paged", "granikv_cascade": "cascade", "dense": "dense"}


def resolve(cfg: Any) -> tuple[BenchSpec, dict]:
    from omegaconf import OmegaConf

    merged = merge_preset(OmegaConf.to_container(cfg, resolve=True), "calibrate")
    hw = merged["hardware"]
    own = {k: merged.pop(k) for k in ("hardware_yaml", "write_table")}
    if own["hardware_yaml"] is None:
        own["hardware_yaml"] = str(Path(__file__).resolve().parents[1] / "conf" / "hardware" / f"{hw}.yaml")
    spec = BenchSpec(num_prefixes=[1], backends=list(OPTIONS), layout_batch=1, layout_prefix_lens=[1], layout=False,
                     dispatch_cost=False, **merged)
    return spec, own


def _cuts(xs: list[int]) -> list[int]:
    """Geometric midpoints between consecutive sorted values."""
    return [int(round(math.sqrt(a * b))) for a, b in zip(xs, xs[1:])]


def fit(points: list[dict], gpu: str, shape: Shape) -> list[dict]:
    """Rules from measured points ``{prefix_len, meff, times: {choice: ms}}`` (see module doc)."""
    lps = sorted({p["prefix_len"] for p in points})
    lp_cuts = _cuts(lps)
    rules = []
    for i, lp in enumerate(lps):
        pts = sorted((p for p in points if p["prefix_len"] == lp), key=lambda p: p["meff"])
        meffs = [p["meff"] for p in pts]
        best = [min(p["times"], key=p["times"].get) for p in pts]
        m_cuts = _cuts(meffs)
        lo_lp = 0 if i == 0 else lp_cuts[i - 1]
        hi_lp = None if i == len(lps) - 1 else lp_cuts[i]
        j = 0
        while j < len(pts):
            k = j
            while k + 1 < len(pts) and best[k + 1] == best[j]:
                k += 1
            r = {"gpu": gpu, "num_q_heads": shape.hq, "num_kv_heads": shape.hkv, "head_dim": shape.d,
                 "lp_min": lo_lp, "meff_min": 0 if j == 0 else m_cuts[j - 1], "choice": best[j]}
            if hi_lp is not None:
                r["lp_max"] = hi_lp
            if k < len(pts) - 1:
                r["meff_max"] = m_cuts[k]
            rules.append(r)
            j = k + 1
    return check_table(rules, "calibrate.fit")


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
    gpu = spec.gpu_name or (torch.cuda.get_device_name(0) if spec.device == "cuda" else "cpu")
    peaks = measure_peaks(torch.device(spec.device), spec.torch_dtype)
    prov = rawio.provenance()
    report = {"done": 0, "skipped": 0, "failed": 0, "left": 0, "tables": {}}
    all_rules = []
    for shape in spec.shapes:
        points = []
        complete = True
        for lp in spec.prefix_lens:
            for b in spec.batches:
                cid = f"{shape.name}-lp{lp}-b{b}"
                d = root / cid
                if spec.force or rawio.cell_state(d) != "done":
                    if spec.time_budget_s and time.monotonic() - t0 > spec.time_budget_s:
                        report["left"] += 1
                        complete = False
                        continue
                    cell = {"cell_id": cid, "kind": "calibration", "shape": asdict(shape), "prefix_len": lp,
                            "batch": b, "meff": b * shape.hq // shape.hkv, "suffix_len": spec.suffix_len}
                    rawio.write_json(d / "config.json", {**asdict(spec), "cell": cell, "peaks": peaks, "provenance": prov})
                    try:
                        rows, metrics = bench_decode_cell(spec, shape, lp, b, 1, peaks)
                        rawio.write_jsonl(d / "kernel.jsonl", rows)
                        rawio.write_json(d / "metrics.json", {"cell_id": cid, "meff": cell["meff"], **metrics})
                        report["done"] += 1
                    except Exception as e:  # noqa: BLE001
                        rawio.write_json(d / "failure.json", {"cell_id": cid, "error": f"{type(e).__name__}: {e}",
                                                              "traceback": traceback.format_exc(), "config": cell})
                        report["failed"] += 1
                        complete = False
                        continue
                else:
                    report["skipped"] += 1
                m = rawio.read_json(d / "metrics.json")
                points.append({"prefix_len": lp, "meff": b * shape.hq // shape.hkv,
                               "times": {c: m[f"time_ms_{v}"] for v, c in OPTIONS.items()}})
        if not complete or not points:
            continue
        rules = fit(points, gpu, shape)
        all_rules += rules
        fd = root / f"fit-{shape.name}"
        rawio.write_json(fd / "config.json", {**asdict(spec), "cell": {"cell_id": fd.name, "kind": "calibration_fit",
                                                                      "shape": asdict(shape)}, "provenance": prov})
        rawio.write_jsonl(fd / "kernel.jsonl", points)
        rawio.write_json(fd / "metrics.json", {"cell_id": fd.name, "gpu": gpu, "decision_table": rules,
                                               "num_points": len(points)})
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
            print(f"  Lp [{r['lp_min']}, {r.get('lp_max', 'inf')})  Meff [{r['meff_min']}, {r.get('meff_max', 'inf')}) -> {r['choice']}")
    wrote = f" -> table in {own['hardware_yaml']}" if own["write_table"] and rep["tables"] else " (no table written)"
    print(f"calibrate: {rep['done']} measured, {rep['skipped']} already done, {rep['failed']} failed, "
          f"{rep['left']} left for the next run{wrote}")


if __name__ == "__main__":
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name="calibrate", version_base=None)(_main)()
