"""The kernels frame: kernel-bench rows with time, throughput, their fractions of the peaks and the bound."""
from __future__ import annotations
import json

import numpy as np
import pandas as pd

from analysis.common import aggregate, config_label, geomean, select
from analysis.load import Results






TIME_FIELDS = (("k.time_ms", 1.0), ("k.mean_ms", 1.0), ("k.median_ms", 1.0), ("k.ms", 1.0), ("k.time_us", 1e-3),
               ("k.us_per_step", 1e-3))


DERIVED_KINDS = ("calibration_fit", "graph_step_fit")  # rows copied from other cells: left out of the table
OWN_EXHIBIT_KINDS = ("hot_batch", "graph_step")   # cells whose variants only their own exhibit compares (per case): left out too


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


def row_kernels(text, where: str) -> list[dict]:
    ks = json.loads(text) if isinstance(text, str) else text
    if not isinstance(ks, list) or not all(isinstance(k, dict) and {"name", "us_per_call", "launches_per_call"} <= set(k)
                                           for k in ks):
        raise ValueError(f"{where}: kernels must be a list of {{name, us_per_call, launches_per_call}} "
                         "(runners.kernel_bench profile_kernels=true writes it); rerun the cell")
    return ks
