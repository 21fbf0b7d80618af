"""ShareGPT Lp x B matrix (paper B.2, Tables 9-11): output tok/s per (config, Lp, B, system) at
the saturating Poisson rate, ratio to sglang_default; B=256 should be the peak or near it.

Writes tables/sharegpt_matrix.{csv,md} and figures/sharegpt_ratio_heatmap.{png,pdf} and
figures/sharegpt_throughput_heatmap.{png,pdf} (GraniKV tok/s over Lp x B).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.common import LPS, PAPER_CONFIG_LABELS, PAPER_HARDWARE, SHAREGPT_B, rename_short, select, system_table, write_table
from analysis.headline import DIGITS
from analysis.load import Results
from analysis.plots import (draw_heatmaps, gpu_names, heatmap_grid, heatmap_ok, one_per_point, paper_claims,
                            ratio_heatmaps, title_of)

NAME = "sharegpt_matrix"
FIGURES = ("sharegpt_ratio_heatmap", "sharegpt_throughput_heatmap")
SELECT = {"workload.kind": "=sharegpt", "workload.num_prefixes": "=1"}


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    dims = ["config", "workload.prefix_len", "workload.batch"]
    t = system_table(res.cells, res.config_columns, SELECT, dims,
                     expected={"config": PAPER_CONFIG_LABELS, "workload.prefix_len": LPS, "workload.batch": SHAREGPT_B})
    write_table(rename_short(t), NAME, out, DIGITS, title="ShareGPT Lp x B matrix (Tables 9-11): output tok/s")
    if not figures:
        return t
    gpu = gpu_names(select(res.cells, SELECT) if not res.cells.empty else res.cells)
    ratio_heatmaps(t, "sharegpt_ratio_heatmap", out, "workload.prefix_len", "workload.batch", ["config"],
                   systems=("granikv", "sglang_cascade", "hydragen"), gpu=gpu,
                   cbar_label="output throughput / sglang_default",
                   title="ShareGPT Lp x B: output throughput over SGLang default (rows Lp, columns B)")
    g = t[(t["status"] == "measured") & (t["system"] == "granikv")] if not t.empty else t
    panels, dropped, drawn = [], [], []
    for c in (sorted(g["config"].unique()) if not g.empty else []):
        one, _ = one_per_point(g[g["config"] == c], ["workload.prefix_len", "workload.batch"])
        grid = heatmap_grid(one, "workload.prefix_len", "workload.batch", "mean")
        if not heatmap_ok(grid):
            dropped.append(f"{c} ({len(one)} cell{'s' if len(one) != 1 else ''})")
            continue
        panels.append((f"{c}: GraniKV", grid))
        drawn.append(one.assign(panel=c)[["panel", "workload.prefix_len", "workload.batch", "system", "mean", "n"]])
    if not panels:
        from analysis.common import placeholder_figure
        placeholder_figure("sharegpt_throughput_heatmap", out, "no configuration with enough measured GraniKV ShareGPT cells")
    else:
        peak = paper_claims([f"b256_peak_{m}" for m in ("llama8b", "qwen14b", "qwen32b")])
        bound = f"{peak['value'].iloc[0]:g}" if not peak.empty else "?"
        draw_heatmaps(panels, "sharegpt_throughput_heatmap", out, center=None, cmap="viridis", fmt=".0f",
                      title=title_of("ShareGPT Lp x B: GraniKV output tok/s", gpu, [c.split(":")[0] for c, _ in panels]),
                      cbar_label="GraniKV output tok/s", outline_col=256,
                      outline_label=f"outlined: B=256, where the paper ({PAPER_HARDWARE}) finds the peak "
                                    f"(>= {bound} of the best B at every Lp)",
                      footnote=("no heatmap (a single row or column, or few cells; in the table): " + ", ".join(dropped))
                      if dropped else "",
                      data=pd.concat(drawn, ignore_index=True))
    return t


def peak_line(res: Results, claim: pd.Series) -> str:
    """For a "B=256 is the peak" claim that fails: per Lp below the bound, the peak B beside B=256 with
    what each run recorded (output tok/s, TPOT p50, KV in use at its peak over the KV budget, decode
    steps run eagerly above the CUDA-graph batch limit), and the KV budget of the paper's A100-40GB
    (hardware=a100_40gb) where a run of the same model recorded one. Empty when nothing applies."""
    from analysis.claims import Context, swept_groups
    from analysis.common import parse_selectors, select, show
    d = Context(res).frame("cells")
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    d = select(d, sel) if not d.empty else d
    (bkey, bcond), = base.items()
    if d.empty or "kv_budget_tokens" not in d.columns:
        return ""
    d = d.assign(_kv=(d["cold_peak_tokens"] + d["hot_peak_tokens"]) / d["kv_budget_tokens"],
                 _eager=d.get("eager_decode_reasons.above_cuda_graph_max_bs", pd.Series(0, index=d.index)).fillna(0)
                 / d["num_decode_steps"])
    bound = float(claim["paper_value"])
    parts, peaks, fullest = [], [], 0.0
    for g, lack in swept_groups(d, res.config_columns, bkey):
        if lack or select(g, {bkey: bcond}).empty:
            continue
        by = g.groupby(bkey).agg(thr=(claim["metric"], "mean"), tpot=("tpot_p50_ms", "mean"), kv=("_kv", "max"),
                                 eager=("_eager", "mean"))
        at, best = by.loc[select(g, {bkey: bcond})[bkey].iloc[0]], by["thr"].idxmax()
        if at["thr"] / by.loc[best, "thr"] >= bound:
            continue

        def one(b, r) -> str:
            return (f"B={show(b)} {r['thr']:.0f} tok/s, TPOT p50 {r['tpot']:.1f} ms, KV peak {r['kv']:.0%} of the budget, "
                    f"{r['eager']:.0%} of decode steps eager above the graph limit")
        parts.append(f"Lp={show(g['workload.prefix_len'].iloc[0])}: {one(best, by.loc[best])}; "
                     f"{one(at.name, at)}")
        peaks.append(best)
        fullest = max(fullest, float(by.loc[best, "kv"]))
    if not parts:
        return ""
    peak_b = [show(b) for b in sorted(set(peaks))]
    names = sorted(set(d["provenance.gpu_name"].dropna())) if "provenance.gpu_name" in d.columns else []
    gpus = ", ".join(names) or "our hardware"
    txt = (f"Per Lp below the bound, the peak beside B={bcond.lstrip('=')} (repetitions averaged): " + " | ".join(parts)
           + f". On {gpus} the KV budget ({d['kv_budget_tokens'].min() / 1e3:.0f}K-{d['kv_budget_tokens'].max() / 1e3:.0f}K tokens) "
           f"held B={', '.join(peak_b)} " + ("without filling" if fullest < 0.95 else f"at up to {fullest:.0%}")
           + f", and throughput kept rising past B={bcond.lstrip('=')}, though "
           f"the decode steps above the CUDA-graph batch limit ran eagerly.")
    model = sel.get("model.name", "").lstrip("=")
    a100 = res.cells[(res.cells.get("hardware.name") == "a100_40gb") & (res.cells.get("model.name") == model)] \
        if {"hardware.name", "model.name", "kv_budget_tokens"} <= set(res.cells.columns) else pd.DataFrame()
    if not a100.empty:
        at_peak = d[d[bkey].isin(peaks)]
        used = float((at_peak["cold_peak_tokens"] + at_peak["hot_peak_tokens"]).max())
        budget = float(a100["kv_budget_tokens"].median())
        txt += (f" The paper's A100-40GB KV budget for {model} (hardware=a100_40gb, as recorded by {len(a100)} "
                f"run(s)) is {budget / 1e3:.0f}K tokens; our peak-B runs held up to {used / 1e3:.0f}K at once"
                + (", which would not fit there." if used > budget else "."))
    return txt
