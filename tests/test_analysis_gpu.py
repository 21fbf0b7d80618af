"""Two GPU models are never pooled: cells of the same configuration on an H200 and an H100 stay apart in
every table (a `gpu` column), every claim (a row per GPU model, the H200's first) and the frames figures
draw from; repetitions, noise and reruns are counted within one GPU model."""
from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from analysis.clean import config_keys
from analysis.common import aggregate, identity, system_table, paired
from analysis.gpu import GPU, NO_GPU, PRIMARY_GPU, gpu_names, only_gpu, primary_gpu
from analysis.load import load_results
from analysis.paper import read_claims
from analysis.verdict.evaluate import evaluate
from granikv import rawio
from tests.raw_cells import serving_cell

H100 = "NVIDIA H100 80GB HBM3"
SWEEP = "headline_llama3_8b_tp1"


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    """Identical configurations on two GPU models: GraniKV and SGLang default at Lp=512 and 16K, the H200
    at 2 repetitions, the H100 at 1, the H100 twice as fast (its duration halved)."""
    root = tmp_path_factory.mktemp("raw")
    for gpu, reps, scale in ((PRIMARY_GPU, 2, 1.0), (H100, 1, 0.5)):
        for lp in (512, 16384):
            for system, dur in (("granikv", 1.0), ("sglang_default", 2.0)):
                for rep in range(reps):
                    sweep = SWEEP if gpu == PRIMARY_GPU else f"{SWEEP}_h100"
                    serving_cell(root, sweep, system=system, lp=lp, gpu=gpu, rep=rep,
                                 duration=dur * scale * (1 + 0.01 * rep), hardware="h200" if gpu == PRIMARY_GPU
                                 else "h100")
    return load_results(root)


def test_every_cell_carries_its_gpu_model_and_it_identifies_a_configuration(res):
    assert set(res.cells[GPU]) == {PRIMARY_GPU, H100}
    assert GPU in identity(res.cells, res.config_columns)
    assert config_keys(res.cells, res.config_columns).nunique() == 8     # 2 GPUs x 2 Lp x 2 systems
    assert list(gpu_names(pd.DataFrame({"provenance.gpu_name": ["", None, "X"]}))) == [NO_GPU, NO_GPU, "X"]


def test_same_configuration_never_pools_across_gpu_models(res):
    keys = [k for k in identity(res.cells, res.config_columns) if k != "hardware.name"]
    a = aggregate(res.cells, keys, "output_throughput_tok_s")
    assert len(a) == 8 and set(a.loc[a[GPU] == H100, "n"]) == {1} and set(a.loc[a[GPU] == PRIMARY_GPU, "n"]) == {2}
    p = paired(res.cells, res.config_columns, {"system.name": "=granikv"}, {"system.name": "=sglang_default"},
               "output_throughput_tok_s")
    assert len(p) == 4 and set(p["n_base"]) == {1, 2}       # each GPU model's baseline is its own


def test_serving_tables_have_a_gpu_column_and_a_row_per_gpu_model(res):
    t = system_table(res.cells, res.config_columns, {}, ["workload.prefix_len"])
    assert GPU in t.columns
    g = t[t["system"] == "granikv"].set_index(["workload.prefix_len", GPU])
    assert g.loc[(512, PRIMARY_GPU), "n"] == 2 and g.loc[(512, H100), "n"] == 1
    assert g.loc[(512, H100), "mean"] == pytest.approx(2 * g.loc[(512, PRIMARY_GPU), "mean"], rel=0.02)


def test_claims_get_a_row_per_gpu_model_the_primary_first(res):
    claims = read_claims()
    claims = claims[claims["id"].isin(["headline_llama8b", "parity_lp512_llama8b"])]
    ev = evaluate(res, claims)
    assert primary_gpu(res) == PRIMARY_GPU
    assert list(zip(ev["id"], ev[GPU], ev["primary"])) == [
        ("headline_llama8b", PRIMARY_GPU, True), ("parity_lp512_llama8b", PRIMARY_GPU, True),
        ("headline_llama8b", H100, False), ("parity_lp512_llama8b", H100, False)]
    for _, r in ev.iterrows():
        assert r["our_hardware"] == r[GPU]                 # each row measured on its GPU model alone
    assert list(ev["n"]) == [2, 2, 1, 1]
    assert list(ev["ours"]) == pytest.approx([2.0, 2.0, 2.0, 2.0], rel=0.02)
    # the H200's numbers are those of its cells alone
    alone = evaluate(only_gpu(res, PRIMARY_GPU), claims)
    assert list(alone["ours"]) == list(ev.loc[ev["primary"], "ours"]) and list(alone["n"]) == [2, 2]


def test_a_claim_without_cells_on_the_other_gpu_model_has_no_row_there(res):
    claims = read_claims()
    ev = evaluate(only_gpu(res, H100), claims[claims["id"] == "headline_qwen14b"])
    assert list(ev[GPU]) == [H100] and ev["verdict"].iloc[0] == "not measured"     # the primary row only
    # selecting the H100's GraniKV cells is not enough: without SGLang-Cascade there, no number, no H100 row
    ev = evaluate(res, claims[claims["id"] == "storage_layer_llama8b"])
    assert list(zip(ev[GPU], ev["verdict"])) == [(PRIMARY_GPU, "not measured")]


def test_the_headline_table_figures_draw_from_keeps_the_gpu_models_apart(res, tmp_path):
    from analysis.exhibits.headline.headline import build

    t = build(res, tmp_path, figures=False)
    written = pd.read_csv(tmp_path / "tables" / "headline.csv")
    assert GPU in t.columns and GPU in written.columns
    m = t[(t["status"] == "measured") & (t["system"] == "granikv")]
    assert sorted(zip(m["workload.prefix_len"], m[GPU], m["n"])) == [
        (512, H100, 1), (512, PRIMARY_GPU, 2), (16384, H100, 1), (16384, PRIMARY_GPU, 2)]
    assert list(m["ratio_vs_sglang_default"]) == pytest.approx([2.0] * 4, rel=0.02)


def _on(t: pd.DataFrame, **where) -> pd.DataFrame:
    """The rows of ``t`` whose columns hold the given values (keyword ``Lp`` for workload.prefix_len)."""
    for k, v in where.items():
        t = t[t[{"Lp": "workload.prefix_len"}.get(k, k)] == v]
    return t


def _per_gpu(t: pd.DataFrame, col: str) -> dict:
    """{gpu: value of ``col``} over the measured rows of ``t``, one row per GPU model (asserted)."""
    m = t[t["status"].astype(str).str.startswith("measured")]
    assert GPU in m.columns and sorted(m[GPU]) == [H100, PRIMARY_GPU], m
    return dict(zip(m[GPU], m[col]))


def test_the_headline_step_breakdown_keeps_the_gpu_models_apart(res, tmp_path):
    from analysis.exhibits.headline.headline_steps import build

    t = build(res, tmp_path)
    written = pd.read_csv(tmp_path / "tables" / "headline_steps.csv")
    assert GPU in written.columns
    d = _per_gpu(_on(t, Lp=512, **{"system.name": "granikv"}), "duration_s")
    assert d[H100] == pytest.approx(0.5 * d[PRIMARY_GPU], rel=0.02)       # each GPU's own cells, never their mean


@pytest.mark.parametrize("exhibit", ["beyond", "beyond_steps"])
def test_the_beyond_tables_keep_the_gpu_models_apart(res, tmp_path, exhibit):
    import importlib

    t = importlib.import_module(f"analysis.exhibits.beyond.{exhibit}").build(res, tmp_path)
    assert GPU in pd.read_csv(tmp_path / "tables" / f"{exhibit}.csv").columns
    row = _on(t, point="config=llama3_8b TP=1, prefix_len=512", system="granikv")
    assert _per_gpu(row, "n") == {PRIMARY_GPU: 2, H100: 1}
    if exhibit == "beyond":
        assert list(_per_gpu(row, "ratio_vs_sglang_default").values()) == pytest.approx([2.0, 2.0], rel=0.02)
    else:
        assert list(_per_gpu(row, "decode_speedup").values()) == pytest.approx([1.0, 1.0])


def test_reruns_keep_the_gpu_models_apart(res):
    from analysis.exhibits.campaign.reruns import table

    new = res.cells[(res.cells["system.name"] == "granikv") & (res.cells["workload.prefix_len"] == 512)]
    old = new.assign(sweep="old_" + new["sweep"], superseded_by=new["sweep"], set_aside_for=new["path"])
    t = table(replace(res, set_aside=old.reset_index(drop=True)))
    assert GPU in t.columns and sorted(zip(t[GPU], t["n_before"], t["n_after"])) == [(H100, 1, 1), (PRIMARY_GPU, 2, 2)]
    assert list(t["after_over_before"]) == pytest.approx([1.0, 1.0])


def test_the_claim_map_has_a_row_per_gpu_model_each_from_its_own_cells(res):
    from analysis.exhibits.campaign.claim_map import tables

    claims = read_claims()
    cm, _, rr = tables(res, claims=claims[claims["id"] == "headline_llama8b"], campaign=[])
    assert list(zip(cm["claim"], cm[GPU], cm["experiment"])) == [
        ("headline_llama8b", PRIMARY_GPU, SWEEP), ("headline_llama8b", H100, f"{SWEEP}_h100")]
    assert list(zip(rr[GPU], rr["raw"])) == [(PRIMARY_GPU, f"results/raw/{SWEEP}/"),
                                             (H100, f"results/raw/{SWEEP}_h100/")]


def _profile(cell, attention_ms: float) -> None:
    """``cell`` as a profiled run (profile_steps > 0) with a torch.profiler trace: ``attention_ms`` of
    attention kernels in 100 ms of kernel time."""
    cfg = rawio.read_json(cell / "config.json")
    rawio.write_json(cell / "config.json", {**cfg, "profile_steps": 20})
    events = [{"ph": "X", "cat": "kernel", "name": "BatchDecodeKernel", "ts": 0, "dur": attention_ms * 1e3},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1e6, "dur": (100 - attention_ms) * 1e3}]
    (cell / "trace.json").write_text(json.dumps({"traceEvents": events}))


def _plan_us(cell, us: float) -> None:
    """``cell``'s decode steps as CUDA-graph steps whose plan took ``us``."""
    steps = [{**s, "plan_us": us, "cuda_graph": True} for s in rawio.read_jsonl(cell / "steps.jsonl")]
    rawio.write_jsonl(cell / "steps.jsonl", steps)


# per GPU model: repetitions, hardware preset, SGLang default's time over GraniKV's, the profiled
# prefix-attention ms of SGLang default, GraniKV's plan time (us; SGLang default's: 100)
GPUS = ((PRIMARY_GPU, 2, "h200", 2.0, 60.0, 80.0), (H100, 1, "h100", 3.0, 30.0, 50.0))


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    """The same configurations on two GPU models, each with its own numbers (GPUS): the synthetic grid point
    Lp=8K, B=256 (GraniKV, SGLang default and the forced backends; a profiled SGLang default and GraniKV) and
    the headline Lp=16K in the engine and in real SGLang (the plugin), with plan times."""
    root = tmp_path_factory.mktemp("raw_more")
    for gpu, reps, hw, slower, attention, plan in GPUS:
        tag = "" if gpu == PRIMARY_GPU else "_h100"
        at = dict(gpu=gpu, hardware=hw)
        for rep in range(reps):
            jitter = 1 + 0.01 * rep
            for system, dur in (("sglang_default", slower), ("granikv", 1.0), ("granikv_dense_only", 1.2),
                                ("granikv_cascade_only", 1.5)):
                serving_cell(root, f"grid{tag}", system=system, lp=8192, kind="synthetic", rep=rep,
                             duration=dur * jitter, **at)
            for system, dur in (("sglang_server", 1.05 * slower), ("sglang_server_granikv", 1.1),
                                ("sglang_default", slower), ("granikv", 1.0)):
                d = serving_cell(root, f"sglang{tag}", system=system, lp=16384, rep=rep, duration=dur * jitter, **at)
                _plan_us(d, plan if system == "granikv" else 100.0)
        for system, ms in (("sglang_default", attention), ("granikv", 10.0)):
            _profile(serving_cell(root, f"profiler{tag}", system=system, lp=8192, kind="synthetic", **at), ms)
    return load_results(root)


def test_amdahl_is_worked_out_per_gpu_model(more, tmp_path):
    from analysis.exhibits.kernel.amdahl import build

    t = build(more, tmp_path, figures=False)
    assert GPU in pd.read_csv(tmp_path / "tables" / "amdahl.csv").columns
    row = _on(t, config="llama3_8b TP=1")
    assert _per_gpu(row, "f_attention_share") == pytest.approx({PRIMARY_GPU: 0.6, H100: 0.3})
    assert _per_gpu(row, "measured") == pytest.approx({PRIMARY_GPU: 2.0, H100: 3.0}, rel=0.02)


def test_the_profiler_table_keeps_the_gpu_models_apart(more, tmp_path):
    from analysis.exhibits.kernel.profiler import build, graph_traces

    t = build(more, tmp_path, figures=False)
    assert _per_gpu(_on(t, system="sglang_default"), "attention_ms") == pytest.approx({PRIMARY_GPU: 60.0, H100: 30.0})
    assert _per_gpu(_on(t, system="granikv"), "default_over_system") == pytest.approx({PRIMARY_GPU: 6.0, H100: 3.0})
    build(only_gpu(more, PRIMARY_GPU), tmp_path, figures=False)       # one GPU model: still its column
    assert set(pd.read_csv(tmp_path / "tables" / "profiler.csv")[GPU]) == {PRIMARY_GPU}
    # an H100 traced only eagerly keeps its trace beside an H200 graph trace of the same configuration
    tf = pd.DataFrame({"config": ["a", "a"], GPU: [PRIMARY_GPU, H100], "system": ["granikv"] * 2,
                       "workload.prefix_len": [8192] * 2, "workload.batch": [256] * 2,
                       "hardware.cuda_graph_max_bs": [256, 0]})
    assert list(graph_traces(tf)[GPU]) == [PRIMARY_GPU, H100]


def test_dispatch_routing_keeps_the_gpu_models_apart(more, tmp_path):
    from analysis.exhibits.dispatch.dispatch_routing import build

    t = build(more, tmp_path, figures=False)
    assert GPU in pd.read_csv(tmp_path / "tables" / "dispatch_routing.csv").columns
    assert _per_gpu(_on(t, Lp=8192, **{"workload.batch": 256}), "n_granikv") == {PRIMARY_GPU: 2, H100: 1}


def test_engine_fidelity_keeps_the_gpu_models_apart(more, tmp_path):
    from analysis.exhibits.sglang.engine_fidelity import build

    t = build(more, tmp_path, figures=False)
    assert GPU in pd.read_csv(tmp_path / "tables" / "engine_fidelity.csv").columns
    row = _on(t, Lp=16384)
    assert _per_gpu(row, "n_real") == {PRIMARY_GPU: 2, H100: 1}
    assert _per_gpu(row, "granikv/real") == pytest.approx({PRIMARY_GPU: 2.1, H100: 3.15}, rel=0.02)


def test_in_sglang_keeps_the_gpu_models_apart(more, tmp_path):
    from analysis.exhibits.sglang.in_sglang import build

    t = build(more, tmp_path, figures=False)
    assert GPU in pd.read_csv(tmp_path / "tables" / "in_sglang.csv").columns
    row = _on(t, set="headline", Lp=16384, system="granikv")
    assert _per_gpu(row, "n_sglang") == {PRIMARY_GPU: 2, H100: 1}
    assert _per_gpu(row, "sglang_x") == pytest.approx({PRIMARY_GPU: 2.1 / 1.1, H100: 3.15 / 1.1}, rel=0.02)


def test_beyond_plan_pairs_plan_times_within_one_gpu_model(more, tmp_path):
    from analysis.exhibits.beyond.beyond_plan import build

    t = build(more, tmp_path)
    assert GPU in pd.read_csv(tmp_path / "tables" / "beyond_plan.csv").columns
    row = _on(t, point="config=llama3_8b TP=1, prefix_len=16384", system="granikv")
    assert _per_gpu(row, "plan_ratio") == pytest.approx({PRIMARY_GPU: 0.8, H100: 0.5})
