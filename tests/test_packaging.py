"""The project's own plumbing: pyproject vs environment.yml, make help, the kv benchmark entry point."""
import json
import re
import subprocess
import tomllib
from pathlib import Path
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_names_the_same_packages_as_pyproject():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = {_name(d) for d in proj["dependencies"]} | {_name(d) for d in proj["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    got = set()
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            if item.startswith("-e") or _name(item) in ("python", "pip"):
                continue
            got.add(CONDA_TO_PIP.get(_name(item), _name(item)))
    assert got == want, f"only in environment.yml: {got - want}; only in pyproject.toml: {want - got}"
    for spec in proj["optional-dependencies"]["gpu"]:  # GPU-only extra: named as a note
        assert _name(spec) in (ROOT / "environment.yml").read_text()


def test_every_make_target_is_documented_in_help():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-zA-Z_-]+):", text, flags=re.M))
    documented = set(re.findall(r"^([a-z][a-zA-Z_-]+):.*## ", text, flags=re.M))
    assert targets == documented, f"undocumented targets: {targets - documented}"
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for t in targets:
        assert f"make {t}" in out


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make reproduce" in readme


def test_kv_bench_runs_and_saves(tmp_path):
    from runners import kv_bench

    out = tmp_path / "kv.json"
    res = kv_bench.main(["--repeats", "20", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"]["match_16k"]["matched"] == 16384 == res["match_16k"]["matched"]
    assert saved["provenance"]["git_commit"]
