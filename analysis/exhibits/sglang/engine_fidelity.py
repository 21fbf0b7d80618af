"""Engine fidelity: real SGLang (``sglang_server``) against our engine's ``sglang_default`` on the same
request sets, cell by cell, plus GraniKV's ratio over real SGLang.

Rows: every (workload, Lp, B) of Llama-3.1-8B TP=1 where a ``sglang_server`` cell exists (the
headline's six Lp; the synthetic burst cell Lp=8K, B=256). Per system, the repetition mean (and n,
min-max) of output throughput, TPOT p50 and TTFT p50; ``ours/real`` is our ``sglang_default`` over
real SGLang (> 1: our baseline is faster than the system it stands for); ``within_10pct`` says
whether the throughput ratio lies in [0.9, 1.1] (the suite's target). ``granikv/real`` is GraniKV
(engine) over real SGLang. ``*_ttft_first5_ms``: the mean TTFT of the trace's first five requests, which
arrive before any queue forms, each from the moment it was sent: the fixed cost of a request (a server's HTTP front-end, tokenizer manager
and detokenizer hops; the engine's none), apart from queueing. Real SGLang's times are taken at its HTTP client (streamed tokens), ours
inside the engine; both through granikv.metrics.

A row is one GPU model's cells (column ``gpu``): every system at a point is compared on the same GPU model,
and a planned point without a cell on any GPU model is a not-measured row without one.

Writes tables/engine_fidelity.{csv,md} and figures/engine_fidelity.{png,pdf,csv} (a row of panels per GPU model).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.common import (LPS, NOT_MEASURED, THROUGHPUT, aggregate, placeholder_figure, save_figure, select,
                             sort_rows, with_derived, write_table)
from analysis.gpu import GPU, ordered, with_gpu
from analysis.load import Results, TOKEN_LISTS, read_rows
from analysis.measures.sglang import plugin_counters as in_sglang_counters, prefer_current
from analysis.plots import gpu_names, lp_axis, system_colors, title_of
from analysis.registry import register_exhibit



NAME = "engine_fidelity"
FIGURES = ("engine_fidelity",)
REAL, OURS, GRANIKV = "sglang_server", "sglang_default", "granikv"
PLUGIN = "sglang_server_granikv"   # GraniKV inside real SGLang (granikv.sglang_plugin)
MODEL = "llama3_8b"
SELECT = {"tp": "=1", "workload.num_prefixes": "=1", "instrumented": "=False"}
KEYS = ["workload.kind", "workload.arrival", "workload.prefix_len", "workload.batch"]
ROW = KEYS + [GPU]       # a row: one point on one GPU model
TARGET = 0.10
METRICS = {THROUGHPUT: "tok_s", "tpot_p50_ms": "tpot_p50_ms", "ttft_p50_ms": "ttft_p50_ms",
           "ttft_first5_ms": "ttft_first5_ms"}
FIRST = 5
# the cells the campaign plans (conf/campaign.yaml): the headline's six Lp and the synthetic burst cell
EXPECTED = [("sharegpt", "poisson", lp, 256) for lp in LPS] + [("synthetic", "burst", 8192, 256)]


def first_ttft_ms(cell: Path, n: int = FIRST) -> float:
    """Mean TTFT (ms) of the ``n`` earliest-arriving measured requests of a cell (requests.jsonl), each from
    the moment its request was sent."""
    rows = sorted((r for r in read_rows(cell / "requests.jsonl", skip=TOKEN_LISTS) if not r.get("warmup")),
                  key=lambda r: r["arrival_s"])
    # from the send time: a server cell's client records how late it sent (extra.send_lag_s; the engine: none)
    t = [r["first_token_s"] - r["arrival_s"] - float((r.get("extra") or {}).get("send_lag_s") or 0.0)
         for r in rows[:n] if r.get("first_token_s") is not None]
    return float(np.mean(t)) * 1e3 if t else np.nan


def fidelity_table(res: Results, model: str = MODEL) -> pd.DataFrame:
    """One row per (workload, arrival, Lp, B) and GPU model of ``model`` with a real-SGLang cell (see the module
    docstring)."""
    cells = res.cells
    cols = [*ROW, "n_real", "n_ours", "n_granikv", "real_tok_s", "real_min", "real_max", "ours_tok_s",
            "ours/real", "within_10pct", "real_tpot_p50_ms", "ours_tpot_p50_ms", "tpot ours/real",
            "real_ttft_p50_ms", "ours_ttft_p50_ms", "ttft ours/real", "real_ttft_first5_ms", "ours_ttft_first5_ms",
            "granikv_tok_s", "granikv/real", "n_plugin", "plugin_tok_s", "plugin/real", "plugin_dense_rows",
            "plugin_plan_us", "plugin_dispatch_us", "status"]
    missing = [{**dict(zip(KEYS, k)), "n_real": 0, "status": NOT_MEASURED} for k in EXPECTED] if model == MODEL else []
    if cells.empty:
        return pd.DataFrame(missing, columns=cols)
    # the plugin's cells with today's settings where a point has them (never pooled across settings)
    df = select(prefer_current(with_gpu(with_derived(cells)), res.config_columns, same_run=False),
                {**SELECT, "model.name": f"={model}"})
    df = df[df["system"].isin((REAL, OURS, GRANIKV, PLUGIN))]
    if df.empty or not (df["system"] == REAL).any():
        return pd.DataFrame(missing, columns=cols)
    df = df.assign(ttft_first5_ms=[first_ttft_ms(Path(res.root) / p) for p in df["path"]])
    per = {}
    for m in METRICS:
        a = aggregate(df, ROW + ["system"], m)
        per[m] = {(tuple(r[k] for k in ROW), r["system"]): r for r in a.to_dict("records")}
    thr = per[THROUGHPUT]
    rows = []
    for key in {k for k, s in thr if s == REAL}:
        def get(m, system, field="mean"):
            r = per[m].get((key, system))
            return float(r[field]) if r is not None and r["n"] > 0 else np.nan

        def n(system):
            r = thr.get((key, system))
            return int(r["n"]) if r is not None else 0

        real, ours, gk = get(THROUGHPUT, REAL), get(THROUGHPUT, OURS), get(THROUGHPUT, GRANIKV)
        pl = get(THROUGHPUT, PLUGIN)
        pc = plugin_counters(df, key)
        ratio = ours / real
        rows.append({**dict(zip(ROW, key)), "n_real": n(REAL), "n_ours": n(OURS), "n_granikv": n(GRANIKV),
                     "real_tok_s": real, "real_min": get(THROUGHPUT, REAL, "min"), "real_max": get(THROUGHPUT, REAL, "max"),
                     "ours_tok_s": ours, "ours/real": ratio,
                     "within_10pct": (NOT_MEASURED if np.isnan(ratio) else "yes" if abs(ratio - 1) <= TARGET else "no"),
                     "real_tpot_p50_ms": get("tpot_p50_ms", REAL), "ours_tpot_p50_ms": get("tpot_p50_ms", OURS),
                     "tpot ours/real": get("tpot_p50_ms", OURS) / get("tpot_p50_ms", REAL),
                     "real_ttft_p50_ms": get("ttft_p50_ms", REAL), "ours_ttft_p50_ms": get("ttft_p50_ms", OURS),
                     "ttft ours/real": get("ttft_p50_ms", OURS) / get("ttft_p50_ms", REAL),
                     "real_ttft_first5_ms": get("ttft_first5_ms", REAL), "ours_ttft_first5_ms": get("ttft_first5_ms", OURS),
                     "granikv_tok_s": gk, "granikv/real": gk / real, "n_plugin": n(PLUGIN), "plugin_tok_s": pl,
                     "plugin/real": pl / real, **pc, "status": "measured"})
    seen = {tuple(r[k] for k in KEYS) for r in rows}
    rows += [m for m in missing if tuple(m[k] for k in KEYS) not in seen]
    return sort_rows(pd.DataFrame(rows, columns=cols), ROW)


def plugin_counters(df: pd.DataFrame, key: tuple) -> dict:
    """The plugin's own counters over its cells of ``key`` (ROW's values; analysis.in_sglang.plugin_counters): the
    share of decode rows whose prefix went dense, and host microseconds per planned step (the whole
    plan, and the dispatcher's choices alone). NaN where no plugin cell recorded them."""
    rows = df[(df["system"] == PLUGIN)]
    for k, v in zip(ROW, key):
        rows = rows[rows[k] == v]
    c = in_sglang_counters(rows)
    return {"plugin_dense_rows": c["rows_dense"], "plugin_plan_us": c["plan_us"], "plugin_dispatch_us": c["dispatch_us"]}


def _finish(ax, x, ylabel: str, title: str) -> None:
    """Labels, the Lp axis, the legend and the title of one panel."""
    ax.set_ylabel(ylabel)
    ax.set_xlabel("shared prefix Lp (tokens)")
    lp_axis(ax, x)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)


def draw(t: pd.DataFrame, res: Results, out: Path) -> None:
    """Per GPU model, a row of two panels: throughput of real SGLang, our sglang_default, GraniKV (and the
    plugin) against Lp on the headline workload, and their ratios to real SGLang."""
    h = t[(t["workload.kind"] == "sharegpt") & (t["status"] == "measured")] if not t.empty else t
    if h.empty:
        placeholder_figure(NAME, out, "no sglang_server cells on the headline workload")
        return
    h = h.sort_values(ROW)
    col = system_colors([REAL, OURS, GRANIKV])
    gpus = ordered(h[GPU])
    fig, axes = plt.subplots(len(gpus), 2, figsize=(11, 0.3 + 3.7 * len(gpus)), squeeze=False, sharey="col")
    cells = select(with_derived(res.cells), {"system": f"={REAL}"})
    versions = sorted({str(v) for v in cells.get("provenance.sglang", pd.Series(dtype=object)).dropna()})
    for (a, b), gpu in zip(axes, gpus):
        g = h[h[GPU] == gpu]
        x = g["workload.prefix_len"].astype(int)
        a.errorbar(x, g["real_tok_s"], yerr=[g["real_tok_s"] - g["real_min"], g["real_max"] - g["real_tok_s"]],
                   marker="o", color=col[REAL], label=f"real SGLang {'/'.join(versions) or '?'} (sglang_server)",
                   capsize=3)
        a.plot(x, g["ours_tok_s"], marker="s", ls="--", color=col[OURS], label="our engine: sglang_default")
        a.plot(x, g["granikv_tok_s"], marker="^", color=col[GRANIKV], label="our engine: granikv")
        gp = g[g["n_plugin"] > 0]
        if not gp.empty:
            a.plot(gp["workload.prefix_len"].astype(int), gp["plugin_tok_s"], marker="D", ls=":", color=col[GRANIKV],
                   label="granikv inside real SGLang (plugin)")
        _finish(a, x, "output tok/s", f"{gpu}: throughput (mean; bars: real SGLang's min-max)")
        b.axhspan(1 - TARGET, 1 + TARGET, color="0.9", label="±10% of real SGLang")
        b.axhline(1.0, color="0.5", lw=0.8)
        b.plot(x, g["ours/real"], marker="s", ls="--", color=col[OURS], label="sglang_default / real SGLang")
        b.plot(x, g["granikv/real"], marker="^", color=col[GRANIKV], label="granikv / real SGLang")
        if not gp.empty:
            b.plot(gp["workload.prefix_len"].astype(int), gp["plugin/real"], marker="D", ls=":", color=col[GRANIKV],
                   label="granikv in SGLang / real SGLang")
        _finish(b, x, "output throughput / real SGLang", f"{gpu}: ratio to real SGLang")
    fig.suptitle(title_of("Engine fidelity, headline (ShareGPT + shared prefix, B=256)", gpu_names(cells),
                          ["Llama-3.1-8B TP=1"]), fontsize=10)
    fig.tight_layout()
    save_figure(fig, NAME, out, data=h[["workload.prefix_len", GPU, "real_tok_s", "real_min", "real_max", "ours_tok_s",
                                        "granikv_tok_s", "plugin_tok_s", "ours/real", "granikv/real", "plugin/real"]])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figure); return the table."""
    t = fidelity_table(res)
    write_table(t, NAME, out, {"real_tok_s": 0, "real_min": 0, "real_max": 0, "ours_tok_s": 0, "granikv_tok_s": 0,
                               "ours/real": 3, "granikv/real": 2, "tpot ours/real": 3, "ttft ours/real": 3,
                               "real_tpot_p50_ms": 1, "ours_tpot_p50_ms": 1, "real_ttft_p50_ms": 0, "ours_ttft_p50_ms": 0,
                               "real_ttft_first5_ms": 1, "ours_ttft_first5_ms": 1,
                               "plugin_tok_s": 0, "plugin/real": 2, "plugin_dense_rows": 2, "plugin_plan_us": 0,
                               "plugin_dispatch_us": 1},
                title="Engine fidelity: real SGLang (sglang_server) vs our engine's sglang_default, Llama-3.1-8B TP=1",
                note="ours/real > 1: our baseline is faster than real SGLang. within_10pct: |ours/real - 1| <= 0.10 "
                     "(output throughput). granikv/real: GraniKV (engine) over real SGLang. Means over repetitions "
                     "(n per system); real SGLang's min/max span its repetitions. Real SGLang is timed at its streaming "
                     "HTTP client, the engine in-process; both through granikv.metrics. plugin: GraniKV inside real "
                     "SGLang (sglang_server_granikv: the granikv attention and radix cache backends, breakable decode "
                     "CUDA graphs), same client; plugin/real over real SGLang default; plugin_dense_rows: share of its "
                     "decode rows whose prefix took the dense path; plugin_plan_us / plugin_dispatch_us: host time per "
                     "planned decode step (whole plan / the dispatcher's choices), from the plugin's own counters.")
    if figures:
        draw(t, res, out)
    return t
