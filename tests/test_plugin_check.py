"""runners/plugin_check.py where it cannot run (no SGLang here): a clear not-run report that still
carries its provenance, and exit code 2, not a pass or a traceback."""
from __future__ import annotations
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plugin_check_without_sglang_reports_not_run_with_provenance(tmp_path):
    env = {**os.environ, "GRANIKV_SGLANG_STATE": str(tmp_path / "state"), "GRANIKV_GIT_COMMIT": "ab" * 20,
           "GRANIKV_GIT_DIRTY": "false", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "runners.plugin_check", "--out", str(tmp_path / "pc"),
                        "--fast-start", "ref", "hardware=h200"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    rep = json.loads((tmp_path / "pc" / "plugin_check.json").read_text())
    assert rep["status"] == "not_run" and "NOT RUN" in p.stderr
    assert rep["provenance"]["git_commit"] == "ab" * 20 and rep["overrides"] == ["hardware=h200"]
    assert rep["error"]


def test_run_one_records_the_servers_package_versions(monkeypatch):
    """Each server's record names the versions its own python imports (SGLang's, FlashInfer's, torch's): the
    check's report carries them as every cell does."""
    import importlib.metadata as md
    from types import SimpleNamespace

    from granikv.serving import server as srvmod
    from runners import plugin_check

    spec = srvmod.ServerSpec(argv=(sys.executable, "-m", "sglang.launch_server"), env=(), host="127.0.0.1",
                             port=0, start_timeout_s=1.0)
    served = SimpleNamespace(adopted=False, started_s=1.0, url="http://127.0.0.1:1", log_tail=lambda: ["ready"])
    pool = SimpleNamespace(acquire=lambda s: served, close=lambda keep: None)

    async def serve(*args):
        return [{"tokens": [1]}]

    monkeypatch.setattr(srvmod, "server_spec", lambda rc: spec)
    monkeypatch.setattr(srvmod, "POOL", pool)
    monkeypatch.setattr(plugin_check, "serve", serve)
    rc = SimpleNamespace(system=SimpleNamespace(name="sglang_server"))
    out, stats, info = plugin_check.run_one(rc, False, [], 16, 2, [], stop=True)
    assert out == [{"tokens": [1]}] and stats is None
    assert info["packages"]["torch"] == md.version("torch")
    assert info["packages"]["sglang"] is None            # not installed here: named as absent, not left out
