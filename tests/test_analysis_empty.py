"""The analysis on a results folder with nothing measured yet: every module runs, nothing is
invented, every claim is 'not measured' with a reason."""
from __future__ import annotations
import subprocess
from pathlib import Path
import pandas as pd
import pytest

from analysis.reproduce import EXHIBITS, main, run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def empty_out(tmp_path_factory):
    raw = tmp_path_factory.mktemp("raw")  # exists, holds no cell
    out = tmp_path_factory.mktemp("out")
    return run(raw, out, folders=None), out


def test_every_module_writes_table_and_figures(empty_out):
    r, out = empty_out
    for m in EXHIBITS:
        for ext in ("csv", "md"):
            assert (out / "tables" / f"{m.name}.{ext}").stat().st_size > 0
    assert r["figures"] == [f for m in EXHIBITS for f in m.figures] and len(r["figures"]) >= 10
    for f in r["figures"]:
        assert (out / "figures" / f"{f}.png").exists() and (out / "figures" / f"{f}.pdf").exists()
    assert {p.stem for p in (out / "figures").glob("*.png")} == set(r["figures"])  # each module declares its figures


def test_nothing_is_invented(empty_out):
    r, out = empty_out
    ev = r["claims"]
    assert (ev["verdict"] == "not measured").all()
    assert (ev["why"].str.len() > 0).all()
    for m in EXHIBITS:
        t = pd.read_csv(out / "tables" / f"{m.name}.csv", dtype=str, keep_default_na=False)
        assert len(t) > 0, m.name
        status = t["status"] if "status" in t.columns else t.get("bound")
        assert status is not None and status.str.startswith("not measured").all(), m.name
        for col in ("mean", "ratio_vs_sglang_default", "tpot_p50_ms", "measured", "share_pct", "attention_ms"):
            if col in t.columns:
                assert (t[col] == "").all(), (m.name, col)
    # bookkeeping: nothing superseded, so the reruns table has its header and no row
    reruns = pd.read_csv(out / "tables" / "reruns.csv", dtype=str, keep_default_na=False)
    assert len(reruns) == 0 and {"before", "after", "after_over_before"} <= set(reruns.columns)
    report = (out / "REPORT.md").read_text()
    assert "A100-SXM4-40GB" in report and "0 reproduced" in report


def test_headline_expects_the_paper_grid(empty_out):
    _, out = empty_out
    t = pd.read_csv(out / "tables" / "headline.csv", dtype=str)
    assert set(t["config"]) == {"llama3_8b TP=1", "qwen25_14b TP=2", "qwen25_32b TP=4"}
    assert set(t["Lp"]) == {"512", "1024", "2048", "4096", "8192", "16384"}
    assert set(t["system"]) == {"sglang_default", "sglang_cascade", "hydragen", "granikv"}
    assert len(t) == 3 * 6 * 4


def test_only_tables_writes_no_figures(tmp_path):
    assert main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--only", "tables"]) == 0
    assert (tmp_path / "o" / "REPORT.md").exists()
    assert not (tmp_path / "o" / "figures").exists()


def test_make_help_lists_analysis_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for target in ("reproduce", "tables", "figures"):
        assert f"make {target}" in out


def test_bad_arguments_fail_before_work(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["--results", str(f), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "--results" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
