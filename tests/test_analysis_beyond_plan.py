"""analysis.beyond_plan: a GraniKV variant's host plan time per decode step against SGLang default's at the
same batch size and step kind, over the beyond-the-paper cells; batch sizes only one system ran are left
out, traces from before the engine recorded plan_us give no measured row, and every expected point without
one is listed as not measured."""
from __future__ import annotations
import json
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.measures import families as beyond
from analysis.exhibits.beyond import beyond_plan
from analysis.common import NOT_MEASURED
from analysis.load import SchemaError
from granikv import rawio

TABLE = json.dumps([{"choice": "dense", "lp_min": 0}])
CONFIG = ["system.name", "model.name", "tp", "rep", "workload.kind", "workload.prefix_len", "workload.batch",
          "workload.num_prefixes", "workload.prefix_lens", "hardware.name", "hardware.decision_table"]
POINT = "config=llama3_8b TP=1, prefix_len=1024, batch=32"


def _cell(root, system, steps, rep=0):
    """A synthetic-grid cell (Lp=1K, B=32) whose trace holds ``steps``: (batch_size, plan_us, graph) decode
    steps, after one prefill step."""
    path = f"grid/system={system},rep={rep}"
    trace = [{"kind": "prefill", "step_time_s": 0.1, "batch_size": 32, "cuda_graph": False, "plan_us": None}]
    trace += [{"kind": "decode", "step_time_s": 0.01, "batch_size": b, "cuda_graph": g, "plan_us": us}
              for b, us, g in steps]
    rawio.write_jsonl(root / path / "steps.jsonl", trace)
    return {"path": path, "system.name": system, "model.name": "llama3_8b", "tp": 1, "rep": rep,
            "workload.kind": "synthetic", "workload.prefix_len": 1024, "workload.batch": 32, "workload.num_prefixes": 1,
            "workload.prefix_lens": None, "hardware.name": "h200", "hardware.decision_table": TABLE,
            "output_throughput_tok_s": 100.0, "provenance.git_commit": "a" * 40, "provenance.git_dirty": "false",
            "profile_steps": 0, "nsys": False, "model.num_heads": 32, "model.num_kv_heads": 8}


def _expected_rows():
    return (e for fam in beyond.FAMILIES for e in beyond.expected(fam))


def _res(root, cells):
    return SimpleNamespace(cells=pd.DataFrame(cells), config_columns=CONFIG, root=str(root))


def test_plan_time_is_compared_at_the_same_batch_and_step_kind(tmp_path):
    base = [(32, 100.0, True)] * 5 + [(16, 50.0, True)] * 5 + [(8, 10.0, True)] * 3 + [(32, 300.0, False)] * 3
    # the variant: 3 steps at B=32 (300 us), 1 at B=16 (100 us), 4 at B=4 (no baseline step there), eager B=32 at 270
    var = [(32, 300.0, True)] * 3 + [(16, 100.0, True)] + [(4, 999.0, True)] * 4 + [(32, 270.0, False)] * 2
    t = beyond_plan.plan_frame(_res(tmp_path, [_cell(tmp_path, "sglang_default", base),
                                               _cell(tmp_path, "granikv_dynamic", var)]))
    measured, missing = t[t["status"] == "measured"], t[t["status"] == NOT_MEASURED]
    assert set(measured["point"]) == {POINT} and set(measured["system"]) == {"granikv_dynamic"}
    assert (POINT, "granikv") in set(zip(missing["point"], missing["system"]))
    assert (POINT, "granikv_dynamic") not in set(zip(missing["point"], missing["system"]))
    assert missing["plan_ratio"].isna().all() and (missing["status"] == NOT_MEASURED).all()
    t = measured
    g = t[t["step_kind"] == "graph"].iloc[0]
    # B=4 has no baseline step: left out; weights 3 (B=32) and 1 (B=16)
    assert g["steps"] == 4 and g["batches"] == 2
    assert g["plan_us"] == pytest.approx((3 * 300 + 100) / 4)
    assert g["base_plan_us"] == pytest.approx((3 * 100 + 50) / 4)
    assert g["plan_ratio"] == pytest.approx(1000 / 350) and g["meets"] == "no"
    e = t[t["step_kind"] == "eager"].iloc[0]
    assert e["plan_ratio"] == pytest.approx(0.9) and e["meets"] == "yes" and e["steps"] == 2
    text = "\n".join(beyond_plan.lines(t))
    assert "granikv_dynamic, graph steps, plan_us covering the plan alone: 0 of 1 rows" in text
    assert "granikv_dynamic, eager steps, plan_us covering the plan alone: 1 of 1 rows" in text


def test_repetitions_pool_into_one_median_per_batch(tmp_path):
    cells = [_cell(tmp_path, "sglang_default", [(32, 100.0, True)] * 3),
             _cell(tmp_path, "granikv", [(32, 80.0, True)] * 2, rep=0),
             _cell(tmp_path, "granikv", [(32, 120.0, True)] * 3, rep=1)]
    t = beyond_plan.plan_frame(_res(tmp_path, cells))
    t = t[t["status"] == "measured"]
    assert len(t) == 1
    r = t.iloc[0]
    assert r["point"] == POINT and r["system"] == "granikv"
    assert r["steps"] == 5 and r["plan_us"] == pytest.approx(120.0) and r["plan_ratio"] == pytest.approx(1.2)


def test_a_trace_without_plan_times_gives_no_row_and_a_missing_trace_is_named(tmp_path):
    old = _cell(tmp_path, "granikv", [])
    rawio.write_jsonl(tmp_path / old["path"] / "steps.jsonl",
                      [{"kind": "decode", "step_time_s": 0.01, "batch_size": 32, "cuda_graph": True}])
    base = _cell(tmp_path, "sglang_default", [(32, 100.0, True)])
    t = beyond_plan.plan_frame(_res(tmp_path, [base, old]))
    assert (t["status"] == NOT_MEASURED).all() and len(t) == sum(1 for _ in _expected_rows())
    assert "not measured" in "\n".join(beyond_plan.lines(t))
    gone = {**_cell(tmp_path, "granikv_dynamic", [(32, 1.0, True)]), "path": "grid/nowhere"}
    with pytest.raises(SchemaError, match="steps.jsonl"):
        beyond_plan.plan_frame(_res(tmp_path, [base, gone]))


def test_a_variant_whose_batch_sizes_the_baseline_never_ran_says_so(tmp_path):
    cells = [_cell(tmp_path, "sglang_default", [(32, 100.0, True)] * 3),
             _cell(tmp_path, "granikv", [(24, 80.0, True)] * 3)]     # fewer requests fit: another batch size
    t = beyond_plan.plan_frame(_res(tmp_path, cells))
    r = t[(t["point"] == POINT) & (t["system"] == "granikv")].iloc[0]
    assert r["status"] == "not measured (no batch size in common with sglang_default)"
    assert (t["status"] != "measured").all()


def test_a_variant_is_paired_only_with_baseline_cells_of_its_plan_scope(tmp_path):
    base_old = _cell(tmp_path, "sglang_default", [(32, 100.0, True)] * 5, rep=0)              # plan alone
    base_new = _cell(tmp_path, "sglang_default", [(32, 150.0, True)] * 5, rep=1)
    base_new["decode_plan_scope"] = "gather+plan"
    var = _cell(tmp_path, "granikv_dynamic", [(32, 120.0, True)] * 5)
    var["decode_plan_scope"] = "gather+plan"
    t = beyond_plan.plan_frame(_res(tmp_path, [base_old, base_new, var]))
    m = t[(t["status"] == "measured") & (t["system"] == "granikv_dynamic")]
    assert len(m) == 1 and m.iloc[0]["plan_scope"] == "gather+plan"
    assert m.iloc[0]["base_plan_us"] == 150.0 and m.iloc[0]["plan_ratio"] == pytest.approx(0.8)
    # the variant alone in its scope: no baseline to compare with, so no measured row
    t = beyond_plan.plan_frame(_res(tmp_path, [base_old, var]))
    assert t[(t["status"] == "measured") & (t["system"] == "granikv_dynamic")].empty
    text = "\n".join(beyond_plan.lines(beyond_plan.plan_frame(_res(tmp_path, [base_new, var]))))
    assert "granikv_dynamic, graph steps, plan_us covering the slot-list gather and the plan: 1 of 1 rows" in text
