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

from analysis.common import NOT_MEASURED, NULL, aggregate, placeholder_figure, plt, save_figure, sort_rows, write_table
from analysis.gpu import ordered
from analysis.load import Results
from analysis.measures.kernels import DERIVED_KINDS, OWN_EXHIBIT_KINDS, describe_columns, kernel_frame
from analysis.paper import paper_claims
from analysis.plots import PAPER_LABEL, legend_below, lp_axis, suptitle, title_of
from analysis.registry import register_exhibit



NAME = "kernel"
FIGURES = ("kernel_roofline",)


# the roofline's series: kernel backends and variants by family (at most five per panel)
FAMILIES = (("paged", ("paged",)), ("dense", ("dense", "contiguous_dense")), ("cascade, hydragen", ("cascade", "hydragen")),
            ("GraniKV", ("granikv",)))
OTHER = "GEMMs and other kernels"


def family(backend) -> str:
    """The roofline series a kernel row's backend falls in (FAMILIES by name prefix, else OTHER)."""
    b = str(backend)
    return next((name for name, pre in FAMILIES if b.startswith(pre)), OTHER)


def _roof(ax, g: pd.DataFrame, xlim) -> str:
    """One GPU's rows by family and its roof from its own measured peaks (median over its rows); the roof's label."""
    markers = "osD^v"
    order = [n for n, _ in FAMILIES] + [OTHER]
    fam = g["k.backend"].map(family) if "k.backend" in g.columns else pd.Series(OTHER, index=g.index)
    for i, name in enumerate(order):
        f = g[fam == name]
        if len(f):
            ax.scatter(f["intensity"], f["tflops"], label=name, s=14, color=plt.cm.tab10(i), marker=markers[i],
                       alpha=0.75)
    pk = g[["peak_tflops", "peak_tbps"]].dropna()
    if pk.empty:
        return "no measured peaks"
    pt, pb = float(pk["peak_tflops"].median()), float(pk["peak_tbps"].median())
    x = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), 100)
    ax.plot(x, np.minimum(pt, x * pb), color="k", lw=1, label="roof (measured peaks)")
    return f"roof: {pt:.0f} TFLOP/s, {pb:.2f} TB/s"


def roofline(t: pd.DataFrame, keys: list[str], out: Path) -> None:
    """One roofline panel per GPU model (achieved TFLOP/s vs arithmetic intensity, the kernel rows by backend
    family, the roof from that GPU's own measured peaks; every panel on the same axes), then the storage-layout
    speed-up (paged-equivalent over HOT layout, per Lp and head shape) on a log axis, with the paper's value."""
    d = t[t["tflops"].notna() & t["intensity"].notna()] if "tflops" in t.columns else t.iloc[0:0]
    if d.empty:
        placeholder_figure("kernel_roofline", out, "kernel rows carry no flops/bytes: roofline not measured")
        return
    gcol = "provenance.gpu_name"
    by_gpu = [(g, d[d[gcol] == g]) for g in ordered(d[gcol].dropna())] \
        if gcol in d.columns and d[gcol].notna().any() else [("GPU ?", d)]     # the primary GPU model's panel first
    n = len(by_gpu)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.6 * n + 4.6, 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": [1.1] * n + [1]})
    rf, a2 = list(axes[0, :n]), axes[0, n]
    xlim = (max(d["intensity"].min() / 2, 1e-2), d["intensity"].max() * 2)
    ylim = (d["tflops"].min() / 2, max(d["tflops"].max(), d["peak_tflops"].max() if "peak_tflops" in d else 0) * 2)
    for ax, (gpu, g) in zip(rf, by_gpu):
        roof = _roof(ax, g, xlim)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(*xlim)
        ax.set_ylim(*ylim)
        ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(f"{gpu}: {len(g)} kernel rows\n{roof}", fontsize=9)
    lay = t[(t.get("cell.kind") == "layout")] if "cell.kind" in t.columns else t.iloc[0:0]
    rows = []
    if not lay.empty:
        lay = lay.assign(**{gcol: lay[gcol].fillna("GPU ?") if gcol in lay.columns else "GPU ?"})
        for (gpu, shape, lp), g in lay.groupby([gcol, "cell.shape.name", "cell.prefix_len"], sort=True):
            tm = g.set_index("k.backend")["time_us_mean"]
            if "contiguous_dense" not in tm.index:
                continue
            for v in ("paged_unique_prefill", "paged_unique_decode"):
                if v in tm.index:
                    rows.append({gcol: gpu, "shape": shape, "workload.prefix_len": lp, "variant": v,
                                 "speedup": float(tm[v] / tm["contiguous_dense"])})
    sp = pd.DataFrame(rows)
    if not sp.empty:
        for i, ((shape, v), g) in enumerate(sp.groupby(["shape", "variant"], sort=True)):
            g = g.sort_values("workload.prefix_len")
            a2.plot(g["workload.prefix_len"], g["speedup"], marker="o", color=plt.cm.tab10(i),
                    ls="-" if v.endswith("prefill") else "--",
                    label=f"{shape}: {v.replace('paged_unique_', 'paged copies, ')} kernel / HOT")
        paper = paper_claims(["kernel_storage_layout"])
        if not paper.empty:
            a2.axhline(paper["value"].iloc[0], color="black", ls=":", lw=1.4, label=f"{PAPER_LABEL}: {paper['value'].iloc[0]:g}x")
        a2.set_yscale("log")
        lp_axis(a2, sp["workload.prefix_len"])
        a2.set_xlabel("Lp")
        a2.set_ylabel("time, paged-equivalent / HOT layout (log)")
        a2.set_title("storage layout alone (B=256): speed-up of the HOT slab\n"
                     + ", ".join(sorted(sp[gcol].astype(str).unique())), fontsize=9)
    else:
        a2.axis("off")
    shapes = sorted(d["cell.shape.name"].dropna().astype(str).unique()) if "cell.shape.name" in d.columns else []
    suptitle(fig, title_of("Attention-layer microbenchmark (one layer per TP rank)", ", ".join(g for g, _ in by_gpu),
                           [f"shapes {', '.join(shapes)}"] if shapes else []))
    fig.tight_layout()
    legend_below(fig, rf, (0.5 * n / (n + 1), 0.0), ncol=3 * n)
    if not sp.empty:
        legend_below(fig, [a2], (1 - 0.5 / (n + 1), 0.0), ncol=1)
    data = d[[c for c in (gcol, "cell.kind", "cell.shape.name", "cell.prefix_len", "cell.batch",
                          "k.backend", "intensity", "tflops") if c in d.columns]]
    save_figure(fig, "kernel_roofline", out, data=pd.concat([data.assign(panel="roofline"),
                                                            sp.assign(panel="layout speed-up")], ignore_index=True))


@register_exhibit(NAME, figures=FIGURES)
def build(res: Results, out: Path, figures: bool = True) -> pd.DataFrame:
    """Write this module's table (and, unless ``figures`` is False, its figures); return the table."""
    k = kernel_frame(res)
    if "cell.kind" in k.columns:
        k = k[~k["cell.kind"].isin(DERIVED_KINDS + OWN_EXHIBIT_KINDS)]
    if k.empty:
        t = pd.DataFrame([{"status": NOT_MEASURED, "why": "no kernel.jsonl rows (run python -m runners.kernel_bench)"}])
        write_table(t, NAME, out, title="Kernel mechanism (attention microbenchmark)")
        if not figures:
            return t
        placeholder_figure("kernel_roofline", out, "no kernel.jsonl rows under the results folder")
        return t
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
                     "the calibration cells' times) are not repeated; hot_batch cells are in tables/hot_batch.md.")
    if not figures:
        return t
    roofline(t, keys, out)
    return t
