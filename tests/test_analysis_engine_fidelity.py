"""analysis.engine_fidelity and the claims over real SGLang, on cells the runners write: our engine's
sglang_default and granikv (tiny model, CPU) beside a sglang_server cell of the same request set
served by the fake SGLang server; a kernel cell whose config has keys named like engine stats."""
from __future__ import annotations
from pathlib import Path
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from analysis.exhibits.sglang import engine_fidelity
from analysis.verdict.evaluate import evaluate
from analysis.load import load_results
from granikv import rawio
from granikv.serving import server as srvmod
from runners.run import run_cell

ROOT = Path(__file__).resolve().parents[1]
CELL = ["model=tiny", "hardware=cpu", "workload=synthetic", "workload.prefix_len=32", "workload.batch=4",
        "workload.suffix_len=4", "workload.output_len=6"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fid")
    mp = pytest.MonkeyPatch()
    mp.setenv(srvmod.STATE_ENV, str(root / "state"))
    mp.delenv(srvmod.KEEP_ENV, raising=False)
    mp.chdir(ROOT)
    pool = srvmod.ServerPool()
    import granikv.serving.session as session
    mp.setattr(session, "POOL", pool)
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            for sysov in (["system=sglang_default"], ["system=granikv"],
                          ["system=sglang_server", "system.server.launcher=tests.fake_sglang_server"]):
                ov = [*CELL, *sysov]
                run_cell(compose("config", overrides=[*ov, "sweep_name=h", f"results_dir={root / 'raw'}"]), ov)
    finally:
        pool.close(keep=False)
        mp.undo()
    k = root / "raw" / "kernel" / "k1"    # a kernel cell: its config has top-level `device` / `dtype`
    rawio.write_json(k / "config.json", {"cell_kind": "kernel", "device": "cuda:0", "dtype": "bfloat16",
                                         "provenance": rawio.provenance(cuda_probe=False)})
    rawio.write_json(k / "metrics.json", {"rows": 1})
    rawio.write_jsonl(k / "kernel.jsonl", [{"backend": "paged", "ms": 1.0}])
    return root / "raw"


def test_fidelity_row_pairs_the_server_cell_with_the_engine_cells(raw):
    res = load_results(raw)
    assert "device" in res.config_columns                      # the kernel cell's config key
    assert res.cells.loc[res.cells["kind"] == "serving", "device"].isna().all()   # engine stat moved aside
    t = engine_fidelity.fidelity_table(res, model="tiny")
    assert len(t) == 1
    r = t.iloc[0]
    thr = {c.parent.name.split("system=")[1].split(",")[0]: rawio.read_json(c)["output_throughput_tok_s"]
           for c in raw.glob("h/*/metrics.json")}
    assert (r["n_real"], r["n_ours"], r["n_granikv"]) == (1, 1, 1)
    assert r["ours/real"] == pytest.approx(thr["sglang_default"] / thr["sglang_server"])
    assert r["granikv/real"] == pytest.approx(thr["granikv"] / thr["sglang_server"])
    assert r["within_10pct"] == ("yes" if abs(r["ours/real"] - 1) <= 0.10 else "no")
    out = raw.parent / "out"
    engine_fidelity.build(res, out, figures=True)
    assert (out / "tables" / "engine_fidelity.md").exists()
    assert (out / "figures" / "engine_fidelity.png").exists() or (out / "figures" / "engine_fidelity.pdf").exists()


def test_a_claim_over_real_sglang_finds_its_baseline_twin(raw):
    res = load_results(raw)
    claims = pd.DataFrame([{
        "id": "c", "section": "s", "claim": "granikv over real SGLang", "model": "tiny", "tp": 1, "frame": "cells",
        "selectors": "model.name=tiny;workload.prefix_len=32;system.name=granikv", "metric": "output_throughput_tok_s",
        "statistic": "ratio", "baseline": "system.name=sglang_server", "check": "bound_ge", "paper_value": 0.0,
        "paper_value_hi": None, "unit": "x", "better": "higher", "comparison": "ratio", "source": "t"}])
    e = evaluate(res, claims).iloc[0]
    thr = {c.parent.name.split("system=")[1].split(",")[0]: rawio.read_json(c)["output_throughput_tok_s"]
           for c in raw.glob("h/*/metrics.json")}
    assert e["ours"] == pytest.approx(thr["granikv"] / thr["sglang_server"])
