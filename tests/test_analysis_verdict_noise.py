"""The five-class, noise-aware verdict rule (analysis.claims.VERDICT_RULE) on constructed data: every class
from the rule alone, and through ``evaluate`` on hand-built cells (repetitions, a sweep's measured noise,
noise borrowed from another sweep, a monotone trend within the spread); the rule's text shared with
analysis/README.md; cells of a system outside the paper's four kept out of their tables."""
from __future__ import annotations
import math
from pathlib import Path
import pandas as pd
import pytest



from analysis.verdict import evaluate as evaluate_mod
from analysis.verdict import rule
from analysis.load import Results

ROOT = Path(__file__).resolve().parents[1]
R, EX, NR, INC, NM = rule.REPRODUCED, rule.EXCEEDED, rule.NOT_REPRODUCED, rule.INCONCLUSIVE, rule.NOT_MEASURED


@pytest.mark.parametrize("check,paper,ours,kw,want", [
    ("point", 2.16, 2.0, {"ratio": True}, R),                        # within 25%
    ("point", 2.16, 3.0, {"ratio": True}, EX),                       # same direction, beyond +25%
    ("point", 2.16, 1.5, {"ratio": True}, NR),                       # short by more than 25%
    ("point", 2.16, 0.9, {"ratio": True}, NR),                       # the other way
    ("point", 0.13, 0.03, {"ratio": True}, EX),                      # a drop, deeper than the paper's
    ("point", 0.70, 0.84, {"ratio": True}, R),                       # a regression, milder but within 25%
    ("point", 0.99, 1.5, {"ratio": True}, NR),                       # parity has no "beyond"
    ("range", 1.05, 1.30, {"paper_hi": 1.15, "ratio": True}, R),     # within 25% of the range's top
    ("range", 1.05, 1.56, {"paper_hi": 1.15, "ratio": True}, EX),
    ("point", 300.0, 425.0, {}, NR),                                 # absolute, no better side: outside = not
    ("point", 109.0, 40.0, {"better": "lower"}, EX),                 # absolute, past the band on the better side
    ("point", 109.0, 200.0, {"better": "lower"}, NR),
    ("bound_ge", 0.97, 5.0, {}, R),                                  # a bound holding by far is still reproduced
    ("bound_le", 0.2, 0.21, {}, NR),
    ("true", None, True, {}, R),
    ("true", None, False, {}, NR),
    ("point", 2.16, float("nan"), {"ratio": True}, NM),
])
def test_each_class_from_the_rule(check, paper, ours, kw, want):
    assert rule.point_verdict(check, paper, ours, **kw) == want
    assert rule.verdict(check, paper, ours, **kw) == want                # no spread: the number as it is


def test_a_spread_across_a_threshold_is_inconclusive():
    assert rule.verdict("bound_ge", 0.97, 0.98, spread=(0.96, 1.01)) == INC
    assert rule.verdict("bound_ge", 0.97, 0.98, spread=(0.975, 0.99)) == R
    assert rule.verdict("point", 2.16, 2.6, spread=(2.5, 2.8), ratio=True) == INC            # reproduced / exceeded
    assert rule.spread_classes("point", 2.16, (2.5, 2.8), ratio=True) == [R, EX]
    assert rule.verdict("point", 2.16, 3.5, spread=(3.2, 3.9), ratio=True) == EX
    assert rule.verdict("true", None, True, spread=(False, True)) == INC                      # holds at one end only
    assert rule.verdict("true", None, False, spread=(False, False)) == NR
    assert rule.verdict("point", 2.16, float("nan"), spread=(1.0, 2.0), ratio=True) == NM


def _cells(rows: list[dict]) -> Results:
    """A Results of plain serving cells: (sweep, system, Lp, rep, tok/s) rows, ShareGPT, B=256, one model."""
    base = {"kind": "serving", "model.name": "m", "tp": 1, "workload.kind": "sharegpt", "workload.batch": 256,
            "workload.num_prefixes": 1, "profile_steps": 0, "nsys": False, "provenance.gpu_name": "GPU X"}
    df = pd.DataFrame([{**base, **r} for r in rows])
    cfg = ["model.name", "tp", "workload.kind", "workload.batch", "workload.num_prefixes", "workload.prefix_len",
           "system.name", "rep", "profile_steps", "nsys"]
    return Results(root=Path("."), cells=df, failures=pd.DataFrame(), kernels=pd.DataFrame(), config_columns=cfg)


def _row(sweep, system, lp, rep, thr):
    return {"sweep": sweep, "system.name": system, "workload.prefix_len": lp, "rep": rep,
            "output_throughput_tok_s": thr}


def _claim(**kw) -> pd.DataFrame:
    row = {"id": "t", "section": "s", "claim": "c", "model": "m", "tp": "1", "frame": "cells",
           "selectors": "workload.kind=sharegpt;workload.prefix_len=512;system.name=granikv",
           "metric": "output_throughput_tok_s", "statistic": "ratio", "baseline": "system.name=sglang_default",
           "check": "bound_ge", "paper_value": "0.97", "paper_value_hi": "", "unit": "x", "better": "higher",
           "comparison": "", "source": "tables/headline"}
    return pd.DataFrame([{**row, **kw}])


def test_repetitions_that_straddle_the_bound_are_inconclusive():
    res = _cells([_row("a", "granikv", 512, r, v) for r, v in enumerate((96.0, 100.0, 104.0))]
                 + [_row("a", "sglang_default", 512, r, 100.0) for r in range(3)])
    ev = evaluate_mod.evaluate(res, _claim()).iloc[0]
    assert ev["ours"] == pytest.approx(1.0) and ev["n"] == 3 and ev["configs"] == 1
    assert ev["spread_lo"] == pytest.approx(0.96) and ev["spread_hi"] == pytest.approx(1.04)
    assert ev["point_verdict"] == R and ev["verdict"] == INC and ev["between"] == "reproduced / not reproduced"
    assert ev["spread_from"] == "min-max over repetitions"
    tight = _cells([_row("a", "granikv", 512, r, v) for r, v in enumerate((99.0, 100.0, 101.0))]
                   + [_row("a", "sglang_default", 512, r, 100.0) for r in range(3)])
    assert evaluate_mod.evaluate(tight, _claim()).iloc[0]["verdict"] == R


def test_one_repetition_takes_the_noise_of_its_sweep_or_borrows_it():
    # sweep "rep" repeats a configuration: its two runs differ by 10% (max - min over mean, median over configs)
    noisy = [_row("rep", s, 4096, r, v) for s in ("granikv", "sglang_default") for r, v in enumerate((95.0, 105.0))]
    close = [_row("one", "granikv", 512, 0, 98.0), _row("one", "sglang_default", 512, 0, 100.0)]   # 1.0% margin
    ev = evaluate_mod.evaluate(_cells(noisy + close), _claim()).iloc[0]
    assert ev["n"] == 1 and ev["point_verdict"] == R and ev["verdict"] == INC
    assert "borrowed from rep" in ev["spread_from"] and "10.0%" in ev["spread_from"]
    # the noise widens each n=1 side by half of it: 0.98 * 0.95 / 1.05 .. 0.98 * 1.05 / 0.95
    assert ev["spread_lo"] == pytest.approx(0.98 * 0.95 / 1.05) and ev["spread_hi"] == pytest.approx(0.98 * 1.05 / 0.95)
    far = [_row("one", "granikv", 512, 0, 130.0), _row("one", "sglang_default", 512, 0, 100.0)]      # 34% margin
    assert evaluate_mod.evaluate(_cells(noisy + far), _claim()).iloc[0]["verdict"] == R
    # the sweep's own noise comes first: the same cells repeated in sweep "one" with 0.4% spread
    own = close + [_row("one", "granikv", 512, 1, 98.2), _row("one", "sglang_default", 512, 1, 100.2)]
    ev = evaluate_mod.evaluate(_cells(noisy + own), _claim()).iloc[0]
    assert ev["n"] == 2 and ev["spread_from"] == "min-max over repetitions" and ev["verdict"] == R
    # no sweep repeats anything: no interval, the number is taken as it is
    ev = evaluate_mod.evaluate(_cells(close), _claim()).iloc[0]
    assert ev["verdict"] == R and math.isnan(ev["spread_lo"]) and "no run-to-run noise" in ev["spread_from"]


def test_exceeded_and_not_measured_through_evaluate():
    res = _cells([_row("a", "granikv", 16384, r, 300.0 + r) for r in range(2)]
                 + [_row("a", "sglang_default", 16384, r, 100.0) for r in range(2)])
    sel = "workload.kind=sharegpt;workload.prefix_len=16384;system.name=granikv"
    ev = evaluate_mod.evaluate(res, _claim(selectors=sel, check="point", paper_value="2.16")).iloc[0]
    assert ev["verdict"] == EX and ev["point_verdict"] == EX and ev["ours"] == pytest.approx(3.005)
    nm = evaluate_mod.evaluate(res, _claim(selectors=sel.replace("16384", "8192"), check="point", paper_value="2.16")).iloc[0]
    assert nm["verdict"] == NM and "prefix_len" in nm["why"]


def test_a_monotone_trend_within_the_spread_is_inconclusive():
    def trend(g512, g1k):
        rows = []
        for lp, g in ((512, g512), (1024, g1k), (2048, (150.0, 151.0)), (16384, (300.0, 301.0))):
            rows += [_row("a", "granikv", lp, r, v) for r, v in enumerate(g)]
            rows += [_row("a", "sglang_default", lp, r, 100.0) for r in range(2)]
        return _cells(rows)
    claim = _claim(selectors="workload.kind=sharegpt;system.name=granikv", statistic="monotone_ratio", check="true",
                   paper_value="", unit="bool", better="")
    flat = evaluate_mod.evaluate(trend((100.0, 104.0), (101.0, 105.0)), claim).iloc[0]     # 1.02 -> 1.03, spreads overlap
    assert flat["point_verdict"] == R and flat["verdict"] == INC
    assert "steps within the spread: 1.02@512 -> 1.03@1024" in flat["spread_from"]
    clear = evaluate_mod.evaluate(trend((100.0, 101.0), (120.0, 121.0)), claim).iloc[0]
    assert clear["verdict"] == R and "every step outside the spread" in clear["spread_from"]
    dip = evaluate_mod.evaluate(trend((120.0, 121.0), (100.0, 101.0)), claim).iloc[0]      # a dip beyond the spread
    assert dip["verdict"] == NR


def test_the_rule_text_is_shared_with_analysis_readme():
    readme = (ROOT / "analysis" / "README.md").read_text()
    assert rule.VERDICT_RULE in readme
    for v in rule.VERDICTS:
        assert f"**{v}**" in rule.VERDICT_RULE


def test_cells_of_another_system_stay_out_of_the_four_systems_tables():
    """A server run beside the engine's cells (system.name=sglang_server, with config keys of its own) is
    neither a row nor a baseline of the headline table, and changes none of its numbers."""
    from analysis.common import system_table
    rows = [_row("h", s, lp, 0, v) for lp in (512, 16384) for s, v in (("granikv", 210.0), ("sglang_default", 100.0))]
    plain = _cells(rows)
    server = [{**_row("h", "sglang_server", lp, 0, 150.0), "system.engine": "sglang", "system.server.port": 0,
               "hardware.mem_fraction": 0.9} for lp in (512, 16384)]
    mixed = _cells(rows + server)
    mixed.config_columns = mixed.config_columns + ["system.engine", "system.server.port", "hardware.mem_fraction"]
    dims = ["workload.prefix_len"]
    a = system_table(plain.cells, plain.config_columns, {}, dims)
    b = system_table(mixed.cells, mixed.config_columns, {}, dims)
    assert set(b["system"]) == {"granikv", "sglang_default"}
    assert list(b.columns) == list(a.columns)                       # no extra key column from the server's cells
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    ev = evaluate_mod.evaluate(mixed, _claim(selectors="workload.kind=sharegpt;workload.prefix_len=512;system.name=granikv",
                                  check="point", paper_value="2.16")).iloc[0]
    assert ev["ours"] == pytest.approx(2.1)                          # still over sglang_default alone


def test_system_table_names_the_code_version_of_each_row():
    """The ``code`` column: the short commit when every repetition of a row was measured at one
    commit ("+" when with uncommitted changes), "N versions" when they span several."""
    from analysis.common import system_table
    rows = [{**_row("h", "granikv", 512, r, 200.0 + r), "provenance.git_commit": c, "provenance.git_dirty": False}
            for r, c in enumerate(("a" * 40, "a" * 40, "b" * 40))]
    rows += [{**_row("h", "sglang_default", 512, r, 100.0), "provenance.git_commit": "c" * 40,
              "provenance.git_dirty": d} for r, d in enumerate((True, True))]
    rows += [{**_row("h", "sglang_default", 1024, 0, 90.0), "provenance.git_commit": "c" * 40, "provenance.git_dirty": False},
             {**_row("h", "granikv", 1024, 0, 95.0), "provenance.git_commit": "d" * 40, "provenance.git_dirty": False}]
    t = system_table(_cells(rows).cells, _cells(rows).config_columns, {}, ["workload.prefix_len"])
    code = {(r["workload.prefix_len"], r["system"]): r["code"] for _, r in t.iterrows() if r["status"] == "measured"}
    assert code == {(512, "granikv"): "2 versions", (512, "sglang_default"): "ccccccc+",
                    (1024, "granikv"): "ddddddd", (1024, "sglang_default"): "ccccccc"}
