"""analysis.multiprefix on runner output that mixes uniform and heterogeneous cells and two KV-budget
presets, as the committed H200 results do: every measured cell gets a row and a figure panel.

Regression (2026-11-30): a configuration column empty for one kind of cell (``workload.prefix_lens``
is null for uniform cells) made pandas drop those groups, and with them every panel: `make
reproduce` stopped with "Number of columns must be a positive integer, not 0".
"""
from __future__ import annotations
import os
import subprocess
import sys
from pathlib import Path
import pandas as pd
import pytest

from analysis.exhibits import multiprefix
from analysis.report import steps as steps_lines
from analysis.load import load_results

ROOT = Path(__file__).resolve().parents[1]
MP = ["model=tiny", "hardware=cpu", "workload=multiprefix", "workload.batch=4", "workload.output_len=4",
      "workload.suffix_len=4", "workload.prefix_len=32", "system=granikv,sglang_default"]


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", "runners.run", "-m", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    if p.returncode != 0:
        pytest.fail(f"runners.run {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("mp") / "raw"
    _run([*MP, "workload.num_prefixes=1,2", "sweep_name=mp_uniform_a", f"results_dir={raw}"])
    _run([*MP, "workload.num_prefixes=1", "hardware.kv_budget_tokens=2048", "sweep_name=mp_uniform_b",
          f"results_dir={raw}"])
    _run([*MP, "workload.prefix_lens=[16,32]", "workload.num_prefixes=2", "sweep_name=mp_hetero",
          f"results_dir={raw}"])
    return raw


def test_uniform_and_heterogeneous_cells_each_get_a_row_and_a_panel(raw, tmp_path, monkeypatch):
    panels = []
    orig = multiprefix.plt.subplots

    def subplots(*a, **kw):
        panels.append(a[1])
        return orig(*a, **kw)
    monkeypatch.setattr(multiprefix.plt, "subplots", subplots)
    t = multiprefix.build(load_results(raw), tmp_path / "out")
    m = t[t["status"] == "measured"]
    assert len(m) == 2 * 2 + 2 + 2, m[["mode", "workload.num_prefixes", "system"]]
    assert set(m["mode"]) == {"uniform", "heterogeneous"}
    # uniform at the default budget, uniform at 2048 tokens, heterogeneous: three panels
    assert panels == [3]
    assert (tmp_path / "out" / "figures" / "multiprefix.png").stat().st_size > 0
    csv = pd.read_csv(tmp_path / "out" / "tables" / "multiprefix.csv", dtype=str, keep_default_na=False)
    assert (csv["status"] == "measured").sum() == len(m)


def test_storage_line_reads_the_claims_granikv_cell(raw):
    """The REPORT's explanation of a multi-prefix claim: the heterogeneous GraniKV cell's prefix tokens
    (16 + 32, from the list), its HOT pool, admissions and paths, against sglang_default's TTFT / TPOT."""
    res = load_results(raw)
    claim = pd.Series({"selectors": "workload.kind=multiprefix;workload.prefix_lens=notnull;workload.num_prefixes=2"})
    line = steps_lines.storage_line(res, claim)
    g = res.cells[(res.cells["system.name"] == "granikv") & res.cells["workload.prefix_lens"].notna()].iloc[0]
    assert "k=2, 0.0K prefix tokens" in line                        # 48 tokens
    assert f"HOT pool of {g['hot_capacity_tokens'] / 1e3:.1f}K" in line
    assert "class-steps by path {" in line and "(sglang_default)" in line
    assert "decode steps " in line and "of GraniKV's step time" in line and "mean decode batch" in line
    none = pd.Series({"selectors": "workload.kind=multiprefix;workload.num_prefixes=64"})
    assert steps_lines.storage_line(res, none) == ""
