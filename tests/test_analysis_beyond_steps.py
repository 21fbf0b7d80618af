"""analysis.beyond_steps: each beyond-the-paper variant row gets its prefill / decode breakdown next to
SGLang default's at the same point, read from the cells' step traces, and the REPORT explains every
row that misses its target with it."""
from __future__ import annotations
import json
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.measures import families as beyond
from analysis.exhibits.beyond import beyond_steps
from analysis.common import NOT_MEASURED
from analysis.load import SchemaError
from granikv import rawio

TABLE = json.dumps([{"choice": "dense", "lp_min": 0}])
CONFIG = ["system.name", "model.name", "tp", "rep", "workload.kind", "workload.prefix_len", "workload.batch",
          "workload.num_prefixes", "workload.prefix_lens", "hardware.name", "hardware.decision_table"]


def _cell(root, system, tok_s, decode_ms, decode_steps=10, prefill_ms=500.0, eager=0, lp=1024, batch=32, rep=0):
    """A synthetic-grid cell with a step trace: 2 prefill steps, then ``decode_steps`` decode steps of
    ``decode_ms`` each (the first ``eager`` without a CUDA graph)."""
    path = f"grid/system={system},rep={rep}"
    steps = [{"kind": "prefill", "step_time_s": prefill_ms / 1e3, "batch_size": batch, "cuda_graph": False}] * 2
    steps += [{"kind": "decode", "step_time_s": decode_ms / 1e3, "batch_size": batch, "cuda_graph": i >= eager}
              for i in range(decode_steps)]
    rawio.write_jsonl(root / path / "steps.jsonl", steps)
    return {"path": path, "system.name": system, "model.name": "llama3_8b", "tp": 1, "rep": rep,
            "workload.kind": "synthetic", "workload.prefix_len": lp, "workload.batch": batch, "workload.num_prefixes": 1,
            "workload.prefix_lens": None, "hardware.name": "h200", "hardware.decision_table": TABLE,
            "output_throughput_tok_s": tok_s, "provenance.git_commit": "a" * 40, "provenance.git_dirty": "false",
            "profile_steps": 0, "nsys": False, "model.num_heads": 32, "model.num_kv_heads": 8}


def _res(root, cells):
    return SimpleNamespace(cells=pd.DataFrame(cells), config_columns=CONFIG, root=str(root))


def test_a_variant_row_holds_its_breakdown_and_the_baselines(tmp_path):
    res = _res(tmp_path, [_cell(tmp_path, "sglang_default", 100.0, decode_ms=100.0),
                          _cell(tmp_path, "sglang_default", 100.0, decode_ms=300.0, rep=1),
                          _cell(tmp_path, "granikv_dynamic", 150.0, decode_ms=50.0, eager=3)])
    t = beyond_steps.steps_frame(res)
    m = t[t["status"] == "measured"]
    assert list(m["system"]) == ["granikv_dynamic"]          # the baseline only as base_* columns
    point = "config=llama3_8b TP=1, prefix_len=1024, batch=32"
    static = t[(t["point"] == point) & (t["system"] == "granikv")]
    assert list(static["status"]) == [NOT_MEASURED]          # an expected point without a cell is listed
    # every expected (point, variant) of every family is there, measured or not
    assert len(t) == sum(len(list(__import__("itertools").product(*f.dims.values()))) * len(beyond.VARIANTS)
                         for f in beyond.FAMILIES)
    r = m.iloc[0]
    assert r["point"] == "config=llama3_8b TP=1, prefix_len=1024, batch=32" and r["n"] == 1
    assert r["decode_s"] == pytest.approx(0.5) and r["decode_steps"] == 10 and r["decode_eager_steps"] == 3
    assert r["decode_eager_s"] == pytest.approx(0.15) and r["prefill_s"] == pytest.approx(1.0)
    assert r["base_decode_s"] == pytest.approx(2.0)          # the two baseline cells pooled: (1 + 3) / 2
    assert r["decode_speedup"] == pytest.approx(4.0) and r["prefill_share"] == pytest.approx(1.0 / 1.5)


def test_the_report_explains_each_miss_with_its_steps(tmp_path):
    res = _res(tmp_path, [_cell(tmp_path, "sglang_default", 100.0, decode_ms=100.0),
                          _cell(tmp_path, "granikv", 90.0, decode_ms=125.0, decode_steps=12),
                          _cell(tmp_path, "granikv_dynamic", 100.0, decode_ms=100.0)])
    t = beyond.beyond_frame(res)
    lines = beyond_steps.miss_lines(t, beyond_steps.steps_frame(res))
    miss = [x for x in lines if x.startswith("- ")]
    assert len(miss) == 1 and "granikv: 0.90x against 0.97x" in miss[0]
    assert "Decode 1.50 s in 12 steps (0 eager) against SGLang default's 1.00 s in 10 (0 eager): 0.67x" in miss[0]
    # nothing misses: no section
    ok = beyond.beyond_frame(_res(tmp_path, [_cell(tmp_path, "sglang_default", 100.0, decode_ms=100.0),
                                             _cell(tmp_path, "granikv_dynamic", 100.0, decode_ms=100.0)]))
    assert beyond_steps.miss_lines(ok, beyond_steps.steps_frame(res)) == []


def test_a_cell_without_its_step_trace_is_named(tmp_path):
    cells = [_cell(tmp_path, "sglang_default", 100.0, decode_ms=100.0),
             _cell(tmp_path, "granikv_dynamic", 100.0, decode_ms=100.0)]
    (tmp_path / cells[1]["path"] / "steps.jsonl").unlink()
    with pytest.raises(SchemaError, match="steps.jsonl"):
        beyond_steps.steps_frame(_res(tmp_path, cells))


def test_needed_decode_speedup_for_a_target():
    r = {"base_prefill_s": 1.0, "base_decode_s": 3.0, "target": 2.0, "prefill_s": 1.0}
    # SGLang default's 4.0 s over 2.0 = 2.0 s of step time, 1.0 of it prefill: decode at 1.0 s, 3.00x
    assert beyond_steps.needed_line(r) == (" At this prefill time, 2.00x in step time needs the decode steps at "
                                           "1.00 s, a 3.00x decode speedup.")
    assert "out of reach" in beyond_steps.needed_line({**r, "prefill_s": 2.5})
