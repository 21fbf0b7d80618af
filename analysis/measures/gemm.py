"""The GEMM floor: every weight GEMM of one decode step timed alone (runners.kernel_bench_gemm_floor)."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED
from analysis.load import Results






PARTS = ("step", "qkv", "o", "gate_up", "down", "lm_head")


KEYS = ["gpu", "model", "tp", "m", "part"]


COLUMNS = KEYS + ["n", "time_ms", "tflops", "tbps", "tflops_frac_peak", "tbps_frac_peak", "parts_sum_ms", "status"]


def floor_frame(res: Results) -> pd.DataFrame:
    """The table's rows (empty frame when no GPU gemm_floor cell exists)."""
    k = res.kernels
    need = {"cell.kind", "k.backend", "k.time_ms", "k.graph", "cell.device", "cell.model.name", "cell.tp",
            "cell.batch", "provenance.gpu_name"}
    if k.empty or not need <= set(k.columns):
        return pd.DataFrame(columns=COLUMNS)
    f = k[(k["cell.kind"] == "gemm_floor") & (k["cell.device"] == "cuda") & (k["k.graph"] == True)  # noqa: E712
          & k["provenance.gpu_name"].notna()]
    if f.empty:
        return pd.DataFrame(columns=COLUMNS)
    num = {c: pd.to_numeric(f[src], errors="coerce") if src in f.columns else np.nan
           for c, src in (("time_ms", "k.time_ms"), ("tflops", "k.tflops"), ("tbps", "k.tbps"),
                          ("tflops_frac_peak", "k.tflops_frac_peak"), ("tbps_frac_peak", "k.tbps_frac_peak"))}
    f = pd.DataFrame({"gpu": f["provenance.gpu_name"].astype(str), "model": f["cell.model.name"].astype(str),
                      "tp": f["cell.tp"].astype(int), "m": f["cell.batch"].astype(int),
                      "part": f["k.backend"].astype(str), "path": f["path"], **num})
    g = f.groupby(KEYS, sort=True)
    t = g[["time_ms", "tflops", "tbps", "tflops_frac_peak", "tbps_frac_peak"]].mean()
    t["n"] = g.size()
    t = t.reset_index()
    parts = t[t["part"] != "step"].groupby(["gpu", "model", "tp", "m"])["time_ms"].sum().rename("parts_sum_ms")
    t = t.merge(parts.reset_index(), on=["gpu", "model", "tp", "m"], how="left")
    t.loc[t["part"] != "step", "parts_sum_ms"] = np.nan
    t["status"] = np.where(t["time_ms"].notna(), "measured", NOT_MEASURED)
    order = {p: i for i, p in enumerate(PARTS)}
    t["_o"] = t["part"].map(order).fillna(len(PARTS))
    t = t.sort_values(["gpu", "model", "tp", "m", "_o"], kind="stable").drop(columns="_o")
    return t[COLUMNS].reset_index(drop=True)
