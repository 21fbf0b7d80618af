"""analysis/bounds.py: a failed bound claim is explained by the configurations that break it (and,
for the routing claims, by the calibration times at those points), on hand-built frames."""
from __future__ import annotations
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.report import bounds

COLS = ["model.name", "system.name", "workload.prefix_len", "workload.batch"]


@pytest.fixture
def frame(monkeypatch):
    """Patch the claims context so that every frame is the given DataFrame."""
    def use(df: pd.DataFrame, kernels: pd.DataFrame | None = None):
        monkeypatch.setattr(bounds, "Context", lambda res: SimpleNamespace(frame=lambda name: df))
        return SimpleNamespace(config_columns=COLS, kernels=kernels if kernels is not None else pd.DataFrame())
    return use


def _routing(fracs: dict) -> pd.DataFrame:
    return pd.DataFrame([{"model.name": "llama3_8b", "system.name": "granikv", "workload.prefix_len": lp,
                          "workload.batch": b, "meff": 4 * b, "dense_fraction": f} for (lp, b), f in fracs.items()])


def _claim(check: str, value: float, statistic: str = "min", **kw) -> pd.Series:
    return pd.Series({"statistic": statistic, "check": check, "paper_value": str(value), "frame": "cells",
                      "metric": kw.get("metric", "dense_fraction"),
                      "selectors": kw.get("selectors", "model.name=llama3_8b;system.name=granikv;meff>=1024"),
                      "baseline": kw.get("baseline", "")})


def test_bound_line_names_only_the_configurations_that_break_it(frame):
    res = frame(_routing({(512, 256): 0.0, (2048, 256): 1.0, (8192, 256): 0.95, (8192, 128): 0.0}))
    line = bounds.bound_line(res, _claim("bound_ge", 0.87))
    assert line.startswith("1 configuration(s) lie below the bound 0.87")
    assert "Lp=512" in line and "Lp=2048" not in line and "Lp=8192" not in line   # B=128 is not selected
    assert bounds.bound_line(res, _claim("bound_ge", 0.0)) == ""                   # nothing breaks it


def test_bound_le_lists_above_and_counts_beyond_the_list(frame):
    fr = {(lp, 32): 1.0 for lp in (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)}
    res = frame(_routing({**fr, (512, 32): 0.0}))
    line = bounds.bound_line(res, _claim("bound_le", 0.13, "max", selectors="model.name=llama3_8b;meff<1024"))
    assert line.startswith("10 configuration(s) lie above the bound 0.13") and "and 2 more" in line
    assert "Lp=512:" not in line


def test_calibration_line_gives_the_kernel_times_at_the_violating_points(frame):
    kern = pd.DataFrame([{"cell.shape.name": "llama3_8b", "k.prefix_len": 512, "k.meff": 1024,
                          "k.times.dense": 0.100, "k.times.cascade": 0.096, "k.times.paged": 0.129}])
    res = frame(_routing({(512, 256): 0.0, (1024, 256): 0.5}), kern)
    line = bounds.calibration_line(res, _claim("bound_ge", 0.87))
    assert "Lp=512, Meff=1024: dense 100 us, cascade 96 us, paged 129 us (fastest: cascade)" in line
    assert "1 point(s) lie between calibration Lp values" in line                 # Lp=1024 not calibrated


def test_deviation_line_splits_by_side_of_one(frame):
    rows = []
    for lp, g in ((512, 0.85), (1024, 1.02), (2048, 1.2)):
        rows += [{"model.name": "m", "system.name": "granikv", "workload.prefix_len": lp, "workload.batch": 256,
                  "ttft": 100 * g},
                 {"model.name": "m", "system.name": "sglang_default", "workload.prefix_len": lp, "workload.batch": 256,
                  "ttft": 100.0}]
    res = frame(pd.DataFrame(rows).assign(system=lambda d: d["system.name"]))
    c = _claim("bound_le", 0.10, "max_abs_dev", metric="ttft", selectors="system.name=granikv",
               baseline="system.name=sglang_default")
    line = bounds.bound_line(res, c)
    assert "(3 pairs, 1 within 10%)" in line
    assert "1 pair(s) lower than the baseline's by more than 10%: Lp=512" in line and "0.8500" in line
    assert "1 pair(s) higher than the baseline's by more than 10%: Lp=2048" in line and "1.2000" in line


def test_kernel_pair_line_gives_the_calibration_ratio_at_each_claimed_point(frame):
    kern = pd.DataFrame([{"cell.shape.name": "llama3_8b", "k.prefix_len": 8192, "k.meff": 1024,
                          "k.times.dense": 0.144, "k.times.cascade": 0.202, "k.times.paged": 0.5},
                         {"cell.shape.name": "qwen25_14b", "k.prefix_len": 2048, "k.meff": 1024,
                          "k.times.dense": 0.5, "k.times.cascade": 0.1, "k.times.paged": 0.5}])
    df = _routing({(8192, 256): 1.0, (2048, 256): 1.0, (8192, 128): 1.0}).assign(**{"system.name": "granikv_dense_only"})
    res = frame(df, kern)
    c = _claim("point", 0.67, "ratio", metric="tpot_p50_ms",
               selectors="model.name=llama3_8b;system.name=granikv_dense_only;meff=1024",
               baseline="system.name=granikv_cascade_only")
    line = bounds.kernel_pair_line(res, c)
    assert "Lp=8192, Meff=1024: dense 144 us vs cascade 202 us (0.71x)" in line
    assert "Meff=512" not in line and "qwen" not in line                      # only the claim's cells and model
    assert "1 point(s) have no calibration measurement" in line               # Lp=2048 is not calibrated for llama
    assert bounds.kernel_pair_line(res, _claim("point", 0.67, selectors="model.name=none")) == ""
