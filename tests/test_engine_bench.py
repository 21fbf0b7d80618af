"""runners.engine_bench on CPU (tiny model): schema-complete cells, identical tokens across systems."""
from __future__ import annotations
import json

import pytest

from granikv import rawio
from runners import engine_bench

pytestmark = pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")


def test_engine_bench_cpu(tmp_path):
    out = engine_bench.main(["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "2048",
                             "--prefix-len", "64", "--batch", "6", "--suffix-len", "5", "--output-len", "6",
                             "--profile-output-len", "3", "--probe-rows", "3", "--probe-steps", "4",
                             "--out", str(tmp_path / "eb")])
    summary = rawio.read_json(out / "summary.json")
    assert set(summary["systems"]) == {"sglang_default", "sglang_cascade", "hydragen", "granikv"}
    for name, s in summary["systems"].items():
        cell = out / name
        for f in rawio.REQUIRED_FILES["serving"]:
            assert rawio.exists(cell / f), f
        m = rawio.read_json(cell / "metrics.json")
        missing = [k for k in rawio.SERVING_METRICS if k not in m]
        assert not missing
        assert m["num_output_tokens"] == 36 and m["tpot_p50_ms"] > 0
        # granikv.metrics.summarize's keys plus the engine's stats, as runners.run writes them
        assert m["num_warmup_requests"] == 0 and m["kv_budget_tokens"] == 2048 and m["decode_step_p50_ms"] > 0
        assert {"hot_peak_tokens", "admissions", "cuda_graph_sizes_captured", "build_s", "profile"} <= set(m)
        reqs = rawio.read_jsonl(cell / "requests.jsonl")
        assert [len(r["output_ids"]) for r in reqs] == [6] * 6
        conf = rawio.read_json(cell / "config.json")
        assert all(k in conf["provenance"] for k in rawio.PROVENANCE_KEYS)
        # fp32 on CPU: every system reproduces the baseline exactly
        v = s["vs_sglang_default"]
        assert v["token_agreement"] == 1.0 and v["identical_requests"] == 1.0
        assert v["logit_positions_compared"] > 0 and v["max_logit_diff"] < 1e-3
        assert s["warmup_vs_measured_token_agreement"] == 1.0
        # CPU trace has no GPU kernels: the share is reported as not measured, with the reason
        assert s["profile"]["measured"] is False and "kernels" in s["profile"]["reason"]
    json.dumps(summary)


def test_outside_kernel_share_from_trace(tmp_path):
    """Two 100 us decode steps 150 us apart; overlapping and boundary-crossing kernels are clipped and merged."""
    ev = [{"name": "decode_step", "cat": "user_annotation", "ts": 0, "dur": 100},
          {"name": "decode_step", "cat": "user_annotation", "ts": 150, "dur": 100},
          {"name": "k", "cat": "kernel", "ts": 10, "dur": 30}, {"name": "k", "cat": "kernel", "ts": 30, "dur": 30},
          {"name": "k", "cat": "kernel", "ts": 95, "dur": 145}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    r = engine_bench.outside_kernel_share(str(p))
    # loop windows: [0,150): busy [10,60]+[95,150] = 105 -> 0.3;  [150,250): busy [150,240] = 90 -> 0.1
    # forward windows: [0,100): 55 busy -> 0.45;  [150,250): 90 -> 0.1
    assert r["measured"] and r["decode_steps"] == 2
    assert r["outside_kernel_share_mean"] == pytest.approx((0.3 + 0.1) / 2)
    assert r["forward_outside_kernel_share_mean"] == pytest.approx((0.45 + 0.1) / 2)
    ev2 = [e for e in ev if e["cat"] == "user_annotation"] + [{"name": "k", "cat": "kernel", "ts": 400, "dur": 5}]
    p.write_text(json.dumps({"traceEvents": ev2}))
    assert engine_bench.outside_kernel_share(str(p))["measured"] is False


def test_bad_bench_args():
    with pytest.raises(ValueError, match="--model"):
        engine_bench.main(["--model", "gpt5", "--hardware", "cpu"])
    with pytest.raises(ValueError, match="unknown system"):
        engine_bench.main(["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "512", "--systems", "vllm"])


def _bench_rank(rank, world, port, out, q):
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    try:
        engine_bench.main(["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "1024",
                           "--systems", "sglang_default,granikv", "--prefix-len", "40", "--batch", "4",
                           "--suffix-len", "3", "--output-len", "4", "--profile-output-len", "0", "--out", out])
        q.put((rank, "ok"))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))
        raise


def test_engine_bench_tp2_gloo(tmp_path):
    """Under torchrun-style env (WORLD_SIZE=2, gloo), tp = world size, one summary, same tokens as TP=1."""
    import socket

    import torch.multiprocessing as mp

    one = engine_bench.main(["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "1024",
                             "--systems", "sglang_default,granikv", "--prefix-len", "40", "--batch", "4",
                             "--suffix-len", "3", "--output-len", "4", "--profile-output-len", "0",
                             "--out", str(tmp_path / "tp1")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bench_rank, args=(r, 2, port, str(tmp_path / "tp2"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: "ok", 1: "ok"}
    s2 = rawio.read_json(tmp_path / "tp2" / "summary.json")
    assert s2["bench"]["tp"] == 2
    for name in ("sglang_default", "granikv"):
        a = [r["output_ids"] for r in rawio.read_jsonl(one / name / "requests.jsonl")]
        b = [r["output_ids"] for r in rawio.read_jsonl(tmp_path / "tp2" / name / "requests.jsonl")]
        assert a == b


def test_markers_cleared_and_provenance_taken_before_the_run(tmp_path, monkeypatch):
    """A rerun never leaves an earlier run's metrics.json (a failed cell read as done) or failure.json
    (a done cell read as failed); each cell's provenance is taken before its engine runs."""
    out = tmp_path / "eb"
    for name in ("sglang_default", "granikv"):
        rawio.write_json(out / name / "metrics.json", {"stale": True})
        rawio.write_json(out / name / "failure.json", {"stale": True})
    events = []
    real_prov = engine_bench.rawio.provenance

    def prov():
        events.append("prov")
        return {**real_prov(), "started_at": f"event{len(events) - 1}"}

    class Flaky(engine_bench.Engine):
        def run(self, requests, on_step=None):
            events.append(f"run:{self.cfg.system.name}")
            if self.cfg.system.name == "granikv":
                raise RuntimeError("injected failure")
            return super().run(requests, on_step)

    monkeypatch.setattr(engine_bench.rawio, "provenance", prov)
    monkeypatch.setattr(engine_bench, "Engine", Flaky)
    with pytest.raises(SystemExit):
        engine_bench.main(["--model", "tiny", "--hardware", "cpu", "--kv-budget-tokens", "1024",
                           "--systems", "sglang_default,granikv", "--prefix-len", "16", "--batch", "2",
                           "--suffix-len", "3", "--output-len", "3", "--profile-output-len", "0", "--out", str(out)])
    ok, bad = out / "sglang_default", out / "granikv"
    assert rawio.cell_state(ok) == "done" and not (ok / "failure.json").exists()
    assert "stale" not in rawio.read_json(ok / "metrics.json")
    assert rawio.cell_state(bad) == "failed" and not (bad / "metrics.json").exists()
    assert "injected failure" in rawio.read_json(bad / "failure.json")["error"]
    for cell, name in ((ok, "sglang_default"), (bad, "granikv")):
        path = cell / ("config.json" if cell is ok else "failure.json")
        taken = int(rawio.read_json(path)["provenance"]["started_at"].removeprefix("event"))
        assert taken < events.index(f"run:{name}"), (name, events)
    summary = rawio.read_json(out / "summary.json")
    assert int(summary["provenance"]["started_at"].removeprefix("event")) < events.index("run:sglang_default")
    assert summary["failed"] == {"granikv": "RuntimeError: injected failure"}
