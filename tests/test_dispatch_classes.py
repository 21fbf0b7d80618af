"""Rules per class count: the table's classes_min/max, the fit per k, the policy's k, calibrate's k > 1 cells."""
import os
import subprocess
import sys
from pathlib import Path
import pytest
import yaml

from granikv import rawio
from granikv.attention.bench import Shape
from granikv.attention.dispatch import Dispatcher, check_table
from granikv.attention.plan import ClassPlan
from granikv.attention.policy import GranikvPolicy
from runners.calibrate import cell_name, eager_costs, fit, grid, guarded_best

ROOT = Path(__file__).resolve().parents[1]
SH = Shape("s", 32, 8, 128)
G = "G"


def _pt(lp, meff, k, times, eager=None):
    p = {"prefix_len": lp, "meff": meff, "times": times}
    if k > 1:
        p["classes"] = k
    if eager is not None:
        p["times_eager"], p["host_eager"] = eager, {c: 0.0 for c in eager}
    return p


def points(eager: bool = False):
    """k=1: dense wins at Meff >= 128; k=8: the batched cascade wins at Meff 128 (eight small dense calls
    cost more), dense still at 2048; k=2 as k=1."""
    out = []
    for k in (1, 2, 8):
        for meff in (32, 128, 2048):
            if meff == 32:
                t = {"paged": 1.0, "cascade": 2.0, "dense": 3.0}
            elif meff == 128 and k == 8:
                t = {"paged": 3.0, "cascade": 1.0, "dense": 2.0}
            else:
                t = {"paged": 3.0, "cascade": 2.0, "dense": 1.0}
            out.append(_pt(4096, meff, k, t, dict(t) if eager else None))
    return out


def test_fit_per_class_count_and_the_dispatcher_follows_it():
    rules = fit(points(), G, SH)
    assert {(r.get("classes_min"), r.get("classes_max")) for r in rules} == {(None, 2), (2, 4), (4, None)}
    d = Dispatcher(32, 8, 128, G, rules)
    assert d.class_specific and not d.kind_specific
    for p in points():
        want = min(p["times"], key=p["times"].get)
        assert d.choose(p["prefix_len"], p["meff"] // 4, classes=p.get("classes", 1)) == want, p
    # between the measured counts: the geometric cuts (sqrt(2*8) = 4): 3 classes as 2, 5 as 8
    assert d.choose(4096, 32, classes=3) == "dense" and d.choose(4096, 32, classes=5) == "cascade"
    assert d.choose(4096, 32, classes=64) == "cascade"          # beyond the largest measured k: as k=8
    assert d.fallbacks == 0


def test_fit_with_one_class_count_writes_no_class_keys():
    one = [p for p in points() if "classes" not in p]
    rules = fit(one, G, SH)
    assert not any("classes_min" in r or "classes_max" in r for r in rules)
    assert not Dispatcher(32, 8, 128, G, rules).class_specific
    # eager == graph at every k: no graph key, whatever the class counts
    assert not any("graph" in r for r in fit(points(eager=True), G, SH))


def test_fit_writes_both_kinds_when_one_class_count_differs():
    pts = points(eager=True)
    for p in pts:
        if p.get("classes") == 8 and p["meff"] == 128:
            p["times_eager"] = {"paged": 1.0, "cascade": 2.0, "dense": 3.0}     # eager: paged there
    rules = fit(pts, G, SH)
    d = Dispatcher(32, 8, 128, G, rules)
    assert d.kind_specific and d.class_specific
    assert d.choose(4096, 32, graph=True, classes=8) == "cascade"
    assert d.choose(4096, 32, graph=False, classes=8) == "paged"
    assert d.choose(4096, 32, graph=False, classes=1) == "dense"


def test_check_table_checks_class_ranges():
    assert check_table([{"choice": "dense", "classes_min": 2, "classes_max": 4}])
    with pytest.raises(ValueError, match=r"\[0\]: classes_max=2 must be > classes_min=2"):
        check_table([{"choice": "dense", "classes_min": 2, "classes_max": 2}])
    with pytest.raises(ValueError, match=r"\[0\]\.classes_min: must be a non-negative int"):
        check_table([{"choice": "dense", "classes_min": -1}])


def _classes(spec):
    out, row = [], 0
    for i, (lp, n, n_real) in enumerate(spec):
        out.append(ClassPlan(i, list(range(row, row + n)), lp, 0, n_real=n_real))
        row += n
    return out


def test_policy_counts_the_steps_classes_with_a_real_request():
    table = [{"classes_min": 3, "choice": "cascade"}, {"choice": "dense"}]
    pol = GranikvPolicy(Dispatcher(32, 8, 128, G, table))
    two = _classes([(4096, 8, 8), (2048, 8, 8), (1024, 4, 0)])     # the third: CUDA-graph pad rows only
    pol.choose(two, 20)
    assert [c.choice for c in two] == ["dense", "dense", "paged"]
    three = _classes([(4096, 8, 8), (2048, 8, 8), (1024, 4, 1)])
    pol.choose(three, 20)
    assert [c.choice for c in three] == ["cascade"] * 3
    # a table without class ranges: every step decides as one class, and the cache stays one key per class
    d = Dispatcher(32, 8, 128, G, [{"choice": "dense"}])
    GranikvPolicy(d).choose(_classes([(4096, 8, 8), (2048, 8, 8)]), 16)
    assert not d.class_specific and set(d.decisions) == {(4096, 8, 1), (2048, 8, 1)}


def test_grid_and_cell_names():
    from types import SimpleNamespace

    spec = SimpleNamespace(prefix_lens=[512, 8192], batches=[1, 64, 512])
    own = {"num_classes": [1, 4, 16], "class_prefix_lens": [2048], "class_batches": [8, 64], "max_batch": 512}
    cells = grid(spec, own)
    assert [c for c in cells if c[2] == 1] == [(lp, b, 1) for lp in (512, 8192) for b in (1, 64, 512)]
    assert [c for c in cells if c[2] > 1] == [(2048, 8, 4), (2048, 64, 4), (2048, 8, 16)]     # 16 x 64 > 512
    assert grid(spec, {}) == [(lp, b, 1) for lp in (512, 8192) for b in (1, 64, 512)]
    assert cell_name(SH, 2048, 8, 4) == "s-lp2048-b8-k4" and cell_name(SH, 2048, 8, 1) == "s-lp2048-b8"


def test_calibrate_classes_reuses_one_class_cells_of_another_folder(tmp_path):
    """k=1 cells measured by an earlier run (another folder) are read, not measured again; the k > 1
    cells are measured with classes of adjacent rows; the fit covers both and its rules carry the
    class ranges the dispatcher then follows at every measured point."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = ["-m", "runners.calibrate", f"results_dir={tmp_path}", "prefix_lens=[16,64]", "batches=[1,8]"]
    p = subprocess.run([sys.executable, *base, "write_table=false", "sweep_name=one"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    before = {f: f.stat().st_mtime_ns for f in (tmp_path / "one").rglob("*.json")}
    hw = tmp_path / "cpu.yaml"
    p = subprocess.run([sys.executable, *base, f"hardware_yaml={hw}", "sweep_name=multi", "reuse_from=[one]",
                        "num_classes=[1,2]", "class_batches=[2,4]", "max_batch=8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 read from ['one']" in p.stdout, p.stdout[-2000:]
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "one").rglob("*.json")} == before   # untouched
    multi = tmp_path / "multi"
    measured = sorted(d.name for d in multi.iterdir() if not d.name.startswith("fit-"))
    assert measured == ["tiny_g4-lp16-b2-k2", "tiny_g4-lp16-b4-k2", "tiny_g4-lp64-b2-k2", "tiny_g4-lp64-b4-k2"]
    cfg = rawio.read_json(multi / "tiny_g4-lp64-b4-k2" / "config.json")
    assert cfg["cell"]["num_prefixes"] == 2 and cfg["cell"]["class_rows"] == "blocked"
    assert cfg["cell"]["batch"] == 8 and cfg["cell"]["batch_class"] == 4 and cfg["cell"]["meff"] == 16
    rows = rawio.read_jsonl(multi / "tiny_g4-lp64-b4-k2" / "kernel.jsonl")
    assert {len(r["decisions"]) for r in rows} == {2}                 # two classes of 4 requests each
    table = yaml.safe_load(hw.read_text())["decision_table"]
    fitm = rawio.read_json(multi / "fit-tiny_g4" / "metrics.json")
    assert fitm["decision_table"] == table and fitm["num_points"] == 8 and fitm["class_specific"]
    d = Dispatcher(8, 2, 16, "cpu", table)
    for pt in rawio.read_jsonl(multi / "fit-tiny_g4" / "kernel.jsonl"):
        k = pt.get("classes", 1)
        for graph, cost in ((True, pt["times"]), (False, eager_costs(pt))):
            c = d.choose(pt["prefix_len"], pt["meff"] // 4, graph=graph, classes=k)
            assert c == guarded_best(cost), (pt, graph)
    # a cell of another GPU model is not reused: measured again here
    cfg_path = tmp_path / "one" / "tiny_g4-lp16-b1" / "config.json"
    rawio.write_json(cfg_path, {**rawio.read_json(cfg_path), "provenance": {"gpu_name": "another GPU"}})
    p = subprocess.run([sys.executable, *base, "write_table=false", "sweep_name=multi2", "reuse_from=[one]"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "calibrate: 1 measured" in p.stdout and "3 read from" in p.stdout, p.stdout[-2000:]
    assert (tmp_path / "multi2" / "tiny_g4-lp16-b1" / "metrics.json").exists()
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, *base, "sweep_name=one", "reuse_from=[one]"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=True)


def test_table_one_class_mode_ignores_the_class_count():
    rules = fit(points(), G, SH)
    one = Dispatcher(32, 8, 128, G, rules, mode="table_one_class")
    full = Dispatcher(32, 8, 128, G, rules)
    assert not one.class_specific
    assert full.choose(4096, 32, classes=8) == "cascade"
    assert one.choose(4096, 32, classes=8) == one.choose(4096, 32) == full.choose(4096, 32, classes=1) == "dense"
    pol = GranikvPolicy(one)
    cs = _classes([(4096, 32, 32)] * 8)
    pol.choose(cs, 256)
    assert {c.choice for c in cs} == {"dense"}
    GranikvPolicy(full).choose(cs, 256)
    assert {c.choice for c in cs} == {"cascade"}
