"""The dispatcher's frames: its routing columns, its time per step, and the hardware presets it reads."""
from __future__ import annotations
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.clean import all_cells
from analysis.common import select, with_derived
from analysis.load import Results, load_steps
from granikv.rawio import data_path



def with_dispatch(cells: pd.DataFrame) -> pd.DataFrame:
    """Cells plus ``dense_fraction`` / ``cascade_fraction`` / ``paged_fraction`` of dispatch_counts."""
    df = with_derived(cells)
    cnt = [c for c in df.columns if c.startswith("dispatch_counts.")]
    if df.empty or not cnt:
        return df.assign(dense_fraction=np.nan, cascade_fraction=np.nan, paged_fraction=np.nan) if not df.empty else df
    total = df[cnt].fillna(0).sum(axis=1).replace(0, np.nan)
    for b in ("dense", "cascade", "paged"):
        col = f"dispatch_counts.{b}"
        df[f"{b}_fraction"] = (df[col].fillna(0) if col in df.columns else 0) / total
    return df


DISPATCHING = {"kind": "=serving", "system.name": "~granikv"}


def bench_dispatch_us(res: Results) -> tuple[float, float]:
    """(Dispatcher.choose us per step for one class, whole plan() us) from the kernel bench, else NaN."""
    k = res.kernels
    if k.empty or not {"cell.kind", "k.backend", "k.num_classes", "k.us_per_step"} <= set(k.columns):
        return float("nan"), float("nan")
    d = select(k, {"cell.kind": "=dispatch", "k.num_classes": "=1"})
    pick = lambda b: float(d.loc[d["k.backend"] == b, "k.us_per_step"].mean()) if (d["k.backend"] == b).any() else float("nan")  # noqa: E731
    return pick("dispatcher"), pick("granikv_plan_cpu")


def decode_timings(cell: Path) -> tuple[int, float, tuple[float, float] | None]:
    """(decode steps, their mean step time in ms, (mean, p50) of their ``dispatch_us`` or None where the
    trace records none) of one cell's steps.jsonl; read once per file version (the table, a claim and the
    report's dispatch line ask for the same cells)."""
    trace = data_path(Path(cell) / "steps.jsonl")
    if not trace.exists():
        return _decode_timings(cell)   # load_steps names the missing file
    st = trace.stat()
    return _decode_timings_cached(str(cell), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=1024)
def _decode_timings_cached(cell: str, mtime_ns: int, size: int) -> tuple[int, float, tuple[float, float] | None]:
    return _decode_timings(cell)


def _decode_timings(cell: str | Path) -> tuple[int, float, tuple[float, float] | None]:
    steps = load_steps(cell)
    dec = steps[steps["kind"] == "decode"] if "kind" in steps.columns else steps
    step_ms = 1e3 * pd.to_numeric(dec["step_time_s"], errors="coerce").mean() if "step_time_s" in dec.columns else np.nan
    if "dispatch_us" in dec.columns and pd.to_numeric(dec["dispatch_us"], errors="coerce").notna().any():
        us = pd.to_numeric(dec["dispatch_us"], errors="coerce")
        return len(dec), step_ms, (float(us.mean()), float(us.median()))
    return len(dec), step_ms, None


def overhead_frame(res: Results) -> pd.DataFrame:
    """One row per dispatch_overhead cell: its columns plus decode steps, mean decode step ms,
    dispatcher us per step (and where it comes from), plan() us, and ``share_pct``. Every cell, those
    analysis.clean sets aside included: graph capture in a run does not touch the dispatcher's CPU time.
    Instrumented cells (torch.profiler, nsys) are left out: the profiler's host hooks slow the dispatcher too."""
    cells = with_derived(all_cells(res))
    cells = select(cells, {**DISPATCHING, "instrumented": "=False"}) if not cells.empty else cells
    if not cells.empty:   # the plugin inside real SGLang: its dispatch cost is in tables/in_sglang (its own counters)
        cells = cells[~cells["system"].str.startswith("sglang_server")]
    bench_us, plan_us = bench_dispatch_us(res)
    rows = []
    for _, r in cells.iterrows():
        n_dec, step_ms, own = decode_timings(Path(res.root) / r["path"])
        if own is not None:
            (disp, p50), src = own, "steps.jsonl"
        else:
            disp, p50, src = bench_us, np.nan, "kernel_bench dispatch_cost" if np.isfinite(bench_us) else ""
        commit = str(r.get("provenance.git_commit") or "")[:7]
        rows.append({**r.to_dict(), "commit": commit, "decode_steps": n_dec, "step_ms_mean": step_ms, "dispatch_us": disp,
                     "dispatch_us_p50": p50, "dispatch_from": src, "bench_lookup_us": bench_us,
                     "plan_us_cpu": plan_us, "share_pct": 100 * disp / (1e3 * step_ms)})
    return pd.DataFrame(rows)


HARDWARE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"


@lru_cache(maxsize=None)
def preset(name: str) -> dict:
    """conf/hardware/<name>.yaml as a dict ({} when there is no such preset)."""
    p = HARDWARE_DIR / f"{name}.yaml"
    return (yaml.safe_load(p.read_text()) or {}) if p.exists() else {}
