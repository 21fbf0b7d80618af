"""Profiler prefix-attention kernel time (paper B.3): torch.profiler traces (``trace.json.gz``; plain ``trace.json`` also read) of
the serving cells run with ``profile_steps > 0`` with CUDA-graph steps, per system and point (B.3's:
B=256, Lp=8K, the figure's); traces of eager steps feed analysis.distance_to_limit only.

From each Chrome-format trace we sum, over GPU kernel events (``ph == "X"``, category
``kernel``), the time of attention kernels: events inside a ``gpu_user_annotation`` named
``prefix_attention*`` when the engine marks them, else kernels whose name matches
``ATTENTION_KERNEL`` (FlashInfer decode / prefill / merge-state kernels). ``share`` = attention
time / all kernel time: the Amdahl fraction f.

A row is one GPU model's traces (column ``gpu``), over that GPU model's SGLang default; the figure draws a row
of panels per GPU model.

Writes tables/profiler.{csv,md} and figures/profiler.{png,pdf}.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, identity, placeholder_figure, plt, save_figure, sort_rows, write_table
from analysis.gpu import GPU, gpu_names as gpu_column, ordered, with_gpu
from analysis.load import Results
from analysis.measures.traces import eager_steps, trace_frame
from analysis.paper import paper_claims
from analysis.plots import gpu_names, legend_below, mark_paper, system_colors, system_order, title_of
from analysis.registry import register_exhibit



NAME = "profiler"
FIGURES = (NAME,)
PROFILED_CONFIGS = ("llama3_8b TP=1", "qwen25_32b TP=4")  # the two configs B.3 traces
B3_POINT = {"workload.prefix_len": 8192, "workload.batch": 256}


def graph_traces(tf: pd.DataFrame) -> pd.DataFrame:
    """Where a configuration has traces of CUDA-graph decode steps, those alone: its traces of eager steps
    (``hardware.cuda_graph_max_bs=0``, run for their prefix / suffix split) feed
    analysis.distance_to_limit's breakdown instead. A configuration traced only eagerly (a CPU run) keeps them;
    a configuration is one GPU model's."""
    if tf.empty:
        return tf
    eager = eager_steps(tf)
    key = ["config", "system", "workload.prefix_len", "workload.batch"]
    has_graph = (~eager).groupby([tf[k].astype(str) for k in key] + [gpu_column(tf)]).transform("any")
    return tf[~(eager & has_graph)]


def at_b3_point(t: pd.DataFrame) -> pd.DataFrame:
    """The rows at B.3's point (B=256, Lp=8K), the figure's."""
    keep = (pd.to_numeric(t["workload.prefix_len"], errors="coerce") == B3_POINT["workload.prefix_len"]) & \
           (pd.to_numeric(t["workload.batch"], errors="coerce") == B3_POINT["workload.batch"])
    return t[keep]


def draw(m: pd.DataFrame, tf: pd.DataFrame, out: Path) -> None:
    """Per GPU model, a row of two panels: left, prefix-attention kernel time per system and configuration;
    right, sglang_default's over each system's, with the paper's SGLang-Cascade values."""
    configs = sorted(m["config"].dropna().unique())
    systems = system_order(m["system"].unique())
    colors = system_colors(systems)
    gpus = ordered(m[GPU])
    fig, axes = plt.subplots(len(gpus), 2, figsize=(11, len(gpus) * (0.5 * len(configs) * len(systems) / 2 + 2.2) + 0.2),
                             squeeze=False, sharex="col")      # the GPU models on one axis per panel column
    h = 0.8 / len(systems)
    pc = paper_claims(["profiler_cascade_llama8b", "profiler_cascade_qwen32b"])
    others = [s_ for s_ in systems if s_ != "sglang_default"]
    first = True
    for (a1, a2), gpu in zip(axes, gpus):
        for j, s_ in enumerate(systems):
            g = m[(m["system"] == s_) & (m[GPU] == gpu)].set_index("config")
            ys = [i - 0.4 + h * (j + 0.5) for i in range(len(configs))]
            a1.barh(ys, [float(g["attention_ms"].get(c, np.nan)) for c in configs], h, color=colors[s_], label=s_)
            if s_ != "sglang_default":
                a2.barh(ys, [float(g["default_over_system"].get(c, np.nan)) for c in configs], h, color=colors[s_],
                        label=s_)
        for _, p in pc.iterrows():
            if p["config"] in configs and p["system"] in others:
                j = systems.index(p["system"])
                mark_paper(a2, p["value"], configs.index(p["config"]) - 0.4 + h * (j + 0.5), label=first)
                first = False
        for ax in (a1, a2):
            ax.set_yticks(range(len(configs)), configs, fontsize=8)
            ax.invert_yaxis()
        a2.axvline(1.0, color="grey", lw=0.8, ls="--")
        a1.set_title(gpu, fontsize=9)
        a1.set_xlabel("prefix-attention kernel time in the profiled window (ms)")
        a2.set_xlabel("sglang_default's prefix-attention time / this system's")
    fig.suptitle(title_of("torch.profiler, B=256, Lp=8K (rank 0's trace)", gpu_names(tf), configs), fontsize=10)
    fig.tight_layout()
    legend_below(fig, list(axes.flat), ncol=5)
    save_figure(fig, NAME, out, data=m[["config", GPU, "system", "n", "attention_ms", "kernel_ms", "share",
                                        "default_over_system"]])


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    tf = graph_traces(trace_frame(res))
    dims = ["config", "workload.prefix_len", "workload.batch", "system"]
    if tf.empty:
        t = pd.DataFrame([{"config": c, GPU: None, "status": NOT_MEASURED} for c in PROFILED_CONFIGS])
        write_table(t, NAME, out, title="Profiler: prefix-attention kernel time (B=256, Lp=8K)",
                    note="No serving cell with profile_steps > 0 and a trace.json (sweep=profiler).")
        if not figures:
            return t
        placeholder_figure(NAME, out, "no torch.profiler traces")
        return t
    tf = with_gpu(tf)
    # the GPU model always (a row is one GPU model's), and every other config key that varies
    extra = [c for c in identity(tf, res.config_columns) if c not in ("model.name", "tp", "workload.prefix_len",
                                                                      "workload.batch") and not c.startswith(("system.", "model."))
             and (c == GPU or tf[c].astype(str).nunique() > 1)]
    keys = dims[:-1] + extra
    g = tf.groupby(keys + ["system"], dropna=False, sort=True)
    t = g.agg(n=("source", "count"), attention_ms=("attention_ms", "mean"), kernel_ms=("kernel_ms", "mean"),
              share=("share", "mean"), source=("source", "first")).reset_index()
    base = t[t["system"] == "sglang_default"][keys + ["attention_ms"]].rename(columns={"attention_ms": "_b"})
    t = t.merge(base, on=keys, how="left")
    t["default_over_system"] = t["_b"] / t["attention_ms"]
    t["status"] = np.where(t["attention_ms"].notna(), "measured", f"{NOT_MEASURED}: trace has no GPU kernel events")
    t = sort_rows(t.drop(columns=["_b"]), keys + ["system"])
    write_table(t, NAME, out, {"attention_ms": 1, "kernel_ms": 1, "share": 3, "default_over_system": 2},
                title="Profiler: prefix-attention kernel time (B.3: B=256, Lp=8K; other profiled points beside it)",
                note="attention_ms / kernel_ms: summed GPU kernel time over the profiled window; "
                     "default_over_system = sglang_default attention time / this system's (paper: cascade 3.66x Llama TP1, 1.24x Qwen-32B TP4).")
    if not figures:
        return t
    m = t[t["status"] == "measured"]
    if m.empty:
        placeholder_figure(NAME, out, "profiler traces hold no GPU kernel events (CPU runs)")
        return t
    if at_b3_point(m).empty:
        placeholder_figure(NAME, out, "no measured trace at B.3's point (B=256, Lp=8K)")
        return t
    draw(at_b3_point(m), at_b3_point(tf), out)
    return t
