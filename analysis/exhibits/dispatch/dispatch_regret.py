"""The dispatcher against the kernel grid: at every kernel-bench decode cell (``runners.kernel_bench``, one
layer's prefix attention for a shape, Lp and B, one prefix class; cells of several classes are left out:
the table decides per class), the option today's decision table picks beside the fastest option measured
there, and how much slower the pick is.

The options are GraniKV's three prefix paths as the kernel bench times them: ``dense`` (the batched GEMM
over the HOT slab), ``granikv_cascade`` (its cascade path) and ``paged``. The table is the one a run would
load now: ``conf/hardware/<hardware>.yaml`` of the bench cell's hardware preset, read through
``granikv.attention.dispatch.Dispatcher`` for the cell's GPU and per-rank shape. A step with B above the
preset's ``cuda_graph_max_bs`` runs eager in the engine: there the table's eager rules decide and the
options' eager device times are compared (without the host launch time the calibration adds, which the
kernel bench does not record); otherwise the graph rules and the graph-replay times. ``bench_choice`` /
``bench_us``: the bench's own ``granikv`` row (the table of the day it ran), for reference.

``regret``: the pick's time over the fastest option's, minus 1; ``within_3pct``: regret <= 0.03 (the
hardware-limit target: the dispatcher within 3% of the fastest option at every kernel-grid cell).
Several sweeps measuring the same cell and option pool by mean (``n``: the rows behind the pick).

Writes tables/dispatch_regret.{csv,md}.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.dispatch import HARDWARE_DIR, preset
from analysis.measures.kernels import kernel_frame
from analysis.registry import register_exhibit
from granikv.attention.dispatch import Dispatcher


NAME = "dispatch_regret"
FIGURES: tuple[str, ...] = ()
OPTIONS = {"dense": "dense", "cascade": "granikv_cascade", "paged": "paged"}   # table choice -> bench backend
WITHIN = 0.03
KEYS = ["provenance.gpu_name", "hardware", "cell.shape.name", "cell.shape.hq", "cell.shape.hkv", "cell.shape.d",
        "cell.prefix_len", "cell.batch"]
COLUMNS = ["gpu", "shape", "Lp", "B", "kind", "paged_us", "cascade_us", "dense_us", "fastest", "table_choice",
           "table_us", "regret", "within_3pct", "n", "bench_choice", "bench_us", "status"]


def _bench_choice(decisions) -> str | None:
    if isinstance(decisions, str):
        try:
            decisions = json.loads(decisions)
        except ValueError:
            return None
    if isinstance(decisions, list) and decisions and isinstance(decisions[0], dict):
        return decisions[0].get("backend")
    return None


def expected_grid(hardware: str = "h200") -> list[tuple]:
    """(gpu, shape, Lp, B) of the kernel bench's grid for a hardware preset (conf/kernel_bench.yaml
    ``presets.<hardware>``, the GPU named by conf/hardware/<hardware>.yaml): the cells a full kernel run
    measures, listed as not measured where no row is there."""
    doc = yaml.safe_load((HARDWARE_DIR.parent / "kernel_bench.yaml").read_text()) or {}
    p = (doc.get("presets") or {}).get(hardware) or {}
    gpu = preset(hardware).get("gpu_name") or hardware
    return [(gpu, s["name"], float(lp), float(b)) for s in p.get("shapes", []) for lp in p.get("prefix_lens", [])
            for b in p.get("batches", [])]


def regret_frame(res: Results) -> pd.DataFrame:
    """One row per kernel-grid decode cell (COLUMNS): the measured ones with all three options timed, and
    a not-measured row for a cell missing an option, and for each cell of the H200 grid
    (``expected_grid``) that no row measured."""
    t = _measured(res)
    seen = {(r.gpu, r.shape, float(r.Lp), float(r.B)) for r in t.itertuples(index=False)}
    missing = [{"gpu": g, "shape": s, "Lp": lp, "B": b, "n": 0, "status": NOT_MEASURED}
               for g, s, lp, b in expected_grid() if (g, s, lp, b) not in seen]
    if missing:
        t = pd.concat([t, pd.DataFrame(missing, columns=COLUMNS)], ignore_index=True) if len(t) else \
            pd.DataFrame(missing, columns=COLUMNS)
    return t


def _measured(res: Results) -> pd.DataFrame:

    k = kernel_frame(res)
    if k.empty or "cell.kind" not in k.columns:
        return pd.DataFrame(columns=COLUMNS)
    k = k[(k["cell.kind"] == "decode") & k["k.backend"].isin(list(OPTIONS.values()) + ["granikv"])]
    if "cell.num_prefixes" in k.columns:       # one class per cell: the table decides per class
        k = k[pd.to_numeric(k["cell.num_prefixes"], errors="coerce").fillna(1) == 1]
    if k.empty or not set(KEYS) <= set(k.columns):
        return pd.DataFrame(columns=COLUMNS)
    k = k.reindex(columns=KEYS + ["k.backend", "k.time_ms", "k.time_ms_eager", "k.decisions"])   # rows may lack the last ones
    rows = []
    for key, g in k.groupby(KEYS, sort=True, dropna=False):
        gpu, hw, shape, hq, hkv, d, lp, b = key
        cfg = preset(str(hw))
        eager = b > (cfg.get("cuda_graph_max_bs") or 0)
        col = "k.time_ms_eager" if eager else "k.time_ms"
        t = {opt: pd.to_numeric(g.loc[g["k.backend"] == be, col], errors="coerce").mean() * 1e3
             for opt, be in OPTIONS.items()}
        n = {opt: int(pd.to_numeric(g.loc[g["k.backend"] == be, col], errors="coerce").notna().sum())
             for opt, be in OPTIONS.items()}
        bench = g[g["k.backend"] == "granikv"]
        row = {"gpu": gpu, "shape": shape, "Lp": lp, "B": b, "kind": "eager" if eager else "graph",
               "paged_us": t["paged"], "cascade_us": t["cascade"], "dense_us": t["dense"],
               "bench_choice": _bench_choice(bench["k.decisions"].iloc[0]) if len(bench) else None,
               "bench_us": pd.to_numeric(bench[col], errors="coerce").mean() * 1e3 if len(bench) else np.nan}
        if any(np.isnan(v) for v in t.values()) or not cfg:
            why = "no hardware preset " + str(hw) if not cfg else "not every option timed"
            rows.append({**row, "n": 0, "status": f"{NOT_MEASURED} ({why})"})
            continue
        disp = Dispatcher(int(hq), int(hkv), int(d), str(gpu), cfg.get("decision_table"))
        choice = disp.choose(int(lp), int(b), graph=not eager) if disp.has_table else None
        fastest = min(t, key=t.get)
        if choice is None:
            rows.append({**row, "fastest": fastest, "n": 0,
                         "status": f"{NOT_MEASURED} (no decision-table rule for this GPU and shape)"})
            continue
        regret = t[choice] / t[fastest] - 1
        rows.append({**row, "fastest": fastest, "table_choice": choice, "table_us": t[choice], "regret": regret,
                     "within_3pct": "yes" if regret <= WITHIN else "no", "n": n[choice], "status": "measured"})
    return pd.DataFrame(rows, columns=COLUMNS)


def summary(t: pd.DataFrame) -> str:
    """One sentence: at how many cells the table's pick is within 3% of the fastest, and the worst."""
    m = t[t["status"] == "measured"] if not t.empty else t
    if m.empty:
        return f"dispatcher vs the kernel grid: {NOT_MEASURED}"
    worst = m.loc[m["regret"].idxmax()]
    if worst["regret"] <= 0:
        return f"today's decision table picks the fastest option at every one of the {len(m)} kernel-grid cells"
    return (f"today's decision table picks an option within 3% of the fastest at {int((m['within_3pct'] == 'yes').sum())} "
            f"of {len(m)} kernel-grid cells; worst: {worst['shape']} Lp={int(worst['Lp'])} B={int(worst['B'])} "
            f"({worst['kind']}), {worst['table_choice']} {worst['regret']:+.0%} against {worst['fastest']}")


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/dispatch_regret.{csv,md}; return the table."""
    t = regret_frame(res)
    write_table(t, NAME, out, {"paged_us": 1, "cascade_us": 1, "dense_us": 1, "table_us": 1, "bench_us": 1,
                               "regret": 3},
                title="Dispatcher vs the kernel grid: today's table's pick against the fastest option",
                note=summary(t) + ". Times: one layer's prefix attention per call, us (graph replay; eager device "
                     "time where B is above the preset's CUDA-graph limit); cascade: GraniKV's cascade path.")
    return t
