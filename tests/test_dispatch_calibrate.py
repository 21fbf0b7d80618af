"""Calibration: fitting a decision table from measured points, writing only its key, CPU end to end."""
import os
import subprocess
import sys
from pathlib import Path
import yaml

from granikv import rawio
from granikv.attention.bench import Shape
from granikv.attention.dispatch import Dispatcher
from runners.calibrate import fit, write_table

ROOT = Path(__file__).resolve().parents[1]
SH = Shape("s", 32, 8, 128)


def pts():
    out = []
    for lp in (512, 8192):
        for meff in (32, 128, 512, 2048):
            if lp == 512:
                t = {"paged": 1.0, "cascade": 2.0, "dense": 3.0}
            else:
                t = {"paged": 9.0, "cascade": 1.0 if meff < 512 else 2.0, "dense": 1.5 if meff < 512 else 1.0}
            out.append({"prefix_len": lp, "meff": meff, "times": t})
    return out


def test_fit_picks_fastest_at_every_point_and_splits_geometrically():
    rules = fit(pts(), "G", SH)
    d = Dispatcher(32, 8, 128, "G", rules)
    for p in pts():
        assert d.choose(p["prefix_len"], p["meff"] // 4) == min(p["times"], key=p["times"].get)
    assert d.choose(2000, 1) == "paged" and d.choose(2100, 1) == "cascade"      # cut at sqrt(512*8192)=2048
    assert d.choose(16384, 63) == "cascade" and d.choose(16384, 64) == "dense"       # Meff cut at 256
    assert d.fallbacks == 0 and len(rules) == 3


def test_write_table_keeps_other_keys_and_other_shapes(tmp_path):
    p = tmp_path / "h200.yaml"
    p.write_text("# owned by RUNNERS\nname: h200\ndevice: cuda\ndecision_table:\n"
                 "  - {gpu: G, num_q_heads: 20, num_kv_heads: 4, head_dim: 128, choice: dense}\n"
                 "  - {gpu: G, num_q_heads: 32, num_kv_heads: 8, head_dim: 128, choice: paged}\n"
                 "cuda_graph_max_bs: 256\n")
    rules = fit(pts(), "G", SH)
    write_table(p, rules, [SH], "G")
    text = p.read_text()
    assert text.startswith("# owned by RUNNERS\nname: h200\ndevice: cuda\n") and "cuda_graph_max_bs: 256" in text
    y = yaml.safe_load(text)
    assert y["decision_table"][0]["num_q_heads"] == 20                  # other shape kept
    assert y["decision_table"][1:] == rules                              # ours replaced
    write_table(tmp_path / "new.yaml", rules, [SH], "G")                 # created minimally
    assert yaml.safe_load((tmp_path / "new.yaml").read_text())["decision_table"] == rules


def test_calibrate_cpu_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    hw = tmp_path / "cpu.yaml"
    p = subprocess.run([sys.executable, "-m", "runners.calibrate", f"results_dir={tmp_path}", f"hardware_yaml={hw}",
                        "prefix_lens=[16,64]", "batches=[1,8]"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    table = yaml.safe_load(hw.read_text())["decision_table"]
    root = tmp_path / "calibration"
    assert rawio.read_json(root / "fit-tiny_g4" / "metrics.json")["decision_table"] == table
    d = Dispatcher(8, 2, 16, "cpu", table)
    for c in ("tiny_g4-lp16-b1", "tiny_g4-lp16-b8", "tiny_g4-lp64-b1", "tiny_g4-lp64-b8"):
        assert rawio.cell_state(root / c) == "done"
        m = rawio.read_json(root / c / "metrics.json")
        times = {"paged": m["time_ms_paged"], "cascade": m["time_ms_granikv_cascade"], "dense": m["time_ms_dense"]}
        lp, b = int(c.split("-lp")[1].split("-")[0]), int(c.split("-b")[1])
        assert d.choose(lp, b) == min(times, key=times.get)
