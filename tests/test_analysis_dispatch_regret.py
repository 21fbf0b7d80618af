"""analysis.dispatch_regret: today's decision table (conf/hardware/h200.yaml) against measured kernel-grid
options: the pick's regret over the fastest option, graph times up to the CUDA-graph limit and eager times
above it, and a cell that lacks an option or a hardware preset reported as not measured."""
from __future__ import annotations
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.exhibits.dispatch import dispatch_regret as dr
from analysis.measures import dispatch as dispatch_measures
from analysis.common import NOT_MEASURED
from granikv.attention.dispatch import Dispatcher

LLAMA = {"cell.shape.name": "llama3_8b", "cell.shape.hq": 32, "cell.shape.hkv": 8, "cell.shape.d": 128}


def _rows(lp, b, times, eager_times=None, hw="h200", gpu="NVIDIA H200"):
    out = []
    for backend, ms in times.items():
        out.append({"cell.kind": "decode", "provenance.gpu_name": gpu, "hardware": hw, **LLAMA, "cell.prefix_len": lp,
                    "cell.batch": b, "k.backend": backend, "k.time_ms": ms,
                    "k.time_ms_eager": (eager_times or times)[backend], "k.decisions": None})
    return out


def _frame(rows) -> pd.DataFrame:
    return dr.regret_frame(SimpleNamespace(kernels=pd.DataFrame(rows)))


def _table_choice(lp, b, graph=True) -> str:
    cfg = dispatch_measures.preset("h200")
    return Dispatcher(32, 8, 128, "NVIDIA H200", cfg["decision_table"]).choose(lp, b, graph=graph)


def test_regret_is_the_picks_time_over_the_fastest_options():
    pick = _table_choice(16384, 256)
    others = [o for o in dr.OPTIONS if o != pick]
    times = {dr.OPTIONS[pick]: 0.110, dr.OPTIONS[others[0]]: 0.100, dr.OPTIONS[others[1]]: 0.300}
    t = _frame(_rows(16384, 256, times))
    r = t.iloc[0]
    assert r["status"] == "measured" and r["kind"] == "graph" and r["table_choice"] == pick
    assert r["fastest"] == others[0] and r["regret"] == pytest.approx(0.10) and r["within_3pct"] == "no"
    assert "within 3% of the fastest at 0 of 1" in dr.summary(t)


def test_above_the_graph_limit_the_eager_rules_and_times_decide():
    limit = dispatch_measures.preset("h200")["cuda_graph_max_bs"]
    b = 2 * limit
    pick = _table_choice(8192, b, graph=False)
    graph = {be: 0.1 for be in dr.OPTIONS.values()}
    graph[dr.OPTIONS[pick]] = 1.0          # slow in graph replay, which an eager step never runs
    eager = {be: 0.2 for be in dr.OPTIONS.values()}
    eager[dr.OPTIONS[pick]] = 0.1
    r = _frame(_rows(8192, b, graph, eager)).iloc[0]
    assert r["kind"] == "eager" and r["regret"] == pytest.approx(0.0) and r["within_3pct"] == "yes"
    assert r["table_us"] == pytest.approx(100.0)


def test_missing_option_or_preset_is_not_measured():
    part = _frame(_rows(2048, 64, {"dense": 0.05, "paged": 0.06}))
    assert part.iloc[0]["status"].startswith(NOT_MEASURED) and "not every option" in part.iloc[0]["status"]
    nohw = _frame(_rows(2048, 64, {be: 0.05 for be in dr.OPTIONS.values()}, hw="no_such_gpu"))
    assert "no hardware preset no_such_gpu" in nohw.iloc[0]["status"]
    assert dr.summary(part).endswith(NOT_MEASURED)
    # every other cell of the H200 kernel grid is listed, not measured, and none is left out
    assert len(dr.expected_grid()) == 2 * 4 * 6 and len(part) == len(dr.expected_grid())
    assert (part["status"] == NOT_MEASURED).sum() == len(dr.expected_grid()) - 1
