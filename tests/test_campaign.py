"""The campaign plan (conf/campaign.yaml, runners.campaign) and its coverage table (analysis.coverage):
the plan names the folders runners.run really writes, and each planned cell is found measured, measured
with other settings, failed or missing from the raw results."""
from __future__ import annotations
import os
import shutil
import subprocess
import sys
from pathlib import Path
import pytest

from analysis.exhibits.campaign import coverage
from analysis.load import load_results
from granikv.rawio import read_json, read_jsonl, write_json, write_jsonl
from runners.campaign import CampaignItem, expand, load_campaign

ROOT = Path(__file__).resolve().parents[1]
SMOKE = CampaignItem(id="smoke", what="CPU smoke", issue=1, sweep="smoke")


@pytest.fixture(scope="module")
def smoke_raw(tmp_path_factory) -> Path:
    """The smoke preset (tiny model, 2 systems x 2 Lp) run by the real CPU runner."""
    root = tmp_path_factory.mktemp("campaign") / "raw"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", "runners.run", "-m", "sweep=smoke", f"results_dir={root}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _status(root: Path) -> dict[str, str]:
    _, cells = coverage.tables(load_results(root), [SMOKE])
    return dict(zip(cells["cell_id"], cells["status"]))


def test_committed_campaign_expands_like_its_presets():
    items = {it.id: it for it in load_campaign()}
    assert len(items) >= 17
    n = {i: len(expand(it)) for i, it in items.items()}
    # conf/README.md: grid 6 Lp x 4 B x 4 systems x 3 reps, headline 6 x 4, dispatch trace 3 x 6 x 3, matrix 6 x 5 x 2
    assert n["grid_llama8b_tp1"] == 288 and n["headline_qwen32b_tp4"] == 24
    assert n["dispatch_trace_llama8b_tp1"] == 54 and n["sharegpt_matrix_llama8b_tp1"] == 60
    assert n["multiprefix_hetero_a100_40gb"] == 8 and n["limitation_qwen14b_tp2"] == 4
    tp4 = expand(items["headline_qwen32b_tp4"])
    assert {c.sweep_name for c in tp4} == {"headline_qwen25_32b_tp4"}
    assert "system=hydragen,workload.prefix_len=4096" in {c.cell_id for c in tp4}
    tp2 = expand(items["headline_qwen32b_tp2"])[0]
    assert tp2.sweep_name == "headline_qwen25_32b_tp2" and tp2.settings["hardware.cuda_graph_max_bs"] == 256
    a100 = expand(items["multiprefix_uniform_a100_40gb"])[0]
    assert a100.identity["hardware.name"] == "a100_40gb" and a100.sweep_name == "multiprefix_uniform_a100_40gb"


def test_fast_expansion_equals_the_runners_composition():
    """expand() skips the dataclass round trip and composes each set of group choices once; with
    check=True it composes every cell as runners.run does. Both must give the same plan: every cell
    of an item of up to 24 cells, every k-th of a larger one (its axes repeat the smaller items')."""
    for it in load_campaign():
        fast = expand(it)
        k = max(1, len(fast) // 24)
        assert fast[::k] == expand(it, check=True, every=k), it.id


def test_plan_names_the_folders_the_runner_writes(smoke_raw):
    plan = expand(SMOKE)
    assert {(c.sweep_name, c.cell_id) for c in plan} == \
        {(p.parent.name, p.name) for p in smoke_raw.glob("*/*") if (p / "metrics.json").exists()}
    assert set(_status(smoke_raw).values()) == {coverage.MEASURED}


def test_missing_failed_and_other_settings_are_told_apart(smoke_raw, tmp_path):
    root = _copy(smoke_raw, tmp_path / "raw")
    cells = sorted(p for p in (root / "smoke").iterdir() if p.is_dir())
    gone, failed, changed, renamed = cells
    shutil.rmtree(gone)
    (failed / "metrics.json").unlink()
    write_json(failed / "failure.json", {"error": "RuntimeError: out of memory", "config": read_json(failed / "config.json")})
    cfg = read_json(changed / "config.json")
    cfg["hardware"]["cuda_graph_max_bs"] = 7
    write_json(changed / "config.json", cfg)
    renamed.rename(renamed.parent / f"{renamed.name},hardware=cpu")    # launched with the default spelt out
    st = _status(root)
    assert st == {gone.name: coverage.MISSING, failed.name: coverage.FAILED, changed.name: coverage.OTHER,
                  renamed.name: coverage.MEASURED}
    t, per_cell = coverage.tables(load_results(root), [SMOKE])
    row = t.iloc[0]
    assert (row["planned"], row["measured"], row["other_settings"], row["failed"], row["missing"]) == (4, 1, 1, 1, 1)
    now = expand(SMOKE)[0].settings["hardware.cuda_graph_max_bs"]
    assert row["settings_then_now"] == f"hardware.cuda_graph_max_bs: 7 -> {now:g}"
    # the command's sweep covers the missing and failed cells, and no cell outside the item's plan
    extra = row["command"].split(" -- ", 1)[1].split() if " -- " in row["command"] else []
    covered = {c.cell_id for c in expand(CampaignItem(id="todo", what="w", issue=1, sweep="smoke", overrides=extra))}
    assert {gone.name, failed.name} <= covered <= set(st)
    assert row["command"].startswith("bash runners/gpu/sweep.sh smoke")
    line = coverage.lines(t)[0]
    assert "2 of 4 cells measured" in line and "1 failed" in line and "1 missing" in line


def test_extra_cells_in_the_folder_are_counted_not_matched(smoke_raw, tmp_path):
    root = _copy(smoke_raw, tmp_path / "raw")
    one = next(p for p in (root / "smoke").iterdir() if p.is_dir())
    extra = one.parent / f"{one.name},rep=1"
    shutil.copytree(one, extra)
    cfg = read_json(extra / "config.json")
    cfg["rep"] = 1
    write_json(extra / "config.json", cfg)
    # a run of its own (a byte-identical copy is refused as one run stored twice): every time 1 s later
    shift = lambda v: [x + 1.0 for x in v] if isinstance(v, list) else v + 1.0  # noqa: E731
    times = ("arrival_s", "first_token_s", "finish_s", "token_times_s")
    write_jsonl(extra / "requests.jsonl", [{k: shift(v) if k in times else v for k, v in r.items()}
                                           for r in read_jsonl(extra / "requests.jsonl")])
    t, _ = coverage.tables(load_results(root), [SMOKE])
    assert t.iloc[0]["measured"] == 4 and t.iloc[0]["unplanned_cells"] == 1


def test_every_item_is_missing_on_empty_results(tmp_path):
    t, cells = coverage.tables(load_results(tmp_path / "none"))
    assert (t["missing"] == t["planned"]).all() and (cells["status"] == coverage.MISSING).all()
    assert all(c.startswith(("bash runners/gpu/sweep.sh", "GRANIKV_TP=", "GRANIKV_ENGINE=sglang bash")) for c in t["command"])


@pytest.mark.parametrize("raw, message", [
    ({"id": "x", "what": "w", "issue": 7, "sweep": "nope"}, "sweep `nope` is not a preset"),
    ({"id": "x", "what": "w", "issue": 7, "sweep": "headline", "gpus": 3}, "gpus=3"),
    ({"id": "x", "what": "w", "issue": 7, "sweep": "headline", "overrides": ["sweep=smoke"]}, "must not set sweep"),
    ({"id": "x", "what": "w", "issue": 7, "sweep": "headline", "overrides": "tp=2"}, "must be a list"),
    ({"id": "X y", "what": "w", "issue": 7, "sweep": "headline"}, "lower-case"),
    ({"id": "x", "what": "w", "sweep": "headline"}, "missing keys ['issue']"),
    ({"id": "x", "what": "w", "issue": 7, "sweep": "headline", "tp": 2}, "unknown keys ['tp']"),
])
def test_bad_campaign_items_name_the_field(tmp_path, raw, message):
    import yaml
    f = tmp_path / "campaign.yaml"
    f.write_text(yaml.safe_dump({"items": [raw]}))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_campaign(f)


def test_duplicate_ids_and_gpus_unlike_tp_are_refused(tmp_path):
    import yaml
    f = tmp_path / "campaign.yaml"
    item = {"id": "x", "what": "w", "issue": 7, "sweep": "headline"}
    f.write_text(yaml.safe_dump({"items": [item, item]}))
    with pytest.raises(ValueError, match="unique"):
        load_campaign(f)
    wrong = CampaignItem(id="wrong_tp", what="w", issue=7, sweep="headline_qwen25_14b", gpus=1)
    with pytest.raises(ValueError, match="gpus=1 but its cells run at tp=2"):
        expand(wrong)


def test_cli_names_unknown_items(capsys):
    with pytest.raises(SystemExit):
        coverage.main(["--results", "/nonexistent", "no_such_item"])
    assert "unknown item" in capsys.readouterr().err


def test_a_cells_command_runs_that_cell_alone(smoke_raw, tmp_path):
    """coverage_cells' command for a missing cell, run as given (plus results_dir), writes exactly that
    cell's folder, which then counts as measured; a measured cell's command says force=true."""
    import shlex
    root = _copy(smoke_raw, tmp_path / "raw")
    gone = sorted(p for p in (root / "smoke").iterdir() if p.is_dir())[0]
    shutil.rmtree(gone)
    _, cells = coverage.tables(load_results(root), [SMOKE])
    row = cells.set_index("cell_id").loc[gone.name]
    assert row["status"] == coverage.MISSING and "force=true" not in row["command"]
    assert all("force=true" in c for c in cells.loc[cells["status"] == coverage.MEASURED, "command"])
    argv = shlex.split(row["command"])
    assert argv[:4] == ["python", "-m", "runners.run", "-m"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, *argv[1:], f"results_dir={root}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (gone / "metrics.json").exists()
    assert set(_status(root).values()) == {coverage.MEASURED}
    assert len([q for q in (root / "smoke").iterdir() if q.is_dir()]) == 4


def test_set_aside_cells_still_count_as_measured(smoke_raw):
    """A repetition analysis.clean sets aside (graph capture in its run) was measured all the same."""
    from dataclasses import replace

    res = load_results(smoke_raw)
    moved = res.cells.iloc[:1].assign(capture_share=0.05, set_aside_for="elsewhere")
    aside = replace(res, cells=res.cells.iloc[1:].reset_index(drop=True), set_aside=moved)
    t, cells = coverage.tables(aside, [SMOKE])
    assert set(cells["status"]) == {coverage.MEASURED} and t.iloc[0]["measured"] == len(res.cells)


def test_missing_values_are_told_in_the_sweeps_own_order():
    """A resumed sweep misses the tail of its first row and every later row: the command keeps each
    axis in launch order, and an axis the missing cells still cover entirely is not restricted."""
    rows = [{"status": coverage.MEASURED if (lp, b) in {("512", "64"), ("512", "128")} else coverage.MISSING,
             "_overrides": [f"workload.prefix_len={lp}", f"workload.batch={b}"]}
            for lp in ("512", "1024") for b in ("64", "128", "256")]
    what, command = coverage.missing_command(SMOKE, rows)
    assert what == "every swept value (6 cells, 2 of them measured and skipped)"
    assert command == SMOKE.device_command(SMOKE.overrides)
    rows[3]["status"] = coverage.MEASURED                      # Lp=1024 B=64 too: B=64 is no longer missing
    rows[0]["status"] = rows[1]["status"] = coverage.MEASURED
    what, _ = coverage.missing_command(SMOKE, rows)
    assert what.startswith("workload.batch=128,256 ")


def test_the_gpu_command_of_an_sglang_served_item_sets_up_sglang():
    real = CampaignItem(id="r", what="x", issue=1, sweep="headline", overrides=["system=sglang_server_granikv"])
    assert real.device_command().startswith("GRANIKV_ENGINE=sglang bash runners/gpu/sweep.sh headline -- ")
    assert real.device_command(["workload.prefix_len=1024"]).startswith("GRANIKV_ENGINE=sglang ")
    assert not SMOKE.device_command().startswith("GRANIKV_ENGINE")
    # the systems may come from the preset's own sweeper params (conf/sweep/in_sglang.yaml), not the overrides
    preset = CampaignItem(id="p", what="x", issue=1, sweep="in_sglang", overrides=["hardware=h100"])
    assert preset.device_command(["rep=1,2"]) == "GRANIKV_ENGINE=sglang bash runners/gpu/sweep.sh in_sglang -- rep=1,2"
    engine = CampaignItem(id="e", what="x", issue=1, sweep="headline", overrides=["system=granikv"])
    assert not engine.device_command().startswith("GRANIKV_ENGINE")
