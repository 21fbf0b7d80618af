"""runners/prefill_bench.py on CPU (tiny model; TP=1 in process, TP=2 under torchrun on gloo) and
analysis/prefill_host.py on what it writes: the table carries the file's numbers, a malformed
file names its field, and no file means an empty table marked not measured."""
from __future__ import annotations
import json
import os
import subprocess
import sys
from pathlib import Path
import pytest
import torch

from analysis.exhibits.headline import prefill_host
from analysis.measures import prefill
from granikv.rawio import SchemaError, read_json
from runners import prefill_bench

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "2048", "--tokens", "8,32", "--reps", "2",
        "--warmup", "1"]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("raw")
    prefill_bench.main([*ARGS, "--out", str(root / "prefill_host")])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2",
                        "-m", "runners.prefill_bench", *ARGS, "--out", str(root / "prefill_host")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return root


def test_bench_writes_one_file_per_tp_with_its_rows(out):
    for tp, calls in ((1, 0), (2, 2 * 2 + 1)):          # tiny: 2 layers -> 2 per layer + the embedding
        d = read_json(out / "prefill_host" / f"tiny_tp{tp}" / "prefill_host.json")
        assert d["config"]["tp"] == tp and d["provenance"]["git_commit"]
        assert [r["tokens"] for r in d["rows"]] == [8, 32]
        for r in d["rows"]:
            assert r["allreduce_calls"] == calls and len(r["step_ms_all"]) == 2
            assert r["step_ms"] > 0 and r["forward_ms"] >= r["launch_ms"] > 0
            assert (r["allreduce_ms"] > 0) == (tp > 1)


def test_table_carries_the_files_numbers(out, tmp_path):
    t = prefill.load(out)
    assert list(zip(t["tp"], t["tokens"])) == [(1, 8), (1, 32), (2, 8), (2, 32)]
    assert set(t["allreduce"]) == {"nccl"} and t["symm_vs_nccl_max_abs_diff"].isna().all()
    d = read_json(out / "prefill_host" / "tiny_tp2" / "prefill_host.json")
    row = t[(t["tp"] == 2) & (t["tokens"] == 32)].iloc[0]
    src = d["rows"][1]
    assert row["step_ms"] == src["step_ms"] and row["allreduce_ms"] == src["allreduce_ms"]
    assert row["launch_share"] == pytest.approx(src["launch_ms"] / src["forward_ms"])
    assert row["per_layer_launch_us"] == pytest.approx(src["launch_ms"] * 1e3 / 2)
    assert row["gpu"] == "no GPU (CPU)"


def test_malformed_file_names_the_field(out, tmp_path):
    bad = tmp_path / "raw" / "prefill_host" / "x"
    bad.mkdir(parents=True)
    d = read_json(out / "prefill_host" / "tiny_tp1" / "prefill_host.json")
    d["rows"][0]["launch_ms"] = "fast"
    (bad / "prefill_host.json").write_text(json.dumps(d))
    with pytest.raises(SchemaError, match=r"rows\[0\]\.launch_ms"):
        prefill.load(tmp_path / "raw")


def test_no_file_is_not_measured(tmp_path):
    from analysis.load import load_results
    t = prefill_host.build(load_results(tmp_path), tmp_path / "out")
    assert len(t) == len(prefill_host.EXPECTED) * len(prefill_host.TOKENS)
    assert t["status"].str.startswith("not measured").all() and t["step_ms"].isna().all()


def test_measured_rows_fill_the_expected_grid(out, tmp_path):
    from analysis.load import load_results
    t = prefill_host.build(load_results(out), tmp_path / "o")
    # the CPU runs (tiny) are not in the expected GPU grid: appended, measured; the grid stays not measured
    tiny = t[t["model"] == "tiny"]
    assert len(tiny) == 4 and (tiny["status"] == "measured").all()
    assert t[t["model"] != "tiny"]["status"].str.startswith("not measured").all()


def test_bad_tokens_argument():
    with pytest.raises(SystemExit, match="--tokens"):
        prefill_bench.main(["--tokens", "8,x"])


def test_expected_row_filled_when_measured(out, tmp_path, monkeypatch):
    from analysis.load import load_results
    monkeypatch.setattr(prefill_host, "EXPECTED", (("tiny", 1, "nccl"), ("tiny", 3, "nccl")))
    monkeypatch.setattr(prefill_host, "TOKENS", (8, 32))
    t = prefill_host.build(load_results(out), tmp_path / "o")
    got = t.set_index(["tp", "tokens"])["status"].to_dict()
    assert got[(1, 8)] == got[(1, 32)] == "measured" and got[(2, 8)] == "measured"   # tp=2: extra, measured
    assert got[(3, 8)].startswith("not measured")
    assert list(t["tp"])[:4] == [1, 1, 3, 3]                                          # the expected grid first


def test_decode_check_serves_both_ways_and_restores_the_one_shot_path():
    """decode_check's mechanics on CPU (TP=1, so both passes take the same path and must agree):
    it runs the burst twice, restores the staging buffer, and leaves no captured graph behind."""
    from granikv.engine.engine import Engine
    from runners.engine_bench import cell_config
    engine = Engine(cell_config("tiny", "cpu", "sglang_default", ["hardware.kv_budget_tokens=2048"]))
    assert prefill_bench.decode_check(engine, 0) == {}              # NCCL only: nothing to compare
    marker = torch.zeros(1)
    engine.tp._symm_buf = marker
    got = prefill_bench.decode_check(engine, 0, batch=3, prompt=10, out=4)
    assert got == {"requests": 3, "output_len": 4, "requests_identical": 3, "first_difference_min": 4}
    assert engine.tp._symm_buf is marker and engine.runner.graphs == {}


def test_report_line_uses_gpu_rows_of_the_claims_model_only(out, tmp_path):
    """The REPORT's prefill line for a TP claim: that model's GPU rows at its TP and at TP=1; CPU rows
    (the tiny runs above) never stand in for a GPU."""
    import pandas as pd

    from analysis.report.steps import prefill_host_line

    res = type("R", (), {"root": out, "ignored": []})()
    claim = pd.Series({"model": "tiny", "tp": "2"})
    assert prefill_host_line(res, claim, {}) == ""                     # CPU rows only
    gpu = tmp_path / "raw"
    for tp in (1, 2):
        d = read_json(out / "prefill_host" / f"tiny_tp{tp}" / "prefill_host.json")
        d["provenance"]["gpu_name"] = "NVIDIA H200"
        (gpu / f"tiny_tp{tp}").mkdir(parents=True)
        (gpu / f"tiny_tp{tp}" / "prefill_host.json").write_text(json.dumps(d))
    line = prefill_host_line(type("R", (), {"root": gpu, "ignored": []})(), claim, {})
    t = prefill.load(gpu)
    two = t[t["tp"] == 2]
    assert line.startswith("Prefill steps measured alone") and "at TP=2 a step takes" in line
    assert f"{two['step_ms'].min():.1f}-{two['step_ms'].max():.1f} ms" in line
    assert prefill_host_line(type("R", (), {"root": gpu, "ignored": []})(), pd.Series({"model": "other", "tp": "2"}), {}) == ""


def test_host_profile_per_rank_and_its_table(out, tmp_path):
    """--profile-tokens (default 16): every rank's host ops of one forward reach rank 0's file; the
    ops table has a (total) row per rank and the kept ops; a malformed profile names its field."""
    from analysis.exhibits.headline import prefill_host_ops

    for tp in (1, 2):
        d = read_json(out / "prefill_host" / f"tiny_tp{tp}" / "prefill_host.json")
        prof = d["host_profile"]
        assert sorted(p["rank"] for p in prof) == list(range(tp))
        for p in prof:
            assert p["tokens"] == 16 and p["wall_ms"] > 0 and p["self_cpu_ms_total"] > 0 and p["top"]
            assert sum(o["self_cpu_ms"] for o in p["top"]) <= p["self_cpu_ms_total"] + 1e-6
    t = prefill_host_ops.load(out)
    totals = t[t["op"] == "(total)"]
    assert sorted(zip(totals["tp"], totals["rank"])) == [(1, 0), (2, 0), (2, 1)]
    assert (t[t["op"] != "(total)"]["share"] <= 1).all()
    bad = tmp_path / "raw" / "prefill_host" / "x"
    bad.mkdir(parents=True)
    d = read_json(out / "prefill_host" / "tiny_tp1" / "prefill_host.json")
    del d["host_profile"][0]["top"][0]["self_cpu_ms"]
    (bad / "prefill_host.json").write_text(json.dumps(d))
    with pytest.raises(SchemaError, match=r"host_profile\[0\]\.top\[0\]\.self_cpu_ms"):
        prefill_host_ops.load(tmp_path / "raw")
