"""analysis.gemm_floor: the step row and its parts per (GPU, model, TP, M), repetitions averaged, the parts'
sum beside the step, CPU cells and rows timed without their graph left out, and a table that says not measured (with the command) without
GPU cells."""
from __future__ import annotations
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.exhibits.kernel import gemm_floor as G
from analysis.measures import gemm
from analysis.common import NOT_MEASURED


def _rows(m=256, device="cuda", times=None, path="gemm_floor/x", graph=True):
    times = times or {"step": 7.0, "qkv": 0.7, "o": 0.6, "gate_up": 3.5, "down": 1.8, "lm_head": 0.5}
    return [{"cell.kind": "gemm_floor", "cell.device": device, "cell.model.name": "llama3_8b", "cell.tp": 1,
             "cell.batch": m, "provenance.gpu_name": "NVIDIA H200", "k.backend": p, "k.time_ms": t, "k.graph": graph,
             "k.tflops": 100.0, "k.tbps": 2.0, "path": path} for p, t in times.items()]


def _frame(rows):
    return gemm.floor_frame(SimpleNamespace(kernels=pd.DataFrame(rows)))


def test_step_and_parts_in_order_with_the_parts_sum():
    t = _frame(_rows() + _rows(times={"step": 7.2, "qkv": 0.7, "o": 0.6, "gate_up": 3.5, "down": 1.8,
                                      "lm_head": 0.5}, path="gemm_floor/y"))
    assert list(t["part"]) == list(gemm.PARTS)
    step = t.iloc[0]
    assert step["n"] == 2 and step["time_ms"] == pytest.approx(7.1)
    assert step["parts_sum_ms"] == pytest.approx(0.7 + 0.6 + 3.5 + 1.8 + 0.5)
    assert t["parts_sum_ms"].iloc[1:].isna().all()


def test_cpu_cells_are_left_out_and_nothing_left_says_not_measured(tmp_path):
    assert _frame(_rows(device="cpu")).empty
    assert _frame(_rows(graph=False)).empty             # timed without its graph: no floor
    t = G.build(SimpleNamespace(kernels=pd.DataFrame(_rows(device="cpu"))), tmp_path)
    assert t.empty
    text = (tmp_path / "tables" / "gemm_floor.md").read_text()
    assert NOT_MEASURED in text and G.CMD in text
