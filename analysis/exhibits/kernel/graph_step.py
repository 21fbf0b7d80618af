"""The SGLang plugin's captured decode step, each prefix path forced, against SGLang's own captured decode
(``runners.graph_step_bench``: cells of kind ``graph_step``, one per case; one kernel row per variant). One row
per GPU model and case: the device time of one layer's replay for SGLang and for each of the plugin's paths,
each path over SGLang's, the fastest path, the path the graph rules picked when it was measured and the one
the rules fitted from the sweep's one-class cells pick (its ``fit-<shape>`` cell), the captured step's fixed cost
(its ``paged`` form, where nothing splits, over SGLang's), the host time of the step's plan and load, and the
largest error against SGLang's output.

Writes tables/graph_step.{csv,md}. No figure.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.common import NOT_MEASURED, write_table
from analysis.load import Results
from analysis.registry import register_exhibit
from granikv.attention.dispatch import Dispatcher

NAME = "graph_step"
PATHS = ("paged", "cascade", "dense")
COLS = ["gpu", "case", "prefix_lens", "batch", "sglang_us", "paged_us", "cascade_us", "dense_us", "best",
        "best_over_sglang", "rule_then", "fitted_rule", "fixed_us", "load_us", "max_rel_err", "sweep", "status"]


def _list(v) -> list:
    return json.loads(v) if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else []


def frame(res: Results) -> pd.DataFrame:
    """One row per (GPU, sweep, case) of every graph_step cell."""
    k = res.kernels
    if k.empty or "cell.kind" not in k.columns:
        return pd.DataFrame(columns=COLS)
    k = k[k["cell.kind"] == "graph_step"]
    c = res.cells
    fits = {}                                     # sweep -> the dispatcher of its fit cell's rules
    if "cell.kind" in c.columns and "rules" in c.columns:
        for _, f in c[c["cell.kind"] == "graph_step_fit"].iterrows():
            rules = _list(f["rules"])
            if rules:
                r0 = rules[0]
                fits[f["sweep"]] = Dispatcher(r0["num_q_heads"], r0["num_kv_heads"], r0["head_dim"], r0["gpu"], rules)
    rows = []
    for (gpu, sweep, case), g in k.groupby(["provenance.gpu_name", "sweep", "cell.cell_id"], sort=True, dropna=False):
        ok = g[g["k.time_ms"].notna()]
        t = {p: 1e3 * float(ok.loc[ok["k.path"] == p, "k.time_ms"].iloc[0]) for p in ("sglang",) + PATHS
             if (ok["k.path"] == p).any()}
        if "sglang" not in t:
            continue
        ours = {p: t[p] for p in PATHS if p in t}
        best = min(ours, key=ours.get) if ours else None
        then = c[(c["sweep"] == sweep) & (c["cell_id"] == case)] if "table_choice" in c.columns else c.iloc[:0]
        lens = _list(g["cell.prefix_lens"].iloc[0])
        b = int(g["cell.batch"].iloc[0])
        fitted = ""
        if sweep in fits and len(lens) == 1:
            fitted = fits[sweep].choose(lens[0], b, graph=True)
        load = ok.loc[ok["k.path"] != "sglang", "k.load_us"] if "k.load_us" in ok.columns else pd.Series(dtype=float)
        rows.append({"gpu": gpu, "case": case, "prefix_lens": "/".join(str(x) for x in lens), "batch": b,
                     "sglang_us": t["sglang"], **{f"{p}_us": t.get(p, float("nan")) for p in PATHS}, "best": best,
                     "best_over_sglang": ours[best] / t["sglang"] if best else float("nan"),
                     "rule_then": "/".join(_list(then["table_choice"].iloc[0])) if len(then) else "",
                     "fitted_rule": fitted,
                     "fixed_us": t["paged"] - t["sglang"] if "paged" in t else float("nan"),
                     "load_us": float(load.median()) if len(load) else float("nan"),
                     "max_rel_err": ok["k.rel_err"].max(), "sweep": sweep, "status": "measured"})
    return pd.DataFrame(rows, columns=COLS)


@register_exhibit(NAME)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/graph_step.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"case": "(none)", "status": f"{NOT_MEASURED}: no graph_step cell (run python -m "
                                                       "runners.graph_step_bench hardware=<gpu preset>)"}], columns=COLS)
    write_table(t, NAME, out, {"sglang_us": 1, "paged_us": 1, "cascade_us": 1, "dense_us": 1, "best_over_sglang": 2,
                               "fixed_us": 1, "load_us": 0, "max_rel_err": 4},
                title="The plugin's captured decode step per prefix path, against SGLang's captured decode",
                note="One attention layer of a B-row decode step (Llama-3.1-8B shape), device time of a CUDA-graph "
                     "replay, FlashInfer of the engine's environment. sglang_us: SGLang's flashinfer backend, one "
                     "batch decode over every request's whole slot list; <path>_us: the plugin's captured step "
                     "(the rest decode with LSE, the prefix launches, one row merge) with every class forced to that "
                     "path; best_over_sglang < 1: the plugin's fastest path beats SGLang; rule_then: the path the "
                     "graph rules in use when the cell ran picked; fitted_rule: the path the rules fitted from these "
                     "cells pick (the plugin's graph rules, hardware.plugin_graph_table); fixed_us = paged_us - "
                     "sglang_us, what the captured prefix launches cost a step in which nothing splits; load_us: "
                     "host time of the step's plan and buffer load; max_rel_err: against SGLang's output.")
    return t
