"""system=sglang_server on CPU: a fake local server (tests/fake_sglang_server.py) that speaks SGLang's
HTTP protocol. The replay client, the metrics (granikv.metrics, as for engine cells), the warm-up and
cache flushes, server reuse, and every failure path (no health, early exit, short output, a stalled
stream, a busy port, a server dying mid-run) leaving failure.json with the log lines, never metrics.json."""
from __future__ import annotations

import gzip
import json
import os
import socket
import time
from pathlib import Path
import pytest
from hydra import compose, initialize_config_dir
from granikv import metrics, rawio
from granikv.config import register, to_run_config
from granikv.request import Request, RequestRecord
from granikv.serving import server as srvmod
from granikv.serving.client import DONE, ReplayError, TokenStream, parse_event
from granikv.serving.hf_config import hf_config
from granikv.serving.sglang_log import parse_line, parse_steps
from runners.run import ConfigError, cell_id, run_cell

ROOT = Path(__file__).resolve().parents[1]
FAKE = ["system=sglang_server", "system.server.launcher=tests.fake_sglang_server", "model=tiny", "hardware=cpu",
        "workload=synthetic", "workload.prefix_len=32", "workload.suffix_len=4", "workload.output_len=6",
        "workload.batch=4", "system.server.start_timeout_s=20", "system.server.request_timeout_s=20"]
register()


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """A private state dir, event log and argv log for the fake server; a fresh pool per test."""
    monkeypatch.setenv(srvmod.STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setenv("FAKE_SGLANG_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("FAKE_SGLANG_ARGV", str(tmp_path / "argv.jsonl"))
    monkeypatch.delenv(srvmod.KEEP_ENV, raising=False)
    monkeypatch.chdir(ROOT)
    pool = srvmod.ServerPool()
    monkeypatch.setattr(srvmod, "POOL", pool)
    import granikv.serving.session as session
    monkeypatch.setattr(session, "POOL", pool)
    yield tmp_path, pool
    pool.close(keep=False)


def cfg_of(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def events(tmp: Path) -> list[dict]:
    p = tmp / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


# ---------------------------------------------------------------- pure parts
def test_hf_config_from_model_presets():
    rc = to_run_config(cfg_of(["model=llama3_8b"]))
    c = hf_config(rc.model)
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["num_hidden_layers"]) == (32, 8, 128, 32)
    assert c["rope_scaling"]["rope_type"] == "llama3" and c["rope_theta"] == 500000.0
    q = hf_config(to_run_config(cfg_of(["model=qwen25_14b"])).model)
    assert q["architectures"] == ["Qwen2ForCausalLM"] and q["num_key_value_heads"] == 8
    from dataclasses import replace
    with pytest.raises(ValueError, match="model.qkv_bias"):
        hf_config(replace(to_run_config(cfg_of(["model=qwen25_14b"])).model, qkv_bias=False))


def test_server_argv_comes_from_the_cell(tmp_path, monkeypatch):
    monkeypatch.setenv(srvmod.STATE_ENV, str(tmp_path))
    from runners.run import resolve
    rc = resolve(to_run_config(cfg_of(["system=sglang_server", "sweep=headline", "workload.batch=128"])))
    a = srvmod.server_spec(rc).argv
    flag = {k: v for k, v in zip(a, a[1:])}
    assert a[1:3] == ("-m", "sglang.launch_server")
    assert flag["--max-running-requests"] == "128" and flag["--tp-size"] == "1"
    assert flag["--attention-backend"] == "flashinfer" and flag["--mem-fraction-static"] == "0.88"
    assert flag["--cuda-graph-max-bs"] == "256" and flag["--chunked-prefill-size"] == "8192"
    assert flag["--load-format"] == "dummy" and "--skip-tokenizer-init" in a and "--max-total-tokens" not in a
    cfg = json.loads((Path(flag["--model-path"]) / "config.json").read_text())
    assert cfg["hidden_size"] == 4096
    a100 = resolve(to_run_config(cfg_of(["system=sglang_server", "sweep=headline", "hardware=a100_40gb"])))
    assert "--max-total-tokens" in srvmod.server_spec(a100).argv       # the preset's fixed KV budget
    with pytest.raises(ValueError, match="system.server.extra_args"):
        to_run_config(cfg_of(["system=sglang_server", "system.server.extra_args=[--port,1]"]))
    with pytest.raises(ValueError, match="system.server"):
        to_run_config(cfg_of(["system=granikv", "system.engine=sglang"]))


def test_stream_parsing_incremental_and_cumulative():
    assert parse_event(b"data: [DONE]\n") is DONE and parse_event(b"\n") is None and parse_event(": ping") is None
    with pytest.raises(ReplayError, match="not JSON"):
        parse_event(b"data: {oops")
    inc = TokenStream(incremental=True)
    for ids, t in (([5], 1.0), ([6, 7], 2.0), ([], 2.5)):
        inc.feed({"output_ids": ids, "meta_info": {}}, t)
    assert inc.ids == [5, 6, 7] and inc.times == [1.0, 2.0, 2.0] and inc.chunks == 2
    cum = TokenStream(incremental=False)
    for ids, t in (([5], 1.0), ([5, 6, 7], 2.0)):
        cum.feed({"output_ids": ids}, t)
    assert cum.ids == [5, 6, 7] and cum.times == [1.0, 2.0, 2.0]
    with pytest.raises(ReplayError, match="incremental"):
        cum.feed({"output_ids": [9, 9, 9, 9]}, 3.0)
    with pytest.raises(ReplayError, match="error"):
        TokenStream(True).feed({"error": {"message": "bad"}}, 0.0)


def test_sglang_log_lines_become_steps():
    dec = ("[2026-12-01 15:23:18] Decode batch, #running-req: 253, #token: 103914, token usage: 0.12, "
           "cuda graph: True, gen throughput (token/s): 2820.91, #queue-req: 1, ")
    pre = ("[2026-12-01 15:23:18] Prefill batch, #new-seq: 2, #new-token: 116, #cached-token: 32768, token usage: "
           "0.12, #running-req: 254, #queue-req: 6, #pending-token: 99688, cuda graph: True, input throughput "
           "(token/s): 1235.21")
    d = parse_line(dec, 40)
    assert (d["kind"], d["batch_size"], d["token"], d["cuda_graph"], d["queue_req"]) == ("decode", 253, 103914, True, 1)
    assert d["gen_throughput_token_s"] == 2820.91 and d["decode_log_interval"] == 40
    p = parse_line(pre)
    assert (p["kind"], p["batch_size"], p["num_tokens"], p["cached_token"]) == ("prefill", 2, 116, 32768)
    assert parse_line("[2026-12-01] INFO: Uvicorn running") is None
    assert [s["step"] for s in parse_steps([pre, "noise", dec])] == [0, 1]


# ---------------------------------------------------------------- a served cell
def test_cell_on_a_fake_server_matches_the_engine_cell_schema(fake):
    tmp, pool = fake
    ov = [*FAKE, "warmup_requests=4", f"results_dir={tmp / 'raw'}", "sweep_name=s"]
    cell = run_cell(cfg_of(ov), ov)
    assert rawio.cell_state(cell) == "done"
    for f in rawio.REQUIRED_FILES["serving"]:
        assert rawio.exists(cell / f), f
    m = rawio.read_json(cell / "metrics.json")
    rows = rawio.read_jsonl(cell / "requests.jsonl")
    assert m["num_requests"] == 4 and m["num_warmup_requests"] == 4 and all(len(r["output_ids"]) == 6 for r in rows)
    recs = [RequestRecord(r["rid"], r["arrival_s"], r["prompt_len"], r["output_ids"], r["token_times_s"]) for r in rows]
    again = metrics.summarize(recs, [], {"warmup": {"requests": 4}})   # one definition for both engines
    for k in ("output_throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p90_ms", "e2e_mean_ms"):
        assert m[k] == pytest.approx(again[k]), k
    prov = rawio.read_json(cell / "config.json")["provenance"]
    assert prov["sglang"] == "0.0.0-fake" and "--max-running-requests" in prov["engine"]["argv"]
    assert "internal_states" not in prov["engine"]["server_info"]
    assert (cell / "server_log_tail.txt").read_text().strip()
    assert "server_args=" in (cell / "server_start_log.txt").read_text()        # it started the server
    warm = (cell / "server_warmup_log.txt").read_text()
    assert "Loading JIT ops" in warm and " batch, #" not in warm             # what the warm-up built
    ev = events(tmp)
    kinds = [e["kind"] for e in ev]
    # flush, 4 warm-up requests (output lengths n+1..2, capped by nothing here), flush, 4 measured requests
    assert kinds == ["flush"] + ["generate"] * 4 + ["flush"] + ["generate"] * 4, kinds
    assert sorted(e["max_new_tokens"] for e in ev[1:5]) == [2, 3, 4, 5] and all(e["ignore_eos"] for e in ev if "ignore_eos" in e)
    assert [e["prompt_len"] for e in ev[6:]] == [r["prompt_len"] for r in rows]
    pid = pool.current.pid
    pool.close(keep=False)
    assert not srvmod._pid_alive(pid)                     # stopped by its own process id


def test_profile_steps_brings_back_the_servers_own_trace_of_decode_steps(fake, monkeypatch):
    """profile_steps on a server cell: at the measured replay's first decode step the server is asked to profile
    that many steps; its trace lands in the cell as trace.json.gz and the cell says how it went."""
    tmp, pool = fake
    monkeypatch.setenv("FAKE_SGLANG_TOKEN_S", "0.02")
    ov = [*FAKE, "workload.output_len=24", "profile_steps=3", f"results_dir={tmp / 'raw'}", "sweep_name=s"]
    cell = run_cell(cfg_of([*ov, "system.server.decode_log_interval=1"]), ov)
    assert rawio.cell_state(cell) == "done"
    with gzip.open(cell / "trace.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"][0]["name"] == "fake_decode_step"
    m = rawio.read_json(cell / "metrics.json")
    assert m["server_trace"].startswith("started at the first decode step (3 steps)") and m["server_trace"].endswith("written")
    starts = [e for e in events(tmp) if e["kind"] == "start_profile"]
    assert len(starts) == 1 and starts[0]["num_steps"] == 3 and starts[0]["activities"] == ["CPU", "GPU"]


def test_consecutive_cells_share_a_server_and_a_new_spec_restarts_it(fake):
    tmp, pool = fake
    for lp in (32, 48):
        ov = [*FAKE, f"workload.prefix_len={lp}", f"results_dir={tmp / 'raw'}", "sweep_name=s"]
        assert rawio.cell_state(run_cell(cfg_of(ov), ov)) == "done"
    assert pool.launches == 1
    cells = sorted((tmp / "raw" / "s").iterdir(), key=lambda c: (c / "metrics.json").stat().st_mtime)
    assert [(c / "server_start_log.txt").exists() for c in cells] == [True, False]   # the server's first cell only
    first = pool.current.pid
    ov = [*FAKE, "workload.batch=2", f"results_dir={tmp / 'raw'}", "sweep_name=s"]   # --max-running-requests 2
    run_cell(cfg_of(ov), ov)
    assert pool.launches == 2 and not srvmod._pid_alive(first)
    assert rawio.cell_state(run_cell(cfg_of(ov), ov)) == "done" and pool.launches == 2   # resumable: skipped


def test_a_kept_server_is_adopted_by_the_next_process(fake, monkeypatch):
    tmp, pool = fake
    rc_ov = [*FAKE, f"results_dir={tmp / 'raw'}", "sweep_name=s"]
    run_cell(cfg_of(rc_ov), rc_ov)
    pid = pool.current.pid
    pool.close(keep=True)                                  # GRANIKV_SGLANG_KEEP=1 at exit
    assert srvmod._pid_alive(pid)
    nxt = srvmod.ServerPool()
    from runners.run import resolve
    srv = nxt.acquire(srvmod.server_spec(resolve(to_run_config(cfg_of(rc_ov)))))
    assert srv.adopted and srv.pid == pid and nxt.launches == 0
    nxt.close(keep=False)
    assert not srvmod._pid_alive(pid)


@pytest.mark.parametrize("mode, extra, match", [
    ("never_healthy", ["system.server.start_timeout_s=2"], "not healthy"),
    ("exit_early", [], "exited \\(code 3\\)"),
    ("short", [], "other than asked"),
    ("stall", ["system.server.request_timeout_s=2"], "did not finish within 2 s"),
    ("die_mid", [], "died|failed"),
])
def test_failures_leave_failure_json_with_the_log(fake, monkeypatch, mode, extra, match):
    tmp, pool = fake
    monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
    ov = [*FAKE, *extra, "workload.batch=6", f"results_dir={tmp / 'raw'}", "sweep_name=s"]
    t0 = time.monotonic()
    cell = run_cell(cfg_of(ov), ov, multirun=True)
    assert time.monotonic() - t0 < 30
    assert rawio.cell_state(cell) == "failed" and not (cell / "metrics.json").exists()
    f = rawio.read_json(cell / "failure.json")
    import re
    assert re.search(match, f["error"]), f["error"]
    assert f["server_log"] and f["server_log_tail"], "failure.json names the server's log lines"
    if mode == "exit_early":
        assert any("Not enough memory" in ln for ln in f["server_log_tail"])
    if mode in ("stall", "short", "die_mid", "never_healthy") and pool.current is not None:
        pool.close(keep=False)


def test_a_busy_port_is_named_with_the_fix(fake):
    tmp, _ = fake
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        ov = [*FAKE, f"system.server.port={port}", f"results_dir={tmp / 'raw'}", "sweep_name=s"]
        cell = run_cell(cfg_of(ov), ov, multirun=True)
    err = rawio.read_json(cell / "failure.json")["error"]
    assert f"port {port}" in err and "system.server.port=0" in err


def test_server_cells_refuse_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ov = [*FAKE, "tp=2", f"results_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="system.engine"):
        run_cell(cfg_of(ov), ov, engine_factory=lambda rc: None)
    assert cell_id(["system=sglang_server", "workload.prefix_len=512"]) == "system=sglang_server,workload.prefix_len=512"


def test_stop_kills_the_whole_process_group(fake):
    tmp, pool = fake
    from runners.run import resolve
    srv = pool.acquire(srvmod.server_spec(resolve(to_run_config(cfg_of([*FAKE, f"results_dir={tmp}"])))))
    assert os.getpgid(srv.pid) == srv.pid               # its own session: it can outlive the command
    srv.stop()
    assert not srv.alive() and not srv.state_file.exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(srv.pid, 0)


def test_a_server_whose_starter_was_killed_is_recorded_and_stopped_by_the_next_start(fake, monkeypatch):
    """The starting process dies (SIGKILL: no finally runs) while its server is still starting: the record
    written at spawn names the orphan, adopting refuses it, and the next start stops it (it would hold
    the GPU's memory)."""
    import signal
    import subprocess
    import sys
    from dataclasses import asdict
    from runners.run import resolve
    tmp, pool = fake
    monkeypatch.setenv("FAKE_SGLANG_MODE", "never_healthy")
    spec = srvmod.server_spec(resolve(to_run_config(cfg_of([*FAKE, "system.server.start_timeout_s=60",
                                                            f"results_dir={tmp}"]))))
    code = ("import json, sys; from granikv.serving import server as s; d = json.loads(sys.argv[1]); "
            "s.SGLangServer.start(s.ServerSpec(tuple(d['argv']), tuple(map(tuple, d['env'])), d['host'], d['port'], "
            "d['start_timeout_s']))")
    starter = subprocess.Popen([sys.executable, "-c", code, json.dumps(asdict(spec))], cwd=ROOT, env=os.environ.copy())
    record = srvmod.state_dir() / f"{spec.key}.json"
    deadline = time.monotonic() + 20
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert record.exists(), "the server is recorded as soon as it is spawned"
    st = json.loads(record.read_text())
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    assert st["ready"] is False and srvmod._pid_alive(st["pid"])        # the orphan still runs
    assert srvmod.SGLangServer.adopt(spec) is None                         # never adopted: it never got ready
    assert not srvmod._pid_alive(st["pid"]) and not record.exists()
    # the same orphan, met by a start of another spec: stopped by the pool before it launches
    starter = subprocess.Popen([sys.executable, "-c", code, json.dumps(asdict(spec))], cwd=ROOT, env=os.environ.copy())
    deadline = time.monotonic() + 20
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = json.loads(record.read_text())["pid"]
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    srvmod.ServerPool()._stop_others()
    assert not srvmod._pid_alive(pid) and not record.exists()


def test_wheel_set_builder_slims_sglang_kernel_and_reads_its_list(tmp_path):
    import importlib.util
    import zipfile
    spec = importlib.util.spec_from_file_location("bsw", ROOT / "runners/gpu/build_sgl_wheels.py")
    bsw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bsw)
    names = bsw.wheel_files()
    assert any(n.startswith("sglang-0.5.17-") for n in names) and any(n.startswith("sglang_kernel-") for n in names)
    assert all(bsw.WHEEL.match(n) for n in names)
    w = tmp_path / "sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl"
    keep = "sgl_kernel/common_ops.abi3.so"
    with zipfile.ZipFile(w, "w") as z:
        for m in (*bsw.SLIM, keep):
            z.writestr(m, b"x" * 10)
        z.writestr("sgl_kernel-0.4.5.dist-info/RECORD", "".join(f"{m},sha256=a,10\n" for m in (*bsw.SLIM, keep)))
    bsw.slim(w)
    with zipfile.ZipFile(w) as z:
        assert sorted(z.namelist()) == ["sgl_kernel-0.4.5.dist-info/RECORD", keep]
        assert z.read("sgl_kernel-0.4.5.dist-info/RECORD").decode() == f"{keep},sha256=a,10\n"
