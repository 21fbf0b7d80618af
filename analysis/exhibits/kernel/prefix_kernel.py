"""The dense prefix path against the hardware, kernel by kernel: where one layer's dense attention call
(``runners.kernel_bench`` backends ``dense*``, run with ``profile_kernels=true``) spends its time, and
how close its prefix kernel runs to the bf16 tensor-core peak.

One row per profiled ``dense*`` kernel-bench row (a shape, Lp, B, one prefix class). The call's kernels
are sorted by name into:

- ``prefix_us``: the dense prefix kernel over the HOT slab (FlashInfer's single prefill, cuDNN's or
  FlashAttention-2's fused attention, by ``system.dense_kernel``);
- ``suffix_us``: the suffix attention over the token-level COLD pool (FlashInfer's paged kernel);
- ``merge_us``: the LSE merges (the KV-split merge and the prefix/suffix merge);
- ``glue_us``: every other kernel (copies of the packed queries, casts);
- ``gaps_us``: the timed call (CUDA-graph replay where captured) less the sum of its kernels.

Rates: ``prefix_tflops`` = 4 x B x Hq x Lp x D / prefix_us (QK^T and PV), as a share of the GPU's
datasheet dense bf16 peak (``prefix_pct_peak``; H200 SXM 989 TFLOP/s, ``VENDOR_PEAKS`` of
analysis.distance_to_limit) and of the peak the bench measured on that GPU (``prefix_pct_measured``,
a large bf16 GEMM); ``suffix_tbps`` = 2 (K, V) x B x s x Hkv x D x 2 B / suffix_us, s = the cell's
suffix length. ``roofline_us``: max(all FLOPs / peak, the slab read once plus every suffix / BW), the
call's lower bound. ``ncu_sm_pct`` / ``ncu_dram_pct``: Nsight Compute's SM and DRAM throughput of
the split prefix kernel, from the layout cell of the same sweep, shape, Lp and B (``ncu=true``).

Target (the hardware-limit work, Llama-3.1-8B shape, Lp=16K, B=256): the dense prefix kernel at
<= 135 us per layer and >= 65% of the datasheet peak; ``meets_target`` is ``-`` at other cells.
Writes tables/prefix_kernel.{csv,md}; ``lines`` gives the REPORT's paragraph.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, VENDOR_PEAKS, write_table
from analysis.load import Results
from analysis.measures.kernels import row_kernels
from analysis.registry import register_exhibit



NAME = "prefix_kernel"
FIGURES: tuple[str, ...] = ()
PREFIX_KERNEL = re.compile(r"(?<!Batch)PrefillWithKVCacheKernel|sdpa|fmha|pytorch_flash::flash_fwd", re.I)
SUFFIX_KERNEL = re.compile(r"Batch(Prefill|Decode)WithPagedKVCache", re.I)
MERGE_KERNEL = re.compile(r"MergeState", re.I)
TARGET = {"shape": "llama3_8b", "Lp": 16384, "B": 256, "max_us": 135.0, "min_pct_peak": 0.65}
ELT_BYTES = 2   # bf16 K/V
COLUMNS = ["gpu", "shape", "Lp", "B", "backend", "sweep", "code", "timed_us", "prefix_us", "suffix_us", "merge_us",
           "glue_us", "gaps_us", "prefix_tflops", "prefix_pct_peak", "prefix_pct_measured", "suffix_tbps",
           "roofline_us", "timed_vs_roofline", "ncu_sm_pct", "ncu_dram_pct", "meets_target", "status"]
DIGITS = {"timed_us": 1, "prefix_us": 1, "suffix_us": 1, "merge_us": 1, "glue_us": 1, "gaps_us": 1, "prefix_tflops": 0,
          "prefix_pct_peak": 3, "prefix_pct_measured": 3, "suffix_tbps": 2, "roofline_us": 1, "timed_vs_roofline": 2,
          "ncu_sm_pct": 1, "ncu_dram_pct": 1, "Lp": 0, "B": 0}


def classify(name: str) -> str:
    """``prefix`` / ``suffix`` / ``merge`` / ``glue`` for one kernel name of a dense call."""
    if MERGE_KERNEL.search(name):
        return "merge"
    if SUFFIX_KERNEL.search(name):
        return "suffix"
    if PREFIX_KERNEL.search(name):
        return "prefix"
    return "glue"


def _ncu(root: Path, kernels: pd.DataFrame) -> dict[tuple, dict]:
    """(sweep, shape, Lp, B) -> ncu record of the split prefix kernel, from the layout cells' metrics."""
    out: dict[tuple, dict] = {}
    lay = kernels[kernels["cell.kind"] == "layout"] if "cell.kind" in kernels.columns else kernels.iloc[0:0]
    for path, g in lay.groupby("path"):
        r = g.iloc[0]
        p = root / str(path) / "metrics.json"
        ncu = json.loads(p.read_text()).get("ncu") if p.exists() else None
        rec = ncu.get("contiguous_dense_split") if isinstance(ncu, dict) else None
        if isinstance(rec, dict) and "sm_pct" in rec:
            out[(r["sweep"], r["cell.shape.name"], int(r["cell.prefix_len"]), int(r["cell.batch"]))] = rec
    return out


def frame(res: Results) -> pd.DataFrame:
    """One row per profiled dense kernel-bench row (empty frame when none)."""
    k = res.kernels
    need = {"k.kernels", "k.backend", "cell.kind"}
    if k.empty or not need <= set(k.columns):
        return pd.DataFrame(columns=COLUMNS)
    ncu = _ncu(Path(res.root), k)
    rows = []
    sel = k[k["k.kernels"].notna() & (k["cell.kind"] == "decode") & k["k.backend"].astype(str).str.startswith("dense")]
    for _, r in sel.iterrows():
        ks = row_kernels(r["k.kernels"], f"{r.get('path', '?')}/kernel.jsonl backend {r['k.backend']}")
        us = {c: 0.0 for c in ("prefix", "suffix", "merge", "glue")}
        for x in ks:
            us[classify(str(x["name"]))] += float(x["us_per_call"])
        gpu = r.get("provenance.gpu_name") if isinstance(r.get("provenance.gpu_name"), str) else None
        b, lp = int(r["cell.batch"]), int(r["cell.prefix_len"])
        hq, hkv, d = int(r["cell.shape.hq"]), int(r["cell.shape.hkv"]), int(r["cell.shape.d"])
        s = int(r["cell.suffix_len"]) if pd.notna(r.get("cell.suffix_len")) else 0
        timed = float(r["k.time_ms"]) * 1e3 if pd.notna(r.get("k.time_ms")) else np.nan
        flops_prefix = 4.0 * b * hq * lp * d
        flops_all = 4.0 * b * hq * (lp + s) * d
        bytes_suffix = 2.0 * b * s * hkv * d * ELT_BYTES
        bytes_all = bytes_suffix + 2.0 * lp * hkv * d * ELT_BYTES
        row = {"gpu": gpu or "no GPU (CPU)", "shape": r["cell.shape.name"], "Lp": lp, "B": b, "backend": r["k.backend"],
               "sweep": r["sweep"], "code": str(r.get("provenance.git_commit") or "unknown")[:7], "timed_us": timed,
               "prefix_us": us["prefix"], "suffix_us": us["suffix"], "merge_us": us["merge"], "glue_us": us["glue"],
               "gaps_us": timed - sum(us.values()) if np.isfinite(timed) else np.nan, "status": "measured"}
        peak_tf, peak_bw = VENDOR_PEAKS.get(gpu, (np.nan, np.nan))
        row["prefix_tflops"] = flops_prefix / (us["prefix"] * 1e-6) / 1e12 if us["prefix"] > 0 else np.nan
        row["prefix_pct_peak"] = row["prefix_tflops"] / peak_tf
        measured = r.get("peaks.peak_tflops")
        row["prefix_pct_measured"] = row["prefix_tflops"] / float(measured) if pd.notna(measured) and float(measured) > 0 else np.nan
        row["suffix_tbps"] = bytes_suffix / (us["suffix"] * 1e-6) / 1e12 if us["suffix"] > 0 else np.nan
        row["roofline_us"] = max(flops_all / (peak_tf * 1e12), bytes_all / (peak_bw * 1e12)) * 1e6
        row["timed_vs_roofline"] = timed / row["roofline_us"]
        rec = ncu.get((r["sweep"], r["cell.shape.name"], lp, b)) if r["k.backend"] == "dense" else None
        row["ncu_sm_pct"] = float(rec["sm_pct"]) if rec else np.nan
        row["ncu_dram_pct"] = float(rec["dram_pct"]) if rec and "dram_pct" in rec else np.nan
        if (row["shape"], lp, b) == (TARGET["shape"], TARGET["Lp"], TARGET["B"]) and np.isfinite(row["prefix_pct_peak"]):
            ok = us["prefix"] <= TARGET["max_us"] and row["prefix_pct_peak"] >= TARGET["min_pct_peak"]
            row["meets_target"] = "yes" if ok else "no"
        else:
            row["meets_target"] = "-"
        rows.append(row)
    t = pd.DataFrame(rows, columns=COLUMNS)
    return t.sort_values(["gpu", "shape", "Lp", "B", "backend", "sweep", "code"], kind="stable").reset_index(drop=True)


def shown(t: pd.DataFrame) -> pd.DataFrame:
    """The table as written: a missing rate or ncu value says ``not measured``."""
    out = t.copy()
    for c in ("prefix_tflops", "prefix_pct_peak", "prefix_pct_measured", "suffix_tbps", "roofline_us",
              "timed_vs_roofline", "ncu_sm_pct", "ncu_dram_pct", "timed_us", "gaps_us"):
        out[c] = out[c].astype(object).where(out[c].notna(), NOT_MEASURED)
    return out


def lines(t: pd.DataFrame) -> list[str]:
    """The REPORT's paragraph on the dense prefix kernel at the target cell (empty list without a row)."""
    at = t[(t["shape"] == TARGET["shape"]) & (t["Lp"] == TARGET["Lp"]) & (t["B"] == TARGET["B"])] if not t.empty else t
    if at.empty:
        return []
    L = ["", "### The dense prefix kernel against the bf16 peak", "",
         "Llama-3.1-8B shape, Lp=16K, B=256, one layer (tables/prefix_kernel.md; target: prefix kernel <= 135 us "
         "at >= 65% of the bf16 peak):", "",
         "| backend | call us | prefix us | % of peak | suffix us | suffix TB/s | merges + glue + gaps us | roofline us | meets |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in at.itertuples(index=False):
        rest = r.merge_us + r.glue_us + (r.gaps_us if np.isfinite(r.gaps_us) else 0.0)
        L.append(f"| {r.backend} | {r.timed_us:.1f} | {r.prefix_us:.1f} | {100 * r.prefix_pct_peak:.1f}% | "
                 f"{r.suffix_us:.1f} | {r.suffix_tbps:.2f} | {rest:.1f} | {r.roofline_us:.1f} | {r.meets_target} |")
    return L


def section(res: Results) -> list[str]:
    """This exhibit's lines in the REPORT."""
    return lines(frame(res))


@register_exhibit(NAME, figures=FIGURES, chapter="limit", rank=2, section=section)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write tables/prefix_kernel.{csv,md}; return the table."""
    t = frame(res)
    text = shown(t) if not t.empty else pd.DataFrame(
        [{"status": f"{NOT_MEASURED}: no dense kernel-bench row carries a kernel profile "
                    "(python -m runners.kernel_bench 'backends=[dense,...]' profile_kernels=true)"}], columns=COLUMNS)
    write_table(text, NAME, out, DIGITS, title="The dense prefix path kernel by kernel, against the bf16 peak",
                note="One layer's dense attention call per profiled kernel-bench row: prefix kernel (HOT slab), suffix "
                     "kernel (COLD pool), merges, glue kernels and launch gaps, in us per call; the prefix kernel's "
                     "TFLOP/s as a share of the datasheet bf16 peak and of the bench's measured GEMM peak; the "
                     "suffix kernel's TB/s; the call's roofline. Target at Llama-3.1-8B, Lp=16K, B=256: prefix "
                     "kernel <= 135 us and >= 65% of peak (meets_target). Module docstring: analysis/prefix_kernel.py.")
    return t
