"""analysis.beyond: the before/after table of the cells where the static design loses. SGLang default pools
across decision tables (it never consults one), a GraniKV variant gets a row per table, the k=8 target is
the paper's 1.82x, and every expected point without a cell is listed as not measured."""
from __future__ import annotations
import json
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.exhibits import beyond
from analysis.measures import families
from analysis.common import NOT_MEASURED, json_digest

TABLE_A = json.dumps([{"choice": "dense", "lp_min": 0}])
TABLE_B = json.dumps([{"choice": "paged", "lp_min": 0}, {"choice": "dense", "lp_min": 4096}])
CONFIG = ["system.name", "model.name", "tp", "rep", "workload.kind", "workload.prefix_len", "workload.batch",
          "workload.num_prefixes", "workload.prefix_lens", "hardware.name", "hardware.decision_table"]


def _cell(system, tok_s, table=TABLE_A, rep=0, kind="synthetic", lp=1024, batch=32, k=1, lens=None, hw="h200",
          model="llama3_8b"):
    return {"system.name": system, "model.name": model, "tp": 1, "rep": rep, "workload.kind": kind,
            "workload.prefix_len": lp, "workload.batch": batch, "workload.num_prefixes": k, "workload.prefix_lens": lens,
            "hardware.name": hw, "hardware.decision_table": table, "output_throughput_tok_s": tok_s,
            "provenance.git_commit": "a" * 40, "provenance.git_dirty": "false", "profile_steps": 0, "nsys": False,
            "model.num_heads": 32, "model.num_kv_heads": 8}


def _res(cells: list[dict]):
    return SimpleNamespace(cells=pd.DataFrame(cells), config_columns=CONFIG)


def _rows(t: pd.DataFrame, family_prefix: str, point: str, system: str) -> pd.DataFrame:
    return t[t["family"].str.startswith(family_prefix) & (t["point"] == point) & (t["system"] == system)]


def test_the_baseline_pools_across_tables_and_each_granikv_table_gets_its_row():
    t = families.beyond_frame(_res([
        _cell("sglang_default", 100.0, TABLE_A, rep=0), _cell("sglang_default", 110.0, TABLE_B, rep=1),
        _cell("granikv", 95.0, TABLE_A), _cell("granikv", 104.0, TABLE_B),
        _cell("granikv", 50.0, kind="sharegpt", lp=3072, batch=128),    # outside every family
    ]))
    rows = _rows(t, "synthetic grid", "config=llama3_8b TP=1, prefix_len=1024, batch=32", "granikv").set_index("table")
    assert set(rows.index) == {json_digest(TABLE_A), json_digest(TABLE_B)}
    a, b = rows.loc[json_digest(TABLE_A)], rows.loc[json_digest(TABLE_B)]
    assert a["base_tok_s"] == pytest.approx(105.0) and a["n_base"] == 2
    assert a["ratio_vs_sglang_default"] == pytest.approx(95 / 105) and a["meets"] == "no"
    assert b["ratio_vs_sglang_default"] == pytest.approx(104 / 105) and b["meets"] == "yes"
    dyn = _rows(t, "synthetic grid", "config=llama3_8b TP=1, prefix_len=1024, batch=32", "granikv_dynamic")
    assert list(dyn["status"]) == [NOT_MEASURED]
    # every expected point of every family is there, measured or not
    grid = t[t["family"].str.startswith("synthetic grid")]
    assert len(grid) == 3 * 2 * 2 + 1 and (grid["status"] == NOT_MEASURED).sum() == 3 * 2 * 2 - 1
    assert not (t["point"].str.contains("3072")).any()


def test_heterogeneous_k8_is_held_to_the_papers_figure():
    lens8 = "[1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288]"
    t = families.beyond_frame(_res([
        _cell("sglang_default", 100.0, kind="multiprefix", lp=8192, batch=256, k=8, lens=lens8, hw="a100_40gb"),
        _cell("granikv_dynamic", 150.0, kind="multiprefix", lp=8192, batch=256, k=8, lens=lens8, hw="a100_40gb"),
    ]))
    r = _rows(t, "multiprefix heterogeneous", "config=llama3_8b TP=1, num_prefixes=8", "granikv_dynamic").iloc[0]
    assert r["target"] == pytest.approx(1.82) and r["ratio_vs_sglang_default"] == pytest.approx(1.5)
    assert r["meets"] == "no"
    lines = "\n".join(beyond.lines(t))
    assert "## Beyond the paper" in lines and "num_prefixes=8 1.50x" in lines


def test_a_variant_without_a_baseline_twin_is_not_measured_rather_than_a_ratio():
    t = families.beyond_frame(_res([_cell("granikv", 120.0, kind="sharegpt", lp=512, batch=512)]))
    r = _rows(t, "limitation", "config=llama3_8b TP=1, batch=512", "granikv").iloc[0]
    assert r["meets"] == NOT_MEASURED and "no sglang_default twin" in r["status"]


def test_a_family_target_must_name_a_value_per_dim():
    with pytest.raises(ValueError, match="target point .* dims"):
        families.Family("x", {}, {"config": ("a",), "workload.batch": (1,)}, targets={("a",): 1.0})
    with pytest.raises(ValueError, match="dims must name"):
        families.Family("x", {})


def test_on_the_headline_the_dynamic_split_is_held_to_the_static_splits_ratio():
    def hl(system, tok_s, lp, rep=0):
        return _cell(system, tok_s, kind="sharegpt", lp=lp, batch=256, rep=rep)
    t = families.beyond_frame(_res([
        hl("sglang_default", 100.0, 16384), hl("granikv", 220.0, 16384), hl("granikv_dynamic", 210.0, 16384),
        hl("sglang_default", 100.0, 512), hl("granikv", 95.0, 512), hl("granikv_dynamic", 99.0, 512),
        hl("sglang_default", 100.0, 2048), hl("granikv_dynamic", 120.0, 2048),
    ]))
    fam = "headline"
    dyn16 = _rows(t, fam, "config=llama3_8b TP=1, prefix_len=16384", "granikv_dynamic").iloc[0]
    assert dyn16["target"] == pytest.approx(2.2) and dyn16["meets"] == "no"     # 2.10x is below today's 2.20x
    static16 = _rows(t, fam, "config=llama3_8b TP=1, prefix_len=16384", "granikv").iloc[0]
    assert static16["target"] == pytest.approx(0.97) and static16["meets"] == "yes"
    # where the static split is below parity, the dynamic one is still held to 0.97x, not to a lower bar
    dyn512 = _rows(t, fam, "config=llama3_8b TP=1, prefix_len=512", "granikv_dynamic").iloc[0]
    assert dyn512["target"] == pytest.approx(0.97) and dyn512["meets"] == "yes"
    # no static cell at a point: the dynamic row keeps the plain target, the static one is not measured
    dyn2k = _rows(t, fam, "config=llama3_8b TP=1, prefix_len=2048", "granikv_dynamic").iloc[0]
    assert dyn2k["target"] == pytest.approx(0.97) and dyn2k["meets"] == "yes"
    assert list(_rows(t, fam, "config=llama3_8b TP=1, prefix_len=2048", "granikv")["status"]) == [NOT_MEASURED]
    with pytest.raises(ValueError, match="target_from='x' is not a variant"):
        families.Family("x", {}, {"config": ("a",)}, target_from="x")


def test_a_forced_dispatch_is_not_pooled_with_the_table():
    lens8 = "[1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288]"
    mp = dict(kind="multiprefix", lp=8192, batch=256, k=8, lens=lens8, hw="a100_40gb")
    forced = {**_cell("granikv_dynamic", 400.0, **mp), "system.dispatch": "cascade_only"}
    t = families.beyond_frame(_res([_cell("sglang_default", 100.0, **mp), _cell("granikv_dynamic", 150.0, **mp), forced]))
    r = _rows(t, "multiprefix heterogeneous", "config=llama3_8b TP=1, num_prefixes=8", "granikv_dynamic")
    assert len(r) == 1 and r.iloc[0]["n"] == 1 and r.iloc[0]["ratio_vs_sglang_default"] == pytest.approx(1.5)
