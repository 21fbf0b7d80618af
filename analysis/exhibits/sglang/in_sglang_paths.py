"""GraniKV inside real SGLang with each prefix path forced (the plugin's ``GRANIKV_DISPATCH``), beside SGLang itself
at the same code version on the same GPU model (conf/sweep/in_sglang_paths.yaml, the headline's workload).

Which path the plugin's graph rules choose is one question; whether a path is the reason GraniKV trails SGLang is
another: when every forced path trails SGLang by about as much, the loss is in what every step of the plugin
pays (its captured launches and host work), not in the choice. One row per GPU model, code version, Lp and
dispatch mode (``table``: the plugin's rules; ``*_only``: every class on that path): output tok/s and its ratio
over the ``sglang_server`` cells of the same GPU model, Lp and code version (NaN where none), ITL p50 of both,
the share of replayed decode steps with a split class, the decode rows by path, the plugin's host time per split
step and per replayed step (NaN in a cell that did not count it).

Writes tables/in_sglang_paths.{csv,md}. No figure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, THROUGHPUT, with_derived, write_table
from analysis.gpu import GPU, with_gpu
from analysis.load import Results
from analysis.measures.sglang import ABLATION_SWEEPS, PATHS, SYSTEMS, BASE, plugin_counters
from analysis.registry import register_exhibit

NAME = "in_sglang_paths"
OURS = SYSTEMS["granikv"][0]
REAL = SYSTEMS[BASE][0]
COLS = [GPU, "code", "workload.prefix_len", "dispatch", "n", "tok_s", "over_sglang", "n_sglang", "sglang_tok_s",
        "itl_p50_ms", "sglang_itl_p50_ms", "split_share", *[f"rows_{p}" for p in PATHS], "plan_us",
        "replay_host_us", "status"]


def _code(df: pd.DataFrame) -> pd.Series:
    return df["provenance.git_commit"].astype(str).str[:7] if "provenance.git_commit" in df.columns \
        else pd.Series("unknown", index=df.index)


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(df[col], errors="coerce") if col in df.columns else pd.Series(np.nan, index=df.index)


def frame(res: Results) -> pd.DataFrame:
    c = res.cells
    if c.empty or "sweep" not in c.columns or "system.name" not in c.columns:
        return pd.DataFrame(columns=COLS)
    c = with_gpu(with_derived(c)).assign(code=lambda d: _code(d))
    ours = c[c["sweep"].astype(str).str.startswith(ABLATION_SWEEPS) & (c["system.name"] == OURS)]
    real = c[(c["system.name"] == REAL) & (c.get("workload.kind", pd.Series("", index=c.index)) == "sharegpt")]
    rows = []
    keys = [GPU, "code", "workload.prefix_len", "system.dispatch"]
    for (gpu, code, lp, mode), g in ours.groupby(keys, sort=True, dropna=False):
        base = real[(real[GPU] == gpu) & (real["code"] == code) & (real["workload.prefix_len"] == lp)]
        tok, btok = _num(g, THROUGHPUT).mean(), _num(base, THROUGHPUT).mean()
        steps = _num(g, "plugin.replay_steps").sum()
        split = _num(g, "plugin.split_steps").sum()
        decode = split + sum(_num(g, f"plugin.paged_steps.{r}").sum() for r in ("no_split", "no_prefix"))
        replay = _num(g, "plugin.replay_host_us").sum() / steps if steps else np.nan
        rows.append({GPU: gpu, "code": code, "workload.prefix_len": int(lp), "dispatch": mode, "n": len(g),
                     "tok_s": tok, "over_sglang": tok / btok if len(base) else np.nan, "n_sglang": len(base),
                     "sglang_tok_s": btok, "itl_p50_ms": _num(g, "itl_p50_ms").mean(),
                     "sglang_itl_p50_ms": _num(base, "itl_p50_ms").mean(),
                     "split_share": split / decode if decode else np.nan, **plugin_counters(g),
                     "replay_host_us": replay, "status": "measured"})
    t = pd.DataFrame(rows)
    return t.reindex(columns=COLS) if len(t) else pd.DataFrame(columns=COLS)


@register_exhibit(NAME)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/in_sglang_paths.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"dispatch": "(none)", "status": f"{NOT_MEASURED}: no forced-path cell (python -m runners.run "
                                                          "-m sweep=in_sglang_paths, on the GPU host)"}], columns=COLS)
    write_table(t, NAME, out, {"tok_s": 0, "over_sglang": 3, "sglang_tok_s": 0, "itl_p50_ms": 1,
                               "sglang_itl_p50_ms": 1, "split_share": 2, **{f"rows_{p}": 2 for p in PATHS},
                               "plan_us": 0, "replay_host_us": 0},
                title="GraniKV inside SGLang with each prefix path forced, beside SGLang at the same code version",
                note="Llama-3.1-8B TP=1, B=256, ShareGPT behind one shared prefix (the in-SGLang headline's "
                     "workload), SGLang 0.5.17 with --attention-backend flashinfer as the baseline. dispatch: "
                     "table = the plugin's graph rules, *_only = every prefix class forced to that path "
                     "(GRANIKV_DISPATCH). over_sglang: output tok/s over the sglang_server cells of the same GPU "
                     "model, Lp and code version (n_sglang of them). split_share: decode steps with a split class "
                     "among the plugin's decode steps; rows_*: decode rows by path over split steps; plan_us: "
                     "host time per split step; replay_host_us: host time per replayed decode step, split or not "
                     "(NaN: not counted by that code version).")
    return t
