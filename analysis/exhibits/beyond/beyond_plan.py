"""Host cost of a decode step's plan in the "beyond the paper" cells: a GraniKV variant's plan() against
SGLang default's at the same batch size (the target: "plan() costs no more than the baseline's at the same
batch").

Each engine cell's trace records, per decode step, ``plan_us``: the host time of the attention backend's
make_plan + load (the policy's choices, the KV index lists, FlashInfer's plan calls), and whether the
step replayed a CUDA graph. For every analysis.beyond row (family, point, system, table) and step kind
(``graph``: replayed; ``eager``: above the graph limit or otherwise not replayed):

- the variant's and SGLang default's decode steps at the same point on the same GPU model (column ``gpu``;
  two GPU models never pool) are grouped by batch size, pooled over their cells (repetitions), and each batch
  size's median ``plan_us`` taken;
- ``plan_us`` / ``base_plan_us``: the variant's and SGLang default's medians, averaged over the batch sizes
  both ran in this step kind, each weighted by the variant's steps at that batch size (the variant's batch
  mix, priced at both systems' plan costs); ``plan_ratio``: plan_us / base_plan_us;
- ``steps``: the variant's steps at those batch sizes; ``batches``: how many batch sizes matched;
- ``meets``: ``plan_ratio`` <= 1 (no tolerance: the ratio is printed; a reader judges a 2% miss);
- ``plan_scope``: what ``plan_us`` covers, from the cell's ``decode_plan_scope`` (granikv.engine.runner
  PLAN_SCOPE): ``gather+plan`` = gathering the step's slot lists from the slot table plus the plan, for
  every system (as SGLang's own plan builds its kv_indices); ``plan`` (cells without the key) = the plan
  alone, the full lists gathered before it was timed (GraniKV's plan then re-derived its prefix-free
  lists from them). A variant is compared only with baseline cells of the same scope.

A variant step kind with no batch size in common with SGLang default's gets no row (eager steps exist only
above the graph limit); an expected (point, variant) of analysis.beyond with no row at all is listed as
not measured. Writes tables/beyond_plan.{csv,md}; ``lines`` gives the REPORT's summary.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, json_digest, write_table
from analysis.gpu import GPU
from analysis.load import Results, load_steps
from analysis.measures.families import BASE, Family, TABLE, expected, family_cells, per_family, point_label
from analysis.registry import register_exhibit
from granikv.rawio import SchemaError, data_path

NAME = "beyond_plan"
FIGURES: tuple[str, ...] = ()
TARGET = 1.0
SCOPE_KEY = "decode_plan_scope"           # engine stats (metrics.json): what plan_us covers
SCOPES = {"plan": "the plan alone", "gather+plan": "the slot-list gather and the plan"}
COLUMNS = ["family", "point", GPU, "system", "table", "step_kind", "plan_scope", "steps", "batches", "plan_us", "base_plan_us",
           "plan_ratio", "target", "meets", "status"]


def cell_plan(path: str | Path) -> pd.DataFrame:
    """One cell's decode steps as (step_kind, batch_size, plan_us) rows; empty where the trace records no
    ``plan_us`` (cells from before the engine recorded it)."""
    trace = data_path(Path(path) / "steps.jsonl")
    if not trace.exists():
        raise SchemaError(f"{Path(path) / 'steps.jsonl'}: `<file>` is missing (a serving cell records its steps)")
    st = trace.stat()
    return _cell_plan_cached(str(path), st.st_mtime_ns, st.st_size).copy()


@lru_cache(maxsize=512)
def _cell_plan_cached(path: str, mtime_ns: int, size: int) -> pd.DataFrame:
    s = load_steps(path)
    cols = ["step_kind", "batch_size", "plan_us"]
    if "plan_us" not in s.columns or "kind" not in s.columns:
        return pd.DataFrame(columns=cols)
    d = s[(s["kind"] == "decode") & s["plan_us"].notna()]
    graph = d["cuda_graph"].fillna(False).astype(bool) if "cuda_graph" in d.columns else pd.Series(True, index=d.index)
    return pd.DataFrame({"step_kind": np.where(graph, "graph", "eager"), "batch_size": d["batch_size"].astype(int),
                         "plan_us": d["plan_us"].astype(float)})[cols]


def family_plan(cells: pd.DataFrame, root: Path, fam: Family) -> pd.DataFrame:
    """The rows of ``fam`` (COLUMNS): one per (point, GPU model, variant, table, step kind) with a batch size in
    common with SGLang default's steps at that point on that GPU model, then a not-measured row per expected
    (point, variant) without one on any GPU model."""
    measured, traced = _measured(cells, root, fam)
    seen = set(zip(measured["point"], measured["system"]))
    missing = [{"family": fam.name, "point": point, "system": system, "table": "-", "step_kind": "-",
                "plan_scope": "-", "steps": 0,
                "batches": 0, "target": TARGET, "meets": NOT_MEASURED,
                "status": NOT_MEASURED + (f" (no batch size in common with {BASE})"
                                          if (point, system) in traced else "")}
               for point, system in ((point_label(fam, v), s) for v, s in expected(fam))
               if (point, system) not in seen]
    parts = [p for p in (measured, pd.DataFrame(missing, columns=COLUMNS)) if not p.empty]
    return pd.concat(parts, ignore_index=True)[COLUMNS] if parts else pd.DataFrame(columns=COLUMNS)


def _measured(cells: pd.DataFrame, root: Path, fam: Family) -> tuple[pd.DataFrame, set]:
    """The measured rows of ``fam`` (see family_plan), and the (point, variant) pairs whose cells record
    plan times at all."""
    df = family_cells(cells, fam)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS), set()
    dims = list(fam.dims) + [GPU]
    parts = []
    for _, c in df.iterrows():
        p = cell_plan(root / c["path"])
        if p.empty:
            continue
        table = json_digest(c[TABLE]) if c["system"] != BASE and TABLE in c.index else "-"
        scope = c.get(SCOPE_KEY)
        parts.append(p.assign(system=c["system"], table=table, plan_scope=scope if isinstance(scope, str) else "plan",
                              **{d: c[d] for d in dims}))
    if not parts:
        return pd.DataFrame(columns=COLUMNS), set()
    steps = pd.concat(parts, ignore_index=True)
    traced = {(point_label(fam, tuple(k[:len(fam.dims)])), k[-1]) for k in steps.groupby(dims + ["system"]).groups}
    keys = dims + ["system", "table", "step_kind", "plan_scope", "batch_size"]
    med = steps.groupby(keys, as_index=False).agg(us=("plan_us", "median"), n=("plan_us", "size"))
    base = med[med["system"] == BASE].drop(columns=["system", "table", "n"]).rename(columns={"us": "base_us"})
    m = med[med["system"] != BASE].merge(base, on=dims + ["step_kind", "plan_scope", "batch_size"])
    rows = []
    for key, g in m.groupby(dims + ["system", "table", "step_kind", "plan_scope"], sort=False):
        w = g["n"].to_numpy(float)
        us, base_us = float(np.average(g["us"], weights=w)), float(np.average(g["base_us"], weights=w))
        ratio = us / base_us
        rows.append({"family": fam.name, "point": point_label(fam, key[:len(fam.dims)]), GPU: key[len(fam.dims)],
                     "system": key[-4],
                     "table": key[-3], "step_kind": key[-2], "plan_scope": key[-1], "steps": int(w.sum()),
                     "batches": len(g),
                     "plan_us": us, "base_plan_us": base_us, "plan_ratio": ratio,
                     "target": TARGET, "meets": "yes" if ratio <= TARGET else "no", "status": "measured"})
    return pd.DataFrame(rows, columns=COLUMNS), traced


def plan_frame(res: Results) -> pd.DataFrame:
    """Every family's rows, in analysis.FAMILIES order."""
    return per_family(res, family_plan, COLUMNS)


def lines(t: pd.DataFrame) -> list[str]:
    """The REPORT's paragraph on plan cost: per GPU model, variant and step kind, how many rows meet the target
    and the range of plan_ratio."""
    L = ["", "Host cost of planning a decode step (tables/beyond_plan.md): each variant's plan() against SGLang "
             "default's at the same batch size, over the same cells.", ""]
    t = t[t["status"] == "measured"]
    if t.empty:
        return L + [f"- {NOT_MEASURED}: no cell records plan_us."]
    for (gpu, system, kind, scope), g in t.groupby([GPU, "system", "step_kind", "plan_scope"], sort=False):
        worst = g.loc[g["plan_ratio"].idxmax()]
        L.append(f"- {gpu}, {system}, {kind} steps, plan_us covering {SCOPES.get(scope, scope)}: "
                 f"{int((g['meets'] == 'yes').sum())} of {len(g)} rows at or below the "
                 f"baseline's plan time; plan_ratio {g['plan_ratio'].min():.2f}-{g['plan_ratio'].max():.2f} "
                 f"(worst: {worst['family']}, {worst['point']}, {worst['plan_us']:.0f} us against "
                 f"{worst['base_plan_us']:.0f} us).")
    return L


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return lines(plan_frame(res))


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=5, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/beyond_plan.{csv,md}; return the table."""
    t = plan_frame(res)
    write_table(t, NAME, out, {"plan_us": 0, "base_plan_us": 0, "plan_ratio": 2, "target": 2},
                title="Beyond the paper: host time of a decode step's plan, GraniKV against SGLang default at the same batch",
                note="plan_us / base_plan_us: median host time of make_plan + load per decode step at each batch size, "
                     "averaged over the batch sizes both systems ran in this step kind (weighted by the variant's "
                     "steps); plan_ratio: plan_us / base_plan_us; target: plan_ratio <= 1. plan_scope: what plan_us "
                     "covers: gather+plan = gathering the step's slot lists from the slot table plus the plan (every "
                     "system, as SGLang's plan builds its kv_indices); plan = the plan alone, the lists gathered "
                     "before it (older cells). Variant and baseline are paired within one scope.")
    return t
