"""analysis.exhibits.kernel.graph_step (runners.graph_step_bench cells, measured here on CPU with the FlashInfer
stand-in) and analysis.exhibits.sglang.in_sglang_paths (forced-path in-SGLang cells beside SGLang at one code
version), on frames whose numbers the tests know."""
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import fake_flashinfer
from analysis.exhibits.kernel import graph_step as gx
from analysis.exhibits.sglang import in_sglang_paths as ip
from analysis.load import Results, load_results
from analysis.measures.sglang import prefer_current
from granikv import rawio
from granikv.config import register
from runners import graph_step_bench as gsb

CONF = str(Path(__file__).resolve().parents[1] / "conf")


@pytest.fixture()
def two_gpu_cells(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    register()
    real = rawio.provenance
    for gpu, sweep in (("GPU A", "gs_a"), ("GPU B", "gs_b")):
        monkeypatch.setattr(gsb.rawio, "provenance", lambda g=gpu, **kw: {**real(**kw), "gpu_name": g})
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose("graph_step_bench", overrides=[f"results_dir={tmp_path}", f"sweep_name={sweep}"])
        assert len(gsb.run(gsb.resolve(cfg))["done"]) == 5
    return tmp_path


def test_graph_step_rows_per_gpu_and_case_with_the_fit_and_the_fixed_cost(two_gpu_cells, tmp_path):
    res = load_results(two_gpu_cells)
    t = gx.frame(res)
    assert len(t) == 10 and set(t["gpu"]) == {"GPU A", "GPU B"}
    k = res.kernels
    for _, r in t.iterrows():
        rows = k[(k["provenance.gpu_name"] == r["gpu"]) & (k["cell.cell_id"] == r["case"])]
        us = {p: 1e3 * rows.loc[rows["k.path"] == p, "k.time_ms"].iloc[0] for p in ("sglang", "paged", "cascade", "dense")}
        assert r["fixed_us"] == pytest.approx(us["paged"] - us["sglang"])
        best = min(("paged", "cascade", "dense"), key=us.get)
        assert r["best"] == best and r["best_over_sglang"] == pytest.approx(us[best] / us["sglang"])
    one = t[t["case"] != "hetero_k3"]
    assert set(one["fitted_rule"]) <= {"paged", "cascade", "dense"} and (one["fitted_rule"] != "").all()
    assert (t.loc[t["case"] == "hetero_k3", "fitted_rule"] == "").all()     # several classes: no one-class rule
    gx.build(res, tmp_path / "out")
    assert "GPU B" in (tmp_path / "out" / "tables" / "graph_step.md").read_text()


def _cell(sweep, system, lp, tok, commit, gpu="NVIDIA H100 80GB HBM3", dispatch="table", **plugin):
    return {"sweep": sweep, "system.name": system, "workload.prefix_len": lp, "output_throughput_tok_s": tok,
            "itl_p50_ms": 10.0, "provenance.git_commit": commit, "provenance.gpu_name": gpu,
            "workload.kind": "sharegpt", "system.dispatch": dispatch, **{f"plugin.{k}": v for k, v in plugin.items()}}


def test_forced_paths_are_over_sglang_of_the_same_gpu_and_code_version_only(tmp_path):
    P = "in_sglang_paths_llama3_8b_tp1_h100"
    cells = pd.DataFrame([
        _cell(P, "sglang_server_granikv", 512, 900.0, "aaaaaaa1", dispatch="paged_only", steps=10, split_steps=0,
              **{"paged_steps.no_split": 10}, replay_steps=10, replay_host_us=2000.0),
        _cell(P, "sglang_server_granikv", 512, 950.0, "aaaaaaa1", dispatch="table", steps=10, split_steps=4,
              **{"paged_steps.no_split": 6}, **{"rows.cascade": 40}, plan_us=400.0),
        _cell("in_sglang_llama3_8b_tp1_h100", "sglang_server", 512, 1000.0, "aaaaaaa1"),
        _cell("in_sglang_llama3_8b_tp1_h100", "sglang_server", 512, 500.0, "bbbbbbb2"),     # another version
        _cell("in_sglang_llama3_8b_tp1_h100", "sglang_server", 512, 400.0, "aaaaaaa1", gpu="NVIDIA H200"),
        _cell(P, "sglang_server_granikv", 2048, 700.0, "ccccccc3", dispatch="dense_only"),   # no SGLang beside it
    ])
    res = Results(tmp_path, cells, pd.DataFrame(), pd.DataFrame())
    t = ip.frame(res).set_index(["workload.prefix_len", "dispatch"])
    assert t.loc[(512, "paged_only"), "over_sglang"] == pytest.approx(0.9) and t.loc[(512, "paged_only"), "n_sglang"] == 1
    assert t.loc[(512, "paged_only"), "split_share"] == 0 and t.loc[(512, "paged_only"), "replay_host_us"] == 200.0
    assert t.loc[(512, "table"), "over_sglang"] == pytest.approx(0.95) and t.loc[(512, "table"), "split_share"] == 0.4
    assert t.loc[(512, "table"), "rows_cascade"] == 1.0 and t.loc[(512, "table"), "plan_us"] == pytest.approx(100.0)
    assert pd.isna(t.loc[(2048, "dense_only"), "over_sglang"]) and t.loc[(2048, "dense_only"), "n_sglang"] == 0
    # the ablation's cells are never a row of the in-SGLang table or a claim's number
    kept = prefer_current(cells, [])
    assert set(kept["sweep"]) == {"in_sglang_llama3_8b_tp1_h100"}
