"""granikv.rawio: jsonl stored plain or gzip-compressed, lossless cell compression."""
import gzip
import os
import subprocess
import sys
from pathlib import Path
import pytest

from granikv import rawio

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"rid": i, "token_times_s": [0.1 * j for j in range(i + 3)], "output_ids": list(range(i, i + 3))}
        for i in range(20)]


def test_compressed_jsonl_reads_through_the_logical_name(tmp_path):
    p = rawio.write_jsonl(tmp_path / "requests.jsonl", ROWS, compress=True)
    assert p == tmp_path / "requests.jsonl.gz" and not (tmp_path / "requests.jsonl").exists()
    assert rawio.exists(tmp_path / "requests.jsonl") and rawio.data_path(tmp_path / "requests.jsonl") == p
    assert rawio.read_jsonl(tmp_path / "requests.jsonl") == ROWS
    # deterministic bytes (mtime 0): rerunning a cell with the same rows gives the same file
    b = p.read_bytes()
    rawio.write_jsonl(tmp_path / "requests.jsonl", ROWS, compress=True)
    assert p.read_bytes() == b


def test_one_form_per_logical_file(tmp_path):
    rawio.write_jsonl(tmp_path / "steps.jsonl", ROWS)
    rawio.write_jsonl(tmp_path / "steps.jsonl", ROWS[:2], compress=True)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["steps.jsonl.gz"]
    rawio.write_jsonl(tmp_path / "steps.jsonl", ROWS[:1])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["steps.jsonl"]
    assert rawio.read_jsonl(tmp_path / "steps.jsonl") == ROWS[:1]
    assert not rawio.exists(tmp_path / "requests.jsonl")


def test_corrupt_compressed_line_names_file_and_line(tmp_path):
    (tmp_path / "steps.jsonl.gz").write_bytes(gzip.compress(b'{"a": 1}\n{"a": \n'))
    with pytest.raises(rawio.SchemaError, match=r"steps.jsonl.gz:2"):
        rawio.read_jsonl(tmp_path / "steps.jsonl")


def test_compress_cell_is_lossless_and_cli(tmp_path):
    cell = tmp_path / "c"
    rawio.write_jsonl(cell / "requests.jsonl", ROWS)
    rawio.write_jsonl(cell / "workload.jsonl", ROWS[:3])
    rawio.write_json(cell / "metrics.json", {"x": 1})
    orig = {p.name: p.read_bytes() for p in cell.glob("*.jsonl")}
    r = subprocess.run([sys.executable, "-m", "granikv.rawio", "compress", str(cell)], cwd=ROOT,
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in cell.iterdir()) == ["metrics.json", "requests.jsonl.gz", "workload.jsonl.gz"]
    for name, raw in orig.items():
        assert gzip.decompress((cell / (name + ".gz")).read_bytes()) == raw
    assert rawio.read_jsonl(cell / "requests.jsonl") == ROWS


def test_provenance_takes_the_launchers_commit(monkeypatch):
    """On the GPU host the tree's .git may be stale: GRANIKV_GIT_COMMIT / _DIRTY win over git."""
    monkeypatch.setenv("GRANIKV_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("GRANIKV_GIT_DIRTY", "false")
    p = rawio.provenance()
    assert p["git_commit"] == "a" * 40 and p["git_dirty"] is False and p["git_commit_source"] == "GRANIKV_GIT_COMMIT"
    monkeypatch.delenv("GRANIKV_GIT_COMMIT")
    p = rawio.provenance()
    assert p["git_commit_source"] in ("git", "none") and p["git_commit"] == (p["git_head_seen"] or "unknown")



def test_provenance_records_a_shared_host(monkeypatch):
    monkeypatch.delenv("GRANIKV_CONCURRENT_SWEEPS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = rawio.provenance()
    assert p["concurrent_sweeps"] == 1 and p["cuda_visible_devices"] is None
    assert p["cpu_count"] == os.cpu_count() and (p["cpu_model"] is None or isinstance(p["cpu_model"], str))
    monkeypatch.setenv("GRANIKV_CONCURRENT_SWEEPS", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    p = rawio.provenance()
    assert p["concurrent_sweeps"] == 2 and p["cuda_visible_devices"] == "1"
    monkeypatch.setenv("GRANIKV_CONCURRENT_SWEEPS", "two")
    with pytest.raises(ValueError, match="GRANIKV_CONCURRENT_SWEEPS='two'.*whole number"):
        rawio.provenance()


def _repo(tmp_path):
    """A git repository with one commit of granikv/x.py and runners/y.sh; returns (path, commit)."""
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    (tmp_path / "granikv").mkdir()
    (tmp_path / "runners").mkdir()
    (tmp_path / "granikv" / "x.py").write_text("A = 1\n")
    (tmp_path / "runners" / "y.sh").write_text("echo y\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "c1"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, env=env, capture_output=True)
    commit = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True, env=env,
                            capture_output=True, text=True).stdout.strip()
    return tmp_path, commit


def test_provenance_refuses_a_clean_commit_whose_code_is_not_the_trees(tmp_path, monkeypatch):
    """GRANIKV_GIT_COMMIT said clean while the tree's code is another commit's (the branch's head exported while
    the tree is pinned to an older commit): refused, never recorded; said dirty: recorded with the files."""
    repo, commit = _repo(tmp_path)
    monkeypatch.setattr(rawio, "REPO", repo)
    monkeypatch.setenv("GRANIKV_GIT_COMMIT", commit)
    monkeypatch.setenv("GRANIKV_GIT_DIRTY", "false")
    assert rawio.code_check(commit) == ("same", [])
    p = rawio.provenance()
    assert p["git_code_check"] == "same" and p["git_code_differs"] is None
    os.chmod(repo / "runners" / "y.sh", 0o755)            # a mode change alone (a copied tree) is not a difference
    assert rawio.code_check(commit) == ("same", [])
    (repo / "granikv" / "x.py").write_text("A = 2\n")
    assert rawio.code_check(commit) == ("differs", ["granikv/x.py"])
    with pytest.raises(rawio.ProvenanceError, match="granikv/x.py.*provenance_env.sh"):
        rawio.provenance()
    monkeypatch.setenv("GRANIKV_GIT_DIRTY", "true")
    p = rawio.provenance()
    assert p["git_code_check"] == "differs" and p["git_code_differs"] == ["granikv/x.py"] and p["git_dirty"] is True


def test_provenance_code_check_unverifiable_without_the_commit(tmp_path, monkeypatch):
    """A commit this copy's git does not hold (the GPU host's .git can predate it), or no git at all: recorded
    as unverifiable, not refused."""
    (tmp_path / "r").mkdir()
    repo, _ = _repo(tmp_path / "r")
    monkeypatch.setattr(rawio, "REPO", repo)
    monkeypatch.setenv("GRANIKV_GIT_COMMIT", "b" * 40)
    monkeypatch.setenv("GRANIKV_GIT_DIRTY", "false")
    assert rawio.provenance()["git_code_check"] == "unverifiable"
    monkeypatch.setattr(rawio, "REPO", tmp_path / "nowhere")
    assert rawio.code_check("b" * 40) == ("unverifiable", [])
    monkeypatch.delenv("GRANIKV_GIT_COMMIT")
    assert rawio.provenance()["git_code_check"] is None      # git's own commit: its dirty flag says it
