"""The analysis on raw folders written by the real CPU runners (runners.run, runners.kernel_bench):
loading, schema errors naming file and field, failures listed, every module, determinism."""
from __future__ import annotations
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
import pandas as pd
import pytest

from analysis.load import find_cells, load_results, load_steps
from analysis.reproduce import EXHIBITS, run
from granikv.rawio import SchemaError, data_path, read_json, write_json
from granikv.rawio import exists as rawio_exists

ROOT = Path(__file__).resolve().parents[1]
SERVING = ["model=tiny", "hardware=cpu", "workload=synthetic", "workload.batch=4", "workload.output_len=8",
           "workload.suffix_len=8"]


def _run(module: str, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    if p.returncode != 0:
        pytest.fail(f"`python -m {module} {' '.join(args)}` failed ({p.returncode}):\n{p.stderr[-3000:]}")


def _failed_cell(root: Path) -> None:
    """A cell whose KV budget cannot hold its requests, run as one sweep job (as a SLURM array job
    runs it): runners.run records failure.json for it (the CLI would refuse the sweep up front)."""
    from hydra import compose, initialize_config_dir

    from runners.run import run_cell
    ov = [*SERVING, "system=granikv", "workload.prefix_len=64", "hardware.kv_budget_tokens=16"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*ov, "sweep_name=budget", f"results_dir={root}"])
    run_cell(cfg, ov, multirun=True)


@pytest.fixture(scope="session")
def raw(tmp_path_factory) -> Path:
    """Raw folders from the CPU runners: 2 systems x 2 Lp (synthetic, B=4), GraniKV at B=2 (plain
    and with a torch.profiler window), one cell that fails its KV
    budget check (failure.json), and two kernel-bench cells (layout, dispatch cost)."""
    for mod in ("runners.run", "runners.kernel_bench"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} does not exist yet (helpers RUNNERS / ATTN are building it): "
                        "these tests need raw folders the CPU runner writes")
    root = tmp_path_factory.mktemp("raw")
    _run("runners.run", ["-m", *SERVING, "system=granikv,sglang_default", "workload.prefix_len=64,128",
                         "sweep_name=grid", f"results_dir={root}"])
    _run("runners.run", ["-m", *SERVING, "system=granikv", "workload.prefix_len=64", "workload.batch=2",
                         "profile_steps=0,2", "sweep_name=grid", f"results_dir={root}"])
    _failed_cell(root)
    _run("runners.kernel_bench", ["sweep_name=kernel", f"results_dir={root}",
                                  "cells=[layout-tiny_g4-lp64-b8,dispatch_cost]"])
    return root


@pytest.fixture(scope="session")
def res(raw):
    return load_results(raw)


def test_load_one_row_per_cell(res, raw):
    serving = res.cells[res.cells["kind"] == "serving"]
    assert len(serving) == 6
    assert (serving["profile_steps"] > 0).sum() == 1
    assert set(serving["system.name"]) == {"granikv", "sglang_default"}
    assert set(serving["workload.prefix_len"]) == {64, 128}
    for col in ("workload.batch", "model.name", "tp", "provenance.git_commit", "provenance.gpu_name",
                "output_throughput_tok_s", "tpot_p50_ms", "ttft_p50_ms"):
        assert col in res.cells.columns, col
    assert any(c.startswith("dispatch_counts.") for c in res.cells.columns)
    assert (serving["output_throughput_tok_s"] > 0).all()
    assert not any(c.startswith("provenance.") for c in res.config_columns)
    assert "workload.prefix_len" in res.config_columns
    assert list(res.cells["path"]) == sorted(res.cells["path"])
    assert len(res.cells) + len(res.failures) == len(find_cells(raw))


def test_failed_cell_is_listed_not_dropped(res):
    f = res.failures
    assert len(f) == 1 and f["state"].iloc[0] == "failed"
    assert "kv_budget_tokens" in f["error"].iloc[0]
    assert f["sweep"].iloc[0] == "budget"


def test_kernel_rows_and_steps(res, raw):
    k = res.kernels
    assert {"k.backend", "k.time_ms", "cell.kind"} <= set(k.columns)
    assert {"contiguous_dense", "dispatcher"} <= set(k["k.backend"].dropna())
    cell = raw / res.cells[res.cells["kind"] == "serving"]["path"].iloc[0]
    steps = load_steps(cell)
    assert len(steps) > 0 and {"kind", "step_time_s", "decisions"} <= set(steps.columns)
    per_class = load_steps(cell, explode="decisions")
    assert "decisions.backend" in per_class.columns


def test_read_rows_skips_only_the_token_lists(res, raw, tmp_path):
    """read_rows(skip=TOKEN_LISTS) gives requests.jsonl's rows as rawio reads them, the per-token lists as
    None; a value that is not a flat list of numbers is decoded, and a broken line still names its file."""
    from analysis.load import TOKEN_LISTS, read_rows
    from granikv.rawio import read_jsonl
    from granikv.rawio import write_jsonl as rawio_write_jsonl
    cell = raw / res.cells[res.cells["kind"] == "serving"]["path"].iloc[0]
    full = read_jsonl(cell / "requests.jsonl")
    assert full and all(isinstance(r["output_ids"], list) and isinstance(r["token_times_s"], list) for r in full)
    assert read_rows(cell / "requests.jsonl", skip=TOKEN_LISTS) == [{**r, **dict.fromkeys(TOKEN_LISTS)} for r in full]
    assert read_rows(cell / "requests.jsonl") == full
    rows = [{"output_ids": [[1, 2], 3], "token_times_s": [0.5, 1e-3], "extra": {"note": "output_ids: [x]"}},
            {"output_ids": ["a]"], "token_times_s": [], "warmup": True}]
    rawio_write_jsonl(tmp_path / "r.jsonl", rows)
    assert read_rows(tmp_path / "r.jsonl", skip=TOKEN_LISTS) == [{**rows[0], "token_times_s": None},
                                                                  {**rows[1], "token_times_s": None}]
    (tmp_path / "bad.jsonl").write_text('{"output_ids": [1, 2], "arrival_s": }\n')
    with pytest.raises(SchemaError, match=r"bad.jsonl:1"):
        read_rows(tmp_path / "bad.jsonl", skip=TOKEN_LISTS)


def test_kernel_table_times_every_measured_row_and_skips_the_fits_copies(raw, tmp_path):
    """The dispatcher's per-step cost (us_per_step) is a measurement like any kernel time: the
    kernel table shows it, never "not measured"; a calibration fit's rows (times copied from the
    calibration cells) are not listed a second time."""
    from analysis.exhibits.kernel import kernel

    root = tmp_path / "raw"
    shutil.copytree(raw, root)
    fit = root / "calibration" / "fit-tiny"
    src = next(c for c in find_cells(root) if (c / "config.json").exists()
               and read_json(c / "config.json").get("cell", {}).get("kind") == "dispatch")
    cfg = read_json(src / "config.json")
    write_json(fit / "config.json", {**cfg, "cell": {"cell_id": "fit-tiny", "kind": "calibration_fit"}})
    (fit / "kernel.jsonl").write_text('{"meff": 4, "prefix_len": 64, "times": {"dense": 0.1, "paged": 0.2}}\n')
    write_json(fit / "metrics.json", {"cell_id": "fit-tiny", "decision_table": [], "num_points": 1})
    kernel.build(load_results(root), tmp_path / "out", figures=False)
    t = pd.read_csv(tmp_path / "out" / "tables" / "kernel.csv", dtype=str, keep_default_na=False)
    d = t[t["cell.kind"] == "dispatch"]
    assert len(d) > 0 and (d["time_us_mean"].astype(float) > 0).all(), d
    assert "not measured" not in set(t["bound"])
    assert "calibration_fit" not in set(t["cell.kind"])
    lay = t[t["cell.kind"] == "layout"]
    assert len(lay) > 0 and set(lay["above_hbm_peak"]) <= {"yes", "no"} and (lay["bound"] != "").all()


def _corrupt(raw: Path, tmp: Path, which: str):
    """A copy of the runner's folders with one cell changed; returns (root, the changed file)."""
    root = tmp / "raw"
    shutil.copytree(raw, root)
    cell = next(c for c in find_cells(root) if rawio_exists(c / "steps.jsonl"))
    if which == "provenance":
        cfg = read_json(cell / "config.json")
        del cfg["provenance"]["gpu_name"]
        write_json(cell / "config.json", cfg)
        return root, cell / "config.json", "provenance.gpu_name"
    if which == "metric":
        m = read_json(cell / "metrics.json")
        del m["tpot_p50_ms"]
        write_json(cell / "metrics.json", m)
        return root, cell / "metrics.json", "tpot_p50_ms"
    if which == "type":
        m = read_json(cell / "metrics.json")
        m["dispatch_counts"] = 3
        write_json(cell / "metrics.json", m)
        return root, cell / "metrics.json", "dispatch_counts"
    if which == "file":
        data_path(cell / "steps.jsonl").unlink()
        return root, cell / "steps.jsonl", "<file>"
    (cell / "metrics.json").write_text('{"output_throughput_tok_s": ')  # truncated JSON
    return root, cell / "metrics.json", "not valid JSON"


@pytest.mark.parametrize("which", ["provenance", "metric", "type", "file", "json"])
def test_schema_error_names_file_and_field(raw, tmp_path, which):
    root, path, field = _corrupt(raw, tmp_path, which)
    with pytest.raises(SchemaError) as e:
        load_results(root)
    assert str(path) in str(e.value) and field in str(e.value)


def test_unfinished_cell_is_listed(raw, tmp_path):
    root = tmp_path / "raw"
    shutil.copytree(raw, root)
    cell = next(c for c in find_cells(root) if rawio_exists(c / "steps.jsonl"))
    (cell / "metrics.json").unlink()
    r = load_results(root)
    assert cell.name in set(r.failures.loc[r.failures["state"] == "partial", "cell_id"])
    assert cell.name not in set(r.cells["cell_id"])


def test_every_module_on_runner_output(raw, tmp_path):
    r = run(raw, tmp_path, folders=None)
    for m in EXHIBITS:
        assert (tmp_path / "tables" / f"{m.name}.csv").exists(), m.name
    grid = pd.read_csv(tmp_path / "tables" / "grid.csv", dtype=str, keep_default_na=False)
    got = grid[grid["status"] == "measured"]
    assert set(zip(got["Lp"], got["B"], got["system"])) == \
        {(lp, "4", s) for lp in ("64", "128") for s in ("granikv", "sglang_default")} | {("64", "2", "granikv")}
    assert (got.loc[got["system"] == "sglang_default", "ratio_vs_sglang_default"] == "1.00").all()
    assert (got["mean"] != "").all()   # the profiled cell is left out of the grid (instrumented)
    prof = pd.read_csv(tmp_path / "tables" / "profiler.csv", dtype=str, keep_default_na=False)
    assert len(prof) == 1 and prof["status"].iloc[0].startswith("not measured")  # CPU: no GPU kernels
    ev = r["claims"].set_index("id")
    # the engine records dispatch_us per step (tables/dispatch_overhead), but a tiny CPU cell never feeds the
    # Llama-3.1-8B claim (claims.csv names its model, TP, presets and workloads)
    over = pd.read_csv(tmp_path / "tables" / "dispatch_overhead.csv", dtype=str, keep_default_na=False)
    assert (over.loc[over["system"] == "granikv", "dispatch_from"] == "steps.jsonl").any()
    assert ev.loc["dispatch_overhead_cpu", "verdict"] == "not measured"
    assert ev.loc["headline_llama8b", "verdict"] == "not measured"
    report = (tmp_path / "REPORT.md").read_text()
    assert "budget" in report and "failed" in report          # the failed cell is in the report
    assert "no GPU (CPU)" in report                           # our hardware, from provenance
    for f in r["figures"]:
        assert (tmp_path / "figures" / f"{f}.png").stat().st_size > 0


def test_tables_are_deterministic(raw, tmp_path):
    run(raw, tmp_path / "a", only="tables", folders=None)
    run(raw, tmp_path / "b", only="tables", folders=None)
    for p in sorted((tmp_path / "a" / "tables").iterdir()):
        assert p.read_bytes() == (tmp_path / "b" / "tables" / p.name).read_bytes(), p.name
    assert (tmp_path / "a" / "REPORT.md").read_text() == (tmp_path / "b" / "REPORT.md").read_text()


def _claim(**kw) -> pd.DataFrame:
    row = {"id": "t", "section": "test", "claim": "test", "model": "tiny", "tp": "1", "frame": "cells",
           "selectors": "", "metric": "output_throughput_tok_s", "statistic": "ratio", "baseline": "", "check": "point",
           "paper_value": "1.0", "paper_value_hi": "", "unit": "x", "better": "", "comparison": "", "source": "tables/grid"}
    return pd.DataFrame([{**row, **kw}])


def _thr(raw: Path, match: dict) -> float:
    """Output tok/s of the one plain (not profiled) cell whose config matches, from its metrics.json."""
    from granikv.rawio import read_json
    hits = []
    for c in find_cells(raw):
        if not (c / "metrics.json").exists() or not rawio_exists(c / "steps.jsonl"):
            continue
        cfg = read_json(c / "config.json")
        if cfg["profile_steps"] == 0 and all(cfg[k.split(".")[0]][k.split(".")[1]] == v for k, v in match.items()):
            hits.append(read_json(c / "metrics.json")["output_throughput_tok_s"])
    assert len(hits) == 1, match
    return hits[0]


def test_claim_statistics_on_runner_output(res, raw):
    from analysis.verdict.evaluate import evaluate
    sel = "workload.kind=synthetic;model.name=tiny;tp=1;workload.prefix_len=128;workload.batch=4;system.name=granikv"
    ev = evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default"))
    want = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 128}) / \
        _thr(raw, {"system.name": "sglang_default", "workload.prefix_len": 128})
    assert ev["ours"].iloc[0] == pytest.approx(want)
    assert ev["our_hardware"].iloc[0] == "no GPU (CPU)"
    peak = evaluate(res, _claim(selectors="workload.kind=synthetic;workload.prefix_len=64;system.name=granikv",
                                statistic="peak_share", baseline="workload.batch=4", check="bound_ge",
                                paper_value="0.97", unit="fraction"))
    b4 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 4})
    b2 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 2})
    assert peak["ours"].iloc[0] == pytest.approx(b4 / max(b2, b4))
    missing = evaluate(res, _claim(selectors=sel.replace("tp=1", "tp=4"), baseline="system.name=sglang_default"))
    assert missing["verdict"].iloc[0] == "not measured"
    assert "tp=4" in missing["why"].iloc[0] and "measured at TP=1" in missing["why"].iloc[0]


PEAK = dict(selectors="workload.kind=synthetic;system.name=granikv;profile_steps=0", statistic="peak_share",
            baseline="workload.batch=4", check="bound_ge", paper_value="0.97", unit="fraction", source="tables/sharegpt_matrix")


def test_peak_share_leaves_out_rows_that_miss_a_b_and_follows_warmup_with_b(res, raw):
    from analysis.verdict.evaluate import evaluate
    b4 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 4})
    b2 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 2})
    ev = evaluate(res, _claim(**PEAK))
    assert ev["ours"].iloc[0] == pytest.approx(b4 / max(b2, b4)) and ev["n"].iloc[0] == 1
    # Lp=128 ran at B=4 only: it cannot say whether B=4 is its peak, so it is named and left out
    assert "left out, incomplete: Lp=128 (no workload.batch=2)" in ev["ours_shown"].iloc[0]
    # a preset that warms up with B requests (warmup_requests: ${workload.batch}) sweeps warm-up with B:
    # still one configuration per Lp
    cells = res.cells.copy()
    cells["warmup_requests"] = cells["workload.batch"]
    same = type(res)(root=res.root, cells=cells, failures=res.failures, kernels=res.kernels,
                     config_columns=res.config_columns)
    assert evaluate(same, _claim(**PEAK))["ours"].iloc[0] == pytest.approx(b4 / max(b2, b4))
    # a warm-up that differs at one Lp without following B makes two configurations, neither complete
    cells["warmup_requests"] = (cells["workload.batch"] == 2).astype(int)
    split = type(res)(root=res.root, cells=cells, failures=res.failures, kernels=res.kernels,
                      config_columns=res.config_columns)
    nm = evaluate(split, _claim(**PEAK))
    assert nm["verdict"].iloc[0] == "not measured"
    assert "every other measured workload.batch (2, 4)" in nm["why"].iloc[0]


def test_peak_line_explains_only_a_broken_peak(res, raw):
    from analysis.verdict.evaluate import evaluate
    from analysis.report.bounds import peak_line
    b4 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 4})
    b2 = _thr(raw, {"system.name": "granikv", "workload.prefix_len": 64, "workload.batch": 2})
    share = b4 / max(b2, b4)
    broken = evaluate(res, _claim(**{**PEAK, "paper_value": str(share + 0.01)})).iloc[0]
    assert broken["verdict"] == "not reproduced"
    line = peak_line(res, broken)
    peak = 4 if b4 >= b2 else 2
    assert line.startswith("Per Lp below the bound") and f"Lp=64: B={peak} {max(b2, b4):.0f} tok/s" in line
    assert f"B=4 {b4:.0f} tok/s" in line and "% of the budget" in line
    assert "Lp=128" not in line                      # incomplete rows are not explained either
    held = evaluate(res, _claim(**{**PEAK, "paper_value": str(share - 0.01)})).iloc[0]
    assert held["verdict"] == "reproduced" and peak_line(res, held) == ""


def test_report_reasoning_uses_only_what_was_measured(res):
    from analysis.verdict.evaluate import load_claims
    from analysis.report.kernels import roofline_line
    from analysis.report.provenance import hardware_summary
    assert hardware_summary(res) == [f"no GPU (CPU): {len(res.cells)} cells"]
    claim = load_claims().iloc[0]
    line = roofline_line(res, claim, {})
    # the CPU kernel bench has no paged_unique_prefill variant (GPU only): no invented speed-up
    assert "without the layout comparison" in line and "s=" not in line


def test_report_lists_code_versions_per_sweep(res):
    from analysis.report.provenance import code_versions
    lines = code_versions(res)
    sweeps = sorted(set(res.cells["sweep"]))
    assert len(lines) == len(set(sweeps) | set(res.kernels["sweep"]) if not res.kernels.empty else sweeps)
    commits = set(res.cells["provenance.git_commit"].astype(str).str[:7])
    assert all(any(c in line for c in commits) for line in lines if not line.startswith("| kernel"))
    mixed = res.cells.copy()
    mixed.loc[mixed.index[0], "provenance.git_commit"] = "f" * 40      # one cell from another commit
    sw = mixed.loc[mixed.index[0], "sweep"]
    line = next(x for x in code_versions(type(res)(root=res.root, cells=mixed, failures=res.failures,
                                                      kernels=res.kernels)) if x.startswith(f"| {sw} "))
    assert "mixed code versions" in line and "fffffff" in line and line.count(": 1") >= 1


def test_amdahl_measures_profiled_pairs_by_step_time_not_wall_time(raw, tmp_path):
    """Without a plain pair, Amdahl's measured ratio comes from the profiled cells' summed step time
    (the profiler's start and trace export fall between steps, inside the run's wall time), and it
    never comes from a profiled cell's throughput."""
    from analysis.measures import amdahl

    root = tmp_path / "raw"
    _run("runners.run", ["-m", *SERVING, "system=granikv,sglang_default", "workload.prefix_len=64",
                         "workload.batch=2", "profile_steps=2", "sweep_name=prof", f"results_dir={root}"])
    r = load_results(root)
    sel = {"workload.prefix_len": "=64", "workload.batch": "=2"}
    steps = {}
    for _, c in r.cells.iterrows():
        s = load_steps(root / c["path"])
        steps[c["system.name"]] = s["step_time_s"].sum()
    want = steps["sglang_default"] / steps["granikv"]
    assert amdahl.step_time_ratio(r, sel) == pytest.approx(want)
    got, src = amdahl.measured_ratio(r, "tiny", 1, cell=sel)
    assert src == amdahl.PROFILED and got == pytest.approx(want)
    thr = r.cells.set_index("system.name")["output_throughput_tok_s"]
    assert got != pytest.approx(thr["granikv"] / thr["sglang_default"], rel=1e-9)
    # the plain pair of the session fixture wins over profiled cells
    plain, src = amdahl.measured_ratio(load_results(raw), "tiny", 1,
                                       cell={"workload.prefix_len": "=64", "workload.batch": "=4"})
    assert src == amdahl.PLAIN and plain > 0


def test_headline_step_breakdown_on_runner_output(res, raw, monkeypatch):
    from analysis.measures import steps as headline_steps
    # the runner's grid (synthetic, B=4) stands in for the headline selection
    monkeypatch.setattr(headline_steps, "SELECT", {"sweep_name": "=grid", "workload.batch": "=4",
                                                   "profile_steps": "=0"})
    t = headline_steps.breakdown(res)
    assert len(t) == 4 and set(t["system.name"]) == {"granikv", "sglang_default"}
    for _, r in t.iterrows():
        cell = res.cells[(res.cells["system.name"] == r["system.name"]) & (res.cells["workload.batch"] == 4)
                         & (res.cells["workload.prefix_len"] == r["workload.prefix_len"])]
        s = load_steps(raw / cell["path"].iloc[0])
        dec = s[s["kind"] == "decode"]
        assert r["decode_s"] == pytest.approx(dec["step_time_s"].sum())
        assert r["prefill_s"] == pytest.approx(s.loc[s["kind"] == "prefill", "step_time_s"].sum())
        assert r["prefill_s"] > 0 and r["decode_s"] > 0
        full = dec[dec["batch_size"] >= 0.9 * 4]["step_time_s"]
        assert r["decode_full_p50_ms"] == pytest.approx(full.median() * 1e3)
        base = t[(t["system.name"] == "sglang_default") & (t["workload.prefix_len"] == r["workload.prefix_len"])].iloc[0]
        assert r["decode_s_vs_sglang_default"] == pytest.approx(r["decode_s"] / base["decode_s"])
    assert (t.loc[t["system.name"] == "sglang_default", "prefill_s_vs_sglang_default"] == 1.0).all()
    commits = {str(c)[:7] for c in res.cells["provenance.git_commit"]}
    assert set(t["commit"]) <= commits and (t["prefill_p50_ms"] > 0).all()


def test_config_key_added_later_takes_its_default_for_older_cells(raw, tmp_path):
    # a cell written before system.cascade_impl existed groups with new cells of the same configuration
    root = tmp_path / "raw"
    shutil.copytree(raw, root)
    cell = next(c for c in find_cells(root) if rawio_exists(c / "steps.jsonl"))
    cfg = read_json(cell / "config.json")
    assert cfg["system"]["cascade_impl"] == "multilevel"
    del cfg["system"]["cascade_impl"]
    write_json(cell / "config.json", cfg)
    cells = load_results(root).cells
    assert "system.cascade_impl" in cells.columns and (cells.loc[cells["kind"] == "serving", "system.cascade_impl"]
                                                       == "multilevel").all()


def test_report_explains_a_reproduced_ratio_short_of_the_paper(res, monkeypatch):
    from analysis.measures import steps as headline_steps
    from analysis.verdict.evaluate import evaluate
    from analysis.report.explain import off_paper
    from analysis.report.steps import shares_line
    monkeypatch.setattr(headline_steps, "SELECT", {"sweep_name": "=grid", "workload.batch": "=4",
                                                   "profile_steps": "=0"})
    sel = "workload.kind=synthetic;model.name=tiny;tp=1;workload.prefix_len=128;workload.batch=4;system.name=granikv"
    ours = evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default"))["ours"].iloc[0]

    def claim(**kw):
        # unit "" (not "x"): the tiny CPU run's ratio falls either side of 1 from run to run, and a paper value
        # placed 20% from it may then cross 1, where the direction rule (tested on its own) would decide instead
        return evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default", better="higher",
                                    unit="", source="tables/headline", **kw))

    # paper 20% above ours: reproduced under the 25% rule, but short of the paper -> explained
    ev = claim(paper_value=f"{ours * 1.2:.6f}")
    assert ev["verdict"].iloc[0] == "reproduced"
    assert list(off_paper(ev)["side"]) == ["short of"]
    # paper at our value: nothing to explain; paper 20% below ours: reproduced, and beyond the paper
    assert off_paper(claim(paper_value=f"{ours:.6f}")).empty
    assert list(off_paper(claim(paper_value=f"{ours * 0.8:.6f}"))["side"]) == ["beyond"]
    # a range: beyond only past its upper end
    assert off_paper(claim(paper_value=f"{ours * 0.5:.6f}", paper_value_hi=f"{ours * 0.95:.6f}")).empty
    line = shares_line(res, ev.iloc[0], {})
    t = headline_steps.breakdown(res)
    at = t[t["workload.prefix_len"] == 128].set_index("system.name")
    want = at.loc["sglang_default", "decode_s"] / at.loc["granikv", "decode_s"]
    assert f"sglang_default / GraniKV = {want:.2f}x" in line
    assert f"GraniKV {at.loc['granikv', 'duration_s']:.1f} s = decode {at.loc['granikv', 'decode_s']:.1f} s" in line
    assert "sglang_default / GraniKV" in line and "full-batch decode step" in line
    other = ev.iloc[0].copy()
    other["baseline"] = "system.name=sglang_cascade"                  # the baseline was not run here
    assert shares_line(res, other, {}) == ""
    # a claim at an Lp without both systems has no line (no invented split)
    assert shares_line(res, ev.iloc[0].copy().replace(ev.iloc[0]["selectors"], sel.replace("128", "4096")), {}) == ""


def test_report_says_which_cells_shared_the_host(res):
    from analysis.report.provenance import hardware_summary
    assert "provenance.concurrent_sweeps" in res.cells.columns
    assert (res.cells["provenance.concurrent_sweeps"] == 1).all()     # the CPU runner alone
    shared = res.cells.copy()
    shared.loc[shared.index[:2], "provenance.concurrent_sweeps"] = 2
    line = hardware_summary(type(res)(root=res.root, cells=shared, failures=res.failures, kernels=res.kernels))
    assert line == [f"no GPU (CPU): {len(res.cells)} cells (2 of them while another sweep ran on the host's "
                    "other GPU; provenance concurrent_sweeps)"]


def test_report_explains_an_absolute_time_by_the_hardware():
    from analysis.report.explain import DATASHEET, absolute_line
    ev = pd.DataFrame([
        {"id": "abs", "comparison": "absolute (hardware-dependent)", "ours": 40.0, "paper_value": "100",
         "paper_value_hi": "", "check": "point", "unit": "ms", "metric": "tpot_p50_ms", "our_hardware": "NVIDIA H200",
         "selectors": "workload.prefix_len=8192;system.name=sglang_default", "verdict": "not reproduced", "ours_shown": "40"},
        {"id": "rel", "comparison": "ratio", "ours": 2.5, "paper_value": "2.6", "paper_value_hi": "", "check": "point",
         "unit": "x", "metric": "tpot_p50_ms", "our_hardware": "NVIDIA H200",
         "selectors": "workload.prefix_len=8192;system.name=granikv", "verdict": "reproduced", "ours_shown": "2.50"},
        {"id": "other", "comparison": "ratio", "ours": 2.0, "paper_value": "2", "paper_value_hi": "", "check": "point",
         "unit": "x", "metric": "tpot_p50_ms", "our_hardware": "NVIDIA H200",
         "selectors": "workload.prefix_len=512;system.name=granikv", "verdict": "reproduced", "ours_shown": "2.00"}])
    line = absolute_line(ev, ev.iloc[0])
    bw = DATASHEET["NVIDIA H200"]["hbm_tbps"] / DATASHEET["A100-SXM4-40GB"]["hbm_tbps"]
    assert f"{bw:.2f}x in HBM bandwidth" in line and "ours is 2.50x lower" in line
    assert "`rel`, is reproduced (paper 2.6 x, ours 2.50)" in line and "`other`" not in line
    assert absolute_line(ev, ev.iloc[1]) == ""                       # a ratio claim: not an absolute time
    unknown = ev.iloc[0].copy()
    unknown["our_hardware"] = "NVIDIA L4"
    assert "no datasheet entry for NVIDIA L4" in absolute_line(ev, unknown)


def test_report_compares_shared_host_cells_with_cells_run_alone(res):
    from analysis.report.provenance import concurrency_check
    assert concurrency_check(res) == ""                              # nothing shared the host
    cells = res.cells.copy()
    serving = cells[(cells["kind"] == "serving") & (cells["system.name"] == "granikv")
                    & (cells["workload.prefix_len"] == 128) & (cells["workload.batch"] == 4)]
    twin = serving.iloc[[0]].copy()                                    # the same configuration, another repetition,
    twin["rep"] = 7                                                    # measured while the host was shared
    twin["provenance.concurrent_sweeps"] = 2
    twin["output_throughput_tok_s"] = serving["output_throughput_tok_s"].iloc[0] * 0.9
    twin["tpot_p50_ms"] = serving["tpot_p50_ms"].iloc[0] * 1.25
    mixed = pd.concat([cells, twin], ignore_index=True)
    line = concurrency_check(type(res)(root=res.root, cells=mixed, failures=res.failures, kernels=res.kernels,
                                       config_columns=res.config_columns))
    assert "1 configurations were measured both alone and while another sweep ran" in line
    assert "output_throughput_tok_s shared / alone: median 0.900" in line
    assert "tpot_p50_ms (the median per-token step) shared / alone: median 1.250" in line
    alone = cells.copy()
    alone.loc[serving.index[0], "provenance.concurrent_sweeps"] = 2  # shared, with no twin run alone
    line = concurrency_check(type(res)(root=res.root, cells=alone, failures=res.failures, kernels=res.kernels,
                                       config_columns=res.config_columns))
    assert line.startswith("1 cells ran while another sweep shared the host") and "not measured" in line
    profiled = twin.copy()                                             # a profiled run is no twin of a plain one
    profiled["provenance.concurrent_sweeps"] = 1
    profiled["profile_steps"] = 20
    profiled["output_throughput_tok_s"] = serving["output_throughput_tok_s"].iloc[0] * 0.3
    line = concurrency_check(type(res)(root=res.root, cells=pd.concat([mixed, profiled], ignore_index=True),
                                       failures=res.failures, kernels=res.kernels, config_columns=res.config_columns))
    assert "output_throughput_tok_s shared / alone: median 0.900" in line


def test_report_flags_graph_capture_inside_measured_runs(res):
    from analysis.report.provenance import capture_check
    cells = res.cells.copy()
    cells["cuda_graph_capture_s"] = 0.0
    quiet = type(res)(root=res.root, cells=cells, failures=res.failures, kernels=res.kernels,
                      config_columns=res.config_columns)
    assert capture_check(quiet) == ""                                  # nothing captured mid-run
    i = cells[(cells["kind"] == "serving") & (cells["system.name"] == "granikv")].index[0]
    cells.loc[i, "cuda_graph_capture_s"] = 0.2 * cells.loc[i, "duration_s"]
    line = capture_check(type(res)(root=res.root, cells=cells, failures=res.failures, kernels=res.kernels,
                                   config_columns=res.config_columns))
    assert "granikv mean" in line and "max 20.0%" in line


def test_report_checks_kv_budgets_within_a_sweep(res):
    """Equal budgets: no line. Unequal: the sweep's range, and the cells whose pool filled are named."""
    from analysis.report.provenance import budget_check

    def with_cells(cells):
        return type(res)(root=res.root, cells=cells, failures=res.failures, kernels=res.kernels,
                         config_columns=res.config_columns)
    cells = res.cells.copy()
    serving = cells.index[(cells["kind"] == "serving") & (cells["sweep"] == "grid")]
    cells.loc[serving, "kv_budget_tokens"] = 4096
    assert budget_check(with_cells(cells)) == ""
    a, b = serving[0], serving[1]
    cells.loc[a, "kv_budget_tokens"] = 2048
    line = budget_check(with_cells(cells))
    assert "grid: 2K-4K tokens" in line and "did not limit admissions" in line
    cells.loc[b, "evicted_tokens"] = 10
    line = budget_check(with_cells(cells))
    assert f"grid/{cells.loc[b, 'cell_id']}" in line and "did not limit" not in line


def test_claim_without_a_better_side_is_explained_when_off_the_paper(res):
    """A regression-size claim (no better side, e.g. the limitation's 0.70x) more than 10% from ours is
    listed "below" / "above" the paper, and explained by the GraniKV/sglang_default step trace."""
    from analysis.verdict.evaluate import evaluate
    from analysis.measures.steps import cell_steps
    from analysis.report.steps import claim_steps_line
    from analysis.report.explain import off_paper
    sel = "workload.kind=synthetic;model.name=tiny;tp=1;workload.prefix_len=128;workload.batch=4;system.name=granikv"
    ours = evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default"))["ours"].iloc[0]
    # unit "" (not "x"): a paper value 15% from the tiny CPU run's ratio may cross 1, where the direction rule
    # would decide instead of the 25% rule this test is about
    ev = evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default", paper_value=f"{ours * 0.85:.6f}",
                              unit="", source="tables/limitation"))
    assert ev["verdict"].iloc[0] == "reproduced" and list(off_paper(ev)["side"]) == ["above"]
    ev2 = evaluate(res, _claim(selectors=sel, baseline="system.name=sglang_default", paper_value=f"{ours:.6f}"))
    assert off_paper(ev2).empty
    line = claim_steps_line(res, ev.iloc[0])
    g = res.cells[(res.cells["sweep"] == "grid") & (res.cells["system.name"] == "granikv")
                  & (res.cells["workload.prefix_len"] == 128) & (res.cells["workload.batch"] == 4)
                  & (res.cells["profile_steps"] == 0)].iloc[0]
    want = cell_steps(Path(res.root) / g["path"], 4)
    assert line.startswith("Step trace, GraniKV vs sglang_default") and f"decode steps {want['decode_s']:.2f} s vs" in line
    assert "eager decode steps" in line
    # on CPU no step replays a CUDA graph: every decode step is eager, and the split says so
    assert want["decode_eager_s"] == pytest.approx(want["decode_s"]) and want["decode_eager_steps"] > 0
    assert f"(no CUDA graph: {want['decode_eager_s']:.2f} s vs" in line and "with graphs: 0.00 s vs 0.00 s" in line
    none = ev.iloc[0].copy()
    none["selectors"] = sel.replace("128", "4096")
    assert claim_steps_line(res, none) == ""


def test_dispatch_overhead_leaves_the_profiled_cell_out(res):
    from analysis.measures.dispatch import overhead_frame
    t = overhead_frame(res)
    assert len(t) == 3 and set(t["system"]) == {"granikv"}      # the 3 plain GraniKV cells, not the profiled one
    assert (pd.to_numeric(t["profile_steps"], errors="coerce").fillna(0) == 0).all()
