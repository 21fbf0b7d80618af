"""kernel_bench on CPU (torch paths, tiny shapes) writes schema-valid, resumable cell folders."""
import os
import subprocess
import sys
from pathlib import Path
import pytest

from granikv import rawio

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["hardware=cpu", "prefix_lens=[16,40]", "batches=[4]", "num_prefixes=[1,2]", "layout_prefix_lens=[32]",
        "layout_batch=4", "shapes=[{name:t,hq:8,hkv:2,d:16}]"]


def _run(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "runners.kernel_bench", f"results_dir={tmp_path}", *ARGS, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_kernel_bench_cpu_cells(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    root = tmp_path / "kernel"
    cells = sorted(d.name for d in root.iterdir())
    assert cells == sorted(["t-lp16-b4-k1", "t-lp16-b4-k2", "t-lp40-b4-k1", "t-lp40-b4-k2", "layout-t-lp32-b4",
                            "dispatch_cost"])
    for c in cells:
        d = root / c
        assert rawio.cell_state(d) == "done"
        for f in rawio.REQUIRED_FILES["kernel"]:
            assert rawio.exists(d / f), (c, f)
        cfg = rawio.read_json(d / "config.json")
        assert all(k in cfg["provenance"] for k in rawio.PROVENANCE_KEYS)
        assert cfg["cell"]["cell_id"] == c
        rows = rawio.read_jsonl(d / "kernel.jsonl")
        assert rows
        if c.startswith("t-"):
            assert [r["backend"] for r in rows] == ["paged", "cascade", "hydragen", "dense", "dense_unsplit",
                                                    "granikv_cascade", "granikv"]
            for r in rows:
                assert r["time_ms"] > 0 and r["flops"] > 0 and r["bytes"] > 0 and r["tflops"] > 0
                assert r["max_abs_err"] < 1e-5 and r["decisions"]
            m = rawio.read_json(d / "metrics.json")
            assert m["fastest_backend"] in {r["backend"] for r in rows} and "dispatch_within_3pct" in m
            paged = next(r for r in rows if r["backend"] == "paged")
            dense = next(r for r in rows if r["backend"] == "dense")
            assert paged["bytes"] > dense["bytes"]          # paged reads the prefix once per request
        if c.startswith("layout"):
            m = rawio.read_json(d / "metrics.json")
            assert m["speedup_vs_paged_unique_decode"] > 0
            assert all(r["max_abs_err"] < 1e-5 for r in rows)
    # resumable: a second run skips every done cell
    p2 = _run(tmp_path)
    assert p2.returncode == 0 and "0 cells" in p2.stdout and "6 already done" in p2.stdout


def test_kernel_bench_refuses_a_folder_of_another_gpu_model(tmp_path):
    """A finished cell of another GPU model in the sweep folder: refused before anything runs (not skipped as
    done), the error naming sweep_name."""
    d = tmp_path / "kernel" / "t-lp16-b4-k1"
    rawio.write_json(d / "config.json", {"provenance": {"gpu_name": "NVIDIA H200"}})
    rawio.write_json(d / "metrics.json", {"cell_id": "t-lp16-b4-k1"})
    p = _run(tmp_path, "prefix_lens=[16]", "num_prefixes=[1]", "layout=false", "dispatch_cost=false")
    assert p.returncode != 0 and "config error at `kernel_bench.sweep_name`" in p.stderr + p.stdout
    assert sorted(x.name for x in (tmp_path / "kernel").iterdir()) == ["t-lp16-b4-k1"]


@pytest.mark.parametrize("bad,field", [("backends=[paged,fast]", "backends"), ("hardware=tpu", "hardware"),
                                       ("batches=[0]", "batches")])
def test_kernel_bench_bad_input(tmp_path, bad, field):
    p = _run(tmp_path, bad)
    assert p.returncode != 0 and field in (p.stderr + p.stdout)
    assert not (tmp_path / "kernel").exists()


def test_kernel_bench_cascade_composed_variant(tmp_path):
    # opt-in variant: SGLang-Cascade's split on the per-class cascade path, checked against the reference
    p = _run(tmp_path, "backends=[cascade,cascade_composed]", "cells=[t-lp16-b4-k1]")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = rawio.read_jsonl(tmp_path / "kernel" / "t-lp16-b4-k1" / "kernel.jsonl")
    assert [r["backend"] for r in rows] == ["cascade", "cascade_composed"]
    assert all(r["max_abs_err"] < 1e-5 and r["time_ms"] > 0 for r in rows)


def test_a_copied_hardware_option_takes_its_devices_preset_and_keeps_its_name(capsys):
    """conf/hardware/<mygpu>.yaml copied from h200.yaml: kernel_bench and calibrate run it with the
    cuda preset (shapes and grid do not depend on the GPU) under its own name, so calibrate writes
    the fitted table into <mygpu>.yaml; a device no preset covers is refused with the fix named."""
    from runners.kernel_bench import merge_preset

    presets = {"cpu": {"device": "cpu", "shapes": [{"name": "a", "hq": 8, "hkv": 2, "d": 16}], "reps": 3},
               "h200": {"device": "cuda", "shapes": [{"name": "b", "hq": 32, "hkv": 8, "d": 128}], "reps": 20}}
    own = merge_preset({"presets": presets, "hardware": {"name": "h200", "device": "cuda"}, "reps": None}, "kb")
    assert own["hardware"] == "h200" and own["reps"] == 20 and own["shapes"][0].name == "b"
    assert "no preset of its own" not in capsys.readouterr().out
    mine = merge_preset({"presets": presets, "hardware": {"name": "l40s", "device": "cuda"}, "reps": 5}, "kb")
    assert mine["hardware"] == "l40s" and mine["reps"] == 5 and mine["shapes"][0].name == "b"
    assert "using presets.h200" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"presets\.tpu1 to conf/kb\.yaml"):
        merge_preset({"presets": presets, "hardware": {"name": "tpu1", "device": "xla"}}, "kb")


def test_kernel_bench_dense_split_variants(tmp_path):
    # opt-in dense_s<n>: the dense backend over exactly n KV chunks (the search behind the SM-filling rule)
    # and dense_<kernel>[_s<n>]: the prefix call on torch's fused attention (on CPU the reference path)
    variants = ["dense", "dense_s1", "dense_s2", "dense_cudnn", "dense_fa2_s2"]
    p = _run(tmp_path, f"backends=[{','.join(variants)}]", "cells=[t-lp16-b4-k1]")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = rawio.read_jsonl(tmp_path / "kernel" / "t-lp16-b4-k1" / "kernel.jsonl")
    assert [r["backend"] for r in rows] == variants
    assert all(r["max_abs_err"] < 1e-5 and r["time_ms"] > 0 for r in rows)
    q = _run(tmp_path / "bad", "backends=[dense,dense_s3]", "cells=[t-lp16-b4-k1]")   # through the CLI once
    assert q.returncode != 0 and "dense[_<kernel>][_s<n>]" in (q.stderr + q.stdout)
    from runners import kernel_bench as kb
    for bad in ("dense_s128", "dense_s0", "dense_triton", "dense_cudnn_s5"):
        with pytest.raises(ValueError, match=r"dense\[_<kernel>\]\[_s<n>\]"):
            kb.BenchSpec(hardware="cpu", device="cpu", dtype="float32", shapes=[kb.Shape("t", 8, 2, 16)],
                         prefix_lens=[16], batches=[4], num_prefixes=[1], suffix_len=1, backends=["dense", bad],
                         warmup=0, reps=1, layout_batch=4, layout_prefix_lens=[16])


def test_kernel_bench_profile_kernels(tmp_path):
    # profile_kernels: each row splits its call into the ops (CPU) / kernels (GPU) it runs
    p = _run(tmp_path, "backends=[paged,dense]", "cells=[t-lp40-b4-k1,layout-t-lp32-b4]", "profile_kernels=true")
    assert p.returncode == 0, p.stderr[-3000:]
    for cell in ("t-lp40-b4-k1", "layout-t-lp32-b4"):
        for r in rawio.read_jsonl(tmp_path / "kernel" / cell / "kernel.jsonl"):
            ks = r["kernels"]
            assert ks and all(k["us_per_call"] > 0 and k["launches_per_call"] > 0 for k in ks), (cell, r["backend"])
            assert [k["us_per_call"] for k in ks] == sorted((k["us_per_call"] for k in ks), reverse=True)
            assert r["kernels_us_per_call"] == pytest.approx(sum(k["us_per_call"] for k in ks))
            assert any(k["name"].startswith("aten::") for k in ks)
            assert not any(k["name"] in ("aten::zero_", "aten::fill_") for k in ks)   # the L2 flush is left out
    plain = _run(tmp_path / "plain", "backends=[dense]", "cells=[t-lp40-b4-k1]")
    assert plain.returncode == 0
    assert "kernels" not in rawio.read_jsonl(tmp_path / "plain" / "kernel" / "t-lp40-b4-k1" / "kernel.jsonl")[0]


def test_kernel_bench_plan_time(tmp_path):
    # plan_reps: each decode row gets the steady-state host time of one step's plan; profile_plan its costliest functions
    p = _run(tmp_path, "backends=[paged,granikv]", "cells=[t-lp40-b4-k2]", "plan_reps=7", "profile_plan=4")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = rawio.read_jsonl(tmp_path / "kernel" / "t-lp40-b4-k2" / "kernel.jsonl")
    assert [r["backend"] for r in rows] == ["paged", "granikv"]
    for r in rows:
        assert r["plan_reps"] == 7 and 0 < r["plan_us_min_eager"] <= r["plan_us_eager"]
        prof = r["plan_profile_eager"]
        assert 1 <= len(prof) <= 4 and all(f["us_per_plan"] >= 0 and f["calls_per_plan"] > 0 for f in prof)
        assert [f["us_per_plan"] for f in prof] == sorted((f["us_per_plan"] for f in prof), reverse=True)
        assert "plan_us_graph" not in r                     # CPU: no CUDA graph, no graph-mode set
    # granikv's plan runs build_plan (the policy, the rest-of-request lists): it shows in the profile
    assert any("build_plan" in f["fn"] or "plan.py" in f["fn"] for f in rows[1]["plan_profile_eager"])
    plain = _run(tmp_path / "plain", "backends=[paged]", "cells=[t-lp40-b4-k1]")
    assert plain.returncode == 0
    assert "plan_us_eager" not in rawio.read_jsonl(tmp_path / "plain" / "kernel" / "t-lp40-b4-k1" / "kernel.jsonl")[0]


def test_kernel_bench_blocked_class_rows(tmp_path):
    # class_rows=blocked: each class's requests are adjacent rows, as the engine orders a decode batch
    import torch

    from granikv.attention.bench import Shape, build_cell
    _, _, rr = build_cell(Shape("t", 8, 2, 16), 8, 6, 2, 2, torch.float32, torch.device("cpu"))
    _, _, bl = build_cell(Shape("t", 8, 2, 16), 8, 6, 2, 2, torch.float32, torch.device("cpu"), blocked=True)
    assert rr.prefix_ids == [0, 1, 0, 1, 0, 1] and bl.prefix_ids == [0, 0, 0, 1, 1, 1]
    assert bl.hot_starts == [0, 0, 0, 8, 8, 8]
    p = _run(tmp_path, "backends=[paged,dense]", "class_rows=blocked", "cells=[t-lp40-b4-k1,t-lp40-b4-k2-blocked]")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = rawio.read_json(tmp_path / "kernel" / "t-lp40-b4-k2-blocked" / "config.json")
    assert cfg["cell"]["class_rows"] == "blocked" and rawio.cell_state(tmp_path / "kernel" / "t-lp40-b4-k1") == "done"
    bad = _run(tmp_path / "bad", "class_rows=sorted")
    assert bad.returncode != 0 and "kernel_bench.class_rows" in bad.stderr


def test_plan_host_time_checks_its_arguments():
    import torch

    from granikv.attention.bench import plan_host_time
    with pytest.raises(ValueError, match="reps"):
        plan_host_time(lambda: None, torch.device("cpu"), reps=0)
    t = plan_host_time(lambda: sum(range(1000)), torch.device("cpu"), reps=5, warmup=0, profile_top=2)
    assert t["plan_reps"] == 5 and t["plan_us"] > 0 and len(t["plan_profile"]) <= 2


def test_kernel_profile_rejects_no_calls():
    import torch

    from granikv.attention.bench import kernel_profile
    with pytest.raises(ValueError, match="calls"):
        kernel_profile(lambda: None, torch.device("cpu"), calls=0)


def test_ncu_layout_parses_every_kernel_of_each_variant(tmp_path, monkeypatch):
    # a stand-in `ncu` on PATH prints Nsight Compute's --csv records: two kernels per variant, in launch order
    from runners import kernel_bench as kb

    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n"
                    "echo '==PROF== Connected to process'\n"
                    "echo '\"ID\",\"Kernel Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"'\n"
                    "for m in 'gpu__time_duration.sum,nsecond,1,200' "
                    "'dram__throughput.avg.pct_of_peak_sustained_elapsed,%,5.5' "
                    "'sm__throughput.avg.pct_of_peak_sustained_elapsed,%,30'; do\n"
                    "  n=${m%%,*}; r=${m#*,}; u=${r%%,*}; v=${r#*,}\n"
                    "  echo \"\\\"0\\\",\\\"merge\\\",\\\"$n\\\",\\\"$u\\\",\\\"$v\\\"\"\n"
                    "done\n"
                    "echo '\"1\",\"prefill\",\"gpu__time_duration.sum\",\"nsecond\",\"150,000\"'\n"
                    "echo '\"1\",\"prefill\",\"sm__throughput.avg.pct_of_peak_sustained_elapsed\",\"%\",\"40\"'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    spec = kb.BenchSpec(hardware="cpu", device="cpu", dtype="float32", shapes=[kb.Shape("t", 8, 2, 16)],
                        prefix_lens=[16], batches=[4], num_prefixes=[1], suffix_len=1, backends=["dense"], warmup=0,
                        reps=1, layout_batch=4, layout_prefix_lens=[16])
    out = kb.ncu_layout(spec, spec.shapes[0], 16, 4)
    assert set(out) == {"contiguous_dense", "contiguous_dense_split", "paged_unique_prefill", "paged_unique_decode"}
    for v in out.values():
        assert v["kernel"] == "prefill" and v["sm_pct"] == 40 and v["dram_pct"] is None
        assert [k["name"] for k in v["kernels"]] == ["prefill", "merge"]              # longest first
        assert v["kernels"][0]["time_us"] == 150.0 and v["kernels"][1]["time_us"] == pytest.approx(1.2)
        assert v["kernels"][1]["dram_pct"] == 5.5


def test_layout_bytes_count_the_slab_once_for_both_contiguous_variants():
    from runners import kernel_bench as kb
    tok, qo = 2 * 8 * 128 * 2, 1000
    one = kb.layout_bytes("contiguous_dense", 16384, 256, tok, qo)
    assert one == 16384 * tok + qo
    assert kb.layout_bytes("contiguous_dense_split", 16384, 256, tok, qo) == one      # the chunks read the slab once
    assert kb.layout_bytes("paged_unique_decode", 16384, 256, tok, qo) == 256 * 16384 * tok + qo


def test_kernel_bench_slot_table_batches(tmp_path):
    # batch_form=slot_table: the cell's slot lists as slot-table rows (the engine's form), same lists as packed;
    # every backend's plan then gathers its own lists, and the outputs still match the reference
    import torch

    from granikv.attention.bench import Shape, build_cell
    _, _, packed = build_cell(Shape("t", 8, 2, 16), 8, 6, 2, 3, torch.float32, torch.device("cpu"))
    _, _, table = build_cell(Shape("t", 8, 2, 16), 8, 6, 2, 3, torch.float32, torch.device("cpu"), slot_table=True)
    assert table.kv_indices is None and torch.equal(table.all_slots(), packed.kv_indices)
    p = _run(tmp_path, "backends=[paged,granikv]", "batch_form=slot_table", "cells=[t-lp40-b4-k2]", "plan_reps=3")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = rawio.read_jsonl(tmp_path / "kernel" / "t-lp40-b4-k2" / "kernel.jsonl")
    assert all(r["max_abs_err"] < 1e-4 and r["plan_us_eager"] > 0 for r in rows)
    assert rawio.read_json(tmp_path / "kernel" / "t-lp40-b4-k2" / "config.json")["cell"]["batch_form"] == "slot_table"
    bad = _run(tmp_path / "bad", "batch_form=rows")
    assert bad.returncode != 0 and "kernel_bench.batch_form" in bad.stderr
