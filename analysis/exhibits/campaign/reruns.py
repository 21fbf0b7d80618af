"""Reruns, before and after: every configuration whose older cells a rerun sweep superseded
(conf/campaign.yaml ``supersedes``; analysis/clean.py ``prefer_rerun``), with the older cells' output
throughput next to the rerun's, each with its repetitions (n) and code version; then every cell a
forced rerun (``runners.run ... force=true``) replaced in place, its old result kept under
``<sweep>/.superseded/`` (``superseded_sweep`` names that folder, ``rerun_sweep`` the cell's sweep).

A row is one GPU model's configuration (column ``gpu``: a configuration includes its GPU model, so the
cells of two never pool). This is where a fix's effect on measured cells is read (the one-commit headline against the
mixed-version cells it replaced; GraniKV's multi-prefix cells rerun after pool-aware eviction). The
older cells stay in results/raw; every other table uses the rerun's alone.

Writes tables/reruns.{csv,md}.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.clean import config_keys
from analysis.common import THROUGHPUT, code_versions, rename_short, sort_rows, with_derived, write_table
from analysis.gpu import GPU, with_gpu
from analysis.load import Results
from analysis.registry import register_exhibit



NAME = "reruns"
SHOWN = (GPU, "model.name", "tp", "hardware.name", "workload.kind", "workload.batch", "workload.prefix_len",
         "workload.num_prefixes", "workload.prefix_lens", "system")   # the keys a row names, where they vary
COLUMNS = ["superseded_sweep", "rerun_sweep", "n_before", "before", "code_before", "n_after", "after", "code_after",
           "after_over_before"]


def table(res: Results, metric: str = THROUGHPUT) -> pd.DataFrame:
    """One row per superseded configuration (a rerun sweep), then one per cell a forced rerun replaced:
    the GPU model and the configuration's varying keys, then ``COLUMNS`` (``before`` / ``after``: the mean of ``metric`` over
    the older / the rerun's repetitions)."""
    parts = [t for t in (sweep_reruns(res, metric), forced_reruns(res, metric)) if not t.empty]
    if not parts:
        return pd.DataFrame(columns=[GPU, "system"] + COLUMNS)
    t = pd.concat(parts, ignore_index=True)
    return t[[c for c in t.columns if c not in COLUMNS] + COLUMNS]


def forced_reruns(res: Results, metric: str = THROUGHPUT) -> pd.DataFrame:
    """One row per cell kept under ``<sweep>/.superseded/`` (``Results.superseded``): the old cell against
    the cell now at its place (``after`` empty where that one is no longer loaded)."""
    if res.superseded.empty:
        return pd.DataFrame()
    old = with_gpu(with_derived(res.superseded.reset_index(drop=True)))
    now = with_derived(pd.concat([res.cells, res.set_aside], ignore_index=True))
    now = now.drop_duplicates(["sweep", "cell_id"]).set_index(["sweep", "cell_id"]) if not now.empty else now
    shown = [c for c in SHOWN if c in old.columns and (c in (GPU, "system") or old[c].astype(str).nunique() > 1)]
    code = lambda r: str(r.get("provenance.git_commit", "unknown"))[:7]  # noqa: E731
    rows = []
    for _, r in old.iterrows():
        cur = now.loc[(r["sweep"], r["cell_id"])] if not now.empty and (r["sweep"], r["cell_id"]) in now.index else None
        rows.append({**{c: r[c] for c in shown}, "superseded_sweep": r["path"], "rerun_sweep": r["sweep"],
                     "n_before": 1, "before": r.get(metric), "code_before": code(r),
                     "n_after": int(cur is not None), "after": cur.get(metric) if cur is not None else None,
                     "code_after": code(cur) if cur is not None else ""})
    t = pd.DataFrame(rows)
    t["after_over_before"] = pd.to_numeric(t["after"]) / pd.to_numeric(t["before"])
    return sort_rows(t[shown + COLUMNS], ["rerun_sweep"] + shown)


def sweep_reruns(res: Results, metric: str = THROUGHPUT) -> pd.DataFrame:
    """The rows of configurations a rerun sweep superseded (analysis/clean.py ``prefer_rerun``)."""
    a = res.set_aside
    if a.empty or "superseded_by" not in a.columns or not a["superseded_by"].notna().any():
        return pd.DataFrame()
    old = with_gpu(with_derived(a[a["superseded_by"].notna()].drop(columns=["capture_share", "set_aside_for"],
                                                                   errors="ignore").reset_index(drop=True)))
    new = with_gpu(with_derived(res.cells[res.cells["sweep"].isin(set(old["superseded_by"]))].reset_index(drop=True)))
    old["_key"], new["_key"] = config_keys(old, res.config_columns), config_keys(new, res.config_columns)
    new = new[new["_key"].isin(set(old["_key"]))]
    shown = [c for c in SHOWN if c in old.columns and (c in (GPU, "system") or old[c].astype(str).nunique() > 1)]

    def side(df: pd.DataFrame, tag: str) -> pd.DataFrame:
        g = df.groupby("_key", sort=True)
        out = pd.DataFrame({f"n_{tag}": g[metric].count(), tag: g[metric].mean()})
        code = code_versions(df.assign(_k=df["_key"]), ["_k"]).set_index("_k")["code"]
        return out.join(code.rename(f"code_{tag}"))

    g = old.groupby("_key", sort=True)
    names = lambda v: ", ".join(sorted(set(v)))  # noqa: E731 - a configuration may be superseded in two sweeps
    rows = g[shown].first().join(g["sweep"].agg(names).rename("superseded_sweep")) \
        .join(g["superseded_by"].agg(names).rename("rerun_sweep"))
    rows = rows.join(side(old, "before")).join(side(new, "after"))
    rows["after_over_before"] = rows["after"] / rows["before"]
    rows = rows.reset_index(drop=True)
    return sort_rows(rows[shown + COLUMNS], ["rerun_sweep"] + shown)


@register_exhibit(NAME, kind="bookkeeping")
def build(res: Results, out: Path) -> pd.DataFrame:
    """Write tables/reruns; return the table."""
    t = table(res)
    write_table(rename_short(t), NAME, out, {"before": 1, "after": 1, "after_over_before": 3},
                title="Reruns: superseded configurations, before and after (output tok/s)",
                note="before: the superseded cells (every repetition, any code version); after: the rerun's. "
                     "code: the commit behind each side, or N versions. Every other table uses the rerun's cells.")
    return t
