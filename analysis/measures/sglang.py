"""The paper's systems inside real SGLang: the plugin's counters and today's plugin settings."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import NULL, SYSTEM_SETTINGS, identity
from granikv.sglang_plugin.path_stats import hist_quantiles






# paper name -> (system inside real SGLang, system in our engine)
SYSTEMS = {"sglang_default": ("sglang_server", "sglang_default"),
           "sglang_cascade": ("sglang_server_cascade", "sglang_cascade"),
           "hydragen": ("sglang_server_hydragen", "hydragen"),
           "granikv": ("sglang_server_granikv", "granikv")}


BASE = "sglang_default"


PATHS = ("dense", "cascade", "hydragen", "paged")


STAGES = ("prefix", "index", "make", "load", "dispatch")


# host time per replayed decode step, quantiles of the cells' pooled histograms (plugin.replay_hist.<stage>):
# column -> (stage, quantile). ``own``: the plugin's part (the step's whole host time less SGLang's own rest-decode
# plan, which SGLang's replay does alike)
HOST_QUANTILES = {"host_p50_us": ("total", "p50"), "own_p50_us": ("own", "p50"), "own_p90_us": ("own", "p90")}


# the plugin settings a row is split by (never pooled across), and today's values
# (conf/system/sglang_server_{cascade,hydragen,granikv}.yaml): cascade_impl for SGLang-Cascade only;
# decode_graphs (derived by with_graph_form): the decode CUDA graphs the plugin's server ran
VARIANTS = {"cascade_impl": "composed", "decode_plan": "fast", "decode_graphs": "full"}
ARGS = "system.server.extra_args"
PLUGIN_TABLE = SYSTEM_SETTINGS[0]
PLUGIN_SYSTEMS = tuple(s for p, (s, _) in SYSTEMS.items() if p != BASE)


def with_graph_form(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` with ``system.decode_graphs`` on the plugin's in-SGLang cells: ``breakable`` when its server
    ran ``--cuda-graph-backend-decode breakable`` (the attention eager at graph breaks), else ``full``
    (SGLang's default full decode graphs, the step's plan written into them); empty elsewhere."""
    if cells.empty or "system.name" not in cells.columns:
        return cells
    plug = cells["system.name"].astype(str).isin(PLUGIN_SYSTEMS)
    args = cells[ARGS].astype(str) if ARGS in cells.columns else pd.Series("", index=cells.index)
    form = pd.Series(np.where(args.str.contains("breakable"), "breakable", "full"), index=cells.index)
    return cells.assign(**{"system.decode_graphs": form.where(plug)})


def plugin_counters(cells: pd.DataFrame) -> dict:
    """The plugin's counters summed over ``cells`` (one system and point): row shares by path and host
    microseconds per split step, and the quantiles of HOST_QUANTILES over every replayed step (NaN where not
    recorded, or where one of the cells did not record it; see the module docstring)."""
    out = {**{f"rows_{p}": np.nan for p in PATHS}, "plan_us": np.nan, **{f"{s}_us": np.nan for s in STAGES},
           **{c: np.nan for c in HOST_QUANTILES}}
    if cells.empty or "plugin.steps" not in cells.columns:
        return out
    rec = cells[cells["plugin.steps"].fillna(0) > 0]      # a window with no step counted recorded nothing
    if rec.empty:
        return out
    for col, (stage, q) in HOST_QUANTILES.items():       # histograms pool by summing their bins
        pre = f"plugin.replay_hist.{stage}."
        bins = [c for c in rec.columns if c.startswith(pre)]
        if bins and rec[bins].notna().any(axis=1).all():
            out[col] = hist_quantiles({c[len(pre):]: rec[c].fillna(0).sum() for c in bins}).get(q, np.nan)
    rows = {p: rec.get(f"plugin.rows.{p}", pd.Series(0.0, index=rec.index)).fillna(0).sum() for p in PATHS}
    total = sum(rows.values())
    steps = rec["plugin.split_steps"].fillna(0).sum()
    if total:
        out.update({f"rows_{p}": rows[p] / total for p in PATHS})
    if steps:
        for col, key in [("plan_us", "plugin.plan_us")] + [(f"{s}_us", f"plugin.{s}_us") for s in STAGES]:
            if key in rec.columns and rec[key].notna().all():
                out[col] = float(rec[key].sum()) / steps
    return out


# the order in which a setting decides which cells a configuration keeps (the first one most)
PRIORITY = ("decode_graphs", "decode_plan", "cascade_impl")


# sweeps whose cells are an ablation with an exhibit of its own (in_sglang_paths: every prefix path forced inside
# SGLang, its `table` cell at the ablation's code version): never a row of the in-SGLang table or a claim's number
ABLATION_SWEEPS = ("in_sglang_paths",)


def without_ablations(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` without those of an ABLATION_SWEEPS sweep."""
    if cells.empty or "sweep" not in cells.columns:
        return cells
    return cells[~cells["sweep"].astype(str).str.startswith(ABLATION_SWEEPS)]


COMMIT, STARTED = "provenance.git_commit", "provenance.started_at"


def latest_version(cells: pd.DataFrame, group: pd.Series) -> pd.Series:
    """Per cell, whether it was measured at the code version its ``group`` (a label per cell) measured last:
    the commit of the group's most recently started cell (``provenance.started_at``). Repetitions of a plugin
    system at two code versions are never pooled; the older version's cells are left out."""
    if cells.empty or COMMIT not in cells.columns:
        return pd.Series(True, index=cells.index)
    commit = cells[COMMIT].astype(str)
    started = cells[STARTED].astype(str) if STARTED in cells.columns else pd.Series("", index=cells.index)
    order = pd.DataFrame({"group": group, "started": started, "commit": commit}).sort_values(["group", "started"])
    last = order.groupby("group")["commit"].last()
    return commit == group.map(last)


def same_run_base(cells: pd.DataFrame, keep: pd.Series, keys: list[str]) -> pd.Series:
    """Per cell, whether to keep it: a plugin cell as ``keep`` says; an SGLang-default cell of a point (``keys``
    without the system's own columns) only if it was measured at a code version (``provenance.git_commit``)
    that one of the point's kept plugin cells was measured at, i.e. in the same run, on the same machine,
    where the point has such a cell; else every SGLang-default cell of the point (a run that measured SGLang
    alone). A ratio then never divides by SGLang cells of another machine session."""
    systems = cells["system.name"].astype(str)
    base = systems == SYSTEMS[BASE][0]
    plug = systems.isin(PLUGIN_SYSTEMS)
    if COMMIT not in cells.columns or not base.any():
        return keep | base
    pkeys = [c for c in keys if not c.startswith("system.") and c != ARGS]
    point = (cells[pkeys].astype(object).where(cells[pkeys].notna(), NULL).astype(str).agg("|".join, axis=1)
             if pkeys else pd.Series("", index=cells.index))
    commit = cells[COMMIT].astype(str)
    runs = (point + "#" + commit)[keep & plug]
    paired = base & (point + "#" + commit).isin(set(runs))
    has_pair = point.isin(set(point[paired]))
    return keep | (base & (paired | ~has_pair))


def prefer_current(cells: pd.DataFrame, config_cols, same_run: bool = True) -> pd.DataFrame:
    """``cells`` with, per configuration of an in-SGLang plugin system (every identity column but its settings),
    only the cells of ONE combination of plugin settings (VARIANTS; the graph form by :func:`with_graph_form`):
    the closest to today's, a setting earlier in PRIORITY deciding first. The claims measure today's plugin
    where a configuration has it and never pool across settings; a configuration measured only with older
    settings keeps the most recent of them (the table names every combination). Of that combination, only the
    cells of the code version measured last (:func:`latest_version`). ``same_run``: SGLang default's cells
    only from the runs of the kept plugin cells where a point has them (:func:`same_run_base`). Ablation cells
    (ABLATION_SWEEPS) are left out."""
    cells = without_ablations(cells)
    if cells.empty or "system.name" not in cells.columns:
        return cells
    given, cells = cells, with_graph_form(cells)      # the derived column decides; the caller's frame comes back
    systems = cells["system.name"].astype(str)
    plug = systems.isin(PLUGIN_SYSTEMS)
    var_cols = [f"system.{k}" for k in VARIANTS if f"system.{k}" in cells.columns]
    if not plug.any() or not var_cols:
        return given
    score = pd.Series(0, index=cells.index)
    combo = pd.Series("", index=cells.index)
    for k in PRIORITY:
        col = f"system.{k}"
        if col not in cells.columns:
            continue
        applies = systems == SYSTEMS["sglang_cascade"][0] if k == "cascade_impl" else pd.Series(True, index=cells.index)
        score = score * 2 + (~applies | (cells[col].astype(str) == VARIANTS[k])).astype(int)
        combo = combo + "|" + cells[col].astype(str).where(applies, "")
    # the graph flag is a variant; the plugin's own graph rules (hardware.plugin_graph_table) are part of its
    # version, like its code: a point measured with new rules keeps only those cells (latest_version)
    keys = [c for c in identity(cells, config_cols) if c not in var_cols and c not in (ARGS, PLUGIN_TABLE)]
    group = cells[keys].astype(object).where(cells[keys].notna(), NULL).astype(str).agg("|".join, axis=1)
    p = pd.DataFrame({"group": group[plug], "score": score[plug], "combo": combo[plug]})
    best = p.sort_values(["score", "combo"], ascending=[False, True]).groupby("group")["combo"].first()
    chosen = plug & (combo == group.map(best))
    latest = latest_version(cells[chosen], group[chosen]).reindex(cells.index, fill_value=False)
    keep = ~plug | (chosen & latest)
    if same_run:
        keep = same_run_base(cells, keep & (plug | ~(systems == SYSTEMS[BASE][0])), keys)
    return given[keep]


def variant_keys(paper: str) -> list[str]:
    """The VARIANTS keys that split ``paper``'s in-SGLang rows (none for SGLang default)."""
    if paper == BASE:
        return []
    return [k for k in VARIANTS if k != "cascade_impl" or paper == "sglang_cascade"]
