"""The dynamic HOT/COLD split in our engine: its settings (SystemConfig, conf/system/granikv_dynamic.yaml),
the static split unchanged, the scheduler's two signals (HOT grows for a prefix that does not fit, HOT
gives back free rows under COLD pressure), and an engine run whose boundary moves both ways with the
tokens of the no-cache reference."""
from __future__ import annotations
import random
from pathlib import Path
import pytest
import torch

import split_trace
from granikv.config import HardwareConfig, ModelConfig, RunConfig, SystemConfig, system_config
from granikv.engine.engine import Engine
from granikv.engine.scheduler import Scheduler, Seq, Storage, check_fits
from granikv.kv import KVCache, SplitPolicy
from granikv.request import Request

pytestmark = pytest.mark.filterwarnings("ignore:no decision-table rules:RuntimeWarning")
CONF = Path(__file__).resolve().parents[1] / "conf"


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("kw,key,fix", [
    (dict(hot_split="elastic"), "system.hot_split", "static = HOT fixed"),
    (dict(hot_split="dynamic", hot_min_fraction=0.3), "system.hot_min_fraction", "lower hot_min_fraction"),
    (dict(hot_split="dynamic", hot_max_fraction=0.1), "system.hot_max_fraction", "raise hot_max_fraction"),
    (dict(hot_max_fraction=1.0), "system.hot_max_fraction", r"in \[0, 1\)"),
    (dict(cold_watermark=-0.01), "system.cold_watermark", r"in \[0, 1\)"),
    (dict(hot_min_fraction=True), "system.hot_min_fraction", "a number"),
    (dict(name="x", backend="paged", hot_fraction=0.0, hot_split="dynamic", hot_max_fraction=0.5),
     "system.hot_split", "set hot_split=static"),
])
def test_bad_split_settings_name_the_field_and_the_fix(kw, key, fix):
    with pytest.raises(ValueError, match=f"`{key}`.*{fix}"):
        SystemConfig(**kw)


def test_static_split_ignores_the_dynamic_bounds():
    SystemConfig(hot_fraction=0.7)             # above the default hot_max_fraction: fine when static
    s = SystemConfig(hot_split="dynamic", hot_fraction=0.0, hot_min_fraction=0.0)
    assert s.hot_split == "dynamic"            # a dynamic split may start with no HOT rows at all


def test_granikv_dynamic_yaml_composes_and_bad_overrides_name_the_key():
    from hydra import compose, initialize_config_dir

    from granikv.config import register, to_run_config
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        rc = to_run_config(compose("config", overrides=["system=granikv_dynamic"], return_hydra_config=True))
        assert rc.system == system_config("granikv_dynamic")
        assert (rc.system.hot_split, rc.system.hot_fraction, rc.system.hot_max_fraction) == ("dynamic", 0.2, 0.5)
        assert to_run_config(compose("config", overrides=["system=granikv"], return_hydra_config=True)
                             ).system.hot_split == "static"
        for ov, key in (("system.hot_split=elastic", "system.hot_split"),
                        ("system.hot_max_fraction=0.1", "system.hot_max_fraction")):
            with pytest.raises(ValueError, match=f"`{key}`"):
                to_run_config(compose("config", overrides=["system=granikv_dynamic", ov], return_hydra_config=True))


# ---------------------------------------------------------------------- the static split, unchanged
# produced by tests/split_trace.py on the code before the dynamic split existed (see its docstring)
STATIC_DIGESTS = {"hot30": "e9b3974b7affeba7", "hot50_small": "c5bf4f0ba2d312af", "paged": "bc728f7598892470",
                  "engine": "3440902fdf20e9a1"}


@pytest.mark.parametrize("case", sorted(split_trace.SCHED_CASES))
def test_static_split_places_every_slot_as_before(case):
    trace = split_trace.sched_trace(*split_trace.SCHED_CASES[case])
    assert {r["hot_tokens"] for r in trace["rounds"]} == {int(split_trace.SCHED_CASES[case][1]
                                                              * split_trace.SCHED_CASES[case][0])}
    assert split_trace.digest(trace) == STATIC_DIGESTS[case]


def test_static_engine_run_is_as_before_and_reports_no_split():
    trace = split_trace.engine_trace()
    assert split_trace.digest(trace) == STATIC_DIGESTS["engine"]
    eng = Engine(RunConfig(model=ModelConfig(**split_trace.TINY), system=system_config("granikv"),
                           hardware=HardwareConfig(kv_budget_tokens=400)))
    assert eng.storage.split is None and eng.kv.cold_pool.order == "fifo"
    assert "hot_split" not in eng.run([Request(0, list(range(40)), 2, shared_len=30)]).stats


# ---------------------------------------------------------------------- the scheduler's signals
def _sched(cap, hot_fraction, dynamic, hot_max=0.5, wm=0.0, rows=16):
    kv = KVCache(1, cap, 1, 1, hot_fraction, torch.float32, "cpu", cold_order="highest_first" if dynamic else "fifo")
    pol = SplitPolicy.from_fractions(cap, hot_fraction, 0.0, hot_max, wm) if dynamic else None
    st = Storage(kv, enable_hot=True, split=pol)
    return st, Scheduler(st, HardwareConfig(kv_budget_tokens=cap, max_running_requests=rows), max_rows=rows)


def _req(rid, prefix, own, out=1):
    return Request(rid, prefix + [1000 + rid] * own, out, shared_len=len(prefix), prefix_class=0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_hot_grows_for_a_prefix_the_static_split_sends_cold(dynamic):
    """Heterogeneous prefixes: the 300-token one does not fit a HOT region of 100 rows."""
    st, sch = _sched(1000, 0.1, dynamic)
    rng = random.Random(0)
    big, mid, third = ([rng.randrange(900) for _ in range(n)] for n in (300, 150, 100))
    sch.add([Seq(_req(0, big, 4), 0), Seq(_req(1, mid, 4), 1), Seq(_req(2, third, 4), 2)])
    s = sch.admit_arrived(0.0)
    assert len(s) == 3
    if not dynamic:
        assert [x.where for x in s] == ["cold", "cold", "hot"] and st.kv.hot_tokens == 100
        return
    # 300 > 100: grow by 200; 150 more: grow by 150; 100 more would pass hot_max = 500: COLD fallback
    assert [x.where for x in s] == ["hot", "hot", "cold"]
    assert [x.hot_start for x in s] == [0, 300, -1] and st.kv.hot_tokens == 450
    assert (st.split.grown, st.split.moves) == (350, 2)
    assert st.kv.cold_pool.offset == 450 and int(s[0].own.min()) >= 450


def test_a_dynamic_split_may_start_with_no_hot_rows():
    st, sch = _sched(500, 0.0, True)
    assert st.kv.hot_tokens == 0 and st.admission.enable_hot
    sch.add([Seq(_req(0, list(range(120)), 5), 0), Seq(_req(1, list(range(120)) + [7] * 30, 5), 1)])
    s = sch.admit_arrived(0.0)
    # the second extends the first: its 30-row slab grows in right after it, one contiguous HOT run
    assert [(x.where, x.hot_start) for x in s] == [("hot", 0), ("hot", 0)]
    assert st.kv.hot_tokens == 150 and st.index.match(list(range(120)) + [7] * 30).hot_runs == [(0, 0, 150)]


@pytest.mark.parametrize("dynamic", [False, True])
def test_cold_pressure_takes_free_hot_rows_before_evicting(dynamic):
    """HOT 200 rows hold one 50-token prefix; requests of 60 own tokens each need COLD."""
    st, sch = _sched(400, 0.5, dynamic, wm=0.02)
    rng = random.Random(1)
    pre, stale = [rng.randrange(900) for _ in range(50)], [rng.randrange(900) for _ in range(40)]
    cached = st.kv.cold_pool.alloc(40)           # a stale COLD prefix (nobody runs on it)
    st.index.insert(stale, cached)
    sch.add([Seq(_req(i, pre, 60), i) for i in range(6)])
    s = sch.admit_arrived(0.0)
    slab = s[0].placement.slab
    assert slab == st.index.match(pre).node.slab and (slab.start, slab.length) == (0, 50)
    if not dynamic:  # COLD 199 free: the stale prefix goes, then 3 requests fit
        assert len(s) == 3 and st.index.evicted_tokens == 40 and st.kv.hot_tokens == 200
        return
    # the free HOT tail (rows 50..199) is given back as needed and the stale COLD prefix stays cached:
    # 5 requests fit (350 COLD rows at most: pad 1 + stale 40 + 5 x 60 = 341); the 6th finds 9 free
    # rows and 40 evictable, too few, so nothing is evicted (all or nothing) and it waits
    assert len(s) == 5 and st.index.evicted_tokens == 0 and st.index.match(stale).length == 40
    assert st.kv.hot_tokens == 50 and st.kv.cold_pool.free_tokens == 9 and st.split.shrunk == 150
    assert st.index.match(pre).node.slab == slab   # the slab did not move


def test_dynamic_admission_check_uses_the_smallest_cold_region():
    st, _ = _sched(1000, 0.2, True, hot_max=0.6)     # COLD can shrink to 400 rows
    check_fits(Request(0, list(range(399)), 1, shared_len=100), st)
    with pytest.raises(ValueError, match="`system.hot_max_fraction`.*lower hot_max_fraction"):
        check_fits(Request(1, list(range(400)), 2, shared_len=100), st)


# ---------------------------------------------------------------------- an engine run
def test_engine_boundary_moves_both_ways_with_the_reference_tokens():
    """A 60-token prefix in a HOT region of 270 rows, three prefix-less 200-token prompts (COLD
    pressure: HOT gives back free tail rows), then, once they finished, a 250-token prefix (HOT grows
    again, keeping the first prefix cached; the static split evicts it). Greedy tokens equal a plain
    forward with no KV cache."""
    rng = random.Random(3)
    a, b = [rng.randrange(512) for _ in range(60)], [rng.randrange(512) for _ in range(250)]
    reqs = [Request(0, a + [rng.randrange(512) for _ in range(20)], 4, shared_len=60, prefix_class=0)]
    reqs += [Request(i, [rng.randrange(512) for _ in range(200)], 4) for i in (1, 2, 3)]
    reqs += [Request(4, b + [rng.randrange(512) for _ in range(10)], 4, shared_len=250, prefix_class=1)]
    hw = HardwareConfig(kv_budget_tokens=900, chunked_prefill_size=128, max_running_requests=4)
    system = system_config("granikv_dynamic")
    system.hot_fraction = 0.3                    # HOT 270 of 900 rows, up to 450 (hot_max_fraction 0.5)
    eng = Engine(RunConfig(model=ModelConfig(**split_trace.TINY), system=system, hardware=hw))
    assert eng.kv.cold_pool.order == "highest_first" and eng.kv.hot_tokens == 270
    res = eng.run(reqs)
    for r, rec in zip(reqs, res.records):
        assert rec.output_ids == eng.generate_reference(r.prompt_ids, r.output_len), f"request {r.rid}"
    s = res.stats
    assert s["hot_split"] == "dynamic" and s["hot_shrunk_tokens"] > 0 and s["hot_grown_tokens"] > 0
    assert s["admissions"] == {"hot": 2} and s["evicted_tokens"] == 0   # both prefixes HOT, none evicted
    assert s["hot_peak_tokens"] <= s["hot_capacity_tokens"] and s["cold_peak_tokens"] <= s["cold_capacity_tokens"]
    assert s["hot_capacity_min_tokens"] < 270 < s["hot_final_tokens"] == s["hot_capacity_max_tokens"] <= 450
    assert sorted((n.slab.start, n.slab.length) for n in eng.storage.index.nodes()) == [(0, 60), (60, 250)]
    assert all(n.lock_ref == 0 for n in eng.storage.index.nodes())
    assert eng.kv.cold_pool.used_tokens == 1     # only the padding scratch slot
    eng.storage.reset()                          # the next run starts from the initial split
    assert eng.kv.hot_tokens == 270 and eng.storage.split.moves == 0
    static = system_config("granikv")
    static.hot_fraction = 0.3
    st = Engine(RunConfig(model=ModelConfig(**split_trace.TINY), system=static, hardware=hw)).run(reqs).stats
    assert st["admissions"] == {"hot": 2} and st["evicted_tokens"] == 60   # B takes A's rows
