"""Beyond the paper: the families of cells where the static design loses, and their ratios to SGLang default."""
from __future__ import annotations
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import pandas as pd

from analysis.common import (NOT_MEASURED, THROUGHPUT, aggregate, code_versions, identity, json_digest, select, show,
                             with_derived)
from analysis.gpu import GPU, with_gpu
from analysis.load import Results






VARIANTS = ("granikv", "granikv_dynamic")   # static split (the paper's design) and the dynamic one


BASE = "sglang_default"


TARGET = 0.97


TABLE = "hardware.decision_table"


OWN_BUDGET = "=h200|h100"   # a GPU model's own KV budget: its hardware preset


@dataclass(frozen=True)
class Family:
    """One group of cells: ``sel`` (analysis.common.select selectors) and the ``dims`` that name a point,
    with the values each dim is expected to take (points without a cell are listed as not measured)."""

    name: str
    sel: dict[str, str]
    dims: dict[str, tuple] = field(default_factory=dict)
    targets: dict[tuple, float] = field(default_factory=dict)   # point (dims' values) -> target other than TARGET
    target_from: str | None = None   # a variant whose ratio at a point is the other variants' target there

    def __post_init__(self):
        if not self.dims:
            raise ValueError(f"Family {self.name}: dims must name at least one config key")
        if self.target_from is not None and self.target_from not in VARIANTS:
            raise ValueError(f"Family {self.name}: target_from={self.target_from!r} is not a variant; "
                             f"use one of {', '.join(VARIANTS)}")
        for point in self.targets:
            if len(point) != len(self.dims):
                raise ValueError(f"Family {self.name}: target point {point} has {len(point)} values for "
                                 f"{len(self.dims)} dims ({', '.join(self.dims)})")


FAMILIES = (
    Family("multiprefix uniform, A100-40GB budget",
           {"workload.kind": "=multiprefix", "workload.prefix_lens": "=null", "hardware.name": "=a100_40gb"},
           {"config": ("llama3_8b TP=1",), "workload.num_prefixes": (1, 4, 16, 64)}),
    Family("multiprefix heterogeneous, A100-40GB budget",
           {"workload.kind": "=multiprefix", "workload.prefix_lens": "!=null", "hardware.name": "=a100_40gb"},
           {"config": ("llama3_8b TP=1",), "workload.num_prefixes": (4, 8)},
           targets={("llama3_8b TP=1", 8): 1.82}),
    Family("limitation, ShareGPT Lp=512",
           {"workload.kind": "=sharegpt", "workload.prefix_len": "=512", "workload.batch": ">=512",
            "hardware.name": OWN_BUDGET, "tp": "=1"},
           {"config": ("llama3_8b TP=1", "qwen25_14b TP=1"), "workload.batch": (512, 1024)}),
    Family("synthetic grid, small B",
           {"workload.kind": "=synthetic", "workload.batch": "<=32", "workload.prefix_len": "<=2048",
            "hardware.name": OWN_BUDGET, "workload.num_prefixes": "=1"},
           {"config": ("llama3_8b TP=1",), "workload.prefix_len": (512, 1024, 2048), "workload.batch": (8, 32)}),
    Family("headline, ShareGPT B=256",
           {"workload.kind": "=sharegpt", "workload.batch": "=256", "hardware.name": OWN_BUDGET, "tp": "=1",
            "workload.num_prefixes": "=1"},
           {"config": ("llama3_8b TP=1",), "workload.prefix_len": (512, 1024, 2048, 4096, 8192, 16384)},
           target_from="granikv"),
)


COLUMNS = ["family", "point", GPU, "system", "table", "n", "tok_s", "n_base", "base_tok_s", "ratio_vs_sglang_default",
           "target", "meets", "code", "status"]


def point_label(fam: Family, values: tuple) -> str:
    return ", ".join(f"{k.split('.')[-1]}={show(v)}" for k, v in zip(fam.dims, values))


def family_rows(cells: pd.DataFrame, config_cols: list[str], fam: Family) -> list[dict]:
    """The rows of one family (see the module doc); ``cells`` carry analysis.common.with_derived's columns.
    A row is one GPU model's cells, over that GPU model's SGLang default; an expected point no GPU model
    measured is a not-measured row without one."""
    df = family_cells(cells, fam)
    dims = list(fam.dims)
    # config keys that vary inside the family beyond the point and GPU model (a setting two sweeps differ in)
    # split rows; the decision table and the system's own keys do not (see the module doc)
    extra = [c for c in identity(df, config_cols) if c not in dims + [GPU] and c != TABLE
             and not c.startswith(("system.", "model.")) and c != "tp"
             and df[c].astype(str).groupby([df[k] for k in dims + [GPU]]).nunique().gt(1).any()] if not df.empty else []
    rows, seen = [], set()
    if not df.empty:
        df = df.assign(table=[json_digest(v) for v in df[TABLE]] if TABLE in df.columns else "-")
        keys = dims + [GPU] + extra
        base = aggregate(df[df["system"] == BASE], keys, THROUGHPUT)[keys + ["mean", "n"]]
        base = base.rename(columns={"mean": "base_tok_s", "n": "n_base"})
        var = df[df["system"].isin(VARIANTS)]
        agg = aggregate(var, keys + ["system", "table"], THROUGHPUT)
        agg = agg.merge(code_versions(var, keys + ["system", "table"]), on=keys + ["system", "table"], how="left")
        agg = agg.merge(base, on=keys, how="left")
        for r in agg.to_dict("records"):
            values = tuple(r[d] for d in dims)
            target = fam.targets.get(values, TARGET)
            ratio = r["mean"] / r["base_tok_s"] if pd.notna(r.get("base_tok_s")) else float("nan")
            point = point_label(fam, values) + "".join(f", {k}={show(r[k])}" for k in extra)
            rows.append({"family": fam.name, "point": point, GPU: r[GPU], "system": r["system"], "table": r["table"],
                         "n": r["n"],
                         "tok_s": r["mean"], "n_base": r.get("n_base") if pd.notna(r.get("n_base")) else 0,
                         "base_tok_s": r.get("base_tok_s"), "ratio_vs_sglang_default": ratio, "target": target,
                         "meets": NOT_MEASURED if pd.isna(ratio) else ("yes" if ratio >= target else "no"),
                         "code": r["code"], "status": "measured" if pd.notna(ratio) else f"{NOT_MEASURED} (no {BASE} twin)"})
            seen.add((values, r["system"]))
    for values, system in expected(fam):
        if (values, system) not in seen:
            rows.append({"family": fam.name, "point": point_label(fam, values), "system": system, "table": "-", "n": 0,
                         "target": fam.targets.get(values, TARGET), "meets": NOT_MEASURED, "status": NOT_MEASURED})
    return _targets_from(fam, rows) if fam.target_from else rows


def _targets_from(fam: Family, rows: list[dict]) -> list[dict]:
    """Hold every variant but ``fam.target_from`` to that variant's best measured ratio at the same point on
    the same GPU model (when above the row's own target); ``meets`` follows the new target."""
    best: dict[tuple, float] = {}
    for r in rows:
        ratio = r.get("ratio_vs_sglang_default")
        at = (r["point"], r.get(GPU))
        if r["system"] == fam.target_from and ratio is not None and pd.notna(ratio):
            best[at] = max(best.get(at, ratio), ratio)
    for r in rows:
        at = (r["point"], r.get(GPU))
        if r["system"] != fam.target_from and at in best and best[at] > r["target"]:
            r["target"] = best[at]
            if r["meets"] != NOT_MEASURED:
                r["meets"] = "yes" if r["ratio_vs_sglang_default"] >= r["target"] else "no"
    return rows


def family_cells(cells: pd.DataFrame, fam: Family) -> pd.DataFrame:
    """``fam``'s uninstrumented cells of SGLang default and the variants (``cells`` with_derived), each with
    its GPU model (``gpu``). A variant cell whose dispatcher was forced (``system.dispatch`` other than
    ``table``: an ablation such as every class on cascade) is another system and is left out; cells older
    than the key ran the table."""
    df = select(with_gpu(cells), {**fam.sel, "instrumented": "=False"}) if not cells.empty else cells
    if df.empty:
        return df
    dispatch = df["system.dispatch"].fillna("table") if "system.dispatch" in df.columns else "table"
    return df[df["system"].isin((BASE,) + VARIANTS) & ((df["system"] == BASE) | (dispatch == "table"))]


def expected(fam: Family):
    """Every (point values, variant) the family expects a cell for, in table order."""
    return ((values, system) for values in product(*fam.dims.values()) for system in VARIANTS)


def beyond_frame(res: Results) -> pd.DataFrame:
    """Every family's rows (COLUMNS), in FAMILIES order."""
    cells = with_derived(res.cells)
    rows = [r for fam in FAMILIES for r in family_rows(cells, res.config_columns, fam)]
    return pd.DataFrame(rows, columns=COLUMNS)


def per_family(res: Results, family_frame, columns: list[str]) -> pd.DataFrame:
    """``family_frame(cells, root, fam)`` (a DataFrame of ``columns``) for every family, in FAMILIES order,
    concatenated: how the step and plan tables beside this one walk the same cells."""
    cells = with_derived(res.cells)
    parts = [family_frame(cells, Path(res.root), fam) for fam in FAMILIES]
    parts = [p for p in parts if not p.empty]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
