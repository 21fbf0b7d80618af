"""Steps of several prefix classes: what the calibration measured there, and what a table fitted on one
class per step picks against a table with rules per class count.

Reads the calibration cells of k > 1 classes (``runners.calibrate num_classes=[1,2,4,...]``: k classes of
B_class adjacent rows each, all at one Lp; cell kind ``calibration``, ``cell.num_prefixes`` = k). Their
options are k dense calls per layer, ONE batched cascade call for all k classes (``granikv_cascade``),
or paged. One row per (GPU, shape, Lp, B_class, k, step kind): each option's cost per layer in us (graph:
CUDA-graph replay; eager: device time plus host launch time, as the calibration's fit counts it), the
fastest (ties: paged, the guard's order), ``one_class_choice``: what the table's rules for ONE class per
step pick for each class (``classes=1``: a table calibrated on single-class steps decides so whatever
the step holds), and ``table_choice``: today's table (``conf/hardware/<hardware>.yaml``) at the step's
k; each with its regret (its cost over the fastest, minus 1).

The engine cells of the multi-class sweeps (``conf/sweep/*_multiclass.yaml``: the dynamic split with
the table, with its one-class rules only, and with every class on the batched cascade path) are read
by ``engine_frame``: output tok/s and TPOT p50 per point and dispatch, against the one-class rules.

Writes tables/multiclass.{csv,md}; ``lines`` gives the REPORT's paragraph. No figure.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.measures.dispatch import preset
from analysis.registry import register_exhibit
from granikv.attention.dispatch import Dispatcher


NAME = "multiclass"
FIGURES: tuple[str, ...] = ()
OPTIONS = {"paged": "paged", "cascade": "granikv_cascade", "dense": "dense"}   # table choice -> calibration backend
KEYS = ["provenance.gpu_name", "hardware", "cell.shape.name", "cell.shape.hq", "cell.shape.hkv", "cell.shape.d",
        "cell.prefix_len", "cell.batch_class", "cell.num_prefixes"]
COLUMNS = ["gpu", "shape", "Lp", "B_class", "k", "kind", "paged_us", "cascade_us", "dense_us", "fastest",
           "one_class_choice", "one_class_regret", "table_choice", "table_regret", "sweep", "status"]
COMMAND = ("bash runners/gpu/calibrate.sh 'shapes=[{name:llama3_8b,hq:32,hkv:8,d:128}]' 'num_classes=[1,2,4,8,16]' "
           "'class_prefix_lens=[512,2048,8192]' 'class_batches=[8,32,128]' max_batch=1024 "
           "'reuse_from=[calibration_eager]' (GRANIKV_CAL_SWEEP=calibration_multiclass)")


def _cost(g: pd.DataFrame, backend: str, eager: bool) -> float:
    r = g[g["k.backend"] == backend]
    if r.empty:
        return float("nan")
    if not eager:
        return float(pd.to_numeric(r["k.time_ms"], errors="coerce").mean()) * 1e3
    dev = pd.to_numeric(r["k.time_ms_eager"], errors="coerce").mean()
    host = pd.to_numeric(r["k.host_ms_eager"], errors="coerce").mean()
    return float(dev + host) * 1e3


def fastest(t: dict[str, float]) -> str:
    """The cheapest option; ties go to paged (the calibration's guard), then table order."""
    return min(t, key=lambda c: (t[c], c != "paged"))


def frame(res: Results) -> pd.DataFrame:
    """One row per multi-class calibration point and step kind (see the module doc)."""

    k = res.kernels
    need = set(KEYS) | {"cell.kind", "k.backend", "k.time_ms", "k.time_ms_eager", "k.host_ms_eager"}
    if k.empty or not need <= set(k.columns):
        return pd.DataFrame(columns=COLUMNS)
    k = k[(k["cell.kind"] == "calibration") & (pd.to_numeric(k["cell.num_prefixes"], errors="coerce") > 1)].copy()
    # the GPU the fit named its rules after: the run's gpu_name override, else the device's, else cpu
    named = k["gpu_name"] if "gpu_name" in k.columns else pd.Series(None, index=k.index, dtype=object)
    k["provenance.gpu_name"] = named.fillna(k["provenance.gpu_name"]).fillna("cpu")
    rows = []
    for key, g in k.groupby(KEYS, sort=True, dropna=False):
        gpu, hw, shape, hq, hkv, d, lp, b, n = key
        cfg = preset(str(hw))
        disp = Dispatcher(int(hq), int(hkv), int(d), str(gpu), cfg.get("decision_table"))
        for kind, graph in (("graph", True), ("eager", False)):
            t = {c: _cost(g, be, not graph) for c, be in OPTIONS.items()}
            row = {"gpu": gpu, "shape": shape, "Lp": int(lp), "B_class": int(b), "k": int(n), "kind": kind,
                   **{f"{c}_us": v for c, v in t.items()}, "sweep": ", ".join(sorted(set(g["sweep"])))}
            if any(pd.isna(v) for v in t.values()):
                rows.append({**row, "status": f"{NOT_MEASURED} (not every option timed)"})
                continue
            if not disp.has_table:
                rows.append({**row, "fastest": fastest(t),
                             "status": f"{NOT_MEASURED} (no decision-table rule for {gpu} and this shape)"})
                continue
            best = fastest(t)
            one = disp.choose(int(lp), int(b), graph=graph, classes=1)
            now = disp.choose(int(lp), int(b), graph=graph, classes=int(n))
            rows.append({**row, "fastest": best, "one_class_choice": one, "one_class_regret": t[one] / t[best] - 1,
                         "table_choice": now, "table_regret": t[now] / t[best] - 1, "status": "measured"})
    return pd.DataFrame(rows, columns=COLUMNS)


def lines(t: pd.DataFrame, res: Results | None = None) -> list[str]:
    """The REPORT's paragraph: per GPU and step kind, how often each table misses the fastest option at
    steps of several classes, and the worst miss of the one-class rules."""
    L = ["", "Steps of several prefix classes (tables/multiclass.md, the calibration's k > 1 cells, one layer per "
             "call): the rules fitted on one class per step and today's table against the fastest option; then "
             "the engine cells of the multi-class sweeps, where a table with rules per class count ran against "
             "its one-class rules.", ""]
    m = t[t["status"] == "measured"] if not t.empty else t
    if m.empty:
        return L + [f"- {NOT_MEASURED}: no calibration cell of several prefix classes."] + (
            engine_lines(res) if res is not None else [])
    for (gpu, kind), g in m.groupby(["gpu", "kind"], sort=True):
        worst = g.loc[g["one_class_regret"].idxmax()]
        one_miss = int((g["one_class_regret"] > 0).sum())
        now_miss = int((g["table_regret"] > 0).sum())
        tail = ""
        if worst["one_class_regret"] > 0:
            tail = (f" (worst: k={worst['k']}, Lp={worst['Lp']}, B_class={worst['B_class']}: "
                    f"{worst['one_class_choice']} {worst[worst['one_class_choice'] + '_us']:.0f} us against "
                    f"{worst['fastest']} {worst[worst['fastest'] + '_us']:.0f} us)")
        L.append(f"- {gpu}, {kind} steps: of {len(g)} points, the one-class rules pick a slower option than the "
                 f"fastest at {one_miss}{tail}; today's table at k classes at {now_miss} (worst regret "
                 f"{g['table_regret'].max():+.0%}).")
    return L + (engine_lines(res) if res is not None else [])


ABLATIONS = ("table", "table_one_class", "cascade_only")   # system.dispatch of the engine's multi-class sweeps


def engine_frame(res: Results) -> pd.DataFrame:
    """The engine cells of the multi-class sweeps (``*_multiclass``): per point (k, prefix lengths) and
    ``system.dispatch``, output tok/s and TPOT p50, and each against ``table_one_class`` (the rules for
    one class per step) at the same point."""
    c = res.cells
    need = {"sweep", "system.dispatch", "workload.num_prefixes", "output_throughput_tok_s", "tpot_p50_ms"}
    if c.empty or not need <= set(c.columns):
        return pd.DataFrame()
    c = c[c["sweep"].astype(str).str.endswith("_multiclass") & c["system.dispatch"].isin(ABLATIONS)].copy()
    if c.empty:
        return pd.DataFrame()
    lens = c["workload.prefix_lens"] if "workload.prefix_lens" in c.columns else pd.Series(None, index=c.index)
    c["lengths"] = [("uniform" if v is None or (isinstance(v, float) and pd.isna(v)) else "heterogeneous")
                    for v in lens]
    tables = c["hardware.decision_table"] if "hardware.decision_table" in c.columns else pd.Series(None, index=c.index)
    classy = ['"classes_m' in json.dumps(t, default=str) for t in tables]       # the table has class-count rules
    c["system.dispatch"] = [d + " (class-count rules)" if d == "table" and k else d
                            for d, k in zip(c["system.dispatch"], classy)]
    keys = ["sweep", "lengths", "workload.num_prefixes", "system.dispatch"]
    g = c.groupby(keys, dropna=False).agg(tok_s=("output_throughput_tok_s", "mean"),
                                          tpot_ms=("tpot_p50_ms", "mean"), n=("cell_id", "size")).reset_index()
    one = g[g["system.dispatch"] == "table_one_class"][keys[:-1] + ["tok_s"]].rename(columns={"tok_s": "one_tok_s"})
    g = g.merge(one, on=keys[:-1], how="left")
    g["vs_one_class"] = g["tok_s"] / g["one_tok_s"]
    return g


def engine_lines(res: Results) -> list[str]:
    """The REPORT's lines on the engine cells of the multi-class sweeps (see ``engine_frame``)."""
    g = engine_frame(res)
    if g.empty:
        return [f"- Engine cells with the class-count rules: {NOT_MEASURED}."]
    L = []
    for (lengths, k), p in g.groupby(["lengths", "workload.num_prefixes"], sort=True):
        parts = [f"{r['system.dispatch']} {r['tok_s']:.0f} tok/s (TPOT p50 {r['tpot_ms']:.1f} ms"
                 + (f", {r['vs_one_class']:.3f}x the one-class rules)" if pd.notna(r["vs_one_class"]) else ")")
                 for r in p.sort_values("system.dispatch").to_dict("records")]
        L.append(f"- Engine, {lengths} k={int(k)} (the dynamic split, A100-40GB budget): " + "; ".join(parts) + ".")
    return L


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return lines(frame(res), res)


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=7, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/multiclass.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"status": f"{NOT_MEASURED}: no calibration cell of several prefix classes "
                                     f"(run {COMMAND})"}], columns=COLUMNS)
    write_table(t, NAME, out, {"paged_us": 1, "cascade_us": 1, "dense_us": 1, "one_class_regret": 3,
                               "table_regret": 3},
                title="Steps of several prefix classes: the calibration's options, and the one-class table's "
                      "pick against the table's",
                note="One layer per call, us: k classes of B_class adjacent rows, one Lp. dense: k dense calls; "
                     "cascade: one batched cascade call for the k classes; paged: one decode. graph: CUDA-graph "
                     "replay; eager: device time + host launch time. one_class_choice: the rules for one class "
                     "per step (classes=1), as a table calibrated on single-class steps decides; table_choice: "
                     "today's table at k classes; regret: the pick's cost over the fastest's, minus 1.")
    return t
