"""Kernel mechanism (paper Sec. 4): the attention microbenchmark (``runners.kernel_bench``,
``kernel.jsonl`` rows) as a table and a roofline plot.

Per kernel row (fields ``k.<name>`` in the kernels frame) we read the time (``time_ms``, else
``mean_ms`` / ``median_ms`` / ``ms``, or ``time_us``) and, where the row gives them, the work done
(``flops``) and HBM traffic (``bytes``): achieved TFLOP/s and TB/s, their fractions of the
measured peaks (row ``peak_*``, else the cell's ``peaks.*`` from runners.kernel_bench, else
``hardware.peak_*``), and arithmetic intensity. ``bound`` is the resource the kernel uses the
larger fraction of (``compute`` or ``memory``): a measured utilisation, not a model. Rows
without flops/bytes or peaks leave these blank ("not measured"), never estimated.

``bytes`` counts what a backend must read (granikv.attention.bench.kv_bytes: paged reads the
shared prefix once per request), not what DRAM served, and the bandwidth peak is a
device-to-device copy's (read + write), so ``pct_peak_bw`` can pass 100 (``above_hbm_peak``):
by a few percent for a read-only stream (paged over per-request copies), by far where
the requests of one launch read the same prefix pages and part of them come from the L2 cache
(paged over a shared prefix). The time is per call, in microseconds, so the dispatcher's per-step cost
(``us_per_step``, kernel bench ``dispatch`` cells) reads in the same column. The calibration
fit's rows (kind ``calibration_fit``: the per-point times copied from the calibration cells the
fit read) are not repeated here.

Writes tables/kernel.{csv,md} and figures/kernel_roofline.{png,pdf,csv} (the roofline of every row, and the
storage-layout speed-up per Lp against the paper's 15.6x).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import (NOT_MEASURED, NULL, aggregate, config_label, geomean, placeholder_figure, plt, save_figure,
                             select, sort_rows, write_table)
from analysis.load import Results

NAME = "kernel"
FIGURES = ("kernel_roofline",)
TIME_FIELDS = (("k.time_ms", 1.0), ("k.mean_ms", 1.0), ("k.median_ms", 1.0), ("k.ms", 1.0), ("k.time_us", 1e-3),
               ("k.us_per_step", 1e-3))
DERIVED_KINDS = ("calibration_fit",)  # rows copied from other cells: left out of the table
def _first(df: pd.DataFrame, names: tuple[str, ...]) -> pd.Series:
    out = pd.Series(np.nan, index=df.index, dtype=float)
    for n in names:
        if n in df.columns:
            out = out.fillna(pd.to_numeric(df[n], errors="coerce"))
    return out


def slab_once(k: pd.DataFrame, nbytes: pd.Series) -> pd.Series:
    """Bytes with a layout cell's ``contiguous_dense_split`` row set to its ``contiguous_dense`` sibling's:
    both read the HOT slab once (the split reads it as interleaved chunks). Runners before the fix of
    runners.kernel_bench.layout_bytes recorded the per-request-copy count for the split row."""
    need = {"cell.kind", "k.backend", "path"}
    if not need <= set(k.columns):
        return nbytes
    lay = k["cell.kind"] == "layout"
    plain = nbytes[lay & (k["k.backend"] == "contiguous_dense")].groupby(k["path"]).first()
    split = lay & (k["k.backend"] == "contiguous_dense_split")
    return nbytes.where(~split, k["path"].map(plain).where(lambda v: v.notna(), nbytes))


def kernel_frame(res: Results) -> pd.DataFrame:
    """The kernels frame plus ``time_ms``, ``tflops``, ``tbps``, ``intensity``, ``peak_*``,
    ``pct_peak_flops``, ``pct_peak_bw``, ``bound`` and ``config``."""
    k = res.kernels.copy()
    if k.empty:
        return k
    t = pd.Series(np.nan, index=k.index, dtype=float)
    for name, scale in TIME_FIELDS:
        if name in k.columns:
            t = t.fillna(pd.to_numeric(k[name], errors="coerce") * scale)
    k["time_ms"] = t
    flops = _first(k, ("k.flops",))
    nbytes = slab_once(k, _first(k, ("k.bytes", "k.hbm_bytes")))
    k["tflops"] = flops / (t * 1e-3) / 1e12
    k["tbps"] = nbytes / (t * 1e-3) / 1e12
    k["intensity"] = flops / nbytes
    k["peak_tflops"] = _first(k, ("k.peak_tflops", "peaks.peak_tflops", "hardware.peak_tflops")).where(lambda s: s > 0)
    k["peak_tbps"] = _first(k, ("k.peak_tbps", "peaks.peak_tbps", "hardware.peak_tbps")).where(lambda s: s > 0)
    k["pct_peak_flops"] = 100 * k["tflops"] / k["peak_tflops"]
    k["pct_peak_bw"] = 100 * k["tbps"] / k["peak_tbps"]
    k["bound"] = np.where(k["pct_peak_flops"].isna() | k["pct_peak_bw"].isna(), None,
                          np.where(k["pct_peak_flops"] >= k["pct_peak_bw"], "compute", "memory"))
    if {"model.name", "tp"} <= set(k.columns):
        k["config"] = [config_label(m, t) for m, t in zip(k["model.name"], k["tp"])]
    return k


# what tells two kernel measurements apart (runners.kernel_bench: cell kind decode | layout |
# dispatch, the head shape, Lp, B, k; per row the backend / layout variant and dispatch classes)
DESCRIBE = ("provenance.gpu_name", "config", "cell.kind", "cell.shape.name", "cell.prefix_len", "cell.batch",
            "cell.num_prefixes", "k.backend", "k.num_classes", "k.batch")


def describe_columns(res: Results, k: pd.DataFrame) -> list[str]:
    """The DESCRIBE columns present in the kernels frame."""
    return [c for c in DESCRIBE if c in k.columns and k[c].notna().any()]


def kernel_speedup(k: pd.DataFrame, keys: list[str], num_sel: dict, base_over: dict) -> tuple[float, int]:
    """Geomean over matched pairs of time(num) / time(base) (> 1: base is faster); (value, pairs)."""
    num = aggregate(select(k, num_sel), keys, "time_ms")
    base = aggregate(select(k, {**num_sel, **base_over}), keys, "time_ms")
    free = [c for c in keys if c not in base_over]
    if num.empty or base.empty:
        return float("nan"), 0
    m = num.merge(base, on=[c for c in free], suffixes=("_n", "_b"))
    return geomean(m["mean_n"] / m["mean_b"]), len(m)


def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    k = kernel_frame(res)
    if k.empty:
        t = pd.DataFrame([{"status": NOT_MEASURED, "why": "no kernel.jsonl rows (run python -m runners.kernel_bench)"}])
        write_table(t, NAME, out, title="Kernel mechanism (attention microbenchmark)")
        if not figures:
            return t
        placeholder_figure("kernel_roofline", out, "no kernel.jsonl rows under the results folder")
        return t
    if "cell.kind" in k.columns:
        k = k[~k["cell.kind"].isin(DERIVED_KINDS)]
    k = k.assign(time_us=1e3 * k["time_ms"])
    keys = describe_columns(res, k)
    agg = aggregate(k, keys, "time_us")
    for col in ("tflops", "tbps", "intensity", "peak_tflops", "peak_tbps", "pct_peak_flops", "pct_peak_bw"):
        agg = agg.merge(aggregate(k, keys, col)[keys + ["mean"]].rename(columns={"mean": col}), on=keys, how="left")
    agg["above_hbm_peak"] = agg["pct_peak_bw"].gt(100).where(agg["pct_peak_bw"].notna())
    b = k[keys + ["bound"]].copy()
    b[keys] = b[keys].astype(object).where(b[keys].notna(), NULL)
    agg = agg.merge(b.drop_duplicates(keys), on=keys, how="left")
    agg = agg.rename(columns={"mean": "time_us_mean", "sd": "time_us_sd", "min": "time_us_min", "max": "time_us_max"})
    agg["bound"] = agg["bound"].fillna(NOT_MEASURED).where(agg["n"] == 0, agg["bound"].fillna(""))
    t = sort_rows(agg, keys)
    write_table(t, NAME, out, {"time_us_mean": 2, "time_us_sd": 2, "time_us_min": 2, "time_us_max": 2, "tflops": 3,
                               "tbps": 3, "intensity": 1, "peak_tflops": 3, "peak_tbps": 3, "pct_peak_flops": 1,
                               "pct_peak_bw": 1},
                title="Kernel mechanism: attention microbenchmark",
                note="time per call in microseconds (mean over repetitions; dispatch rows: the dispatcher's CPU time "
                     "per step); pct_peak_*: achieved share of the measured peaks; bound: the resource used the "
                     "larger share of (blank where the row carries no flops/bytes). bytes count what the backend "
                     "must read (paged: the shared prefix once per request); above_hbm_peak: that count over the "
                     "time passes the measured bandwidth peak (a device-to-device copy): a few percent above it "
                     "a read-only stream beats the copy, far above it part of the reads came from the L2 cache "
                     "(requests of one launch reading the same prefix pages). calibration_fit rows (copies of "
                     "the calibration cells' times) are not repeated.")
    if not figures:
        return t
    roofline(t, keys, out)
    return t


def roofline(t: pd.DataFrame, keys: list[str], out: Path) -> None:
    """Left: achieved TFLOP/s vs arithmetic intensity, one marker per kernel row, with the roof. Right: the
    storage-layout speed-up (paged-equivalent over HOT layout, per Lp and head shape) on a log axis, with
    the paper's value."""
    from analysis.plots import PAPER_LABEL, lp_axis, paper_claims, title_of
    d = t[t["tflops"].notna() & t["intensity"].notna()] if "tflops" in t.columns else t.iloc[0:0]
    if d.empty:
        placeholder_figure("kernel_roofline", out, "kernel rows carry no flops/bytes: roofline not measured")
        return
    hue = "k.backend" if "k.backend" in d.columns else None
    fig, (ax, a2) = plt.subplots(1, 2, figsize=(11.5, 4.4), gridspec_kw={"width_ratios": [1.3, 1]})
    groups = list(d.groupby(hue, sort=True)) if hue else [("kernel", d)]
    markers = "osD^v<>"
    for i, (lab, g) in enumerate(groups):   # a colour and marker of its own per backend / variant
        ax.scatter(g["intensity"], g["tflops"], label=str(lab), s=16, color=plt.cm.tab20(i % 20),
                   marker=markers[i % len(markers)], alpha=0.85)
    pk = d[["peak_tflops", "peak_tbps"]].dropna()
    if not pk.empty:
        pt, pb = float(pk["peak_tflops"].iloc[0]), float(pk["peak_tbps"].iloc[0])
        x = np.logspace(np.log10(max(d["intensity"].min() / 4, 1e-2)), np.log10(d["intensity"].max() * 4), 100)
        ax.plot(x, np.minimum(pt, x * pb), color="k", lw=1, label=f"roof ({pt:.0f} TFLOP/s, {pb:.2f} TB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("roofline, every kernel row", fontsize=9)
    ax.legend(fontsize=6, title=hue[2:] if hue else None, title_fontsize=6, ncol=2)
    lay = t[(t.get("cell.kind") == "layout")] if "cell.kind" in t.columns else t.iloc[0:0]
    rows = []
    if not lay.empty:
        for (shape, lp), g in lay.groupby(["cell.shape.name", "cell.prefix_len"], sort=True):
            tm = g.set_index("k.backend")["time_us_mean"]
            if "contiguous_dense" not in tm.index:
                continue
            for v in ("paged_unique_prefill", "paged_unique_decode"):
                if v in tm.index:
                    rows.append({"shape": shape, "workload.prefix_len": lp, "variant": v,
                                 "speedup": float(tm[v] / tm["contiguous_dense"])})
    sp = pd.DataFrame(rows)
    if not sp.empty:
        for (shape, v), g in sp.groupby(["shape", "variant"], sort=True):
            g = g.sort_values("workload.prefix_len")
            a2.plot(g["workload.prefix_len"], g["speedup"], marker="o",
                    ls="-" if v.endswith("prefill") else "--",
                    label=f"{shape}: {v.replace('paged_unique_', 'paged copies, ')} kernel / HOT")
        paper = paper_claims(["kernel_storage_layout"])
        if not paper.empty:
            a2.axhline(paper["value"].iloc[0], color="black", ls=":", lw=1.4, label=f"{PAPER_LABEL}: {paper['value'].iloc[0]:g}x")
        a2.set_yscale("log")
        lp_axis(a2, sp["workload.prefix_len"])
        a2.set_xlabel("Lp")
        a2.set_ylabel("time, paged-equivalent / HOT layout (log)")
        a2.set_title("storage layout alone (B=256): speed-up of the HOT slab", fontsize=9)
        a2.legend(fontsize=6)
    else:
        a2.axis("off")
    gpus = sorted(d["provenance.gpu_name"].dropna().astype(str).unique()) if "provenance.gpu_name" in d.columns else []
    shapes = sorted(d["cell.shape.name"].dropna().astype(str).unique()) if "cell.shape.name" in d.columns else []
    fig.suptitle(title_of("Attention-layer microbenchmark (one layer per TP rank)", ", ".join(gpus) or "GPU ?",
                          [f"shapes {', '.join(shapes)}"] if shapes else []), fontsize=10)
    fig.tight_layout()
    data = d[[c for c in ("provenance.gpu_name", "cell.kind", "cell.shape.name", "cell.prefix_len", "cell.batch",
                          "k.backend", "intensity", "tflops") if c in d.columns]]
    save_figure(fig, "kernel_roofline", out, data=pd.concat([data.assign(panel="roofline"),
                                                            sp.assign(panel="layout speed-up")], ignore_index=True))


# the paper's storage-layout comparison: the fixed dense prefix kernel (non-causal prefill) on
# the unique paged-equivalent layout (each request its own prefix copy, re-read B times) vs on
# the contiguous HOT slab (runners.kernel_bench layout cells; B=256 on the GPU preset)
LAYOUT_NUM = {"cell.kind": "=layout", "k.backend": "=paged_unique_prefill", "cell.batch": "=256",
              "cell.prefix_len": "=max"}
LAYOUT_BASE = {"k.backend": "=contiguous_dense"}


def layout_speedup(res: Results) -> tuple[float, int]:
    """Our kernel-isolated storage-layout speed-up s (paper: 15.6x) and the number of pairs."""
    k = kernel_frame(res)
    if k.empty:
        return float("nan"), 0
    return kernel_speedup(k, describe_columns(res, k), LAYOUT_NUM, LAYOUT_BASE)
