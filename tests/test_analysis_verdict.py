"""Claims: the verdict rule at its boundaries, selectors, and the committed claims.csv."""
from __future__ import annotations
import math

import pandas as pd
import pytest

from analysis import paper
from analysis.verdict import context
from analysis.verdict import evaluate as evaluate_mod
from analysis.verdict import rule
from analysis.verdict import statistics
from analysis.common import parse_selectors, select
from analysis.reproduce import EXHIBITS

R, EX, NR, NM = rule.REPRODUCED, rule.EXCEEDED, rule.NOT_REPRODUCED, "not measured"


@pytest.mark.parametrize("ours,better,want", [
    (2.16, "higher", R),
    (2.16 * 0.75, "higher", R),            # exactly 25% below: still within
    (2.16 * 0.75 - 1e-6, "higher", NR),    # just outside, short of the paper
    (2.16 * 1.25, None, R),                # exactly 25% above
    (2.16 * 1.25 + 1e-6, None, EX),        # beyond the band, further from 1: the same effect, larger
    (5.0, "higher", EX),                   # far beyond the paper: exceeded, not reproduced
    (5.0, "lower", EX),                    # a ratio's direction is its side of 1, whatever `better` says
])
def test_point_band_and_beyond(ours, better, want):
    assert rule.verdict("point", 2.16, ours, better=better, ratio=True) == want


def test_point_lower_is_better():
    assert rule.verdict("point", 0.67, 0.30, better="lower", ratio=True) == EX       # a larger reduction
    assert rule.verdict("point", 0.67, 0.67 * 1.25 + 1e-6, better="lower", ratio=True) == NR


def test_ratio_direction_must_match():
    # within 25% of 1.10 but the effect points the other way (or vanished)
    assert rule.verdict("point", 1.10, 0.95, ratio=True) == NR
    assert rule.verdict("point", 1.10, 1.00, ratio=True) == NR
    assert rule.verdict("point", 1.10, 0.95, ratio=False) == R     # absolute values: no direction
    assert rule.verdict("point", 0.70, 1.02, ratio=True) == NR     # a regression claim needs a regression
    assert rule.verdict("point", 0.70, 0.60, ratio=True) == R


def test_parity_claims_have_no_direction():
    assert rule.verdict("point", 0.99, 1.02, ratio=True) == R      # |0.99 - 1| < 5%: parity
    assert rule.verdict("point", 0.96, 1.02, ratio=True) == R
    assert rule.verdict("point", 0.95, 1.02, ratio=True) == NR     # at the 5% band the direction counts


def test_parity_is_one_rule_the_papers_parity_bound():
    """A ratio claimed at parity reads reproduced only within 0.97x-1/0.97x, the bound the paper's Lp=512
    parity claims state (>= 0.97x); 0.86x read reproduced under the +-25% band before."""
    assert rule.verdict("point", 0.99, 0.86, ratio=True) == NR
    assert rule.verdict("point", 0.99, 0.86, ratio=True) == rule.verdict("bound_ge", 0.97, 0.86, ratio=True)
    assert rule.verdict("point", 0.99, 0.97, ratio=True) == R == rule.verdict("bound_ge", 0.97, 0.97, ratio=True)
    assert rule.verdict("point", 0.99, 1.03, ratio=True) == R
    assert rule.verdict("point", 0.99, 1.10, ratio=True) == NR     # still an advantage: not parity
    assert rule.verdict("point", 0.99, 0.99, ratio=True, spread=(0.95, 1.04)) == rule.INCONCLUSIVE


def test_range():
    assert rule.verdict("range", 1.05, 1.10, paper_hi=1.15, better="higher", ratio=True) == R
    assert rule.verdict("range", 1.05, 1.15 * 1.25, paper_hi=1.15, ratio=True) == R
    assert rule.verdict("range", 1.05, 1.15 * 1.25 + 1e-6, paper_hi=1.15, ratio=True) == EX
    assert rule.verdict("range", 1.05, 3.0, paper_hi=1.15, better="higher", ratio=True) == EX
    assert rule.verdict("range", 1.05, 0.99, paper_hi=1.15, better="higher", ratio=True) == NR  # below 1


def test_bounds_hold_as_stated():
    assert rule.verdict("bound_ge", 0.97, 0.97) == R
    assert rule.verdict("bound_ge", 0.97, 0.9699) == NR
    assert rule.verdict("bound_le", 0.2, 0.2) == R
    assert rule.verdict("bound_le", 0.2, 0.2001) == NR


def test_qualitative_and_missing():
    assert rule.verdict("true", None, True) == R
    assert rule.verdict("true", None, False) == NR
    for missing in (None, float("nan"), float("inf")):
        assert rule.verdict("point", 2.16, missing, ratio=True) == NM
        assert rule.verdict("bound_ge", 0.97, missing) == NM
    with pytest.raises(ValueError, match="check"):
        rule.verdict("roughly", 1.0, 1.0)


def test_selectors():
    assert parse_selectors("a=1;b>=2;c!=null;d~x;e=g|h;f<3") == \
        {"a": "=1", "b": ">=2", "c": "!=null", "d": "~x", "e": "=g|h", "f": "<3"}
    assert parse_selectors("") == {}
    with pytest.raises(ValueError, match="operator"):
        parse_selectors("a")
    df = pd.DataFrame({"a": [1, 2, 3], "s": ["x", "y", "z"], "n": [None, 1.0, 2.0]})
    assert list(select(df, {"a": ">=2", "s": "=y|z"})["a"]) == [2, 3]
    assert list(select(df, {"n": "=null"})["a"]) == [1]
    assert list(select(df, {"n": "!=null"})["a"]) == [2, 3]
    assert list(select(df, {"a": "=max", "s": "!=z"})["a"]) == [2]   # max after the other selectors
    assert list(select(df, {"s": "~y"})["a"]) == [2]
    assert select(df, {"missing": "=1"}).empty


def test_committed_claims_cover_the_paper():
    df = evaluate_mod.load_claims()
    vals = {(r["id"], r["paper_value"]) for _, r in df.iterrows()}
    got = {v for _, v in vals}
    for want in ("2.16", "1.98", "1.57", "0.97", "1.05", "1.36", "1.38", "300", "0.13", "1.95", "0.99", "1.82",
                 "15.6", "0.67", "0.03", "0.2", "1.0", "109", "42", "2.6", "0.10", "0.70", "3.66", "1.24", "0.13"):
        assert want in got, f"paper value {want} missing from claims.csv"
    assert (df.loc[df["id"].str.startswith("storage_layer"), "paper_value_hi"] == "1.15").all()
    assert {"monotone_ratio", "roofline_shift", "amdahl_overshoot", "peak_share"} <= set(df["statistic"])
    assert (df["section"].str.len() > 0).all() and (df["claim"].str.len() > 0).all()
    names = {m.name for m in EXHIBITS}
    for src in df["source"]:
        tables = [s.strip().split("/", 1)[1] for s in src.split(",") if s.strip().startswith("tables/")]
        assert tables and all(t in names for t in tables), src


def test_bad_claims_file_names_claim_and_field(tmp_path):
    df = pd.read_csv(paper.CLAIMS_CSV, dtype=str, keep_default_na=False)
    df.loc[0, "check"] = "roughly"
    p = tmp_path / "claims.csv"
    df.to_csv(p, index=False)
    with pytest.raises(ValueError, match=rf"{df.loc[0, 'id']}.*`check`"):
        evaluate_mod.load_claims(p)
    df = pd.read_csv(paper.CLAIMS_CSV, dtype=str, keep_default_na=False)
    df.loc[1, "statistic"] = "vibes"
    df.to_csv(p, index=False)
    with pytest.raises(ValueError, match="`statistic`"):
        evaluate_mod.load_claims(p)


def test_amdahl_formula():
    from analysis.measures.amdahl import amdahl
    assert amdahl(0.0, 15.6) == 1.0
    assert math.isclose(amdahl(1.0, 15.6), 15.6)
    assert math.isclose(amdahl(0.5, 2.0), 1 / 0.75)


def _monotone(lps, ratios):
    """The monotone statistic over a hand-built frame: granikv / sglang_default = ``ratios`` at ``lps``."""
    from types import SimpleNamespace

    rows = []
    for lp, r in zip(lps, ratios):
        rows += [{"system.name": "granikv", "workload.prefix_len": lp, "output_throughput_tok_s": 100.0 * r},
                 {"system.name": "sglang_default", "workload.prefix_len": lp, "output_throughput_tok_s": 100.0}]
    df = pd.DataFrame(rows)
    ctx = SimpleNamespace(frame=lambda name: df,
                          res=SimpleNamespace(config_columns=["system.name", "workload.prefix_len"]))
    c = pd.Series({"frame": "cells", "metric": "output_throughput_tok_s"})
    return statistics._ratio_stat(ctx, c, parse_selectors("system.name=granikv"),
                         parse_selectors("system.name=sglang_default"), "monotone")


def test_monotone_needs_the_claimed_lp_span():
    full = [512, 1024, 2048, 4096, 8192, 16384]
    assert _monotone(full, [1.0, 1.0, 1.1, 1.3, 1.5, 1.9]).value is True
    assert _monotone(full, [1.0, 1.2, 1.1, 1.3, 1.5, 1.9]).value is False
    partial = _monotone([8192, 16384], [1.49, 1.88])          # rising, but two points of six
    assert math.isnan(partial.value) and "needs both ends" in partial.why and "[8192, 16384]" in partial.why
    assert math.isnan(_monotone([512, 8192, 16384], [1.0, 1.5, 1.9]).value)   # fewer than 4 Lp values
    assert _monotone([8192, 16384], [1.9, 1.5]).value is False             # a decrease refutes at once


def test_monotone_margin_is_the_step_that_decides():
    full = [512, 1024, 2048, 4096, 8192, 16384]
    up = _monotone(full, [1.0, 1.0, 1.1, 1.3, 1.5, 1.9])
    assert up.margin == pytest.approx(0.0) and up.margin_note == "smallest rise 1.00@512 -> 1.00@1024"
    down = _monotone(full, [1.0, 1.2, 1.1, 1.3, 1.2, 1.9])              # two dips: 8.3% and 7.7%
    assert down.margin == pytest.approx(0.1 / 1.2) and down.margin_note == "largest dip 1.20@1024 -> 1.10@2048"
    assert down.decider == "Lp=1024 (1 repetition; its baseline 1) and Lp=2048 (1 repetition; its baseline 1)"


def test_pair_label_names_the_cell_and_its_repetitions():
    p = pd.DataFrame({"model.name": ["llama3_8b"] * 2, "workload.prefix_len": [512.0, 4096.0],
                      "workload.batch": [256.0, 256.0], "system": ["granikv", "granikv"],
                      "n_num": [2, 1], "n_base": [3, 1]})
    assert context.pair_label(p, 0) == "Lp=512, B=256, system=granikv (2 repetitions; its baseline 3)"
    assert context.pair_label(p, 1) == "Lp=4096, B=256, system=granikv (1 repetition; its baseline 1)"


def _ctx(rows: list[dict]):
    from types import SimpleNamespace

    df = pd.DataFrame(rows)
    cols = [c for c in df.columns if c != "output_throughput_tok_s"]
    return SimpleNamespace(frame=lambda name: df, res=SimpleNamespace(config_columns=cols))


def test_other_preset_and_tp_notes_give_information_without_a_verdict():
    rows = [{"hardware.name": "h200", "tp": 1, "system.name": s, "output_throughput_tok_s": v}
            for s, v in (("granikv", 178.0), ("sglang_default", 100.0))]
    ctx = _ctx(rows)
    c = pd.Series({"frame": "cells", "metric": "output_throughput_tok_s", "statistic": "ratio"})
    base = parse_selectors("system.name=sglang_default")
    note = evaluate_mod.other_hardware_note(ctx, c, parse_selectors("hardware.name=a100_40gb;system.name=granikv"), base)
    assert "measured with hardware=h200" in note and "1.78" in note and "(no verdict)" in note
    assert evaluate_mod.other_tp_note(ctx, c, parse_selectors("tp=4;system.name=granikv"), base).endswith("(no verdict)")
    assert "TP=1" in evaluate_mod.other_tp_note(ctx, c, parse_selectors("tp=4;system.name=granikv"), base)
    # nothing measured under any preset: no note
    assert evaluate_mod.other_hardware_note(ctx, c, parse_selectors("hardware.name=a100_40gb;system.name=hydragen"), base) == ""


def test_absolute_line_states_the_factor_both_ways():
    """An absolute claim's line gives how far ours is from the paper's as a factor >= 1 with its direction
    (425 vs 300 tok/s read '0.71x higher' before)."""
    import pandas as pd

    from analysis.report.explain import absolute_line

    def line(ours, paper):
        claim = pd.Series({"id": "a", "comparison": "absolute (hardware-dependent)", "ours": ours,
                           "paper_value": paper, "our_hardware": "NVIDIA H200", "selectors": "x=1",
                           "unit": "tok/s", "metric": "m"})
        return absolute_line(pd.DataFrame([claim]), claim)

    assert "ours is 1.42x higher than the paper's" in line(425.0, 300.0)
    assert "ours is 2.75x lower than the paper's" in line(39.6, 109.0)


@pytest.mark.parametrize("check,paper,kw,want", [
    ("bound_ge", 0.97, {}, [0.97]),
    ("bound_le", 0.10, {}, [0.10]),
    ("point", 0.70, {"ratio": True}, [0.525, 0.875]),                       # a regression: 1.0 is inside NR
    ("point", 2.16, {"ratio": True, "better": "higher"}, [1.62, 2.70]),        # short of / beyond the band
    ("range", 1.05, {"paper_hi": 1.15, "ratio": True, "better": "higher"}, [1.0, 1.4375]),  # lower edge 0.79 < 1
    ("point", 0.99, {"ratio": True}, [0.97, 1 / 0.97]),                     # parity: the paper's parity band
    ("point", 1.10, {"ratio": True}, [1.0, 1.375]),
    ("true", None, {}, []),
])
def test_flip_points(check, paper, kw, want):
    assert rule.flip_points(check, paper, **kw) == pytest.approx(want)


@pytest.mark.parametrize("check,paper,kw", [
    ("point", 0.70, {"ratio": True}), ("point", 1.10, {"ratio": True}), ("point", 0.99, {"ratio": True}),
    ("range", 1.05, {"paper_hi": 1.15, "ratio": True}), ("point", 300.0, {"better": "lower"}),
    ("point", 0.13, {"ratio": True, "better": "lower"}), ("bound_ge", 0.87, {}),
])
def test_flip_points_are_where_the_verdict_changes(check, paper, kw):
    """Scan our number finely: every change of the verdict lies at a flip point, and no flip point is idle."""
    xs = [i * 1e-4 * paper for i in range(1, 30001)]         # 0 .. 3x the paper's value
    vs = [rule.verdict(check, paper, x, **kw) for x in xs]
    changes = [(xs[i - 1] + xs[i]) / 2 for i in range(1, len(xs)) if vs[i] != vs[i - 1]]
    pts = [p for p in rule.flip_points(check, paper, **kw) if p <= xs[-1]]
    assert len(changes) == len(pts)
    for c, p in zip(changes, pts):
        assert abs(c - p) <= 1e-4 * paper


def test_margin():
    assert rule.margin(0.0955, [0.10]) == pytest.approx((0.10, 0.045))
    assert rule.margin(1.2, [1.0, 1.375]) == pytest.approx((1.375, 0.175 / 1.375))
    assert all(math.isnan(v) for v in rule.margin(float("nan"), [1.0]))
    assert all(math.isnan(v) for v in rule.margin(True, [1.0]))       # qualitative claims have no distance
    assert all(math.isnan(v) for v in rule.margin(0.5, []))


def test_close_calls_lists_only_near_flips():
    from analysis.report.claims import close_calls
    ev = pd.DataFrame([
        {"id": "near", "ours_shown": "0.96", "configs": 1, "n": 1, "verdict": NR, "flips_at": 0.97, "margin": 0.011,
         "check": "bound_ge", "paper_value": "0.97", "paper_value_hi": "", "unit": "x"},
        {"id": "far", "ours_shown": "2.29", "configs": 6, "n": 2, "verdict": R, "flips_at": 1.62, "margin": 0.41,
         "check": "point", "paper_value": "2.16", "paper_value_hi": "", "unit": "x"},
        {"id": "unmeasured", "ours_shown": "", "configs": 0, "n": 0, "verdict": NM, "flips_at": float("nan"),
         "margin": float("nan"), "check": "point", "paper_value": "1.0", "paper_value_hi": "", "unit": "x"},
    ])
    text = "\n".join(close_calls(ev))
    assert "`near`" in text and "flips at 0.97, 1.1% away" in text and "(1 configuration, n = 1)" in text
    assert "`far`" not in text and "`unmeasured`" not in text
    assert close_calls(ev[ev["id"] == "far"]) == []
    other = ev.assign(primary=[False, True, True], gpu="NVIDIA H100 80GB HBM3")   # another GPU model's row: named so
    assert "`near on NVIDIA H100 80GB HBM3`" in "\n".join(close_calls(other))
    mono = pd.DataFrame([{"id": "mono", "ours_shown": "not monotone: ...", "configs": 6, "n": 1, "verdict": NR,
                          "flips_at": float("nan"), "margin": 0.019, "margin_note": "largest dip 1.05@512 -> 1.03@1024",
                          "check": "true", "paper_value": "", "paper_value_hi": "", "unit": "bool"}])
    assert "it turns on its largest dip 1.05@512 -> 1.03@1024 (1.9%)" in "\n".join(close_calls(mono))
