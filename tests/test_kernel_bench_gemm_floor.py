"""runners.kernel_bench_gemm_floor on CPU (tiny model, float32, eager): schema-valid, resumable cells with
provenance, the FLOP count of one decode step's weight GEMMs, and config errors that name the field."""
import os
import subprocess
import sys
from pathlib import Path
import pytest
import torch
from hydra import compose, initialize_config_dir
from granikv import rawio
from granikv.config import register
from runners.kernel_bench_gemm_floor import resolve, run

ROOT = Path(__file__).resolve().parents[1]
CELLS = ["tiny-tp1-m1", "tiny-tp1-m4", "tiny-tp2-m1", "tiny-tp2-m4"]
# conf/model/tiny.yaml: H=64, L=2, Hq=4, Hkv=2, D=16, I=128, V=512. Per layer K x N of one shard:
#   tp=1: qkv 64 x (4+2*2)*16=128, o 64 x 64, gate_up 64 x 256, down 128 x 64; lm_head 64 x 512
#   -> 2 * (8192 + 4096 + 16384 + 8192) + 32768 = 106496 MACs per token, FLOPs = 2 * M * 106496
#   tp=2: every N (qkv, gate_up, lm_head) or K (o, down) halves -> 53248 MACs per token
MACS = {1: 106496, 2: 53248}
PART_MACS_TP1 = {"qkv": 2 * 8192, "o": 2 * 4096, "gate_up": 2 * 16384, "down": 2 * 8192, "lm_head": 32768}
register()


def spec_of(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("kernel_bench_gemm_floor", overrides=[f"results_dir={tmp_path}", *overrides])
    return resolve(cfg)


def test_cpu_cells_are_well_formed_and_resumable(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "runners.kernel_bench_gemm_floor", f"results_dir={tmp_path}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path / "gemm_floor_cpu"           # CPU cells never land in the GPU sweep's folder
    assert sorted(d.name for d in root.iterdir()) == CELLS
    assert "wrote 4 cells, 0 failed" in p.stdout
    for c in CELLS:
        d = root / c
        assert rawio.cell_state(d) == "done"
        for f in rawio.REQUIRED_FILES["kernel"]:
            assert rawio.exists(d / f), (c, f)
        cfg = rawio.read_json(d / "config.json")
        assert all(k in cfg["provenance"] for k in rawio.PROVENANCE_KEYS)
        tp, m = int(c.split("-")[1][2:]), int(c.split("-")[2][1:])
        cell = cfg["cell"]
        assert cell["cell_id"] == c and cell["kind"] == "gemm_floor" and cell["device"] == "cpu"
        assert cell["model"]["name"] == "tiny" and cell["tp"] == tp and cell["batch"] == m
        assert cfg["dtype"] == "float32" and cfg["peaks"]["peak_tflops"] > 0
        rows = rawio.read_jsonl(d / "kernel.jsonl")
        assert [r["backend"] for r in rows] == ["step", "qkv", "o", "gate_up", "down", "lm_head"]
        step = rows[0]
        assert step["flops"] == 2 * m * MACS[tp]
        assert sum(r["flops"] for r in rows[1:]) == step["flops"]
        assert step["num_gemms"] == 2 * 4 + 1
        assert step["weight_bytes"] == 4 * MACS[tp]          # float32, no bias in the tiny model
        for r in rows:
            assert r["time_ms"] > 0 and r["graph"] is False   # CPU: eager, never a graph
            assert r["tflops"] == pytest.approx(r["flops"] / (r["time_ms"] * 1e-3) / 1e12)
        if tp == 1:
            assert {r["backend"]: r["flops"] for r in rows[1:]} == {k: 2 * m * v for k, v in PART_MACS_TP1.items()}
        met = rawio.read_json(d / "metrics.json")
        assert met["step_ms"] == step["time_ms"] and met["device"] == "cpu" and met["step_graph"] is False
    # the analysis reads these cells, and never takes a CPU cell as a GPU floor
    from analysis.measures.limit import gemm_floors
    from analysis.load import load_results
    res = load_results(tmp_path)
    assert len(res.cells) == 4 and set(res.cells["kind"]) == {"kernel"}
    assert {"cell.kind", "cell.model.name", "cell.tp", "cell.batch", "cell.device", "k.graph"} <= set(res.kernels.columns)
    assert gemm_floors(res).empty
    # resumable: a second run skips every finished cell; force reruns only the cells asked for
    assert run(spec_of(tmp_path)) == {"done": [], "skipped": CELLS, "failed": [], "left": []}
    rep = run(spec_of(tmp_path, "force=true", "cells=[tiny-tp2-m1]"))
    assert rep["done"] == ["tiny-tp2-m1"] and rep["failed"] == []


@pytest.mark.parametrize("override,field", [
    ("models=[{model:nosuch,tp:1}]", "models[0].model"),
    ("models=[{model:tiny,tp:3}]", "models[0].tp"),       # 3 divides neither 4 heads nor 2 KV heads
    ("models=[{model:tiny,tq:1}]", "models[0]"),
    ("batches=[4,0]", "batches"),
    ("reps=0", "reps"),
    ("+dtype=int8", "dtype"),
])
def test_bad_config_names_the_field(tmp_path, override, field):
    with pytest.raises(ValueError, match=r"config error at `kernel_bench_gemm_floor\." + field.replace("[", r"\[")
                       .replace("]", r"\]") + "`"):
        spec_of(tmp_path, override)
    assert not any(tmp_path.iterdir())


def test_unknown_cell_and_gpu_preset_without_gpu(tmp_path):
    with pytest.raises(ValueError, match=r"`kernel_bench_gemm_floor\.cells`: \['tiny-tp1-m9'\]"):
        run(spec_of(tmp_path, "cells=[tiny-tp1-m9]"))
    assert not any(tmp_path.iterdir())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"config error at `hardware`: hardware=h200 needs a CUDA GPU"):
            spec_of(tmp_path, "hardware=h200")


def test_a_folder_of_another_gpu_model_is_not_resumed(tmp_path):
    """A finished cell measured on another GPU model is neither skipped as this run's nor rerun beside it: the
    run is refused before anything is measured, and the error names sweep_name."""
    d = tmp_path / "gemm_floor_cpu" / "tiny-tp1-m1"
    rawio.write_json(d / "config.json", {"provenance": {"gpu_name": "NVIDIA H200"}})
    rawio.write_json(d / "metrics.json", {"cell_id": "tiny-tp1-m1", "step_ms": 1.0})
    for force in ("force=false", "force=true"):
        with pytest.raises(ValueError, match=r"config error at `kernel_bench_gemm_floor\.sweep_name`: .*NVIDIA H200"):
            run(spec_of(tmp_path, force))
    assert sorted(p.name for p in (tmp_path / "gemm_floor_cpu").iterdir()) == ["tiny-tp1-m1"]
    assert run(spec_of(tmp_path, "sweep_name=gemm_floor_cpu_mine", "cells=[tiny-tp1-m1]"))["done"] == ["tiny-tp1-m1"]


def test_every_gpu_preset_writes_a_folder_of_its_own():
    """Two GPU presets sharing a sweep folder would meet the refusal above on their first run."""
    from omegaconf import OmegaConf
    presets = OmegaConf.load(ROOT / "conf" / "kernel_bench_gemm_floor.yaml")["presets"]
    names = [p["sweep_name"] for p in presets.values()]
    assert len(names) == len(set(names)) and {"h200", "h100"} <= set(presets)
