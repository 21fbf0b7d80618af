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
