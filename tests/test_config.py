"""Every YAML under conf/ composes through Hydra and instantiates its dataclasses."""
from __future__ import annotations
import importlib.util
import itertools

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from granikv.config import (CONF_DIR, HardwareConfig, ModelConfig, RunConfig, SystemConfig, WorkloadConfig, options,
                            register, to_run_config)

CONF = CONF_DIR
GROUPS = ("model", "system", "workload", "hardware", "launcher", "sweep")
register()


@pytest.fixture(scope="module")
def hydra_ctx():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def _compose(overrides):
    return compose("config", overrides=overrides, return_hydra_config=True)


def test_contract_options_exist():
    assert set(options("model")) >= {"llama3_8b", "qwen25_14b", "qwen25_32b", "tiny"}
    assert set(options("system")) >= {"sglang_default", "sglang_cascade", "hydragen", "granikv"}
    assert set(options("workload")) == {"synthetic", "sharegpt", "multiprefix"}
    assert set(options("hardware")) == {"h200", "h100", "a100_40gb", "a100_40gb_on_h100", "cpu"}
    assert set(options("launcher")) == {"local", "slurm"}
    assert len(options("sweep")) >= 10


@pytest.mark.parametrize("group", ["model", "system", "workload", "hardware"])
def test_every_group_option_instantiates(hydra_ctx, group):
    kinds = {"model": ModelConfig, "system": SystemConfig, "workload": WorkloadConfig, "hardware": HardwareConfig}
    for opt in options(group):
        rc = to_run_config(_compose([f"{group}={opt}"]))
        assert isinstance(rc, RunConfig)
        sub = getattr(rc, group)
        assert isinstance(sub, kinds[group])
        if group in ("model", "hardware", "system"):
            assert sub.name == opt, f"{group}/{opt}.yaml has name={sub.name}"
        else:
            assert sub.kind == opt


def test_engine_systems_are_the_yaml_presets(hydra_ctx):
    """conf/system/<name>.yaml is the one source of a system's preset: runners.run composes it, and
    runners.engine_bench and the engine tests read it through granikv.config.system_config. The
    systems our engine runs are the paper's four and the ablations, by name."""
    from dataclasses import asdict

    from granikv.config import ABLATIONS, SYSTEMS, system_config
    composed = {opt: to_run_config(_compose([f"system={opt}"])).system for opt in options("system")}
    engine = {o for o, s in composed.items() if s.engine == "granikv"}   # the others run a real server
    assert engine == set(SYSTEMS) | set(ABLATIONS)
    for opt in composed:
        assert asdict(composed[opt]) == asdict(system_config(opt)), opt
    assert {o for o, s in composed.items() if s.engine == "sglang"} >= {"sglang_server"}


def test_launchers_compose(hydra_ctx):
    assert _compose(["launcher=local"]).hydra.launcher._target_.endswith("BasicLauncher")
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:  # no hydra_plugins package at all
        found = False
    if not found:
        pytest.skip("hydra-submitit-launcher not installed (pip install 'granikv[cluster]')")
    c = _compose(["launcher=slurm", "model=qwen25_14b", "tp=2"])
    assert c.hydra.launcher._target_.endswith("SlurmLauncher")
    assert c.hydra.launcher.gpus_per_node == 2


def _sweep_cells(c, full: bool = True) -> list[list[str]]:
    """The cells a sweep preset expands to; full=False: every value of every axis once (with
    the first value of the other axes), which covers each option at a fraction of the cost."""
    params = OmegaConf.to_container(c.hydra.sweeper.params) if c.hydra.sweeper.get("params") else {}
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes = []
    for k, v in params.items():
        ov = parser.parse_override(f"{k}={v}")
        vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() \
            else [ov.get_value_element_as_str()]
        axes.append([f"{k}={x}" for x in vals])
    if full:
        return [list(p) for p in itertools.product(*axes)]
    firsts = [a[0] for a in axes]
    cells = [firsts[:i] + [v] + firsts[i + 1:] for i, a in enumerate(axes) for v in a]
    return [list(c) for c in dict.fromkeys(map(tuple, cells))]   # the all-firsts cell once, not once per axis


@pytest.mark.parametrize("preset", options("sweep"))
def test_every_sweep_cell_instantiates(hydra_ctx, preset):
    base = _compose([f"sweep={preset}"])
    cells = _sweep_cells(base, full=False)
    assert cells, f"sweep/{preset}.yaml sweeps nothing"
    names = set()
    for cell in cells:
        rc = to_run_config(_compose([f"sweep={preset}", *cell]))
        names.add(rc.sweep_name)
        assert "${" not in rc.sweep_name
    assert len(names) == 1, f"{preset}: sweep_name must be fixed within a sweep, got {names}"


def test_paper_values(hydra_ctx):
    """The presets carry the paper's exact grids (Tables 6-8, B.8, limitations)."""
    p = _compose(["sweep=synthetic_grid"]).hydra.sweeper.params
    assert p["workload.prefix_len"] == "512,1024,2048,4096,8192,16384"
    assert p["workload.batch"] == "8,32,128,256" and p["rep"] == "0,1,2"
    assert _compose(["sweep=multiprefix_uniform"]).hydra.sweeper.params["workload.num_prefixes"] == "1,4,16,64"
    hetero = _sweep_cells(_compose(["sweep=multiprefix_hetero"]))
    ks = {to_run_config(_compose(["sweep=multiprefix_hetero", *c])).workload.num_prefixes for c in hetero}
    assert ks == {4, 8}
    lim = _compose(["sweep=limitation"])
    assert lim.workload.prefix_len == 512 and lim.hydra.sweeper.params["workload.batch"] == "512,1024"
    heads = {(rc.model.name, rc.tp) for rc in (to_run_config(_compose([f"sweep={s}"]))
                                               for s in ("headline", "headline_qwen25_14b", "headline_qwen25_32b"))}
    assert heads == {("llama3_8b", 1), ("qwen25_14b", 2), ("qwen25_32b", 4)}
    m = _compose(["sweep=sharegpt_matrix"]).hydra.sweeper.params["workload.batch"]
    assert max(int(x) for x in m.split(",")) == 1024


def test_real_model_shapes(hydra_ctx):
    llama = to_run_config(_compose(["model=llama3_8b"])).model
    assert (llama.num_heads, llama.num_kv_heads, llama.vocab_size) == (32, 8, 128256)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 8.0
    q14 = to_run_config(_compose(["model=qwen25_14b", "tp=2"])).model
    assert q14.qkv_bias and (q14.num_layers, q14.num_heads) == (48, 40)
    q32 = to_run_config(_compose(["model=qwen25_32b", "tp=4"])).model
    assert q32.qkv_bias and (q32.num_layers, q32.intermediate_size) == (64, 27648)


def test_a100_budgets_follow_the_arithmetic(hydra_ctx):
    """The a100_40gb budgets are the comment's formula, recomputed here from the model shapes."""
    hw = to_run_config(_compose(["hardware=a100_40gb"])).hardware
    gib, total = 2**30, 42298834944 / 2**30
    for model, params, tp, frac in (("llama3_8b", 8.030261248e9, 1, .88), ("qwen25_14b", 14.770033664e9, 2, .87),
                                    ("qwen25_32b", 32.763876352e9, 4, .85)):
        m = to_run_config(_compose([f"model={model}", f"tp={tp}"])).model
        per_tok = m.num_layers * (m.num_kv_heads // tp) * m.head_dim * 2 * 2
        rest = total * frac - params * 2 / gib / tp - 0.5
        assert hw.kv_budget_per_model[model] == int(rest * gib // per_tok)


def test_the_a100_budget_on_an_h100_is_a100_40gbs_with_the_h100s_tables(hydra_ctx):
    """a100_40gb_on_h100: the A100-40GB token budgets, everything else the H100 preset's (its GPU, tables, limits)."""
    a100 = to_run_config(_compose(["hardware=a100_40gb"])).hardware
    h100 = to_run_config(_compose(["hardware=h100"])).hardware
    both = to_run_config(_compose(["hardware=a100_40gb_on_h100"])).hardware
    assert both.kv_budget_per_model == a100.kv_budget_per_model and both.kv_budget_tokens is None
    assert both.gpu_name == h100.gpu_name == "NVIDIA H100 80GB HBM3" and both.decision_table == h100.decision_table
    assert both.plugin_graph_table == h100.plugin_graph_table and both.mem_fraction == h100.mem_fraction


def test_unknown_option_names_the_group(hydra_ctx):
    with pytest.raises(MissingConfigException, match="model/nope"):
        _compose(["model=nope"])


def test_unknown_key_is_rejected(hydra_ctx):
    with pytest.raises(ConfigCompositionException, match="workload.bogus"):
        _compose(["workload.bogus=1"])


@pytest.mark.parametrize("override,key", [("workload.prefix_len=-1", "workload.prefix_len"),
                                          ("workload.output_len=0", "workload.output_len"),
                                          ("workload.rate=0", "workload.rate"),
                                          ("workload.arrival=uniform", "workload.arrival"),
                                          ("tp=3", "tp"),
                                          ("system.hot_fraction=1.5", "system.hot_fraction"),
                                          ("system.cascade_impl=fast", "system.cascade_impl"),
                                          ("system.cascade_impl=composed", "system.cascade_impl"),
                                          ("system.decode_plan=quick", "system.decode_plan"),
                                          ("system=sglang_server system.decode_plan=fast", "system.decode_plan"),
                                          ("system.dense_kernel=triton", "system.dense_kernel"),
                                          ("system=hydragen system.dense_kernel=cudnn", "system.dense_kernel"),
                                          ("system=sglang_server system.dense_kernel=cudnn", "system.dense_kernel"),
                                          ("hardware.allreduce=mpi", "hardware.allreduce"),
                                          ("hardware.allreduce=symm_one_shot", "hardware.allreduce"),   # CPU
                                          ("hardware.allreduce_symm_max_mib=0", "hardware.allreduce_symm_max_mib")])
def test_bad_values_name_the_key(hydra_ctx, override, key):
    with pytest.raises(ValueError, match=f"`{key}`"):
        to_run_config(_compose(override.split()))


def test_dense_kernel_is_granikvs_setting(hydra_ctx):
    # the dense prefix call's kernel: FlashInfer's by default, torch's fused kernels on request
    assert to_run_config(_compose([])).system.dense_kernel == "flashinfer"
    for k in ("cudnn", "fa2"):
        assert to_run_config(_compose(["system=granikv", f"system.dense_kernel={k}"])).system.dense_kernel == k
