"""No stray cell can move a verdict: a metrics.json that disagrees with its own requests.jsonl, one run
stored twice, a folder no campaign item or bench names, a claim that leaves its configuration open, and
a tiny CPU cell dropped into the results: each is refused, ignored or left out, with the cell and the fix named."""
from __future__ import annotations
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load_results
from analysis.paper import CLAIMS_CSV, read_claims
from analysis.report.provenance import ignored_line
from analysis.verdict.evaluate import evaluate
from granikv.rawio import SchemaError
from tests.raw_cells import serving_cell

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "results" / "raw"


def test_a_metrics_json_off_its_own_requests_stops_the_analysis(tmp_path):
    d = serving_cell(tmp_path, "headline_llama3_8b_tp1", duration=2.0)
    assert load_results(tmp_path).cells["output_throughput_tok_s"].iloc[0] == pytest.approx(128.0)
    m = json.loads((d / "metrics.json").read_text())
    (d / "metrics.json").write_text(json.dumps({**m, "output_throughput_tok_s": 10 * m["output_throughput_tok_s"]}))
    with pytest.raises(SchemaError, match=r"rep=0,system=granikv.*metrics.json: field `output_throughput_tok_s`.*Fix:"):
        load_results(tmp_path)
    (d / "metrics.json").write_text(json.dumps({**m, "num_output_tokens": m["num_output_tokens"] - 1}))
    with pytest.raises(SchemaError, match=r"field `num_output_tokens` is 255, but requests.jsonl holds 256"):
        load_results(tmp_path)
    (d / "metrics.json").write_text(json.dumps({**m, "duration_s": m["duration_s"] * 1.005,
                                                "output_throughput_tok_s": m["output_throughput_tok_s"] / 1.005}))
    assert len(load_results(tmp_path).cells) == 1          # within 1%: a rounding, not a disagreement


def test_one_run_stored_twice_is_refused_with_both_cells_named(tmp_path):
    d = serving_cell(tmp_path, "headline_llama3_8b_tp1")
    serving_cell(tmp_path, "headline_llama3_8b_tp1", rep=1)        # a second run: its own records
    assert len(load_results(tmp_path).cells) == 2
    copy = tmp_path / "headline_onecommit_llama3_8b_tp1" / d.name  # a byte-identical copy in another sweep folder
    shutil.copytree(d, copy)
    with pytest.raises(SchemaError, match=r"headline_onecommit_llama3_8b_tp1/rep=0.*same request records as "
                                          r"headline_llama3_8b_tp1/rep=0.*Fix:"):
        load_results(tmp_path)
    shutil.rmtree(copy)
    rep7 = d.with_name(d.name.replace("rep=0", "rep=7"))           # the same run renamed as repetition 7
    shutil.copytree(d, rep7)
    cfg = json.loads((rep7 / "config.json").read_text())
    (rep7 / "config.json").write_text(json.dumps({**cfg, "rep": 7}))
    with pytest.raises(SchemaError, match=r"rep=7,.*same request records as .*rep=0,"):
        load_results(tmp_path)


def test_folders_no_campaign_item_or_bench_names_are_ignored_and_listed(tmp_path):
    serving_cell(tmp_path, "headline_llama3_8b_tp1")
    serving_cell(tmp_path, "my_experiment", rep=3)
    res = load_results(tmp_path, folders={"headline_llama3_8b_tp1"})
    assert list(res.cells["sweep"]) == ["headline_llama3_8b_tp1"]
    assert res.ignored == [str(tmp_path / "my_experiment")]
    assert f"`{tmp_path / 'my_experiment'}`" in ignored_line(res) and "conf/campaign.yaml" in ignored_line(res)
    assert len(load_results(tmp_path).cells) == 2 and load_results(tmp_path).ignored == []


def test_every_committed_folder_is_named_by_the_campaign():
    from runners.campaign import load_benches, named_folders

    named = named_folders()
    assert {"kernel", "calibration_h100", "kernel_hot_batch_h100", "prefill_host", "smoke"} <= set(load_benches())
    assert sorted(d.name for d in RAW.iterdir() if d.is_dir() and d.name not in named) == []


def test_claims_name_their_full_configuration(tmp_path):
    claims = read_claims()
    for cid in ("dispatch_overhead_share", "dispatch_overhead_cpu"):
        sel = claims.set_index("id").loc[cid, "selectors"]
        assert "model.name=llama3_8b" in sel and "tp=1" in sel and "hardware.name=" in sel and "workload.kind=" in sel
    text = CLAIMS_CSV.read_text()
    old = text.replace("system.name=granikv;dispatch_from=steps.jsonl;model.name=llama3_8b;tp=1;",
                       "system.name=granikv;dispatch_from=steps.jsonl;", 1)
    assert old != text
    (tmp_path / "claims.csv").write_text(old)
    with pytest.raises(ValueError, match=r"claim `dispatch_overhead_share`: field `selectors` does not name "
                                         r"`model.name`.*Fix: add `model.name=llama3_8b`"):
        read_claims(tmp_path / "claims.csv")
    (tmp_path / "claims.csv").write_text(text.replace("model.name=qwen25_14b;tp=2;workload.prefix_len=16384",
                                                      "model.name=llama3_8b;tp=2;workload.prefix_len=16384", 1))
    with pytest.raises(ValueError, match=r"claim `headline_qwen14b`: field `selectors` has `model.name=llama3_8b`"):
        read_claims(tmp_path / "claims.csv")


def test_a_stray_cpu_cell_moves_no_verdict(tmp_path):
    """A copy of two folders of results/raw (Qwen2.5-32B's TP=2 headline and the kernel bench, 3.5 MB) with one
    tiny CPU GraniKV cell added under the dispatch-overhead sweep: no claim's verdict or number changes (its
    dispatcher time made the Llama-3.1-8B overhead claims read 0.0888% and 88.8 us before, from a cell of
    another model and no GPU)."""
    farm = tmp_path / "raw"
    for name in ("headline_qwen25_32b_tp2", "kernel"):
        shutil.copytree(RAW / name, farm / name)
    before = evaluate(load_results(farm))
    assert (before["verdict"] != "not measured").sum() >= 2       # the kernel claims are measured here
    serving_cell(farm, "dispatch_overhead_llama3_8b_tp1", model="tiny", hardware="cpu", gpu="", kind="synthetic",
                 lp=64, batch=4, dispatch_us=88.8, step_s=0.1)
    after_res = load_results(farm)
    assert "dispatch_overhead_llama3_8b_tp1" in set(after_res.cells["sweep"])
    after = evaluate(after_res)
    def shown(ev):   # each claim's verdict and number (its row on the primary GPU model)
        ev = ev[ev["primary"]] if "primary" in ev.columns else ev
        return ev[["id", "verdict", "ours_shown", "n"]].reset_index(drop=True)
    assert shown(after).to_dict("records") == shown(before).to_dict("records")
    mine = shown(after).set_index("id")
    for cid in ("dispatch_overhead_share", "dispatch_overhead_cpu"):
        assert mine.loc[cid, "verdict"] == "not measured"      # no Llama-3.1-8B cell here
