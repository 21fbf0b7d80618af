"""analysis.multiclass on a real CPU calibration with k > 1 cells: one row per point and step kind, the
one-class rules' pick and the table's pick at k with their regrets; no such cell -> one 'not measured' row."""
import os
import subprocess
import sys
from pathlib import Path
import pandas as pd
import pytest
import yaml

from analysis.exhibits.dispatch import multiclass as MC
from analysis.load import load_results

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mc")
    raw, hw = tmp / "raw", tmp / "cpu.yaml"
    p = subprocess.run([sys.executable, "-m", "runners.calibrate", f"results_dir={raw}", f"hardware_yaml={hw}",
                        "prefix_lens=[16,64]", "batches=[1,8]", "num_classes=[1,4]", "class_batches=[2]"],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return raw, yaml.safe_load(hw.read_text())["decision_table"]


def test_rows_with_both_picks_and_regrets(calibrated, tmp_path, monkeypatch):
    raw, table = calibrated
    monkeypatch.setattr(MC, "preset", lambda name: {"decision_table": table})   # the table this run fitted
    t = MC.build(load_results(raw), tmp_path)
    assert (tmp_path / "tables" / "multiclass.md").exists()
    assert len(t) == 4 and set(t["status"]) == {"measured"} and set(t["k"]) == {4} and set(t["B_class"]) == {2}
    assert sorted(t["kind"].unique()) == ["eager", "graph"] and sorted(t["Lp"].unique()) == [16, 64]
    for r in t.itertuples():
        costs = {c: getattr(r, f"{c}_us") for c in ("paged", "cascade", "dense")}
        assert r.fastest == MC.fastest(costs)
        assert r.table_regret == pytest.approx(costs[r.table_choice] / costs[r.fastest] - 1)
        assert r.one_class_regret == pytest.approx(costs[r.one_class_choice] / costs[r.fastest] - 1)
        assert r.table_regret == 0          # the table fitted on these very points picks the fastest
    L = MC.lines(t)
    assert any("of 2 points" in x for x in L)


def test_no_multiclass_cell_is_not_measured(tmp_path):
    t = MC.build(load_results(tmp_path / "none"), tmp_path / "out")
    assert len(t) == 1 and t["status"].iloc[0].startswith("not measured") and "num_classes" in t["status"].iloc[0]
    assert any("not measured" in x for x in MC.lines(MC.frame(load_results(tmp_path / "none"))))


def test_fastest_prefers_paged_on_ties():
    assert MC.fastest({"paged": 1.0, "cascade": 1.0, "dense": 2.0}) == "paged"
    assert MC.fastest({"paged": 2.0, "cascade": 1.0, "dense": 1.0}) == "cascade"
    assert pd.isna(MC._cost(pd.DataFrame(columns=["k.backend"]), "dense", False))


def test_engine_cells_against_the_one_class_rules():
    from types import SimpleNamespace

    rows = [{"sweep": "mp_multiclass", "cell_id": f"c{i}", "system.dispatch": d, "workload.num_prefixes": 8,
             "workload.prefix_lens": [1, 2], "output_throughput_tok_s": tok, "tpot_p50_ms": 10.0}
            for i, (d, tok) in enumerate([("table", 90.0), ("table_one_class", 100.0), ("cascade_only", 80.0)])]
    rows.append({**rows[0], "sweep": "other", "cell_id": "x"})                 # not a multi-class sweep
    res = SimpleNamespace(cells=pd.DataFrame(rows))
    g = MC.engine_frame(res).set_index("system.dispatch")
    assert len(g) == 3 and g.loc["table", "vs_one_class"] == pytest.approx(0.9)
    assert g.loc["cascade_only", "vs_one_class"] == pytest.approx(0.8) and set(g["lengths"]) == {"heterogeneous"}
    L = MC.engine_lines(res)
    assert len(L) == 1 and "table 90 tok/s (TPOT p50 10.0 ms, 0.900x the one-class rules)" in L[0]
    assert "not measured" in MC.engine_lines(SimpleNamespace(cells=pd.DataFrame()))[0]
