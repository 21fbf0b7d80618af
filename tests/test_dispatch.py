"""Dispatcher on hand-built tables: matching, ranges, ties (table order), unknown GPU fallback, modes."""
import warnings

import pytest

from granikv.attention.dispatch import Dispatcher, check_table, paper_rule

H200 = "NVIDIA H200"
TABLE = [
    {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "lp_max": 1024, "choice": "paged"},
    {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "meff_min": 256, "choice": "dense"},
    {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "meff_min": 128, "choice": "cascade"},
    {"gpu": H200, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "choice": "paged"},
    {"gpu": "NVIDIA A100-SXM4-40GB", "choice": "dense"},
]


def test_rules_by_lp_and_meff():
    d = Dispatcher(32, 8, 128, H200, TABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.choose(512, 256) == "paged"          # Lp < 1024
        assert d.choose(8192, 64) == "dense"          # Meff = 256 = boundary -> inclusive min
        assert d.choose(8192, 63) == "cascade"        # Meff = 252
        assert d.choose(8192, 32) == "cascade"        # Meff = 128 boundary
        assert d.choose(8192, 31) == "paged"
        assert d.choose(1024, 1000) == "dense"        # lp_max is exclusive
    assert d.fallbacks == 0 and d.has_table


def test_ties_first_rule_wins():
    t = [{"meff_min": 10, "choice": "cascade"}, {"meff_min": 10, "choice": "dense"}]
    assert Dispatcher(4, 1, 64, "x", t).choose(100, 100) == "cascade"
    t.reverse()
    assert Dispatcher(4, 1, 64, "x", t).choose(100, 100) == "dense"


def test_gpu_name_is_case_insensitive_and_shape_must_match():
    assert Dispatcher(32, 8, 128, "nvidia h200", TABLE).choose(8192, 64) == "dense"
    with pytest.warns(RuntimeWarning, match="no decision-table rules"):
        d = Dispatcher(20, 4, 128, H200, TABLE)     # Qwen shape at TP=2: not in the table
        assert d.choose(8192, 8) == paper_rule(8 * 5) == "cascade"


def test_unknown_gpu_warns_once_and_uses_paper_rule():
    d = Dispatcher(32, 8, 128, "Some Future GPU", TABLE)
    with pytest.warns(RuntimeWarning, match="paper's A100 rule"):
        assert d.choose(8192, 256) == "dense"        # Meff 1024 -> dense
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # a second warning would raise
        assert d.choose(8192, 255) == "cascade"      # Meff 1020 < 1024
        assert d.choose(16384, 512) == "dense"
    assert d.fallbacks == 3


def test_uncovered_range_falls_back():
    d = Dispatcher(4, 1, 64, "g", [{"lp_min": 100, "choice": "dense"}])
    with pytest.warns(RuntimeWarning, match="does not cover"):
        assert d.choose(50, 1) == "cascade"


@pytest.mark.parametrize("mode,want", [("dense_only", "dense"), ("cascade_only", "cascade"), ("paged_only", "paged")])
def test_ablation_modes(mode, want):
    d = Dispatcher(32, 8, 128, H200, TABLE, mode=mode)
    assert {d.choose(lp, b) for lp in (1, 512, 16384) for b in (1, 64, 512)} == {want}


@pytest.mark.parametrize("table,field", [
    ([{"choice": "fast"}], "choice"), ([{"choice": "dense", "lp_mn": 3}], "unknown key"),
    ([{"choice": "dense", "meff_min": -1}], "meff_min"), ([{"choice": "dense", "lp_min": 9, "lp_max": 9}], "lp_max"),
    ({"choice": "dense"}, "list"),
])
def test_bad_tables_name_the_field(table, field):
    with pytest.raises(ValueError, match=field):
        check_table(table)
    with pytest.raises(ValueError, match="system.dispatch"):
        Dispatcher(4, 1, 64, mode="fastest")


def test_from_hardware():
    from granikv.config import HardwareConfig

    hw = HardwareConfig(name="h200", device="cuda", dtype="bfloat16", gpu_name=H200, decision_table=TABLE)
    assert Dispatcher.from_hardware(hw, 32, 8, 128).choose(8192, 64) == "dense"


def test_choose_many_equals_choose_per_class():
    table = [{"lp_max": 1024, "choice": "paged"}, {"meff_min": 256, "choice": "dense"}, {"choice": "cascade"}]
    pairs = [(512, 300), (8192, 64), (8192, 63), (2048, 1), (8192, 64), (16384, 500)]
    a = Dispatcher(32, 8, 128, "g", table)
    b = Dispatcher(32, 8, 128, "g", table)
    assert a.choose_many(pairs) == [b.choose(*p) for p in pairs]
    assert a.choose_many(pairs) == [b.choose(*p) for p in pairs]      # all cached now
    assert a.choose_many([]) == []


@pytest.mark.parametrize("mode", ["table", "dense_only"])
def test_a_class_without_requests_is_paged_without_asking_the_table(mode):
    # only CUDA-graph pad rows: batch_class 0; the table (which starts at Meff 512) is not consulted
    d = Dispatcher(32, 8, 128, "g", [{"meff_min": 512, "choice": "dense"}], mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.choose(8192, 0) == "paged"
        assert d.choose_many([(8192, 0), (8192, 128)]) == ["paged", "dense"]
    assert d.fallbacks == 0
