"""runners.graph_step_bench on CPU (the FlashInfer stand-in): a cell per case with SGLang's decode and each forced
plugin path, every path computing SGLang's attention; resumable; the fit's rules are graph rules and a fit-only
run writes them into a hardware yaml and nothing under results; bad input names its field."""
from pathlib import Path

import pytest
import yaml

from attn_util import fake_fi_module  # noqa: F401  (a fixture)
from granikv import rawio
from granikv.attention.dispatch import Dispatcher, plugin_table

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def _spec(tmp_path, overrides=()):
    from hydra import compose, initialize_config_dir

    from granikv.config import register
    from runners import graph_step_bench as gsb

    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("graph_step_bench", overrides=[f"results_dir={tmp_path}", *overrides])
    return gsb.resolve(cfg)


def test_bench_cells_paths_fit_and_resume(fake_fi_module, tmp_path):
    from runners import graph_step_bench as gsb

    spec = _spec(tmp_path)
    names = ["lp16-b2", "lp16-b8", "lp64-b2", "lp64-b8", "hetero_k3"]
    assert [c.name for c in spec.cases] == names
    rep = gsb.run(spec)
    assert rep["done"] == names and not rep["failed"]
    root = tmp_path / "graph_step_cpu"
    for name in names:
        rows = rawio.read_jsonl(root / name / "kernel.jsonl")
        assert [r["path"] for r in rows] == ["sglang", "paged", "cascade", "dense"]
        assert all("error" not in r and r["rel_err"] < 1e-5 for r in rows)
        forced = {r["path"]: r["choices"] for r in rows[1:]}
        assert set(forced["paged"]) == {"paged"} and set(forced["cascade"]) == {"cascade"}
        assert set(forced["dense"]) == {"dense"}       # every slab aligned and inside the pool: all dense
        m = rawio.read_json(root / name / "metrics.json")
        assert set(m["time_ms"]) == {"sglang", "paged", "cascade", "dense"} and m["table_choice"]
        assert rawio.read_json(root / name / "config.json")["provenance"]["git_commit"]
    fit = rawio.read_json(root / "fit-tiny_g4" / "metrics.json")
    assert len(fit["points"]) == 4 and fit["rules"] == rep["rules"]
    assert rep["rules"] and all(r["graph"] is True for r in rep["rules"])
    assert gsb.run(spec)["skipped"] == names


def test_fit_only_writes_the_plugin_table_and_keeps_an_equal_fit_cell(fake_fi_module, tmp_path):
    from runners import graph_step_bench as gsb

    gsb.run(_spec(tmp_path))
    hw = tmp_path / "hw.yaml"
    hw.write_text("name: x\ndecision_table:\n- {choice: paged, graph: false}\n")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "graph_step_cpu").rglob("*")}
    rep = gsb.run(_spec(tmp_path, ["fit_only=true", "write_table=true", f"hardware_yaml={hw}"]))
    assert rep["skipped"] and not rep["done"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "graph_step_cpu").rglob("*")} == before   # nothing rewritten
    data = yaml.safe_load(hw.read_text())
    assert data["decision_table"] == [{"choice": "paged", "graph": False}] and data["name"] == "x"
    assert data["plugin_graph_table"] == rep["rules"]
    gsb.run(_spec(tmp_path, ["fit_only=true", "write_table=true", f"hardware_yaml={hw}"]))   # rewritten, not doubled
    assert yaml.safe_load(hw.read_text())["plugin_graph_table"] == rep["rules"]
    with pytest.raises(ValueError, match="graph_step_bench.fit_only"):
        gsb.run(_spec(tmp_path / "empty", ["fit_only=true"]))


def test_a_fit_cell_of_other_content_is_moved_aside(fake_fi_module, tmp_path):
    from runners import graph_step_bench as gsb

    gsb.run(_spec(tmp_path))
    fd = tmp_path / "graph_step_cpu" / "fit-tiny_g4"
    (fd / "kernel.jsonl").unlink()               # a fit cell in an older form: no kernel.jsonl
    gsb.run(_spec(tmp_path, ["fit_only=true"]))
    aside = list((tmp_path / "graph_step_cpu" / ".superseded").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("fit-tiny_g4.") and (fd / "kernel.jsonl").exists()
    assert rawio.read_json(fd / "config.json")["cell"]["kind"] == "graph_step_fit"


def test_a_spent_time_budget_starts_no_cell(fake_fi_module, tmp_path):
    from runners import graph_step_bench as gsb

    spec = _spec(tmp_path, ["time_budget_s=0.000001"])
    rep = gsb.run(spec)
    assert len(rep["done"]) == 1 and rep["not_started"] == [c.name for c in spec.cases[1:]]


@pytest.mark.parametrize("override,field", [("paths=[paged]", "paths"), ("suffix_min=0", "suffix_min"),
                                            ("reps=0", "reps"), ("cases=[{name:x,prefix_lens:[],batch:1}]",
                                                                 "cases")])
def test_bad_config_names_the_field(tmp_path, override, field):
    with pytest.raises(ValueError, match=f"graph_step_bench.{field}"):
        _spec(tmp_path, [override])


GPU = "NVIDIA H100 80GB HBM3"
ENGINE = [{"gpu": GPU, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "choice": "cascade", "graph": True},
          {"gpu": GPU, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "choice": "paged", "graph": False},
          {"gpu": GPU, "num_q_heads": 40, "num_kv_heads": 8, "head_dim": 128, "choice": "dense"}]
PLUGIN = [{"gpu": GPU, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "lp_max": 1024, "choice": "paged",
           "graph": True},
          {"gpu": GPU, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "lp_min": 1024, "choice": "dense",
           "graph": True}]


def test_plugin_table_takes_its_graph_rules_and_the_engines_eager_ones():
    d = Dispatcher(32, 8, 128, GPU, plugin_table(ENGINE, PLUGIN))
    assert d.choose(512, 256, graph=True) == "paged" and d.choose(2048, 256, graph=True) == "dense"
    assert d.choose(2048, 256, graph=False) == "paged"                  # the engine's eager rule
    other = Dispatcher(40, 8, 128, GPU, plugin_table(ENGINE, PLUGIN))  # a shape the plugin table does not name
    assert other.choose(2048, 256, graph=True) == "dense" and other.choose(2048, 256, graph=False) == "dense"
    engine = Dispatcher(32, 8, 128, GPU, ENGINE)
    assert engine.choose(512, 256, graph=True) == "cascade"
    assert plugin_table(ENGINE, None) == ENGINE
    with pytest.raises(ValueError, match=r"plugin_graph_table\[0\].graph"):
        plugin_table(ENGINE, [{**PLUGIN[0], "graph": False}])


def test_the_plugin_reads_the_hardware_yamls_plugin_table(tmp_path):
    from granikv.sglang_plugin.path_stats import load_hardware

    (tmp_path / "x.yaml").write_text(yaml.safe_dump({"name": "x", "gpu_name": GPU, "decision_table": ENGINE,
                                                     "plugin_graph_table": PLUGIN}))
    hw = load_hardware("auto", GPU, conf_dir=tmp_path)
    d = Dispatcher.from_hardware(hw, 32, 8, 128, gpu_name=GPU, plugin=True)
    assert d.choose(512, 256, graph=True) == "paged"
    assert Dispatcher.from_hardware(hw, 32, 8, 128, gpu_name=GPU).choose(512, 256, graph=True) == "cascade"
