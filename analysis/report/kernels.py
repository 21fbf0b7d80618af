"""Claim explanations from kernel rows and dispatcher timings: roofline, Amdahl, dispatch cost."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import config_label, select, show
from analysis.load import Results
from analysis.measures.amdahl import amdahl, amdahl_frame
from analysis.measures.dispatch import overhead_frame
from analysis.measures.kernels import LAYOUT_BASE, LAYOUT_NUM, kernel_frame, layout_speedup


def roofline_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """One line of reasoning from our kernel numbers: layout speed-up s, bound classes, Amdahl bound."""
    if "s" not in cache:
        cache["s"], _ = layout_speedup(res)
        k = kernel_frame(res)
        cache["k"] = k
        cache["amdahl"] = amdahl_frame(res)
    s, k, am = cache["s"], cache["k"], cache["amdahl"]
    if k.empty:
        return "No kernel measurements under the results folder to reason from (run runners.kernel_bench)."
    parts = []
    if np.isfinite(s):
        parts.append(f"our kernel-isolated storage-layout speed-up is s={s:.2f} (geomean over shapes; paper 15.6)")
    num, base = select(k, LAYOUT_NUM), select(k, {**LAYOUT_NUM, **LAYOUT_BASE})
    for lab, d in (("paged-equivalent", num), ("HOT", base)):
        if not d.empty and d["bound"].notna().any():
            r = d.iloc[0]
            parts.append(f"{lab} layout ({r.get('cell.shape.name', '?')}, Lp={show(r.get('cell.prefix_len'))}, "
                         f"B={show(r.get('cell.batch'))}): "
                         f"{r['bound']}-bound, "
                         f"{r['tflops']:.0f} TFLOP/s ({r['pct_peak_flops']:.0f}% of the measured peak) and "
                         f"{r['tbps']:.2f} TB/s ({r['pct_peak_bw']:.0f}%)")
    label = config_label(claim["model"], int(claim["tp"])) if str(claim["tp"]).isdigit() else ""
    row = am[am["config"] == label] if not am.empty else am
    if not row.empty and np.isfinite(s):
        f = float(row["f_attention_share"].iloc[0])
        parts.append(f"with f={f:.3f} (profiled prefix-attention share, {label}) Amdahl bounds the end-to-end gain "
                     f"at {amdahl(f, s):.2f}x")
    return ("Roofline: " + "; ".join(parts) + ".") if parts else \
        "Kernel rows present but without the layout comparison or flops/bytes: no roofline reasoning possible."


def dispatch_line(res: Results, cache: dict) -> str:
    """The dispatcher's time in the engine against the same lookup in a tight loop (tables/dispatch_overhead)."""
    if "dispatch" not in cache:
        cache["dispatch"] = overhead_frame(res)
    t = cache["dispatch"]
    t = t[t["dispatch_from"] == "steps.jsonl"] if not t.empty else t
    if t.empty:
        return ""
    lookup = t["bench_lookup_us"].dropna()
    by_commit = ""
    if "commit" in t.columns and t["commit"].nunique() > 1:   # the versions themselves: the table's commit column
        by_commit = f" at {t['commit'].nunique()} code versions (each cell's: tables/dispatch_overhead)"
    return (f"In the engine the per-step dispatcher time (GranikvPolicy.choose inside the step plan: the table lookup "
            f"and writing each class's choice into its plan) is {t['dispatch_us_p50'].min():.1f}-"
            f"{t['dispatch_us_p50'].max():.1f} us p50 over {len(t)} cells{by_commit}"
            + (f", while the lookup alone in a tight loop on the same host takes {lookup.iloc[0]:.2f} us (kernel bench "
               "dispatch_cost); the rest is host work around the lookup in a running engine, not broken down further"
               if len(lookup) else "")
            + f"; as a share of the decode step: {share_line(t)} (tables/dispatch_overhead).")


def share_line(t: pd.DataFrame) -> str:
    """The dispatcher's share of the decode step, at most, per system (the claims read GraniKV's, system=granikv,
    written as the claims table writes their number: 4 significant digits)."""
    by = t.groupby("system.name")["share_pct"].agg(["max", "size"]) if "system.name" in t.columns else pd.DataFrame()
    if by.empty:
        return f"at most {t['share_pct'].max():.4g}%"
    order = sorted(by.index, key=lambda s: (s != "granikv", s))
    return ", ".join(f"at most {by.loc[s, 'max']:.4g}% in {s}'s {int(by.loc[s, 'size'])} cells" for s in order)
