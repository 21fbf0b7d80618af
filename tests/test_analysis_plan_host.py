"""analysis.plan_host on a real CPU kernel-bench run with plan_reps / profile_plan: one row per (backend,
step kind) with the paged backend's plan time beside it (paged against itself: 1.0); the costliest
functions listed; a malformed profile names the fix; no row with a plan time -> one 'not measured' row."""
import os
import subprocess
import sys
from pathlib import Path
import pandas as pd
import pytest

from analysis.exhibits.kernel import plan_host as PH
from analysis.load import load_results

ROOT = Path(__file__).resolve().parents[1]


def _bench(raw, *extra, sweep="pb"):
    args = ["hardware=cpu", f"results_dir={raw}", f"sweep_name={sweep}", "prefix_lens=[40]", "batches=[4]",
            "num_prefixes=[2]", "layout=false", "dispatch_cost=false", "backends=[paged,granikv]",
            "shapes=[{name:t,hq:8,hkv:2,d:16}]", *extra]
    p = subprocess.run([sys.executable, "-m", "runners.kernel_bench", *args], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return raw


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    return _bench(tmp_path_factory.mktemp("raw"), "plan_reps=5", "profile_plan=3", "class_rows=blocked")


def test_rows_per_backend_with_the_paged_baseline(timed, tmp_path):
    t = PH.build(load_results(timed), tmp_path)
    assert (tmp_path / "tables" / "plan_host.md").exists()
    assert list(t["backend"]) == ["granikv", "paged"] and set(t["step_kind"]) == {"eager"}   # CPU: no graph set
    assert set(t["status"]) == {"measured"} and (t["class_rows"] == "blocked").all() and (t["k"] == 2).all()
    paged = t[t["backend"] == "paged"].iloc[0]
    assert paged["plan_ratio"] == pytest.approx(1.0) and paged["paths"] == "2x paged"
    gk = t[t["backend"] == "granikv"].iloc[0]
    assert gk["plan_ratio"] == pytest.approx(gk["plan_us"] / paged["plan_us"])
    assert gk["top"] and len(gk["top"].split("; ")) <= PH.TOP
    assert pd.isna(gk["busy_us"])                    # plan_busy_ms is a GPU measurement


def test_malformed_profile_names_the_fix(timed):
    res = load_results(timed)
    res.kernels["k.plan_profile_eager"] = [[{"us_per_plan": 1.0}]] * len(res.kernels)
    with pytest.raises(ValueError, match="profile_plan=n"):
        PH.frame(res)


def test_no_plan_time_is_not_measured(tmp_path):
    raw = _bench(tmp_path / "raw")
    t = PH.build(load_results(raw), tmp_path / "out")
    assert len(t) == 1 and t["status"].iloc[0].startswith("not measured")


def test_report_lines(timed):
    L = PH.lines(PH.frame(load_results(timed)))
    rows = [x for x in L if x.startswith("- ")]
    assert len(rows) == 1 and rows[0].startswith("- pb (no GPU (CPU)), eager plans:") and "worst: Lp=40, B=4, k=2" in rows[0]
    assert PH.lines(PH.frame(load_results(timed)).iloc[0:0])[-1].startswith("- not measured")


def test_batch_forms_stay_apart(timed, tmp_path):
    # a slot-table run beside the packed one: its rows say so, each compared with the paged row of its own cell
    raw = _bench(tmp_path / "raw", "plan_reps=5", "class_rows=blocked", "batch_form=slot_table", sweep="pb_table")
    res = load_results(timed)
    both = load_results(raw)
    both.kernels = pd.concat([res.kernels, both.kernels], ignore_index=True)
    t = PH.frame(both)
    assert sorted(t["batch_form"]) == ["packed", "packed", "slot_table", "slot_table"]
    for form, g in t.groupby("batch_form"):
        assert g[g["backend"] == "paged"]["plan_ratio"].iloc[0] == pytest.approx(1.0)
