"""Two GPU models are never pooled: cells of the same configuration on an H200 and an H100 stay apart in
every table (a `gpu` column), every claim (a row per GPU model, the H200's first) and the frames figures
draw from; repetitions, noise and reruns are counted within one GPU model."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis.clean import config_keys
from analysis.common import aggregate, identity, system_table, paired
from analysis.gpu import GPU, NO_GPU, PRIMARY_GPU, gpu_names, only_gpu, primary_gpu
from analysis.load import load_results
from analysis.paper import read_claims
from analysis.verdict.evaluate import evaluate
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


def test_the_headline_table_figures_draw_from_keeps_the_gpu_models_apart(res, tmp_path):
    from analysis.exhibits.headline.headline import build

    t = build(res, tmp_path, figures=False)
    written = pd.read_csv(tmp_path / "tables" / "headline.csv")
    assert GPU in t.columns and GPU in written.columns
    m = t[(t["status"] == "measured") & (t["system"] == "granikv")]
    assert sorted(zip(m["workload.prefix_len"], m[GPU], m["n"])) == [
        (512, H100, 1), (512, PRIMARY_GPU, 2), (16384, H100, 1), (16384, PRIMARY_GPU, 2)]
    assert list(m["ratio_vs_sglang_default"]) == pytest.approx([2.0] * 4, rel=0.02)
