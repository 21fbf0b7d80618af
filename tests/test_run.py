"""runners.run: cell folders, skip/force, failure.json, bad input before any work, telemetry."""
from __future__ import annotations
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
import pytest
from hydra import compose, initialize_config_dir
from granikv import rawio, workloads
from granikv.config import to_run_config
from granikv.telemetry import NvmlSampler, nsys_command
from runners.run import ConfigError, cell_id, default_engine, run_cell

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny", "hardware=cpu", "workload=synthetic", "workload.batch=2", "workload.suffix_len=4",
         "workload.output_len=4", "workload.prefix_len=16", "nvml=false"]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def cli(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "runners.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def check_serving_cell(cell: Path) -> dict:
    for f in rawio.REQUIRED_FILES["serving"] + ("workload.jsonl",):
        assert rawio.exists(cell / f), f"{cell}: {f} missing"
    cfg = rawio.read_json(cell / "config.json")
    assert cfg["cell_kind"] == "serving" and cfg["cell"]["cell_id"] == cell.name
    assert set(rawio.PROVENANCE_KEYS) <= set(cfg["provenance"])
    m = rawio.read_json(cell / "metrics.json")
    assert set(rawio.SERVING_METRICS) <= set(m)
    reqs = rawio.read_jsonl(cell / "requests.jsonl")
    assert len(reqs) == m["num_requests"] == cfg["workload"]["batch"]
    for r in reqs:
        assert len(r["output_ids"]) == r["output_len"] == cfg["workload"]["output_len"]
        assert r["first_token_s"] >= r["arrival_s"] and r["finish_s"] >= r["first_token_s"]
    steps = rawio.read_jsonl(cell / "steps.jsonl")
    assert steps and all("step_time_s" in s for s in steps)
    return m


# ---------------------------------------------------------------- cell ids
def test_cell_id_sorted_sanitised_and_stable():
    a = cell_id(["workload.prefix_len=256", "system=granikv", "results_dir=/x", "sweep=smoke", "force=true"])
    assert a == "system=granikv,workload.prefix_len=256"
    assert a == cell_id(["system=granikv", "workload.prefix_len=256"])
    assert cell_id([]) == "default"
    assert cell_id(["workload.prefix_lens=[1024, 2048]", "+x=a/b"]) == "workload.prefix_lens=1024-2048,x=a_b"
    long = cell_id([f"k{i}=" + "v" * 30 for i in range(20)])
    assert len(long) == 200 and long != cell_id([f"k{i}=" + "v" * 30 for i in range(21)])


# ---------------------------------------------------------------- bad input, before any work
@pytest.mark.parametrize("override,key", [
    ("workload.prefix_len=-5", "workload.prefix_len"),
    ("workload.rate=0", "workload.rate"),
    ("hardware.kv_budget_tokens=10", "hardware.kv_budget_tokens"),      # 16 + 4 + 4 tokens do not fit
    ("workload.prefix_len=40000", "workload.prefix_len"),                # beyond max_position_embeddings
    ("tp=3", "tp"),
])
def test_bad_input_named_before_any_work(tmp_path, override, key):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", override])
    calls = []
    with pytest.raises(ConfigError, match=f"`{key}`"):
        run_cell(cfg, [override], engine_factory=lambda rc: calls.append(rc))
    assert not calls, "the engine was built before the error"
    assert not any(p.is_file() for p in tmp_path.rglob("*")), "files were written before the error"


def test_kv_budget_of_a100_preset_is_checked(tmp_path):
    # Lp=16K + 2048 on the a100 preset fits llama3_8b (157K) ...
    cfg = compose_cfg(["hardware=a100_40gb", "model=llama3_8b", f"results_dir={tmp_path}"])
    from runners.run import kv_budget, resolve

    assert kv_budget(resolve(cfg)) == 157360
    # ... and a preset without this model is a named error
    cfg = compose_cfg(["hardware=a100_40gb", "model=llama3_8b", "model.name=llama_other",
                       f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="`hardware.kv_budget_per_model`"):
        run_cell(cfg, [], engine_factory=lambda rc: None)


def test_unwritable_results_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = compose_cfg([*SMALL, f"results_dir={blocker}/sub"])
    with pytest.raises(ConfigError, match="`results_dir`"):
        run_cell(cfg, [], engine_factory=lambda rc: None)


def test_cli_errors(tmp_path):
    p = cli("model=nope", f"results_dir={tmp_path}")
    assert p.returncode != 0 and "model/nope" in p.stderr
    p = cli(*SMALL, "workload.output_len=-1", f"results_dir={tmp_path}")
    assert p.returncode == 2 and "`workload.output_len`" in p.stderr
    assert not list(tmp_path.rglob("*.json"))


# ---------------------------------------------------------------- end to end (real engine, CPU)
def test_multirun_writes_cells_then_skips(tmp_path):
    base = [o for o in SMALL if not o.startswith("workload.prefix_len")]
    args = ["-m", *base, "system=sglang_default,granikv", "workload.prefix_len=16,48",
            "sweep_name=t", f"results_dir={tmp_path}"]
    p = cli(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sweep t: 4 cells: 4 measured, 0 skipped, 0 failed" in p.stdout
    cells = sorted((tmp_path / "t").iterdir())
    expect = {cell_id([*base, f"system={s}", f"workload.prefix_len={lp}"]): (s, lp)
              for s in ("sglang_default", "granikv") for lp in (16, 48)}
    assert {c.name for c in cells} == set(expect)
    for c in cells:
        m = check_serving_cell(c)
        assert m["num_output_tokens"] == 8 and m["output_throughput_tok_s"] > 0
        # the saved trace is regenerable from seed + config
        s, lp = expect[c.name]
        rc = to_run_config(compose_cfg([*base, f"system={s}", f"workload.prefix_len={lp}"]))
        assert rawio.read_jsonl(c / "workload.jsonl") == json.loads(json.dumps(workloads.trace_rows(workloads.build(rc))))
    assert (tmp_path / ".hydra" / "t" / "multirun.yaml").exists()
    mtimes = {c: (c / "metrics.json").stat().st_mtime_ns for c in cells}
    p = cli(*args)
    assert p.returncode == 0 and p.stdout.count("skip (metrics.json exists") == 4
    assert "4 cells: 0 measured, 4 skipped, 0 failed" in p.stdout
    assert mtimes == {c: (c / "metrics.json").stat().st_mtime_ns for c in cells}
    # same greedy outputs across systems (random weights, same seed)
    outs = {expect[c.name]: [r["output_ids"] for r in rawio.read_jsonl(c / "requests.jsonl")] for c in cells}
    assert outs[("granikv", 16)] == outs[("sglang_default", 16)]


def test_failing_cell_leaves_failure_json_and_sweep_goes_on(tmp_path):
    def flaky(rc):
        if rc.workload.prefix_len == 16:
            raise RuntimeError("injected failure for prefix_len=16")
        return default_engine(rc)

    folders = []
    for lp in (16, 48):
        ov = [f"workload.prefix_len={lp}"]
        cfg = compose_cfg([*SMALL[:-2], f"results_dir={tmp_path}", "sweep_name=f", *ov])
        folders.append(run_cell(cfg, ov, multirun=True, engine_factory=flaky))
    bad, good = folders
    f = rawio.read_json(bad / "failure.json")
    assert "injected failure" in f["error"] and "Traceback" in f["traceback"]
    assert f["config"]["workload"]["prefix_len"] == 16 and rawio.cell_state(bad) == "failed"
    check_serving_cell(good)
    # a failed cell is retried next time (only metrics.json marks a cell done); success clears failure.json
    cfg = compose_cfg([*SMALL[:-2], f"results_dir={tmp_path}", "sweep_name=f", "workload.prefix_len=16"])
    run_cell(cfg, ["workload.prefix_len=16"], multirun=True)
    assert rawio.cell_state(bad) == "done" and not (bad / "failure.json").exists()


def test_bad_cell_stops_a_sweep_before_any_work(tmp_path):
    p = cli("-m", *SMALL, "hardware.kv_budget_tokens=10,4096", "sweep_name=k", f"results_dir={tmp_path}")
    assert p.returncode == 2
    assert "1 of 2 cells are invalid; nothing was run" in p.stderr and "`hardware.kv_budget_tokens`" in p.stderr
    assert not any(f.is_file() for f in tmp_path.rglob("*"))
    (tmp_path / "f").write_text("")  # results_dir under a file: cannot be created
    p = cli("-m", *SMALL, "workload.suffix_len=1,2", f"results_dir={tmp_path / 'f'}/x")
    assert p.returncode == 2 and "`results_dir`" in p.stderr


def test_config_error_inside_a_sweep_job_is_a_failed_cell(tmp_path):
    """Fallback when a job's config is only checked in the job (e.g. a SLURM array)."""
    ov = ["hardware.kv_budget_tokens=10"]
    cell = run_cell(compose_cfg([*SMALL, f"results_dir={tmp_path}", *ov]), ov, multirun=True)
    f = rawio.read_json(cell / "failure.json")
    assert f["kind"] == "config_error" and "`hardware.kv_budget_tokens`" in f["error"]


def test_fast_sweep_composition_matches_hydra(tmp_path):
    from hydra import compose

    from runners.run import _compose_cached

    cells = [["sweep=multiprefix_hetero", "system=granikv", "workload.prefix_lens=[1024,1536,2048,3072,4096,6144,8192,12288]"],
             ["sweep=synthetic_grid", "system=hydragen", "workload.prefix_len=2048", "workload.batch=32", "rep=2"],
             ["sweep=headline_qwen25_32b", "tp=2", "hardware.mem_fraction=0.87", "system=sglang_cascade"]]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for ov in cells:
            assert to_run_config(_compose_cached(ov, compose)) == to_run_config(compose("config", overrides=ov))


def test_force_reruns(tmp_path):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}"])
    cell = run_cell(cfg, [])
    t0 = (cell / "metrics.json").stat().st_mtime_ns
    run_cell(cfg, [])
    assert (cell / "metrics.json").stat().st_mtime_ns == t0
    run_cell(compose_cfg([*SMALL, f"results_dir={tmp_path}", "force=true"]), ["force=true"])
    assert (cell / "metrics.json").stat().st_mtime_ns != t0


def test_warmup_requests_are_counted(tmp_path):
    """The engine serves warm-up requests in a pass of its own (no records); metrics.json still counts them."""
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", "warmup_requests=2"])
    m = check_serving_cell(run_cell(cfg, ["warmup_requests=2"]))
    assert m["num_warmup_requests"] == 2 and m["warmup"]["requests"] == 2 and m["num_requests"] == 2


# ---------------------------------------------------------------- telemetry
def test_cell_records_where_its_wall_time_went(tmp_path):
    """metrics.json names the cell's seconds of preparing (workload), engine start, serving and trace writing;
    serving covers the engine's own measured duration."""
    cell = run_cell(compose_cfg([*SMALL, f"results_dir={tmp_path}"]), [])
    m = rawio.read_json(cell / "metrics.json")
    ph = m["telemetry"]["cell_phases_s"]
    assert set(ph) == {"prepare", "engine", "serve", "write"} and all(v >= 0 for v in ph.values())
    assert ph["prepare"] > 0 and ph["engine"] > 0 and ph["serve"] >= m["duration_s"] - 1e-3


def test_profiler_window_writes_trace(tmp_path):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", "profile_steps=2", "workload.output_len=12"])
    cell = run_cell(cfg, [])
    trace = json.loads(gzip.decompress((cell / "trace.json.gz").read_bytes()))
    assert any(e.get("name") == "decode_step" for e in trace["traceEvents"])
    t = rawio.read_json(cell / "metrics.json")["telemetry"]
    assert t["trace_json"] == "trace.json.gz" and t["profiled_decode_steps"] == 2
    assert t["profiler_overhead_s"] > 0          # start + stop + export, spent inside the run


def test_profiler_is_primed_once_per_process_before_the_run(tmp_path, monkeypatch):
    """The profiler's one-time start-up (CUPTI on a GPU: 3.7-6.4 s on the H200) is paid by prime(),
    before the measured run, once per process and activity set; a disabled profiler never primes."""
    from granikv.telemetry import profiler as P

    monkeypatch.setattr(P, "_primed", set())
    off = P.StepProfiler(tmp_path / "off.json.gz", 0)
    off.prime()
    assert off.prime_s is None and P._primed == set()
    a = P.StepProfiler(tmp_path / "a.json.gz", 2)
    a.prime()
    assert a.prime_s is not None and a.prime_s > 0 and P._primed == {False}
    b = P.StepProfiler(tmp_path / "b.json.gz", 2)
    b.prime()
    assert b.prime_s is None                   # already paid in this process
    for i in range(8):
        b.on_step({"step": i, "kind": "decode"})
    assert b.captured == 2 and (tmp_path / "b.json.gz").exists() and b.overhead_s > 0
    assert b.summary()["profiler_prime_s"] is None and b.summary()["profiler_overhead_s"] == b.overhead_s


def test_nvml_without_gpu_is_a_noop_with_a_note(tmp_path):
    with NvmlSampler(tmp_path / "nvml.csv") as s:
        pass
    if s.summary()["nvml_csv"] is None:
        assert not (tmp_path / "nvml.csv").exists() and s.note
    else:  # a GPU machine: rows were written
        assert (tmp_path / "nvml.csv").read_text().startswith("t_s,gpu,sm_clock_mhz")


def test_nsys_command_reruns_the_same_cell(tmp_path):
    cmd = nsys_command(tmp_path, ["sweep=dispatch_overhead", "system=granikv"], "/usr/bin/nsys")
    assert cmd[:2] == ["/usr/bin/nsys", "profile"] and "--trace=cuda,nvtx,osrt" in cmd
    assert cmd[-4:] == ["-m", "runners.run", "sweep=dispatch_overhead", "system=granikv"]
    assert f"--output={tmp_path / 'profile'}" in cmd


def test_every_sweep_preset_passes_the_precheck():
    """Each paper preset's cells fit the model context and the (estimated or preset) KV budget."""
    from hydra import compose

    from runners.run import _compose_cached, check_workload, resolve, sweep_jobs

    presets = sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml"))
    assert not [p.name for p in (ROOT / "conf" / "system").glob("*.yaml") if "@package" in p.read_text()]
    extra = {"headline_qwen25_32b": [["tp=2", "hardware.mem_fraction=0.87"]],
             "multiprefix_uniform": [["hardware=a100_40gb"]], "multiprefix_hetero": [["hardware=a100_40gb"]]}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for preset in presets:
            for more in [[]] + extra.get(preset, []):
                base = compose("config", overrides=[f"sweep={preset}", *more], return_hydra_config=True)
                base.hydra.overrides.task = [f"sweep={preset}", *more]
                jobs = sweep_jobs(base)
                assert jobs
                # the fit check reads the model, tp, the workload and the hardware, never `rep` or the system
                # (a system option sets keys under `system` only, asserted above): one of each configuration
                distinct = {tuple(o for o in ov if not o.startswith(("rep=", "system="))): ov for ov in jobs}
                for ov in distinct.values():
                    check_workload(resolve(_compose_cached(ov, compose)))


def test_tp_needs_torchrun(tmp_path):
    cfg = compose_cfg([*SMALL, f"results_dir={tmp_path}", "tp=2"])
    with pytest.raises(ConfigError, match="`tp`.*torchrun --nproc_per_node=2"):
        run_cell(cfg, ["tp=2"], engine_factory=lambda rc: None)


def test_tp2_sweep_under_torchrun_writes_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.run([str(torchrun), "--nproc_per_node=2", "-m", "runners.run", "-m", *SMALL, "tp=2",
                        "system=sglang_default,granikv", "sweep_name=tp", f"results_dir={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("[runners.run] wrote") == 2          # rank 0 only
    cells = sorted((tmp_path / "tp").iterdir())
    assert len(cells) == 2
    for c in cells:
        check_serving_cell(c)
        assert rawio.read_json(c / "config.json")["tp"] == 2


def test_gpu_tp_group_has_a_host_side(monkeypatch):
    """On the GPU, init_tp asks for NCCL for CUDA tensors and gloo for host tensors: the engine's
    clock broadcast is a host tensor, and over NCCL its .item() would wait for every queued kernel
    each step (the overlap schedule lost; seen in the TP=2 headline cells at 26f2413)."""
    import torch
    import torch.distributed as dist

    import runners.run as run_mod
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(run_mod.atexit, "register", lambda f: None)
    rc = to_run_config(compose_cfg([*SMALL, "tp=2", "hardware.device=cuda"]))
    assert run_mod.init_tp(rc) == 1
    assert set(seen["backend"].split(",")) == {"cpu:gloo", "cuda:nccl"}


def test_tp_clock_broadcasts_a_host_tensor(monkeypatch):
    """Engine._clock under TP broadcasts on TPGroup.host_device (the CPU with a gloo side)."""
    import torch
    import torch.distributed as dist

    from granikv.engine.engine import Engine
    from granikv.engine.model import TPGroup

    tp = TPGroup(1)
    tp.size = 2
    devices = []
    monkeypatch.setattr(dist, "broadcast", lambda t, src: devices.append(t.device.type))
    eng = Engine.__new__(Engine)
    eng.tp, eng.device = tp, torch.device("cuda")    # the old clock put its tensor here
    eng._clock(0.0, need_sync=True)
    assert devices == ["cpu"]


def test_tp4_headline_preset_under_torchrun(tmp_path):
    """Issue #8's run (the Qwen2.5-32B headline preset at TP=4, `GRANIKV_TP=4 runners/gpu/sweep.sh
    headline_qwen25_32b`) on 4 CPU processes (gloo): the same preset and launcher, a tiny model with
    4 KV heads, 2 ShareGPT requests; rank 0 writes each cell once, and the systems agree token for token."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.run([str(torchrun), "--nproc_per_node=4", "-m", "runners.run", "-m", "sweep=headline_qwen25_32b",
                        "model=tiny", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=8", "hardware=cpu",
                        "workload.prefix_len=64", "workload.batch=2", "workload.num_requests=2", "warmup_requests=0",
                        "nvml=false", "system=sglang_default,granikv", "sweep_name=tp4", f"results_dir={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("[runners.run] wrote") == 2          # rank 0 only
    cells = sorted((tmp_path / "tp4").iterdir())
    assert len(cells) == 2
    from analysis.load import load_results
    assert len(load_results(tmp_path).cells) == 2                # both cells pass the analysis schema
    outs = []
    for c in cells:
        reqs = rawio.read_jsonl(c / "requests.jsonl")
        assert len(reqs) == 2 and all(len(r["output_ids"]) == r["output_len"] > 0 for r in reqs)
        cfg = rawio.read_json(c / "config.json")
        assert cfg["tp"] == 4 and cfg["workload"]["kind"] == "sharegpt" and cfg["workload"]["batch"] == 2
        outs.append([r["output_ids"] for r in rawio.read_jsonl(c / "requests.jsonl")])
    assert outs[0] == outs[1] and all(outs[0])


def test_a_sweep_on_another_gpu_model_stops_before_any_cell(monkeypatch):
    # hardware=h200 on an H100: the precheck refuses it (naming both GPUs and the fix) before a cell runs;
    # a preset with an empty gpu_name, or a CPU preset, runs anywhere
    import torch

    from runners.run import check_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    rc = to_run_config(compose_cfg(["hardware=h200", "workload=synthetic"]))
    with pytest.raises(ConfigError, match=r"hardware.gpu_name.*'NVIDIA H200'.*'NVIDIA H100 80GB HBM3'"):
        check_gpu(rc)
    check_gpu(to_run_config(compose_cfg(["hardware=h200", "workload=synthetic", "hardware.gpu_name=''"])))
    check_gpu(to_run_config(compose_cfg(["hardware=cpu", "workload=synthetic"])))


def test_the_h100_headline_runs_on_an_h100_only(monkeypatch):
    # sweep=headline hardware=h100: accepted on the H100 its table was fitted on (h100's own table, not the H200's),
    # refused on an H200 with the error that names the fix
    import torch

    from runners.run import check_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gpu, ok in (("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", False)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, g=gpu: g)
        rc = to_run_config(compose_cfg(["sweep=headline", "hardware=h100", "workload.prefix_len=512"]))
        assert rc.hardware.name == "h100" and {r["gpu"] for r in rc.hardware.decision_table} == {"NVIDIA H100 80GB HBM3"}
        if ok:
            check_gpu(rc)
        else:
            with pytest.raises(ConfigError, match=r"hardware.gpu_name.*'NVIDIA H100 80GB HBM3'.*'NVIDIA H200'.*calibrate"):
                check_gpu(rc)
