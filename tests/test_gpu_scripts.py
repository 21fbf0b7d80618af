"""runners/gpu/sweep.sh's own logic, run on CPU (tiny model, GRANIKV_ENV_CPU_TEST: no FlashInfer):
the two-sweeps-at-once split (GRANIKV_GPU_SPLIT), what each cell's provenance then records, the
packing of the changed cells, and the refusal of a split that cannot work."""
from __future__ import annotations
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["workload.prefix_len=64"]   # smoke: tiny model, B=4, 8 output tokens


@pytest.fixture()
def repo(tmp_path) -> Path:
    """A copy of the code (no results) to run the script in: it writes results/raw under its cwd."""
    dst = tmp_path / "repo"
    dst.mkdir()
    for name in ("conf", "granikv", "runners", "analysis"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _sweep(repo: Path, out: Path, split: str, ngpu: int, gate: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRANIKV_ENV_CPU_TEST": "1", "GRANIKV_SKIP_FUSED_CHECK": "1", "PYTHON": sys.executable,
           "OUT": str(out), "GRANIKV_GPU_SPLIT": split, "GRANIKV_NGPU": str(ngpu), "GRANIKV_BUDGET_S": "400",
           "GRANIKV_PACK_RESERVE_S": "10", "GRANIKV_GIT_COMMIT": "0" * 40, "GRANIKV_GIT_DIRTY": "false",
           "GRANIKV_DONE_DIR": str(repo.parent / "done")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gate:
        env.pop("GRANIKV_SKIP_FUSED_CHECK")
    return subprocess.run(["bash", "runners/gpu/sweep.sh", "smoke", "--", *TINY], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)


def test_split_runs_one_sweep_per_part_and_records_it(repo, tmp_path):
    out = tmp_path / "out"
    p = _sweep(repo, out, "system=sglang_default|system=granikv", ngpu=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cells = sorted((repo / "results/raw/smoke").glob("*/metrics.json"))
    assert [c.parent.name for c in cells] == ["system=granikv,workload.prefix_len=64",
                                              "system=sglang_default,workload.prefix_len=64"]
    seen = {}
    for c in cells:
        prov = json.loads((c.parent / "config.json").read_text())["provenance"]
        seen[c.parent.name.split(",")[0]] = (prov["cuda_visible_devices"], prov["concurrent_sweeps"])
    # part i ran with CUDA_VISIBLE_DEVICES=i, and both know they shared the host
    assert seen == {"system=sglang_default": ("0", 2), "system=granikv": ("1", 2)}
    assert (out / "sweep.gpu0.log").exists() and (out / "sweep.gpu1.log").exists()
    parts = sorted(out.glob("raw.tar.gz.part-*"))
    data = b"".join(x.read_bytes() for x in parts)
    (tmp_path / "raw.tar.gz").write_bytes(data)
    with tarfile.open(tmp_path / "raw.tar.gz") as t:
        names = {n for n in t.getnames() if n.endswith("metrics.json")}
    assert names == {f"results/raw/smoke/{c.parent.name}/metrics.json" for c in cells}
    listed = p.stdout[p.stdout.index("== cells finished in this call =="):].splitlines()[1:]
    assert sorted(ln.split(":")[0] for ln in listed if "tok/s" in ln) == [f"smoke/{c.parent.name}" for c in cells]
    # a cell carried in (finished by an earlier call) is skipped, and neither packed nor listed again
    again = _sweep(repo, tmp_path / "out2", "system=sglang_default|system=granikv", ngpu=2)
    assert again.returncode == 0 and "no cell written" in again.stdout
    assert "tok/s" not in again.stdout[again.stdout.index("== cells finished in this call =="):]
    # the next call on the same warm machine gets the checkout without those cells: they are skipped all the
    # same (their metrics.json kept outside the checkout), not measured twice
    shutil.rmtree(repo / "results/raw/smoke")
    third = _sweep(repo, tmp_path / "out3", "system=sglang_default|system=granikv", ngpu=2)
    assert third.returncode == 0 and "2 cell(s) finished by an earlier call on this machine" in third.stdout
    assert "no cell written" in third.stdout and not list((tmp_path / "out3").glob("raw.tar.gz.part-*"))


def test_split_refuses_more_parts_than_gpus(repo, tmp_path):
    p = _sweep(repo, tmp_path / "out", "system=sglang_default|system=granikv", ngpu=1)
    assert p.returncode == 2
    assert "GRANIKV_GPU_SPLIT has 2 parts for 1 GPUs" in p.stdout
    assert not (repo / "results/raw/smoke").exists()


def test_a_failed_gate_stops_later_sweeps_of_the_same_call(repo, tmp_path):
    """The engine GPU gate fails on CPU (its tests skip without CUDA): sweep.sh exits 3, measures nothing
    and marks $OUT/.gate_failed; a later sweep.sh of the same device call then measures nothing either,
    even with GRANIKV_SKIP_FUSED_CHECK set."""
    shutil.copytree(ROOT / "tests", repo / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    out = tmp_path / "out"
    p = _sweep(repo, out, "", ngpu=1, gate=True)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / ".gate_failed").exists()
    p = _sweep(repo, out, "", ngpu=1)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "failed the engine GPU gate" in p.stdout
    assert not (repo / "results/raw/smoke").exists()


def test_slim_tree_leaves_out_the_bulk_and_brings_it_back(tmp_path):
    """runners/gpu/slim_tree.sh on a throwaway git repo: `on` removes the per-cell traces from the
    working tree (not from git) and keeps config/metrics; `off` restores them byte for byte.
    Traces of a cell not yet committed stay on disk but are excluded from what travels while `on`
    holds; `off` lists them again and leaves the user's own exclude lines alone."""
    g = tmp_path / "g"
    cell = g / "results" / "raw" / "sweep" / "system=granikv"
    cell.mkdir(parents=True)
    files = {"config.json": b"{}", "metrics.json": b'{"x": 1}', "requests.jsonl.gz": b"R" * 100,
             "steps.jsonl.gz": b"S" * 100, "workload.jsonl": b"W\n"}
    for n, b in files.items():
        (cell / n).write_bytes(b)
    (g / "runners" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "runners" / "gpu" / "slim_tree.sh", g / "runners" / "gpu")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "cells"]):
        subprocess.run(cmd, cwd=g, env=env, check=True)
    exclude = g / ".git" / "info" / "exclude"
    exclude.write_text("/.whl/\n")
    on = subprocess.run(["bash", "runners/gpu/slim_tree.sh", "on"], cwd=g, capture_output=True, text=True)
    assert on.returncode == 0, on.stderr
    assert sorted(p.name for p in cell.iterdir()) == ["config.json", "metrics.json"]
    assert "3 raw files left out" in on.stdout
    assert subprocess.run(["git", "status", "--porcelain"], cwd=g, capture_output=True, text=True).stdout == ""

    def untracked():
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=g,
                             capture_output=True, text=True, check=True).stdout
        return sorted(line[3:].rsplit("/", 1)[1] for line in out.splitlines())

    new = g / "results" / "raw" / "sweep" / "system=sglang_default"  # unpacked between two calls
    new.mkdir()
    for n, b in files.items():
        (new / n).write_bytes(b)
    assert untracked() == ["config.json", "metrics.json"]
    again = subprocess.run(["bash", "runners/gpu/slim_tree.sh", "on"], cwd=g, capture_output=True, text=True)
    assert again.returncode == 0 and exclude.read_text().count("slim_tree.sh: untracked") == 1
    off = subprocess.run(["bash", "runners/gpu/slim_tree.sh", "off"], cwd=g, capture_output=True, text=True)
    assert off.returncode == 0, off.stderr
    assert {p.name: p.read_bytes() for p in cell.iterdir()} == files
    assert untracked() == sorted(files)
    assert exclude.read_text() == "/.whl/\n"
    assert subprocess.run(["bash", "runners/gpu/slim_tree.sh"], cwd=g, capture_output=True).returncode == 2


def _sgl(root: Path, script: str, **env) -> subprocess.CompletedProcess:
    """``script`` after sourcing runners/gpu/sglang.sh with its working root at ``root``."""
    full = {**os.environ, "SGL_ROOT": str(root), **{k: str(v) for k, v in env.items()}}
    return subprocess.run(["bash", "-c", f"source {ROOT}/runners/gpu/sglang.sh; {script}"], cwd=root, env=full,
                          capture_output=True, text=True, timeout=120)


def test_sglang_jit_cache_without_carried_parts_comes_from_the_committed_seed(tmp_path):
    """No SGLang JIT part staged: sglang_jit_restore restores the seed committed in runners/gpu/sgl_jit_seed, a
    whole archive of SGLang's FlashInfer module cache (compiled modules for sm90a)."""
    seed = sorted((ROOT / "runners" / "gpu" / "sgl_jit_seed").glob("sgl_fi_cache.tar.xz.part-*"))
    assert seed, "runners/gpu/sgl_jit_seed holds no sgl_fi_cache.tar.xz.part-*"
    whole = tmp_path / "seed.tar.xz"
    whole.write_bytes(b"".join(p.read_bytes() for p in seed))
    with tarfile.open(whole, "r:xz") as tf:
        names = tf.getnames()
    assert any(n.startswith(".cache/flashinfer/") and n.endswith(".so") for n in names), names[:5]
    new, site = tmp_path / "new", tmp_path / "site"
    new.mkdir()
    (site / "flashinfer").mkdir(parents=True)
    r = _sgl(new, "sglang_jit_restore", GRANIKV_SGLANG_SITE=site, GRANIKV_SGLANG_PARTS=tmp_path / "staged")
    assert "restored the FlashInfer JIT cache" in r.stdout, r.stdout + r.stderr
    assert any(p.suffix == ".so" for p in (new / ".sgl_fi_cache" / ".cache" / "flashinfer").rglob("*"))


def test_sglang_jit_cache_travels_in_parts_and_is_restored_whole(tmp_path):
    """SGLang's FlashInfer JIT cache: packed from one machine's workspace into $OUT parts, carried one
    per staging call, restored whole on the next machine, with the installed sources' mtimes set back
    (ninja would otherwise rebuild every module); a missing part leaves no half cache behind."""
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    mod = old / ".sgl_fi_cache" / ".cache" / "flashinfer" / "0.6.15" / "90a" / "cached_ops" / "single_prefill"
    mod.mkdir(parents=True)
    blob = os.urandom(5 << 19)                   # incompressible: three 1 MiB parts
    (mod / "single_prefill.so").write_bytes(blob)
    (mod / "build.ninja").write_text("rule cxx\n")
    (mod / ".ninja_lock.lock").write_text("")
    p = _sgl(old, "sglang_pack_jit 3", OUT=out, GRANIKV_JIT_PART_MIB=1)
    assert p.returncode == 0, p.stderr
    parts = sorted(out.glob("sgl_fi_cache.tar.xz.part-*"))
    assert [q.name[-2:] for q in parts] == ["aa", "ab", "ac"], p.stdout
    assert "packed the JIT cache: 3 part(s)" in p.stdout
    assert _sgl(old, "sglang_pack_jit 2", OUT=out / "small", GRANIKV_JIT_PART_MIB=1).stdout.count("not packed") == 1
    assert not list((out / "small").glob("sgl_fi_cache*"))

    site, staged = tmp_path / "site", tmp_path / "staged"
    (site / "flashinfer").mkdir(parents=True)
    (site / "flashinfer" / "prefill.cuh").write_text("// source\n")
    env = {"GRANIKV_SGLANG_SITE": site, "GRANIKV_SGLANG_PARTS": staged}
    (new / ".sgl_fi_cache" / "parts").mkdir(parents=True)
    for q in parts[:2]:                          # two of the three calls so far
        shutil.copy(q, new / ".sgl_fi_cache" / "parts")
    assert _sgl(new, "sglang_stage", **env).returncode == 0
    r = _sgl(new, "sglang_jit_restore", **env)
    assert "do not make a whole archive" in r.stdout and not (new / ".sgl_fi_cache" / ".cache").exists()
    shutil.rmtree(new / ".sgl_fi_cache" / "parts")
    (new / ".sgl_fi_cache" / "parts").mkdir()
    shutil.copy(parts[2], new / ".sgl_fi_cache" / "parts")   # the third call
    assert _sgl(new, "sglang_stage", **env).returncode == 0
    r = _sgl(new, "sglang_jit_restore", **env)
    assert "restored the FlashInfer JIT cache" in r.stdout, r.stdout + r.stderr
    got = new / ".sgl_fi_cache" / mod.relative_to(old / ".sgl_fi_cache")
    assert (got / "single_prefill.so").read_bytes() == blob and not (got / ".ninja_lock.lock").exists()
    assert (site / "flashinfer" / "prefill.cuh").stat().st_mtime < (got / "single_prefill.so").stat().st_mtime
    assert (site / "flashinfer" / "prefill.cuh").stat().st_mtime < 1.6e9          # 2020-01-01
    r = _sgl(new, 'echo "ws=$FLASHINFER_WORKSPACE_BASE"', **env)
    assert f"ws={new}/.sgl_fi_cache" in r.stdout


def _git_repo(g: Path) -> dict:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "cells"]):
        subprocess.run(cmd, cwd=g, env=env, check=True)
    return env


def test_unpack_refuses_to_overwrite_a_committed_cell_unless_told(tmp_path):
    """runners/gpu/unpack.sh: a call's raw parts unpack into results/raw, but a cell folder that
    already has a committed metrics.json stops the whole unpack (nothing written) until
    GRANIKV_UNPACK_REPLACE=1; JIT cache parts replace the older ones in .sgl_fi_cache/parts."""
    g = tmp_path / "g"
    old = g / "results" / "raw" / "sweep" / "rep=1,system=granikv"
    old.mkdir(parents=True)
    (old / "metrics.json").write_text('{"tok_s": 1}')
    (g / ".sgl_fi_cache" / "parts").mkdir(parents=True)
    (g / ".sgl_fi_cache" / "parts" / "sgl_fi_cache.tar.xz.part-ab").write_text("stale")
    (g / ".gitignore").write_text("/.sgl_fi_cache/\n")
    env = _git_repo(g)
    # what the device call packed: the same cell measured again, and a new one
    src = tmp_path / "src"
    for name, body in (("rep=1,system=granikv", '{"tok_s": 2}'), ("rep=1,system=sglang_default", '{"tok_s": 3}')):
        c = src / "results" / "raw" / "sweep" / name
        c.mkdir(parents=True)
        (c / "metrics.json").write_text(body)
    (src / "results" / "raw" / "sweep" / "half").mkdir()  # no metrics.json: not a cell
    files_at = tmp_path / "files_at"
    files_at.mkdir()
    blob = tmp_path / "raw.tar.gz"
    with tarfile.open(blob, "w:gz") as t:
        t.add(src / "results", arcname="results")
    data = blob.read_bytes()
    half = len(data) // 2
    (files_at / "raw.tar.gz.part-aa").write_bytes(data[:half])
    (files_at / "raw.tar.gz.part-ab").write_bytes(data[half:])
    (files_at / "sgl_fi_cache.tar.xz.part-aa").write_text("fresh")
    script = ROOT / "runners" / "gpu" / "unpack.sh"

    refused = subprocess.run(["bash", str(script), str(files_at)], cwd=g, env=env, capture_output=True, text=True)
    assert refused.returncode == 3, refused.stderr
    assert "results/raw/sweep/rep=1,system=granikv" in refused.stderr
    assert (old / "metrics.json").read_text() == '{"tok_s": 1}'
    assert not (g / "results" / "raw" / "sweep" / "rep=1,system=sglang_default").exists()

    done = subprocess.run(["bash", str(script), str(files_at)], cwd=g, env={**env, "GRANIKV_UNPACK_REPLACE": "1"},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 cell folder(s)" in done.stdout and "1 replaced" in done.stdout
    assert (old / "metrics.json").read_text() == '{"tok_s": 2}'
    assert (g / "results" / "raw" / "sweep" / "rep=1,system=sglang_default" / "metrics.json").exists()
    assert not (g / "results" / "raw" / "sweep" / "half").exists()
    assert sorted(p.name for p in (g / ".sgl_fi_cache" / "parts").iterdir()) == ["sgl_fi_cache.tar.xz.part-aa"]

    (files_at / "raw.tar.gz.part-ab").unlink()  # a part lost on the way
    cut = subprocess.run(["bash", str(script), str(files_at)], cwd=g, env=env, capture_output=True, text=True)
    assert cut.returncode == 2 and "a part missing" in cut.stderr


def test_pin_commit_measures_at_an_earlier_commit_with_todays_raw_results(tmp_path):
    """runners/gpu/pin_commit.sh on a throwaway repo: `on A` gives A's code with the branch's raw
    results, and provenance_env.sh names A, clean; the slim tree works while pinned; `off` returns to
    the branch with the cells measured meanwhile kept untracked. Bad uses exit 2 and change nothing.
    A predates pin_commit.sh, so while pinned the script runs through the copy `on` keeps in the git dir."""
    g = tmp_path / "g"
    (g / "runners" / "gpu").mkdir(parents=True)
    for s in ("provenance_env.sh", "slim_tree.sh"):
        shutil.copy(ROOT / "runners" / "gpu" / s, g / "runners" / "gpu")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*a):
        return subprocess.run(["git", *a], cwd=g, env=env, capture_output=True, text=True, check=True).stdout.strip()

    def sh(*a):
        return subprocess.run(["bash", "runners/gpu/" + a[0], *a[1:]], cwd=g, env=env, capture_output=True, text=True)

    def cell(name, body):
        d = g / "results" / "raw" / "s" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.json").write_text(body)
        (d / "steps.jsonl.gz").write_text("S" * 50)

    git("init", "-q", "-b", "main")
    (g / "code.py").write_text("v1\n")
    cell("c1", "1")
    git("add", "-A"); git("commit", "-qm", "A")
    a = git("rev-parse", "HEAD")
    (g / "code.py").write_text("v2\n")
    shutil.copy(ROOT / "runners" / "gpu" / "pin_commit.sh", g / "runners" / "gpu")
    cell("c2", "2")
    git("add", "-A"); git("commit", "-qm", "B")
    b = git("rev-parse", "HEAD")
    (g / "stray.txt").write_text("x")
    assert sh("pin_commit.sh", "on", a).returncode == 2 and git("rev-parse", "HEAD") == b   # dirty tree
    (g / "stray.txt").unlink()
    assert sh("pin_commit.sh", "off").returncode == 2                                        # not pinned
    on = sh("pin_commit.sh", "on", a)
    assert on.returncode == 0, on.stdout + on.stderr
    assert "to return: bash .git/granikv_pin_commit.sh off" in on.stdout
    assert not (g / "runners/gpu/pin_commit.sh").exists()                                    # A has none

    def pinned(*a):
        return subprocess.run(["bash", ".git/granikv_pin_commit.sh", *a], cwd=g, env=env, capture_output=True,
                              text=True)

    assert (g / "code.py").read_text() == "v1\n" and (g / "results/raw/s/c2/metrics.json").read_text() == "2"
    assert sh("provenance_env.sh").stdout.strip() == f"export GRANIKV_GIT_COMMIT={a} GRANIKV_GIT_DIRTY=false"
    assert pinned("on", a).returncode == 2                                                   # already pinned
    assert sh("slim_tree.sh", "on").returncode == 0 and not (g / "results/raw/s/c2/steps.jsonl.gz").exists()
    assert pinned("off").returncode == 2                                                     # slim tree on
    cell("c3", "3")                                                                           # measured while pinned
    assert sh("slim_tree.sh", "off").returncode == 0 and (g / "results/raw/s/c2/steps.jsonl.gz").exists()
    off = pinned("off")
    assert off.returncode == 0, off.stdout + off.stderr
    assert "2 new file(s)" in off.stdout and not (g / ".git/granikv_pin_commit.sh").exists()
    assert git("rev-parse", "HEAD") == b and git("symbolic-ref", "--short", "HEAD") == "main"
    assert (g / "code.py").read_text() == "v2\n" and (g / "results/raw/s/c3/metrics.json").read_text() == "3"
    assert git("status", "--porcelain") == "?? results/raw/s/c3/"


def test_kernel_sh_gates_measures_and_packs_like_sweep_sh(repo, tmp_path):
    """runners/gpu/kernel.sh on CPU (GRANIKV_ENV_CPU_TEST, kernel_bench's cpu preset): sweep_name is required;
    the gate's tests run first and a failing one measures nothing; the cells it finishes come back as
    raw.tar.gz parts, and a second call measures nothing again."""
    env = {**os.environ, "GRANIKV_ENV_CPU_TEST": "1", "PYTHON": sys.executable, "GRANIKV_BUDGET_S": "300",
           "GRANIKV_PACK_RESERVE_S": "10", "GRANIKV_GIT_COMMIT": "0" * 40, "GRANIKV_GIT_DIRTY": "false",
           "GRANIKV_KERNEL_HARDWARE": "cpu"}
    (repo / "tests").mkdir(exist_ok=True)
    gpu = "import pytest\n\n\n@pytest.mark.gpu\n"
    (repo / "tests" / "test_ok.py").write_text(gpu + "def test_ok():\n    assert True\n")
    (repo / "tests" / "test_bad.py").write_text(gpu + "def test_bad():\n    assert False\n")
    args = ["sweep_name=kb", "prefix_lens=[16]", "batches=[4]", "num_prefixes=[1]",
            "layout=false", "dispatch_cost=false", "backends=[dense,dense_cudnn]",
            "shapes=[{name:t,hq:8,hkv:2,d:16}]"]

    def run(out, tests, *a):
        e = {**env, "OUT": str(out), "GRANIKV_KERNEL_TESTS": tests}
        return subprocess.run(["bash", "runners/gpu/kernel.sh", *a], cwd=repo, env=e, capture_output=True, text=True,
                              timeout=600)

    p = run(tmp_path / "o0", "tests/test_ok.py", *[x for x in args if not x.startswith("sweep_name")])
    assert p.returncode == 2 and "sweep_name" in p.stdout
    p = run(tmp_path / "o1", "tests/test_bad.py", *args)
    assert p.returncode == 3 and not (repo / "results/raw/kb").exists()
    p = run(tmp_path / "o2", "tests/test_ok.py", *args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    parts = sorted((tmp_path / "o2").glob("raw.tar.gz.part-*"))
    data = b"".join(x.read_bytes() for x in parts)
    with tarfile.open(fileobj=__import__("io").BytesIO(data), mode="r:gz") as t:
        names = t.getnames()
    assert "results/raw/kb/t-lp16-b4-k1/metrics.json" in names
    rows = [json.loads(x) for x in (repo / "results/raw/kb/t-lp16-b4-k1/kernel.jsonl").read_text().splitlines()]
    assert [r["backend"] for r in rows] == ["dense", "dense_cudnn"]
    again = run(tmp_path / "o3", "tests/test_ok.py", *args)                       # resumable: nothing new
    assert again.returncode == 0 and "no cell written" in again.stdout
    env["GRANIKV_KERNEL_TOOL"] = "kernel_bench_gemm_floor"                       # the GEMM floor, packed the same way
    p = run(tmp_path / "o4", "tests/test_ok.py", "sweep_name=gf", "models=[{model:tiny,tp:1}]", "batches=[1]")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = b"".join(x.read_bytes() for x in sorted((tmp_path / "o4").glob("raw.tar.gz.part-*")))
    with tarfile.open(fileobj=__import__("io").BytesIO(data), mode="r:gz") as t:
        assert "results/raw/gf/tiny-tp1-m1/metrics.json" in t.getnames()


def test_jit_cache_is_restored_from_the_last_call_else_from_the_committed_seed(tmp_path):
    """env.sh restores the engine's FlashInfer JIT cache from the parts the last call brought back
    (.fi_cache/parts) and, in a fresh checkout that has none, from the seed committed in
    runners/gpu/jit_seed; the committed seed is a whole archive of FlashInfer's module cache."""
    seed = sorted((ROOT / "runners" / "gpu" / "jit_seed").glob("fi_cache.tar.xz.part-*"))
    assert seed, "runners/gpu/jit_seed holds no fi_cache.tar.xz.part-*"
    whole = tmp_path / "seed.tar.xz"
    whole.write_bytes(b"".join(p.read_bytes() for p in seed))
    with tarfile.open(whole, "r:xz") as tf:
        names = tf.getnames()
    assert any(n.startswith(".cache/flashinfer/") and n.endswith(".so") for n in names), names[:5]

    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "runners" / "gpu", root / "runners" / "gpu")
    env = {**os.environ, "GRANIKV_ENV_CPU_TEST": "1", "OUT": str(tmp_path / "out"),
           "GRANIKV_GIT_COMMIT": "0" * 40, "GRANIKV_GIT_DIRTY": "false"}

    def where() -> str:
        p = subprocess.run(["bash", "-c", "source runners/gpu/env.sh; fi_cache_parts_dir"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip().splitlines()[-1]

    assert where() == str(root / "runners" / "gpu" / "jit_seed")
    parts = root / ".fi_cache" / "parts"
    parts.mkdir(parents=True)
    (parts / "fi_cache.tar.xz.part-aa").write_bytes(b"x")
    assert where() == str(parts)


def test_calibrate_sh_measures_fits_and_packs_its_cells_and_table(repo, tmp_path):
    """runners/gpu/calibrate.sh on CPU (GRANIKV_ENV_CPU_TEST, the calibration's cpu preset): the cells go to
    results/raw/calibration_eager with graph and eager host times, the fitted table into the hardware yaml,
    and both come back in cal.tar.gz; a second call measures nothing again."""
    env = {**os.environ, "GRANIKV_ENV_CPU_TEST": "1", "PYTHON": sys.executable, "GRANIKV_BUDGET_S": "300",
           "GRANIKV_PACK_RESERVE_S": "10", "GRANIKV_GIT_COMMIT": "0" * 40, "GRANIKV_GIT_DIRTY": "false",
           "GRANIKV_CAL_HARDWARE": "cpu"}
    args = ["prefix_lens=[16]", "batches=[1,4]"]
    (repo / "tests").mkdir(exist_ok=True)
    gpu = "import pytest\n\n\n@pytest.mark.gpu\n"
    (repo / "tests" / "test_cal_ok.py").write_text(gpu + "def test_ok():\n    assert True\n")
    (repo / "tests" / "test_cal_bad.py").write_text(gpu + "def test_bad():\n    assert False\n")

    def run(out, tests="tests/test_cal_ok.py"):
        return subprocess.run(["bash", "runners/gpu/calibrate.sh", *args], cwd=repo,
                              env={**env, "OUT": str(out), "GRANIKV_CAL_TESTS": tests},
                              capture_output=True, text=True, timeout=600)

    bad = run(tmp_path / "o0", "tests/test_cal_bad.py")                 # a failing gate: nothing measured
    assert bad.returncode == 3 and not (repo / "results/raw/calibration_eager").exists(), bad.stdout[-2000:]
    p = run(tmp_path / "o1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "calibrate: 2 measured" in p.stdout
    with tarfile.open(tmp_path / "o1" / "cal.tar.gz", "r:gz") as t:
        names = t.getnames()
    assert "results/raw/calibration_eager/tiny_g4-lp16-b4/metrics.json" in names
    assert "results/raw/calibration_eager/fit-tiny_g4/metrics.json" in names and "conf/hardware/cpu.yaml" in names
    m = json.loads((repo / "results/raw/calibration_eager/tiny_g4-lp16-b4/metrics.json").read_text())
    assert {"host_ms_eager_paged", "time_ms_eager_dense", "time_ms_granikv_cascade"} <= set(m)
    assert "decision_table" in (repo / "conf/hardware/cpu.yaml").read_text()
    again = run(tmp_path / "o2")
    assert again.returncode == 0 and "calibrate: 0 measured, 2 already done" in again.stdout
