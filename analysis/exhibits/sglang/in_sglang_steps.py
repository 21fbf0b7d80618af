"""Where a decode step's time goes inside real SGLang: SGLang's own torch.profiler trace of a profiled server
cell (``profile_steps`` > 0; ``analysis.measures.server_steps``), GraniKV's plugin beside SGLang.

One row per GPU model, code version, Lp and system: the decode steps of the trace whose batch is at least
``FULL`` of the workload's B (steps of a full batch, comparable across systems; ``cut_steps``: those left out
because the trace ended inside them, fewer than ``CUT`` of the median step's kernels), averaged per step: the step's
span on the GPU timeline, its kernel time (whole and by class: GEMMs, the rest decode's attention, the
plugin's prefix launches and row kernels, the rest), the time the GPU waited for the host before the step's
graph began, and the idle time within the span. ``busy_over_sglang`` / ``span_over_sglang``: over the
``sglang_server`` row of the same GPU model, code version and Lp.

A profiled cell's throughput is not a measurement (the profiler slows the host): those cells stay out of every
throughput table; here only their step anatomy is read. Host-side times are inflated by the profiler alike in
both systems' traces; kernel times are the GPU's own.

Writes tables/in_sglang_steps.{csv,md}. No figure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, with_derived, write_table
from analysis.gpu import GPU, with_gpu
from analysis.load import Results
from analysis.measures.server_steps import CLASSES, decode_steps
from analysis.measures.sglang import BASE, SYSTEMS
from analysis.registry import register_exhibit

NAME = "in_sglang_steps"
FULL = 0.95            # a full-batch step: batch >= FULL x the workload's B
CUT = 0.8              # a step with fewer kernels than CUT x the median step's was cut by the trace's end
IN_SGLANG = tuple(s for s, _ in SYSTEMS.values())
REAL = SYSTEMS[BASE][0]
MEANS = ["span_ms", "busy_ms", "pre_graph_ms", "idle_ms", "kernels", *[f"{c}_ms" for c, _ in CLASSES]]
COLS = [GPU, "code", "workload.prefix_len", "system", "steps", "cut_steps", "batch", *MEANS, "busy_over_sglang",
        "span_over_sglang", "status"]


def frame(res: Results) -> pd.DataFrame:
    c = res.cells
    if c.empty or "system.name" not in c.columns or "profile_steps" not in c.columns:
        return pd.DataFrame(columns=COLS)
    c = with_gpu(with_derived(c))
    c = c[c["system.name"].isin(IN_SGLANG) & (pd.to_numeric(c["profile_steps"], errors="coerce").fillna(0) > 0)]
    rows = []
    for _, cell in c.iterrows():
        trace = Path(res.root) / cell["path"] / "trace.json.gz"
        if not trace.exists():
            continue
        st = decode_steps(trace)
        b = float(cell.get("workload.batch", np.nan))
        full = st[st["batch"] >= FULL * b] if len(st) and b == b else st.iloc[0:0]
        whole = full["kernels"] >= CUT * full["kernels"].median() if len(full) else full["kernels"] > 0
        cut, full = int((~whole).sum()), full[whole]
        commit = str(cell.get("provenance.git_commit", "unknown"))[:7]
        row = {GPU: cell[GPU], "code": commit, "workload.prefix_len": int(cell["workload.prefix_len"]),
               "system": cell["system.name"], "steps": len(full), "cut_steps": cut,
               "batch": full["batch"].mean() if len(full) else np.nan,
               **{m: full[m].mean() if len(full) else np.nan for m in MEANS},
               "status": "measured" if len(full) else f"{NOT_MEASURED}: no full-batch decode step in the trace"}
        rows.append(row)
    t = pd.DataFrame(rows, columns=COLS)
    if t.empty:
        return t
    keys = [GPU, "code", "workload.prefix_len"]
    base = t[t["system"] == REAL].set_index(keys)
    for i, r in t.iterrows():
        k = tuple(r[x] for x in keys)
        if k in base.index:
            ref = base.loc[[k]].iloc[0]
            t.loc[i, "busy_over_sglang"] = r["busy_ms"] / ref["busy_ms"]
            t.loc[i, "span_over_sglang"] = r["span_ms"] / ref["span_ms"]
    return t.sort_values(keys + ["system"]).reset_index(drop=True)


@register_exhibit(NAME)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/in_sglang_steps.{csv,md}; return the table."""
    t = frame(res)
    if t.empty:
        t = pd.DataFrame([{"system": "(none)", "status": f"{NOT_MEASURED}: no profiled in-SGLang cell (python -m "
                                                         "runners.run -m sweep=in_sglang profile_steps=20 ...)"}],
                         columns=COLS)
    write_table(t, NAME, out, {**{m: 2 for m in MEANS}, "kernels": 0, "batch": 0, "busy_over_sglang": 3,
                               "span_over_sglang": 3},
                title="A decode step inside real SGLang, from SGLang's own profiler trace: GPU time by kernel class "
                      "and the GPU's wait for the host",
                note="Per decode step of a full batch (batch >= 95% of B), averaged over the trace's steps (cut_steps: "
                     "steps the trace's end cut, left out); ms. "
                     "span: the step on the GPU timeline; busy: its kernel time; pre_graph: the GPU's wait from the "
                     "step's start to its CUDA graph's first kernel (the host preparing the step: index lists, "
                     "re-plans, the plugin's plan and buffer loads); idle: span less busy. Kernel classes: gemm, "
                     "attention (the paged / rest decode and its state merges), prefix (the plugin's prefix "
                     "launches), rows (its query gather and row merge), other (norms, RoPE, activation, KV "
                     "writes, copies). Host times run slower under the profiler, in both systems alike; a profiled "
                     "cell's throughput is never used. *_over_sglang: over SGLang's row of the same GPU model, code "
                     "version and Lp.")
    return t
