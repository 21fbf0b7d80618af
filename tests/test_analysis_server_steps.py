"""analysis.measures.server_steps and analysis.exhibits.sglang.in_sglang_steps (a decode step's anatomy from
SGLang's own profiler trace), and the same-run SGLang baseline of the in-SGLang ratios
(analysis.exhibits.sglang.in_sglang.same_run, analysis.measures.sglang.prefer_current), on inputs whose
numbers the tests know."""
import gzip
import json

import pandas as pd
import pytest

from analysis.common import paired
from analysis.exhibits.sglang import in_sglang_steps as steps_x
from analysis.exhibits.sglang.in_sglang import same_run
from analysis.load import Results
from analysis.measures.server_steps import decode_steps, kernel_class
from analysis.measures.sglang import prefer_current

H100 = "NVIDIA H100 80GB HBM3"


def _kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _step(name, ts, dur):
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}


def _decode(t0, batch, prep_us, graph_corr, kernels):
    """A decode step at ``t0``: one host-issued copy kernel, ``prep_us`` of waiting, then the graph's kernels
    (name, dur) back to back. Returns its events and its end."""
    ev = [_kernel("create_flashinfer_kv_indices_triton", t0, 10, 1)]
    t = t0 + prep_us
    for name, dur in kernels:
        ev.append(_kernel(name, t, dur, graph_corr))
        t += dur
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 5,
               "args": {"correlation": graph_corr}})
    ev.append(_step(f"step[DECODE bs={batch}]", t0, t - t0))
    return ev, t


STEP = [("nvjet_sm90_tst_128x64_TNT", 600), ("flashinfer::BatchPrefillWithPagedKVCacheKernel<x>", 300),
        ("flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<RaggedParams, cutlass::x>>", 50),
        ("_merge_rows_kernel", 20), ("flashinfer::norm::FusedAddRMSNormKernel", 30)]


def _trace(path, prep_us):
    ev = [_step("step[EXTEND bs=3 toks=600]", 0, 900), _kernel("nvjet_sm90_big", 0, 900, 7)]
    t = 1000
    for i, b in enumerate((256, 250, 100)):
        e, t = _decode(t, b, prep_us, 100 + i, STEP)
        ev += e
        t += 50
    e, _ = _decode(t, 256, prep_us, 200, STEP[:1])          # cut by the trace's end: one kernel of five
    ev += e
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_kernel_classes_put_flashinfer_prefill_launches_before_the_gemms():
    assert kernel_class("flashinfer::PrefillWithKVCacheKernel<cutlass::gemm>") == "prefix"
    assert kernel_class("nvjet_sm90_tst_256x128") == "gemm" and kernel_class("_gather_q_kernel") == "rows"
    assert kernel_class("flashinfer::PersistentVariableLengthMergeStatesKernel") == "attention"
    assert kernel_class("void flashinfer::norm::FusedAddRMSNormKernel") == "other"


def test_decode_steps_split_kernel_time_by_class_and_the_wait_before_the_graph(tmp_path):
    _trace(tmp_path / "t.json.gz", prep_us=400)
    st = decode_steps(tmp_path / "t.json.gz")
    assert list(st["batch"]) == [256, 250, 100, 256]                       # the extend step is not a decode step
    r = st.iloc[0]
    assert r["kernels"] == 6 and r["busy_ms"] == pytest.approx(1.01)      # the copy kernel counts, 10 us
    assert r["pre_graph_ms"] == pytest.approx(0.4) and r["span_ms"] == pytest.approx(1.4)
    assert r["idle_ms"] == pytest.approx(0.39)
    assert (r["gemm_ms"], r["attention_ms"], r["prefix_ms"], r["rows_ms"]) == pytest.approx((0.6, 0.3, 0.05, 0.02))
    assert r["other_ms"] == pytest.approx(0.04)


def _cells(tmp_path):
    rows = []
    for system, prep in (("sglang_server", 100), ("sglang_server_granikv", 400)):
        d = tmp_path / system
        d.mkdir()
        _trace(d / "trace.json.gz", prep)
        rows.append({"system.name": system, "profile_steps": 20, "path": system, "workload.prefix_len": 512,
                     "workload.batch": 256, "provenance.git_commit": "abcdef0123", "provenance.gpu_name": H100})
    rows.append({**rows[0], "profile_steps": 0, "path": "none"})               # an unprofiled cell: not read
    return Results(tmp_path, pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame())


def test_steps_table_keeps_full_uncut_steps_and_compares_with_sglang_of_the_same_run(tmp_path):
    t = steps_x.frame(_cells(tmp_path)).set_index("system")
    assert list(t.index) == ["sglang_server", "sglang_server_granikv"]
    g = t.loc["sglang_server_granikv"]
    assert g["steps"] == 2 and g["cut_steps"] == 1 and g["batch"] == pytest.approx(253)   # bs 100 is not full
    assert g["pre_graph_ms"] == pytest.approx(0.4) and t.loc["sglang_server", "pre_graph_ms"] == pytest.approx(0.1)
    assert g["busy_over_sglang"] == pytest.approx(1.0)
    assert g["span_over_sglang"] == pytest.approx(1.4 / 1.1)
    again = tmp_path / "again"
    again.mkdir()
    steps_x.build(_cells(again), tmp_path / "out")
    assert "pre_graph" in (tmp_path / "out" / "tables" / "in_sglang_steps.md").read_text()


def _run(system, lp, commit, tok=1000.0):
    return {"system.name": system, "workload.prefix_len": lp, "provenance.git_commit": commit,
            "provenance.started_at": f"2026-12-0{1 if commit == 'B' else 6}T00:00:00", "output_throughput_tok_s": tok}


def test_a_plugin_ratio_is_over_sglang_of_its_own_run_where_there_is_one():
    base = pd.DataFrame([_run("sglang_server", 512, "A", 900.0), _run("sglang_server", 512, "B", 1100.0)])
    twin, how = same_run(base, pd.DataFrame([_run("sglang_server_granikv", 512, "A")]))
    assert how == "same" and list(twin["output_throughput_tok_s"]) == [900.0]
    pooled, how = same_run(base, pd.DataFrame([_run("sglang_server_granikv", 512, "C")]))
    assert how == "pooled" and len(pooled) == 2
    assert same_run(base, base.iloc[0:0])[1] == ""
    cells = pd.DataFrame([_run("sglang_server", 512, "A"), _run("sglang_server", 512, "B"),
                          _run("sglang_server_granikv", 512, "A"),
                          _run("sglang_server", 2048, "B"), _run("sglang_server_granikv", 2048, "A")])
    cols = ["system.name", "workload.prefix_len"]
    kept = prefer_current(cells, cols)
    base_kept = kept[kept["system.name"] == "sglang_server"]
    assert sorted(zip(base_kept["workload.prefix_len"], base_kept["provenance.git_commit"])) == [(512, "A"), (2048, "B")]
    assert len(prefer_current(cells, cols, same_run=False)) == 5
    # new graph rules are part of the plugin's version: the older cell without them is left out, and the
    # baseline (which never carries the plugin's rules) still pairs with the new one
    newer = {**_run("sglang_server_granikv", 512, "D"), "provenance.started_at": "2026-12-07T00:00:00",
             "hardware.plugin_graph_table": "[rules]"}
    cells = pd.concat([cells, pd.DataFrame([newer, _run("sglang_server", 512, "D", 700.0)])], ignore_index=True)
    kept = prefer_current(cells, cols + ["hardware.plugin_graph_table"])
    at512 = kept[kept["workload.prefix_len"] == 512]
    assert sorted(zip(at512["system.name"], at512["provenance.git_commit"])) == [("sglang_server", "D"),
                                                                                 ("sglang_server_granikv", "D")]
    p = paired(at512, cols + ["hardware.plugin_graph_table"], {"system.name": "=sglang_server_granikv"},
               {"system.name": "=sglang_server"}, "output_throughput_tok_s")
    assert len(p) == 1 and p["ratio"].iloc[0] == pytest.approx(1000.0 / 700.0)
