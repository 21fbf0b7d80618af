"""The plugin attention backends' host side, without SGLang: each request's prefix class and HOT start
read off a radix path, the staged prefixes of a step, the path counters and their file, where the
decision table comes from, and the per-class plan the engine's policies make over SGLang-shaped KV
rows (a HOT slab for GraniKV, paged slots for the two baselines). Plus the in-SGLang systems'
configs: the server's command line, environment and the client's request body."""
from __future__ import annotations
import json
from pathlib import Path
from types import SimpleNamespace
import pytest
import torch
from hydra import compose, initialize_config_dir
from granikv.attention.batch import DecodeBatch
from granikv.attention.dispatch import Dispatcher
from granikv.attention.plan import build_plan
from granikv.attention.policy import make_policy
from granikv.config import register, to_run_config
from granikv.request import Request
from granikv.serving import server as srvmod
from granikv.serving.client import ReplayClient
from granikv.serving.session import stats_delta
from granikv.sglang_plugin.hot_region import SLAB_ATTR
from granikv.sglang_plugin.path_stats import PathStats, StatsWriter, load_hardware
from granikv.sglang_plugin.settings import PluginSettings
from granikv.sglang_plugin.step_prefixes import request_prefix, staged_for, step_prefixes

ROOT = Path(__file__).resolve().parents[1]
register()


class Node:
    """SGLang's TreeNode shape: parent, value (slots), id."""

    _next = 0

    def __init__(self, parent, n_tokens, slab=None):
        self.parent, self.value = parent, list(range(n_tokens))
        Node._next += 1
        self.id = Node._next
        if slab is not None:
            setattr(self, SLAB_ATTR, slab)


def chain(*lens, slab=None, hot=0, root=None):
    """Nodes of ``lens`` tokens below ``root``; the first ``hot`` of them in ``slab``."""
    node = root or Node(None, 0)
    for i, n in enumerate(lens):
        node = Node(node, n, slab if i < hot else None)
    return node


Slab = SimpleNamespace


def test_prefix_class_is_the_node_at_depth_n_and_hot_only_when_one_slab_covers_it():
    root = Node(None, 0)
    slab = Slab(start=100, length=4096)
    shared = chain(4096, slab=slab, hot=1, root=root)            # the slab, one node
    a, b = Node(shared, 40), Node(shared, 33)                     # two suffixes below it
    pa, ha = request_prefix(a, 4096)
    pb, hb = request_prefix(b, 4096)
    assert pa == pb and pa >= 0 and ha == hb == 100
    # the slab split by the radix tree (upper part keeps the slab attribute): still one HOT run
    split_top = chain(1000, 3096, slab=slab, hot=2, root=Node(None, 0))
    assert request_prefix(Node(split_top, 8), 4096)[1] == 100
    # a prefix whose head is COLD and tail in a slab is not one HOT run
    mixed = chain(1000, 3096, slab=Slab(start=7, length=3096), hot=0, root=Node(None, 0))
    setattr(mixed, SLAB_ATTR, Slab(start=7, length=3096))
    pid, hs = request_prefix(Node(mixed, 8), 4096)
    assert pid >= 0 and hs == -1
    # paged storage: same class for two requests, never HOT
    cold = chain(4096, root=Node(None, 0))
    p1, h1 = request_prefix(Node(cold, 5), 4096)
    p2, h2 = request_prefix(Node(cold, 9), 4096)
    assert p1 == p2 >= 0 and h1 == h2 == -1
    # a declared prefix shorter than the node it ends in: the node still names it, and a different
    # length is a different class
    assert request_prefix(Node(cold, 5), 2048)[0] not in (-1, p1)
    # no prefix, no path, a path shorter than the prefix
    assert request_prefix(a, 0) == (-1, -1)
    assert request_prefix(None, 16) == (-1, -1)
    assert request_prefix(chain(10), 4096) == (-1, -1)


def req(last_node, prompt_len, prefix_len=None):
    cp = None if prefix_len is None else {"granikv_prefix_len": prefix_len}
    return SimpleNamespace(last_node=last_node, origin_input_ids=[0] * prompt_len,
                           sampling_params=SimpleNamespace(custom_params=cp))


def test_step_prefixes_reads_each_request_in_batch_order():
    slab = Slab(start=1, length=512)
    shared = chain(512, slab=slab, hot=1)
    other = chain(256)
    reqs = [req(Node(shared, 4), 516, 512), req(Node(other, 4), 260, 256), req(Node(shared, 9), 521, 512),
            req(Node(other, 1), 257)]                             # the last names no prefix
    sp = step_prefixes(reqs, PluginSettings())
    assert sp.batch_size == 4 and sp.any_prefix
    assert sp.prefix_lens == [512, 256, 512, 0]
    assert sp.hot_starts == [1, -1, 1, -1]
    assert sp.prefix_ids[0] == sp.prefix_ids[2] != sp.prefix_ids[1] and sp.prefix_ids[3] == -1
    # GRANIKV_PREFIX_LEN names the prefix of a request that does not
    sp2 = step_prefixes([req(Node(other, 1), 257)], PluginSettings(prefix_len=256))
    assert sp2.prefix_lens == [256]
    assert staged_for(sp, 4) is sp and staged_for(sp, 5) is None and staged_for(None, 4) is None


def rows_batch(lens, prefixes, hot_starts, slot_of):
    """A DecodeBatch over SGLang-shaped rows: request i's slots are slot_of(i, position)."""
    indptr = [0]
    idx = []
    for i, n in enumerate(lens):
        idx += [slot_of(i, p) for p in range(n)]
        indptr.append(len(idx))
    ip = torch.tensor(indptr, dtype=torch.int64)
    return DecodeBatch(ip.int(), torch.tensor(idx, dtype=torch.int32), [p[1] for p in prefixes],
                       [p[0] for p in prefixes], hot_starts, kv_indptr_host=ip)


@pytest.mark.parametrize("backend,want", [("granikv", "dense"), ("granikv_cascade", "cascade"), ("hydragen", "hydragen")])
def test_each_backends_policy_plans_the_split_over_sglang_rows(backend, want):
    """32 requests share a 4096-token prefix at HOT slots 1.. (GraniKV) or paged slots (baselines)."""
    from granikv.config import PLUGIN_ATTENTION

    lp, b = 4096, 32
    hot = backend == "granikv"
    base = 1 if hot else 10_000

    def slot(i, p):
        return base + p if p < lp else 200_000 + i * 64 + (p - lp)

    lens = [lp + 5 + i % 3 for i in range(b)]
    batch = rows_batch(lens, [(7, lp)] * b, [base if hot else -1] * b, slot)
    hw = load_hardware("h200", "NVIDIA H200")
    disp = Dispatcher.from_hardware(hw, 32, 8, 128, gpu_name="NVIDIA H200") if hot else None
    policy = make_policy(PLUGIN_ATTENTION[backend], disp)
    step = build_plan(batch, policy, group=4)
    assert [c.choice for c in step.split] == [want]
    c = step.split[0]
    assert c.rows == list(range(b)) and c.prefix_len == lp and c.row_start == 0
    assert c.slots.tolist() == [slot(0, p) for p in range(lp)]
    # the rest of each request: its own slots only, in order
    rest = [step.rest_indices[step.rest_indptr[i]:step.rest_indptr[i + 1]].tolist() for i in range(b)]
    assert rest == [[slot(i, p) for p in range(lp, lens[i])] for i in range(b)]
    # the H200 table sends a small class at the same Lp to paged: no split, SGLang's own path
    small = rows_batch(lens[:2], [(7, lp)] * 2, [base if hot else -1] * 2, slot)
    if hot:
        assert build_plan(small, make_policy("granikv", disp), group=4).split == []


def test_path_stats_count_and_the_file_is_replaced_whole(tmp_path, monkeypatch):
    from granikv.sglang_plugin import path_stats

    # the monotonic clock counts from boot: on a machine up for less than the interval the first
    # write must still happen
    monkeypatch.setattr(path_stats.time, "monotonic", lambda: 5.0)
    st = PathStats("granikv", "granikv")
    st.paged("no_prefix")
    st.split([{"prefix_id": 5, "batch": 30, "backend": "dense"}, {"prefix_id": -1, "batch": 2, "backend": "paged"}],
             prefix_us=10.0, dispatch_us=2.0, plan_us=50.0, index_us=5.0, make_us=15.0, load_us=20.0)
    with pytest.raises(ValueError, match="unknown reason"):
        st.paged("bogus")
    d = st.to_dict()
    assert d["steps"] == 2 and d["split_steps"] == 1 and d["classes"]["dense"] == 1 and d["rows"]["dense"] == 30
    assert d["classes"]["paged"] == 0 and d["paged_steps"]["no_prefix"] == 1 and d["max_batch"] == 32
    assert d["per_split_step_us"] == {"prefix": 10.0, "dispatch": 2.0, "plan": 50.0, "index": 5.0, "make": 15.0,
                                      "load": 20.0}
    assert d["replay_steps"] == 0 and d["per_replay_step_us"] == 0.0
    st.replay(300.0)
    st.replay(100.0)                                    # every replayed step, split or not
    assert st.to_dict()["replay_steps"] == 2 and st.to_dict()["per_replay_step_us"] == 200.0
    w = StatsWriter(str(tmp_path / "s" / "stats.json"), interval_s=3600)
    w.maybe_write(st)
    st.paged("no_split")
    w.maybe_write(st)                                   # within the interval: not rewritten
    assert json.loads((tmp_path / "s" / "stats.json").read_text())["steps"] == 2
    w.maybe_write(st, force=True)
    assert json.loads((tmp_path / "s" / "stats.json").read_text())["steps"] == 3
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["stats.json"]
    StatsWriter("").maybe_write(st, force=True)         # no file configured: nothing written, no error


def test_the_measured_window_is_after_minus_before():
    before = {"pid": 7, "steps": 10, "split_steps": 4, "classes": {"dense": 4}, "dispatch_us": 8.0, "prefix_us": 0.0,
              "plan_us": 40.0, "max_batch": 3, "backend": "granikv"}
    after = {"pid": 7, "steps": 30, "split_steps": 14, "classes": {"dense": 14}, "dispatch_us": 28.0, "prefix_us": 0.0,
             "plan_us": 140.0, "max_batch": 32, "backend": "granikv"}
    d = stats_delta(before, after)
    assert d["steps"] == 20 and d["classes"]["dense"] == 10 and d["backend"] == "granikv"
    assert d["per_split_step_us"]["dispatch"] == pytest.approx(2.0) and d["per_split_step_us"]["plan"] == pytest.approx(10.0)
    assert stats_delta({**before, "pid": 8}, after)["steps"] == 30       # another server: all of it
    r = stats_delta({**before, "replay_steps": 5, "replay_host_us": 500.0},
                    {**after, "replay_steps": 25, "replay_host_us": 4500.0})
    assert r["per_replay_step_us"] == pytest.approx(200.0)                 # host time per replayed step
    assert "per_replay_step_us" not in d                                   # counters of a server without them
    assert stats_delta(before, None) is None


def test_replay_host_times_are_kept_as_histograms_whose_quantiles_bound_the_true_ones():
    """Each replayed step's host time lands in its stage's histogram (8 bins per octave); a quantile is its
    bin's upper edge: at or above the true value, within 9%. ``own`` is the total less SGLang's own part."""
    import gc
    import random

    from granikv.sglang_plugin.path_stats import GcClock, hist_quantiles, host_bin

    st = PathStats("granikv", "granikv")
    rng = random.Random(1)
    totals = sorted(rng.uniform(50, 5000) for _ in range(1000))
    for t in rng.sample(totals, len(totals)):
        st.replay(t, {"prefix": 10.0, "make": 5.0, "load": 5.0, "index": t / 2})
    q = st.to_dict()["replay_quantiles_us"]
    for name, frac in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        true = totals[int(frac * len(totals)) - 1]
        assert true <= q["total"][name] <= true * 2 ** (1 / 8) * 1.001
        assert q["own"][name] == pytest.approx(q["total"][name] / 2, rel=0.1)
    assert q["prefix"]["p99"] == 2 ** (host_bin(10.0) / 8) and 10.0 <= q["prefix"]["p50"] < 11
    assert hist_quantiles({}) == {} and host_bin(0.3) == 0 and hist_quantiles({"0": 3})["p50"] == 1.0
    # the window's quantiles come from the window's histograms (after - before)
    before = json.loads(json.dumps(st.to_dict()))
    for _ in range(100):
        st.replay(20000.0, {"index": 100.0})
    r = stats_delta(before, json.loads(json.dumps(st.to_dict())))
    assert r["replay_steps"] == 100 and 20000 <= r["replay_quantiles_us"]["total"]["p50"] < 22000
    assert r["replay_quantiles_us"]["prefix"] == {}
    clock = GcClock()
    try:
        st.gc_clock = clock
        gc.collect()
        d = st.to_dict()["gc"]
        assert d["gen2"]["count"] >= 1 and d["gen2"]["ms"] > 0
    finally:
        clock.close()
    assert clock._on not in gc.callbacks


def test_decision_table_source(tmp_path):
    auto = load_hardware("auto", "NVIDIA H200")
    assert auto is not None and auto.name == "h200" and auto.decision_table
    assert load_hardware("auto", "Some Other GPU") is None                 # the paper's rule, said at start-up
    # a preset that only changes the KV budget takes its table through its Hydra defaults
    assert load_hardware("a100_40gb", "NVIDIA H200").decision_table == auto.decision_table
    h100 = load_hardware("h100", "NVIDIA H100 80GB HBM3")      # the A100 budget on an H100: the H100's own rules
    on_h100 = load_hardware("a100_40gb_on_h100", "NVIDIA H100 80GB HBM3")
    assert on_h100.plugin_graph_table == h100.plugin_graph_table and on_h100.decision_table == h100.decision_table
    assert on_h100.gpu_name == "NVIDIA H100 80GB HBM3" and on_h100.decision_table != auto.decision_table
    with pytest.raises(ValueError, match="GRANIKV_HARDWARE='nope'.*h200"):
        load_hardware("nope", "NVIDIA H200")
    (tmp_path / "t.yaml").write_text("name: t\ngpu_name: X\n")
    with pytest.raises(ValueError, match="no decision_table"):
        load_hardware(str(tmp_path / "t.yaml"), "X")


def cfg(overrides):
    from runners.run import resolve

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return resolve(to_run_config(compose("config", overrides=["sweep=headline", *overrides])))


@pytest.mark.parametrize("system,attn,radix,hot", [("sglang_server_granikv", "granikv", "granikv", "0.2"),
                                                   ("sglang_server_cascade", "granikv_cascade", None, None),
                                                   ("sglang_server_hydragen", "hydragen", None, None)])
def test_in_sglang_systems_start_the_plugin(tmp_path, monkeypatch, system, attn, radix, hot):
    monkeypatch.setenv(srvmod.STATE_ENV, str(tmp_path))
    monkeypatch.setenv(srvmod.PLUGIN_PATH_ENV, "/repo:/ep")
    monkeypatch.setenv(srvmod.PYTHONPATH_ENV, "/site")
    spec = srvmod.server_spec(cfg([f"system={system}"]))
    a, env = spec.argv, dict(spec.env)
    flag = {k: v for k, v in zip(a, a[1:])}
    assert flag["--attention-backend"] == attn
    assert "--cuda-graph-backend-decode" not in flag       # SGLang's default full decode graphs
    assert flag.get("--radix-cache-backend") == radix
    assert env["SGLANG_PLUGINS"] == "granikv" and env["GRANIKV_HARDWARE"] == "h200"
    assert env.get("GRANIKV_HOT_FRACTION") == (hot or "0.0")
    if attn == "granikv_cascade":      # the engine's SGLang-Cascade GPU path (conf/system/sglang_cascade.yaml)
        assert env["GRANIKV_CASCADE_IMPL"] == "composed" == PluginSettings.from_env(env).cascade_impl
    # SGLang's own decode re-plan (FlashInfer's fast_decode_plan) on every plugin system
    assert env["GRANIKV_DECODE_PLAN"] == "fast" == PluginSettings.from_env(env).decode_plan
    assert PluginSettings.from_env(env).hot_split == "static"           # the plugin systems' split, as the paper's
    # a dynamic split reaches the plugin's cache with its bounds
    if radix:
        dyn = dict(srvmod.server_spec(cfg([f"system={system}", "system.hot_split=dynamic", "system.hot_max_fraction=0.4",
                                           "system.cold_watermark=0.1"])).env)
        got = PluginSettings.from_env(dyn)
        assert (got.hot_split, got.hot_fraction, got.hot_min_fraction, got.hot_max_fraction, got.cold_watermark) == \
            ("dynamic", 0.2, 0.0, 0.4, 0.1)
        # a forced path (the dispatcher's ablation, as the engine's) reaches the plugin's dispatcher
        forced = dict(srvmod.server_spec(cfg([f"system={system}", "system.dispatch=paged_only"])).env)
        assert PluginSettings.from_env(forced).dispatch == "paged_only" and env["GRANIKV_DISPATCH"] == "table"
    assert env["PYTHONPATH"] == "/site:/repo:/ep"
    assert Path(env["GRANIKV_STATS_FILE"]).parent == tmp_path / "plugin_stats"
    # SGLang's own system: no plugin on the path, nothing of granikv in its environment
    plain = dict(srvmod.server_spec(cfg(["system=sglang_server"])).env)
    assert plain["PYTHONPATH"] == "/site" and not any(k.startswith(("GRANIKV_", "SGLANG_PLUGINS")) for k in plain)


@pytest.mark.parametrize("system", ["sglang_server_granikv", "sglang_server_granikv_dynamic", "sglang_server_cascade"])
def test_the_server_passes_every_plugin_setting_of_its_system(tmp_path, monkeypatch, system):
    """The server's environment holds every setting the plugin reads, and the plugin reads back the
    cell's system (PluginSettings.to_env / from_env, the one pair both sides use)."""
    monkeypatch.setenv(srvmod.STATE_ENV, str(tmp_path))
    rc = cfg([f"system={system}"])
    spec = srvmod.server_spec(rc)
    env = dict(spec.env)
    assert {k for k in env if k.startswith("GRANIKV_")} == set(PluginSettings().to_env())
    assert PluginSettings.from_env(env) == PluginSettings.from_system(
        rc.system, hardware=rc.hardware.name, stats_file=str(srvmod.plugin_stats_path(spec.argv)))


@pytest.mark.parametrize("override,field", [
    (["system=sglang_server_granikv", "system.backend=paged"], "system.backend"),
    (["system=sglang_server", "system.backend=granikv"], "system.backend"),
    (["system=sglang_server", "system.hot_fraction=0.2"], "system.hot_fraction"),
    (["system=sglang_server_cascade", "system.server.send_prefix_len=false"], "system.server.send_prefix_len"),
    (["system=sglang_server", "system.server.radix_cache_backend=lru"], "system.server.radix_cache_backend"),
    (["system=sglang_server", "system.server.extra_args=[--radix-cache-backend,granikv]"], "system.server.extra_args"),
])
def test_in_sglang_system_configs_that_cannot_work_name_the_field(override, field):
    with pytest.raises(Exception, match=field.replace(".", r"\.")):
        cfg(override)


def test_the_client_names_the_shared_prefix_only_when_asked():
    r = Request(rid=0, prompt_ids=list(range(40)), output_len=3, shared_len=32, prefix_class=0)
    plain = ReplayClient("http://x").payload(r)["sampling_params"]
    assert "custom_params" not in plain
    named = ReplayClient("http://x", send_prefix_len=True).payload(r)["sampling_params"]
    assert named["custom_params"] == {"granikv_prefix_len": 32}
    none = ReplayClient("http://x", send_prefix_len=True).payload(Request(rid=1, prompt_ids=[1, 2], output_len=1))
    assert "custom_params" not in none["sampling_params"]


def test_breakable_graph_hooks_hold_a_dataclass_output_field_by_field():
    """SGLang's breakable decode graphs allocate, fill and slice a captured step's output; the hooks
    do it for a LogitsProcessorOutput-shaped dataclass and leave everything else to SGLang."""
    import dataclasses

    from granikv.sglang_plugin import bcg_outputs as h

    @dataclasses.dataclass
    class Out:
        next_token_logits: torch.Tensor
        hidden_states: object = None
        extra: object = None

    def sglang(*a):                       # SGLang's own method: only reached for non-dataclass outputs
        return ("sglang", a[1:])

    out = Out(torch.arange(12.0).reshape(3, 4), None, [1])
    buf = h.alloc_full_buffer(sglang, None, out, 8)
    assert isinstance(buf, Out) and buf.next_token_logits.shape == (8, 4) and buf.extra == [1]
    assert h.copy_output_to_buffer(sglang, None, out, buf, 3) is None
    assert torch.equal(buf.next_token_logits[:3], out.next_token_logits)
    cut = h.slice_output(sglang, None, buf, 2)
    assert cut.next_token_logits.shape == (2, 4) and cut.next_token_logits.data_ptr() == buf.next_token_logits.data_ptr()
    t = torch.zeros(2)
    assert h.alloc_full_buffer(sglang, None, t, 4) == ("sglang", (t, 4))
    assert h.slice_output(sglang, None, t, 1) == ("sglang", (t, 1))
    with pytest.raises(ValueError, match="structure changed"):
        h.copy_output_to_buffer(sglang, None, out, t, 1)
    assert set(h.HOOKS) == {f"{h.TARGET}.{m}" for m in ("_alloc_full_buffer", "_copy_output_to_buffer", "_slice_output")}


def test_the_memo_reads_a_request_once_and_again_when_its_path_changes():
    """A request seen last step with the same last_node is taken from the memo; a new last_node (its
    prompt re-cached), or a request not in the last step, is read; a HOT class keeps its id across a
    radix split above its prefix end, since it is named by its slab."""
    from granikv.sglang_plugin.step_prefixes import PrefixMemo

    slab = Slab(start=1, length=512)
    shared = chain(512, slab=slab, hot=1)
    r1, r2 = req(Node(shared, 4), 516, 512), req(Node(shared, 6), 518, 512)
    memo = PrefixMemo()
    first = step_prefixes([r1, r2], PluginSettings(), memo=memo)
    again = step_prefixes([r1, r2], PluginSettings(), memo=memo)     # the same step: taken whole
    assert (memo.misses, memo.hits, memo.whole) == (2, 2, 1) and again.prefix_ids == first.prefix_ids
    assert again.prefix_ids is first.prefix_ids and again.hot_starts == first.hot_starts == [1, 1]
    swapped = step_prefixes([r2, r1], PluginSettings(), memo=memo)   # another order: read per request
    assert (memo.misses, memo.hits, memo.whole) == (2, 4, 1) and swapped.prefix_ids == first.prefix_ids[::-1]
    r1.last_node = Node(shared, 9)                       # r1's path changed: read again, not taken whole
    step_prefixes([r1, r2], PluginSettings(), memo=memo)
    assert (memo.misses, memo.hits, memo.whole) == (3, 5, 1)
    assert getattr(r1, memo.attr)[0] is r1.last_node and memo.entries([r2])[0][1:] == (first.prefix_ids[1], 512, 1)
    assert PrefixMemo().entries([r1]) == [None]                    # another memo never reads this one's
    # the radix tree splits the slab's node (upper part keeps the slab): a new request still joins the class
    upper = Node(shared.parent, 200, slab)
    shared.parent, shared.value = upper, list(range(312))
    r3 = req(Node(shared, 3), 515, 512)
    third = step_prefixes([r1, r2, r3], PluginSettings(), memo=memo)
    assert len(set(third.prefix_ids)) == 1 and third.hot_starts == [1, 1, 1]
    fewer = step_prefixes([r1, r2], PluginSettings(), memo=memo)    # a request left: not taken whole
    assert memo.whole == 1 and fewer.prefix_ids == third.prefix_ids[:2]
    # a COLD (paged) class is named by its node: without a memo every request is read every step
    cold = chain(256)
    plain = step_prefixes([req(Node(cold, 2), 258, 256)] * 2, PluginSettings())
    assert plain.prefix_ids[0] == plain.prefix_ids[1] >= 0 and plain.hot_starts == [-1, -1]
