"""runners.run cannot hurt the results it is asked to add to: an unknown preset, an ad-hoc run into
results/raw, a sweep of failed cells, a forced rerun killed midway, a killed write's temp file, a GPU
preset or a server without SGLang on this host; and the analysis names unreadable or unknown files."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from analysis.exhibits.campaign.reruns import table as reruns_table
from analysis.load import load_results
from analysis.reproduce import main as reproduce_main
from granikv import rawio
from granikv.config import to_run_config
from runners.run import SUPERSEDED, ConfigError, check_gpu, check_server, run_cell

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "hardware=cpu", "workload=synthetic", "workload.batch=2", "workload.suffix_len=4",
         "workload.output_len=4", "workload.prefix_len=16", "nvml=false"]
NO_GPU = not torch.cuda.is_available()


def compose_cfg(overrides, conf=ROOT / "conf"):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=overrides)


def cli(*args, cwd=ROOT, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "runners.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


# ---------------------------------------------------------------- where a run may write
def test_an_unknown_sweep_is_an_error_listing_the_presets(tmp_path):
    p = cli("-m", "sweep=headlin", *SMALL, f"results_dir={tmp_path}")
    assert p.returncode != 0
    assert "sweep/headlin" in p.stderr and "headline" in p.stderr and "smoke" in p.stderr
    assert not files(tmp_path)


def test_a_run_without_a_preset_names_its_folder(tmp_path):
    # from an empty folder: the default results_dir (results/raw) is relative to it
    p = cli(*SMALL, cwd=tmp_path)
    assert p.returncode == 2 and "`sweep_name`" in p.stderr and "results_dir=" in p.stderr
    p = cli("-m", *SMALL[:-2], "workload.prefix_len=16,48", cwd=tmp_path)
    assert p.returncode == 2 and "`sweep_name`" in p.stderr
    assert not (tmp_path / "results").exists()


# ---------------------------------------------------------------- a sweep's end, its host
def test_a_sweep_with_a_failed_cell_says_so_and_exits_1(tmp_path):
    fake = ["system=sglang_server", "system.server.launcher=tests.fake_sglang_server",
            "system.server.start_timeout_s=20", "system.server.request_timeout_s=20"]
    env = {"GRANIKV_SGLANG_STATE": str(tmp_path / "state"), "FAKE_SGLANG_MODE": "exit_early",
           "FAKE_SGLANG_EVENTS": str(tmp_path / "ev.jsonl"), "FAKE_SGLANG_ARGV": str(tmp_path / "argv.jsonl")}
    p = cli("-m", *SMALL, *fake, "workload.prefix_len=16,32", "sweep_name=f", f"results_dir={tmp_path / 'raw'}",
            env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "2 cells: 0 measured, 0 skipped, 2 failed" in p.stdout
    assert len(list((tmp_path / "raw" / "f").glob("*/failure.json"))) == 2


@pytest.mark.skipif(not NO_GPU, reason="a host with a GPU")
def test_a_gpu_preset_on_a_cpu_host_is_a_clean_error_single_or_sweep(tmp_path):
    args = [o for o in SMALL if o != "hardware=cpu"]
    p = cli(*args, "hardware=h200", f"results_dir={tmp_path}")
    assert p.returncode == 2 and "`hardware.device`" in p.stderr and "Traceback" not in p.stderr
    p = cli("-m", *args, "hardware=h200", "system=granikv,sglang_default", f"results_dir={tmp_path}")
    assert p.returncode == 2 and "2 of 2 cells are invalid" in p.stderr and "`hardware.device`" in p.stderr
    assert not files(tmp_path)


def test_check_gpu_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(rawio, "gpu_count_nvml", lambda: 0)
    with pytest.raises(ConfigError, match=r"`hardware.device`.*hardware=cpu"):
        check_gpu(to_run_config(compose_cfg(["hardware=h200"])))
    check_gpu(to_run_config(compose_cfg(["hardware=cpu"])))


def test_a_server_system_needs_an_importable_launcher(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    check_server(to_run_config(compose_cfg([*SMALL, "system=sglang_server",
                                            "system.server.launcher=tests.fake_sglang_server"])))
    with pytest.raises(ConfigError, match=r"`system.server.launcher`.*no_such_server_module"):
        check_server(to_run_config(compose_cfg([*SMALL, "system=sglang_server",
                                                "system.server.launcher=no_such_server_module"])))
    if importlib.util.find_spec("sglang") is None:   # the real launcher, on a host without SGLang
        p = cli("-m", *SMALL, "system=sglang_server,sglang_server_granikv", f"results_dir={tmp_path}")
        assert p.returncode == 2 and "2 of 2 cells are invalid" in p.stderr and "`system.server.launcher`" in p.stderr
        assert not files(tmp_path)


# ---------------------------------------------------------------- reruns and resumes
class Killed(RuntimeError):
    pass


def killed(rc):
    raise Killed("killed midway")


def test_a_forced_rerun_keeps_the_old_cell_until_the_new_is_complete(tmp_path):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", "sweep_name=s"])
    cell = run_cell(cfg, [])
    before = {p.name: p.read_bytes() for p in cell.iterdir()}
    forced = compose_cfg([*SMALL, f"results_dir={tmp_path}", "sweep_name=s", "force=true"])
    assert run_cell(forced, ["force=true"], multirun=True, engine_factory=killed) == cell
    assert {p.name: p.read_bytes() for p in cell.iterdir()} == before, "the old cell was touched"
    assert len(load_results(tmp_path).cells) == 1
    run_cell(forced, ["force=true"])
    kept = list((cell.parent / SUPERSEDED).iterdir())
    assert len(kept) == 1 and kept[0].name.startswith(cell.name + ".")
    assert {p.name: p.read_bytes() for p in kept[0].iterdir()} == before
    assert rawio.cell_state(cell) == "done" and (cell / "metrics.json").read_bytes() != before["metrics.json"]
    res = load_results(tmp_path)
    assert len(res.cells) == 1 and len(res.superseded) == 1        # the kept cell is not read as a cell
    t = reruns_table(res)
    assert len(t) == 1 and t["rerun_sweep"].iloc[0] == "s" and t["superseded_sweep"].iloc[0].startswith("s/.superseded/")
    assert t["n_before"].iloc[0] == t["n_after"].iloc[0] == 1 and t["after_over_before"].iloc[0] > 0


def test_a_killed_writes_temp_file_is_removed_on_resume(tmp_path):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", "sweep_name=s"])
    cell = tmp_path / "s" / "default"
    cell.mkdir(parents=True)
    (cell / "workload.jsonl").write_text("")
    (cell / ".metrics.json.k3x9q.tmp").write_text('{"num_requests": ')
    run_cell(cfg, [])
    assert rawio.cell_state(cell) == "done" and not list(cell.glob(".*.tmp"))
    (cell / ".steps.jsonl.gz.a1.tmp").write_bytes(b"\x1f")
    run_cell(cfg, [])                                               # skipped, and swept
    assert not list(cell.glob(".*.tmp"))


# ---------------------------------------------------------------- what a user is offered
def test_schemas_are_not_offered_as_options_but_still_validate(tmp_path):
    for group in ("model", "hardware"):
        p = cli(f"{group}=nope", f"results_dir={tmp_path}")
        assert p.returncode != 0 and f"Available options in '{group}'" in p.stderr
        assert f"{group}_schema" not in p.stderr
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    with open(conf / "model" / "tiny.yaml", "a") as f:
        f.write("no_such_key: 1\n")
    with pytest.raises(Exception, match="no_such_key"):
        compose_cfg(["model=tiny"], conf=conf)


# ---------------------------------------------------------------- the analysis on damaged cells
def test_a_truncated_metrics_json_is_a_named_error_not_a_traceback(tmp_path, capsys):
    raw = tmp_path / "raw"
    cell = run_cell(compose_cfg([*SMALL, f"results_dir={raw}", "sweep_name=s"]), [])
    (cell / "metrics.json").write_bytes((cell / "metrics.json").read_bytes()[:40])
    assert reproduce_main(["--results", str(raw), "--out", str(tmp_path / "out"), "--only", "tables", "--every-folder"]) == 2
    err = capsys.readouterr().err
    assert str(cell / "metrics.json") in err and "Fix:" in err and "force=true" in err


def test_an_unknown_file_in_a_cell_is_listed_once(tmp_path):
    for sweep in ("a", "b"):
        run_cell(compose_cfg([*SMALL, f"results_dir={tmp_path}", f"sweep_name={sweep}"]), [])
    (tmp_path / "a" / "default" / "notes.txt").write_text("mine")
    (tmp_path / "b" / "default" / ".metrics.json.x1.tmp").write_text("{")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_results(tmp_path)
    msgs = [str(x.message) for x in w if "no runner writes" in str(x.message)]
    assert len(msgs) == 1 and "a/default/notes.txt" in msgs[0] and "b/default/.metrics.json.x1.tmp" in msgs[0]
