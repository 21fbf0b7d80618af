"""The plugin where SGLang is absent: it imports cleanly, load() does nothing (quietly), the entry
point resolves; its settings and how a request names its shared prefix."""
from __future__ import annotations
import ast
import importlib.metadata
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
import pytest

from granikv.sglang_plugin.settings import PREFIX_PARAM, PluginSettings, shared_prefix_len

ROOT = Path(__file__).resolve().parents[1]

# SGLang absent, whatever this machine has: a None entry in sys.modules makes `import sglang`
# fail and importlib.util.find_spec("sglang") answer None
_NO_SGLANG = """
import sys
sys.modules["sglang"] = None
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_SGLANG + code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_the_plugin_imports_and_loads_without_sglang_quietly():
    r = _run("""
import logging
records = []
class Keep(logging.Handler):
    def emit(self, rec): records.append(rec)
log = logging.getLogger("granikv.sglang_plugin"); log.addHandler(Keep()); log.setLevel(logging.DEBUG)
import granikv.sglang_plugin as p
p.load()
p.load()
assert not any(m.startswith("sglang.") for m in sys.modules) and sys.modules["sglang"] is None, "sglang was imported"
assert records and all(r.levelno == logging.DEBUG for r in records), [(r.levelname, r.getMessage()) for r in records]
assert "sglang is not installed" in records[0].getMessage()
try:
    import granikv.sglang_plugin.cache
except ImportError as e:
    print("adapter refused:", e.name)
print("OK")
""")
    assert r.returncode == 0 and r.stdout.split()[-1] == "OK", r.stdout + r.stderr
    assert "adapter refused: sglang" in r.stdout


@pytest.mark.parametrize("module", ["__init__", "settings", "hot_region", "slab_groups", "step_prefixes", "path_stats", "bcg_outputs"])
def test_only_the_adapter_imports_sglang(module):
    """Only the adapters (cache.py, attention.py) import SGLang at import time; load() imports them lazily."""
    tree = ast.parse((ROOT / "granikv" / "sglang_plugin" / f"{module}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m == "sglang" or m.startswith(("sglang.", "granikv.sglang_plugin.cache"))]


def test_the_entry_point_is_declared_and_found_as_sglang_finds_plugins(tmp_path):
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    value = proj["entry-points"]["sglang.srt.plugins"]["granikv"]
    assert value == "granikv.sglang_plugin:load"
    # SGLang: importlib.metadata.entry_points(group="sglang.srt.plugins"), then ep.load()
    dist = tmp_path / "granikv_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: granikv-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\ngranikv = {value}\n")
    (d,) = importlib.metadata.distributions(path=[str(tmp_path)])
    (ep,) = [e for e in d.entry_points if e.group == "sglang.srt.plugins"]
    import granikv.sglang_plugin as p

    assert ep.name == "granikv" and ep.load() is p.load


# ---------------------------------------------------------------------- settings
def test_settings_from_the_environment():
    assert PluginSettings.from_env({}) == PluginSettings(0.2, 0)
    assert PluginSettings.from_env({"GRANIKV_HOT_FRACTION": "0.35", "GRANIKV_PREFIX_LEN": "2048"}) == \
        PluginSettings(0.35, 2048)
    assert PluginSettings.from_env({"GRANIKV_HOT_FRACTION": "0"}).hot_fraction == 0.0
    assert PluginSettings.from_env({}).cascade_impl == "composed"      # the SGLang-Cascade baseline's GPU path
    assert PluginSettings.from_env({"GRANIKV_CASCADE_IMPL": "multilevel"}).cascade_impl == "multilevel"
    assert PluginSettings.from_env({}).decode_plan == "fast"
    assert PluginSettings.from_env({}).dispatch == "table"
    assert PluginSettings.from_env({"GRANIKV_DISPATCH": "cascade_only"}).dispatch == "cascade_only"
    assert PluginSettings.from_env({"GRANIKV_DECODE_PLAN": "flashinfer"}).decode_plan == "flashinfer"
    dyn = PluginSettings.from_env({"GRANIKV_HOT_SPLIT": "dynamic", "GRANIKV_HOT_MAX_FRACTION": "0.6"})
    assert dyn.split_policy(1000).hot_max == 600 and PluginSettings.from_env({}).split_policy(1000) is None
    for env in ({"GRANIKV_HOT_FRACTION": "1"}, {"GRANIKV_HOT_FRACTION": "-0.1"}, {"GRANIKV_HOT_FRACTION": "a lot"},
                {"GRANIKV_PREFIX_LEN": "-1"}, {"GRANIKV_PREFIX_LEN": "1.5"}, {"GRANIKV_CASCADE_IMPL": "fast"},
                {"GRANIKV_DECODE_PLAN": "quick"}, {"GRANIKV_HOT_SPLIT": "moving"},
                {"GRANIKV_HOT_SPLIT": "dynamic", "GRANIKV_HOT_MAX_FRACTION": "0.1"},
                {"GRANIKV_COLD_WATERMARK": "x"}, {"GRANIKV_HOT_MIN_FRACTION": "1.2"}, {"GRANIKV_DENSE_FOLD": "3"},
                {"GRANIKV_DENSE_BACKEND": "fa9"}, {"GRANIKV_GRAPH_GROUPS": "0"}, {"GRANIKV_HYDRAGEN_SCRATCH": "-1"},
                {"GRANIKV_ROW_BUCKET": "0"},
                {"GRANIKV_DISPATCH": "dense"}):
        with pytest.raises(ValueError, match="GRANIKV_"):
            PluginSettings.from_env(env)


# a value other than the default for every field of PluginSettings (valid together)
SAMPLE = {"hot_fraction": 0.35, "prefix_len": 2048, "hardware": "h200", "stats_file": "/tmp/stats.json",
          "cascade_impl": "multilevel", "decode_plan": "flashinfer", "hot_split": "dynamic",
          "hot_min_fraction": 0.1, "hot_max_fraction": 0.6, "cold_watermark": 0.07, "graph_groups": 4,
          "graph_cascades": 2, "dense_fold": 4, "dense_fold_min_len": 8192, "dense_backend": "fa2",
          "hydragen_scratch": 32768, "dispatch": "paged_only", "row_bucket": 16}
# SystemConfig's fields the plugin does not read: what a server's command line or our engine takes
ENGINE_ONLY = {"name", "backend", "tensor_core_decode", "dense_kernel", "engine", "server"}


def test_every_setting_round_trips_through_the_environment():
    """to_env and from_env cover every field; a field without a SAMPLE value fails here."""
    import dataclasses

    from granikv.sglang_plugin.settings import env_name
    names = [f.name for f in dataclasses.fields(PluginSettings)]
    assert set(names) == set(SAMPLE), "give a new field a SAMPLE value"
    s = PluginSettings(**SAMPLE)
    default = PluginSettings()
    assert all(getattr(s, n) != getattr(default, n) for n in names)
    env = s.to_env()
    assert set(env) == {env_name(n) for n in names}
    back = PluginSettings.from_env(env)
    for n in names:
        assert getattr(back, n) == SAMPLE[n] and type(getattr(back, n)) is type(SAMPLE[n]), n
    assert back == s and PluginSettings.from_env(default.to_env()) == default


def test_settings_share_the_system_configs_fields():
    """PluginSettings' system fields are SystemConfig's (name and type); every SystemConfig field is
    either read by the plugin or listed as engine-only, so a field added to one side only fails here."""
    import dataclasses

    from granikv.config import SystemConfig
    from granikv.sglang_plugin.settings import OWN_FIELDS, SYSTEM_FIELDS
    system = {f.name: f.type for f in dataclasses.fields(SystemConfig)}
    plugin = {f.name: f.type for f in dataclasses.fields(PluginSettings)}
    assert set(system) == set(SYSTEM_FIELDS) | ENGINE_ONLY, "a new SystemConfig field: the plugin's, or ENGINE_ONLY?"
    assert set(plugin) == set(SYSTEM_FIELDS) | {n for n, _, _ in OWN_FIELDS}
    assert all(plugin[n] == system[n] for n in SYSTEM_FIELDS)
    s = SystemConfig(name="x", backend="granikv", hot_fraction=0.3, hot_split="dynamic", hot_max_fraction=0.7,
                     cold_watermark=0.1, decode_plan="fast")
    got = PluginSettings.from_system(s, hardware="h100")
    assert all(getattr(got, n) == getattr(s, n) for n in SYSTEM_FIELDS) and got.hardware == "h100"


def test_a_request_names_its_shared_prefix_in_custom_params(caplog):
    s = PluginSettings(0.2, 0)
    assert shared_prefix_len({PREFIX_PARAM: 100}, 300, s) == 100
    assert shared_prefix_len({PREFIX_PARAM: 500}, 300, s) == 300  # at most the prompt
    assert shared_prefix_len({PREFIX_PARAM: 0}, 300, PluginSettings(0.2, 50)) == 0  # the field wins
    assert shared_prefix_len({"__req__": object()}, 300, s) == 0  # SGLang adds __req__ to the dict
    assert shared_prefix_len(None, 300, s) == 0
    assert shared_prefix_len(None, 300, PluginSettings(0.2, 256)) == 256
    assert shared_prefix_len(None, 200, PluginSettings(0.2, 256)) == 0  # too short for the default
    with caplog.at_level(logging.WARNING):
        for bad in (-3, "12", 1.5, True):
            assert shared_prefix_len({PREFIX_PARAM: bad}, 300, s) == 0
    assert len(caplog.records) == 4
