"""Step breakdown of the "beyond the paper" cells: where a GraniKV variant's time goes next to SGLang
default's at the same point, so that a cell that misses its target is explained by measurement.

The cells are analysis.beyond's families. From each cell's trace (analysis.headline_steps.cell_steps:
measured steps only, warm-up excluded), averaged over the cells of a (family, point, system, table) row:

- ``prefill_s`` / ``decode_s``: summed wall time of prefill / decode steps; ``decode_steps``: their count
  (a system that fits fewer requests at once runs more, smaller decode steps);
- ``decode_eager_steps`` / ``decode_eager_s``: decode steps run without a CUDA graph (above the graph
  limit), where host launch cost is not hidden;
- ``decode_batch_mean``: mean decode batch size;
- ``decode_speedup``: SGLang default's decode_s over the variant's (above 1: the variant decodes faster);
  ``prefill_share``: the variant's prefill_s over its prefill_s + decode_s (time no attention backend
  changes, which bounds the end-to-end ratio).

SGLang default's columns (``base_*``) pool its cells at the point on the same GPU model, as analysis.beyond's
ratio does; a row is one GPU model's cells (column ``gpu``), never two.
Writes tables/beyond_steps.{csv,md}; ``miss_lines`` gives the REPORT's lines on the cells that miss.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, json_digest, write_table
from analysis.gpu import GPU
from analysis.load import Results
from analysis.measures.families import (BASE, Family, TABLE, beyond_frame, expected, family_cells, per_family,
                                        point_label)
from analysis.measures.steps import cell_steps
from analysis.registry import register_exhibit



NAME = "beyond_steps"
FIGURES: tuple[str, ...] = ()
STEP_COLS = ["prefill_s", "decode_s", "decode_steps", "decode_eager_steps", "decode_eager_s", "decode_batch_mean"]
COLUMNS = (["family", "point", GPU, "system", "table", "n"] + STEP_COLS + [f"base_{c}" for c in STEP_COLS]
           + ["decode_speedup", "prefill_share", "status"])


def family_steps(cells: pd.DataFrame, root: Path, fam: Family) -> pd.DataFrame:
    """One row per (point, GPU model, system, table) of ``fam`` with a measured cell (COLUMNS; the baseline's
    step columns pooled per point and GPU model), and a not-measured row per expected (point, variant) no GPU
    model measured."""
    measured = _measured(cells, root, fam)
    seen = set(zip(measured["point"], measured["system"])) if not measured.empty else set()
    missing = [{"family": fam.name, "point": point_label(fam, values), "system": system, "table": "-", "n": 0,
                "status": NOT_MEASURED}
               for values, system in expected(fam) if (point_label(fam, values), system) not in seen]
    parts = [p for p in (measured, pd.DataFrame(missing, columns=COLUMNS)) if not p.empty]
    return pd.concat(parts, ignore_index=True)[COLUMNS] if parts else pd.DataFrame(columns=COLUMNS)


def _measured(cells: pd.DataFrame, root: Path, fam: Family) -> pd.DataFrame:
    """The rows of ``fam``'s (point, GPU model, system, table) groups that have a variant cell."""
    df = family_cells(cells, fam)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    dims = list(fam.dims) + [GPU]
    rows = []
    for _, c in df.iterrows():
        s = cell_steps(root / c["path"], int(c["workload.batch"]))
        rows.append({**{d: c[d] for d in dims}, "system": c["system"],
                     "table": json_digest(c[TABLE]) if TABLE in c.index else "-",
                     **{k: s[k] for k in STEP_COLS}})
    raw = pd.DataFrame(rows)
    base = raw[raw["system"] == BASE].groupby(dims, as_index=False)[STEP_COLS].mean()
    base = base.rename(columns={c: f"base_{c}" for c in STEP_COLS})
    var = raw[raw["system"] != BASE]
    if var.empty:
        return pd.DataFrame(columns=COLUMNS)
    agg = var.groupby(dims + ["system", "table"], as_index=False).agg(
        n=("decode_s", "size"), **{c: (c, "mean") for c in STEP_COLS})
    agg = agg.merge(base, on=dims, how="left")
    agg["decode_speedup"] = agg["base_decode_s"] / agg["decode_s"]
    agg["prefill_share"] = agg["prefill_s"] / (agg["prefill_s"] + agg["decode_s"])
    agg["family"] = fam.name
    agg["point"] = [point_label(fam, tuple(r[d] for d in fam.dims)) for _, r in agg.iterrows()]
    agg["status"] = "measured"
    return agg[COLUMNS]


def steps_frame(res: Results) -> pd.DataFrame:
    """Every family's rows, in analysis.FAMILIES order."""
    return per_family(res, family_steps, COLUMNS)


def miss_lines(t: pd.DataFrame, steps: pd.DataFrame) -> list[str]:
    """One REPORT line per measured row of analysis.beyond's table ``t`` that misses its target, with
    its step breakdown from ``steps`` (this module's table)."""
    miss = t[t["meets"] == "no"]
    steps = steps[steps["status"] == "measured"]
    if miss.empty:
        return []
    key = ["family", "point", GPU, "system", "table"]
    m = miss.merge(steps, on=key, how="left", suffixes=("", "_steps"))
    L = ["", "The cells that miss their target, with their step breakdown (tables/beyond_steps.md):", ""]
    for r in m.to_dict("records"):
        head = (f"- {r['family']}, {r['point']}, {r[GPU]}, {r['system']}: {r['ratio_vs_sglang_default']:.2f}x against "
                f"{r['target']:.2f}x.")
        if pd.isna(r.get("decode_s")):
            L.append(head + " (no step trace)")
            continue
        L.append(head + f" Decode {r['decode_s']:.2f} s in {r['decode_steps']:.0f} steps "
                 f"({r['decode_eager_steps']:.0f} eager) against SGLang default's {r['base_decode_s']:.2f} s in "
                 f"{r['base_decode_steps']:.0f} ({r['base_decode_eager_steps']:.0f} eager): {r['decode_speedup']:.2f}x. "
                 f"Prefill {r['prefill_s']:.2f} s against {r['base_prefill_s']:.2f} s; prefill is "
                 f"{r['prefill_share']:.0%} of the variant's step time. Mean decode batch {r['decode_batch_mean']:.0f} "
                 f"against {r['base_decode_batch_mean']:.0f}." + needed_line(r))
    return L


def needed_line(r: dict) -> str:
    """What the decode steps would have to reach for the target with this prefill time: the step-time
    ratio target asks for (SGLang default's summed step time over the target, less the variant's
    prefill), as a decode speedup over SGLang default; '' when prefill alone exceeds that budget."""
    total = r["base_prefill_s"] + r["base_decode_s"]
    budget = total / r["target"] - r["prefill_s"]
    if budget <= 0:
        return (f" With this prefill the target is out of reach in step time: prefill alone takes more than "
                f"SGLang default's step time over {r['target']:.2f}.")
    return (f" At this prefill time, {r['target']:.2f}x in step time needs the decode steps at {budget:.2f} s, "
            f"a {r['base_decode_s'] / budget:.2f}x decode speedup.")


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return miss_lines(beyond_frame(res), steps_frame(res))


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=4, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/beyond_steps.{csv,md}; return the table."""
    t = steps_frame(res)
    digits = {c: 2 for c in STEP_COLS + [f"base_{c}" for c in STEP_COLS]}
    digits.update({"decode_steps": 0, "base_decode_steps": 0, "decode_eager_steps": 0, "base_decode_eager_steps": 0,
                   "decode_batch_mean": 1, "base_decode_batch_mean": 1, "decode_speedup": 2, "prefill_share": 2})
    write_table(t, NAME, out, digits,
                title="Beyond the paper: step breakdown of each GraniKV variant next to SGLang default",
                note="prefill_s / decode_s: summed step wall time by kind (measured steps); decode_eager_*: decode "
                     "steps without a CUDA graph; base_*: SGLang default at the same point; decode_speedup: "
                     "base_decode_s / decode_s; prefill_share: prefill_s / (prefill_s + decode_s).")
    return t
