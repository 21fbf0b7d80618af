"""The no-regression guard: step-kind rules (graph-replayed vs eager), the COLD path of dense rules,
the calibrator's guarded fit, old tables unchanged, and choose() staying a dict lookup per step."""
from __future__ import annotations
import random
import warnings
from pathlib import Path
import pytest
import torch
import yaml

from granikv import rawio
from granikv.attention.batch import DecodeBatch
from granikv.attention.bench import Shape, build_cell
from granikv.attention.dispatch import Dispatcher, check_table, paper_rule
from granikv.attention.plan import ClassPlan, build_plan
from granikv.attention.policy import GranikvPolicy, PagedPolicy
from runners.calibrate import OPTIONS, eager_costs, fit, guarded_best

ROOT = Path(__file__).resolve().parents[1]
G = "G"
SH = Shape("s", 32, 8, 128)          # group 4
KIND_TABLE = [
    {"lp_max": 100, "choice": "paged"},                                   # both kinds
    {"graph": True, "meff_min": 256, "choice": "dense"},
    {"graph": True, "choice": "cascade"},
    {"graph": False, "meff_min": 1024, "choice": "dense", "cold": "paged"},
    {"graph": False, "choice": "paged"},
]


# ---------------------------------------------------------------- rule format
@pytest.mark.parametrize("bad", ["yes", 1, 0, "true", [True]])
def test_bad_graph_value_names_entry_and_field(bad):
    table = [{"choice": "paged"}, {"choice": "dense", "graph": bad}]
    with pytest.raises(ValueError, match=r"decision_table\[1\]\.graph"):
        check_table(table)
    with pytest.raises(ValueError, match=r"\[1\]\.graph"):
        Dispatcher(32, 8, 128, G, table)


def test_graph_key_accepts_bools_and_null_and_cold_is_checked():
    assert len(check_table([{"choice": "dense", "graph": True}, {"choice": "paged", "graph": False},
                            {"choice": "cascade", "graph": None}])) == 3
    with pytest.raises(ValueError, match=r"\[0\]\.cold.*only a dense rule"):
        check_table([{"choice": "cascade", "cold": "paged"}])
    with pytest.raises(ValueError, match=r"\[0\]\.cold.*not one of"):
        check_table([{"choice": "dense", "cold": "dense"}])


# ---------------------------------------------------------------- step-kind selection
def test_step_kind_selects_its_rules_and_default_is_graph():
    d = Dispatcher(32, 8, 128, G, KIND_TABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d.kind_specific
        assert d.choose(50, 512) == d.choose(50, 512, graph=False) == "paged"       # kind-less rule: both
        assert d.choose(4096, 64) == d.choose(4096, 64, graph=True) == "dense"       # default = graph
        assert d.choose(4096, 63) == "cascade"
        assert d.choose(4096, 63, graph=False) == "paged"
        assert d.choose(4096, 64, graph=False) == "paged"
        assert d.choose(4096, 256, graph=False) == "dense"
        pairs = [(4096, 64), (4096, 63), (4096, 256), (50, 9)]
        assert d.choose_many(pairs) == [d.choose(*p) for p in pairs] == ["dense", "cascade", "dense", "paged"]
        assert d.choose_many(pairs, graph=False) == ["paged", "paged", "dense", "paged"]
        assert d.choose(4096, 0, graph=False) == "paged"                             # pad rows only
    assert d.fallbacks == 0
    assert d.decisions is d.decisions_for(True) and d.decisions_for(False) is not d.decisions_for(True)


def test_kind_rules_for_one_kind_only_leave_the_other_uncovered():
    d = Dispatcher(4, 1, 64, G, [{"graph": True, "choice": "dense"}])
    assert d.choose(100, 100) == "dense"
    with pytest.warns(RuntimeWarning, match="for eager steps"):
        assert d.choose(100, 100, graph=False) == paper_rule(100) == "cascade"
    assert d.fallbacks == 1


def _classes(spec):
    """ClassPlans from (prefix_len, n_real, hot_start) triples (rows made up, one per request)."""
    out, row = [], 0
    for i, (lp, n, hs) in enumerate(spec):
        out.append(ClassPlan(i, list(range(row, row + n)), lp, hs, n_real=n))
        row += n
    return out


def test_policy_follows_step_kind_and_cold_path():
    pol = GranikvPolicy(Dispatcher(32, 8, 128, G, KIND_TABLE))
    spec = [(4096, 64, 0), (4096, 64, -1), (4096, 256, 0), (4096, 256, -1), (4096, 8, 0)]
    cs = _classes(spec)
    assert pol.graph_step is True                        # a caller that never sets it: graph steps
    pol.choose(cs, 400)
    # graph rules: dense (HOT), dense -> cascade for a COLD prefix (no cold key: the default)
    assert [c.choice for c in cs] == ["dense", "cascade", "dense", "cascade", "cascade"]
    pol.graph_step = False
    pol.choose(cs, 400)
    # eager rules: paged below Meff 1024; dense above, its COLD class on the rule's cold path (paged)
    assert [c.choice for c in cs] == ["paged", "paged", "dense", "paged", "paged"]


# ---------------------------------------------------------------- the guard in the fit
def _pt(lp, meff, graph, eager, host=None):
    p = {"prefix_len": lp, "meff": meff, "times": graph, "times_eager": eager}
    if host is not None:
        p["host_eager"] = host
    return p


def test_guard_cascade_slower_than_paged_in_eager_steps_is_paged_there_only():
    # cascade beats paged when replayed (0.04 ms vs 0.05-0.2); eagerly its launches (+0.10 ms, paged
    # +0.02) cost more than it saves below Meff 1024
    def pt(lp, m):
        paged = 0.05 * m / 256
        dev = {"paged": paged, "cascade": 0.04, "dense": 0.5}
        return _pt(lp, m, dict(dev), dict(dev), {"paged": 0.02, "cascade": 0.10, "dense": 0.10})

    pts = [pt(lp, m) for lp in (512, 2048) for m in (256, 512, 1024)]
    rules = fit(pts, G, SH)
    assert [r["graph"] for r in rules] == sorted((r["graph"] for r in rules), reverse=True)   # graph rules first
    d = Dispatcher(32, 8, 128, G, rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # both kinds covered everywhere
        for lp in (512, 2048):
            assert [d.choose(lp, m // 4) for m in (256, 512, 1024)] == ["cascade"] * 3
            assert [d.choose(lp, m // 4, graph=False) for m in (256, 512, 1024)] == ["paged", "paged", "cascade"]
            assert d.choose(lp, 1023 // 4, graph=False) == "paged"            # the gap next to a paged point
    # the eager device times alone favour cascade at every point: the host launch time is what flips it
    assert all(min(p["times_eager"], key=p["times_eager"].get) == "cascade" for p in pts)
    pol = GranikvPolicy(d)
    cs = _classes([(2048, 64, 0)])
    pol.graph_step = False
    pol.choose(cs, 64)
    assert cs[0].choice == "paged"
    pol.graph_step = True
    pol.choose(cs, 64)
    assert cs[0].choice == "cascade"


def test_host_launch_time_flips_an_eager_choice():
    # device time alone: cascade 20% faster than paged; with launches: paged
    p = _pt(512, 2560, {"paged": 0.135, "cascade": 0.101, "dense": 0.122},
            {"paged": 0.126, "cascade": 0.100, "dense": 0.260}, {"paged": 0.02, "cascade": 0.09, "dense": 0.05})
    rules = fit([p], G, Shape("q", 20, 4, 128))
    d = Dispatcher(20, 4, 128, G, rules)
    assert d.choose(512, 512) == "cascade" and d.choose(512, 512, graph=False) == "paged"
    no_host = dict(p)
    del no_host["host_eager"]
    d2 = Dispatcher(20, 4, 128, G, fit([no_host], G, Shape("q", 20, 4, 128)))
    assert d2.choose(512, 512, graph=False) == "cascade"
    assert not d2.kind_specific                           # same rules both kinds: written without `graph`


def test_fit_never_chooses_slower_than_paged_at_any_measured_point_and_covers_the_grid():
    rng = random.Random(7)
    lps, meffs = (512, 2048, 8192), (4, 8, 16, 64, 256, 1024)
    pts = []
    for lp in lps:
        for m in meffs:
            t = {c: rng.uniform(0.05, 0.3) for c in ("paged", "cascade", "dense")}
            e = {c: rng.uniform(0.05, 0.3) for c in ("paged", "cascade", "dense")}
            h = {c: rng.uniform(0.0, 0.1) for c in ("paged", "cascade", "dense")}
            pts.append(_pt(lp, m, t, e, h))
    rules = fit(pts, G, SH)
    d = Dispatcher(32, 8, 128, G, rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in pts:
            b = p["meff"] // 4
            for graph, cost in ((True, p["times"]), (False, eager_costs(p))):
                got = d.choose(p["prefix_len"], b, graph=graph)
                assert cost[got] <= cost["paged"] and cost[got] == min(cost.values())
                if got == "dense":                        # a COLD prefix takes the better of cascade, paged
                    cold = d.cold_decisions_for(graph)[(p["prefix_len"], b)]
                    assert cold in ("cascade", "paged") and cost[cold] <= cost["paged"]
        for lp in (1, 700, 3000, 20000):
            for b in range(1, 300, 7):
                d.choose(lp, b), d.choose(lp, b, graph=False)
    assert d.fallbacks == 0


def test_paged_covers_the_gap_next_to_a_paged_point_and_margin_holds():
    pts = [_pt(2048, 64, {"paged": 1.0, "cascade": 2.0, "dense": 3.0}, {"paged": 1.0, "cascade": 2.0, "dense": 3.0}),
           _pt(2048, 256, {"paged": 4.0, "cascade": 1.0, "dense": 3.0}, {"paged": 4.0, "cascade": 1.0, "dense": 3.0}),
           _pt(2048, 1024, {"paged": 9.0, "cascade": 2.0, "dense": 1.0}, {"paged": 9.0, "cascade": 2.0, "dense": 1.0})]
    d = Dispatcher(32, 8, 128, G, fit(pts, G, SH))
    assert d.choose(2048, 16) == "paged" and d.choose(2048, 63) == "paged"      # Meff 252: not measured, paged
    assert d.choose(2048, 64) == "cascade"                                       # the measured point
    assert d.choose(2048, 127) == "cascade" and d.choose(2048, 128) == "dense"   # cascade|dense: cut at sqrt = 512
    # a split option that wins only within the margin stays paged
    assert guarded_best({"paged": 1.0, "cascade": 0.98}, 0.03) == "paged"
    assert guarded_best({"paged": 1.0, "cascade": 0.98}, 0.0) == "cascade"
    assert guarded_best({"paged": 1.0, "cascade": 1.0, "dense": 1.0}) == "paged"        # ties: paged
    m = [_pt(512, 8, {"paged": 1.0, "cascade": 0.98, "dense": 3.0}, {"paged": 1.0, "cascade": 0.98, "dense": 3.0})]
    assert Dispatcher(32, 8, 128, G, fit(m, G, SH, margin=0.03)).choose(512, 2) == "paged"
    assert Dispatcher(32, 8, 128, G, fit(m, G, SH)).choose(512, 2) == "cascade"


def test_adjacent_meff_points_keep_their_own_choice():
    # group 1: Meff 1 and 2; a rounded geometric cut of 1 would hand Meff 1 to the next rule
    pts = [{"prefix_len": 64, "meff": 1, "times": {"paged": 3.0, "cascade": 2.0, "dense": 1.0}},
           {"prefix_len": 64, "meff": 2, "times": {"paged": 3.0, "cascade": 1.0, "dense": 2.0}}]
    d = Dispatcher(1, 1, 64, G, fit(pts, G, Shape("g1", 1, 1, 64)))
    assert d.choose(64, 1) == "dense" and d.choose(64, 2) == "cascade"


def test_fit_needs_eager_times_at_every_point_once_any_has_them():
    pts = [_pt(512, 8, {"paged": 1.0}, {"paged": 1.0}), {"prefix_len": 512, "meff": 16, "times": {"paged": 1.0}}]
    with pytest.raises(ValueError, match="times_eager"):
        fit(pts, G, SH)


# ---------------------------------------------------------------- old tables: unchanged decisions
def _old_choose(rules, gpu, shape, lp, b):
    """The decision as the code before step kinds made it: first matching rule, else the paper's rule."""
    if b == 0:
        return "paged"
    meff = b * shape[0] // shape[1]
    for r in rules:
        if r.get("gpu", "*") not in ("*", None) and str(r["gpu"]).lower() != gpu.lower():
            continue
        if any(r.get(k) is not None and r[k] != v for k, v in zip(("num_q_heads", "num_kv_heads", "head_dim"), shape)):
            continue
        if lp >= r.get("lp_min", 0) and (r.get("lp_max") is None or lp < r["lp_max"]) \
                and meff >= r.get("meff_min", 0) and (r.get("meff_max") is None or meff < r["meff_max"]):
            return r["choice"]
    return paper_rule(meff)


def _committed_h200():
    hw = yaml.safe_load((ROOT / "conf" / "hardware" / "h200.yaml").read_text())
    table = hw["decision_table"]
    by_shape: dict[tuple, list[dict]] = {}
    for r in table:
        by_shape.setdefault((r["num_q_heads"], r["num_kv_heads"], r["head_dim"]), []).append(r)
    return hw, table, by_shape


def test_committed_h200_graph_only_tables_decide_as_before_for_every_step_kind():
    """Shapes whose rules name no step kind (fitted before eager times were recorded) decide as the code
    before step kinds did, in graph and eager steps alike."""
    hw, table, by_shape = _committed_h200()
    shapes = sorted(k for k, rs in by_shape.items() if not any("graph" in r or "cold" in r for r in rs))
    edges = sorted({v for k in shapes for r in by_shape[k] for v in (r.get("lp_min"), r.get("lp_max")) if v})
    lps = sorted({1, 256, 512, 2048, 8192, 16384, 32768} | {e + o for e in edges for o in (-1, 0, 1)})
    bs = range(0, 1100)
    n = 0
    for shape in shapes:
        d = Dispatcher(*shape, hw["gpu_name"], table)
        assert not d.kind_specific and d.decisions_for(False) is d.decisions_for(True)
        pol = GranikvPolicy(d)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for lp in lps:
                for b in bs:
                    want = _old_choose(table, hw["gpu_name"], shape, lp, b)
                    assert d.choose(lp, b) == d.choose(lp, b, graph=True) == d.choose(lp, b, graph=False) == want
                    n += 1
                # through the policy, HOT and COLD prefixes, both step kinds: dense on a COLD prefix -> cascade
                cs = _classes([(lp, b, 0) for b in range(1, 1100, 37)] + [(lp, b, -1) for b in range(1, 1100, 37)])
                for kind in (True, False):
                    pol.graph_step = kind
                    pol.choose(cs, 0)
                    for c in cs:
                        w = _old_choose(table, hw["gpu_name"], shape, lp, c.n_real)
                        assert c.choice == ("cascade" if w == "dense" and c.hot_start < 0 else w)
        assert d.fallbacks == 0
    assert len(shapes) >= 2 and len(lps) >= 16 and n == len(shapes) * len(lps) * len(bs)


def test_committed_h200_step_kind_tables_are_the_fit_of_the_committed_eager_calibration():
    """Shapes with graph / eager rules: the committed rules are exactly what runners.calibrate fits from the
    committed calibration_eager points (so the table holds no hand edit), the guard holds at every point
    (a non-paged choice only where it was measured faster than paged, in its step kind's cost), and the
    dispatcher decides by step kind."""
    hw, table, by_shape = _committed_h200()
    fitted = {k: rs for k, rs in by_shape.items() if any("graph" in r for r in rs)}
    assert {(32, 8, 128), (40, 8, 128)} <= set(fitted)          # Llama-3.1-8B, Qwen2.5-14B at TP=1
    cal = ROOT / "results" / "raw" / "calibration_eager"
    for (hq, hkv, dd), rules in fitted.items():
        fit_dir = next(f for f in cal.glob("fit-*")
                       if rawio.read_json(f / "config.json")["cell"]["shape"] == {"name": f.name[4:], "hq": hq,
                                                                                    "hkv": hkv, "d": dd})
        points = rawio.read_jsonl(fit_dir / "kernel.jsonl")
        assert len(points) == 40 and all("host_eager" in p for p in points)
        assert fit(points, hw["gpu_name"], Shape(fit_dir.name[4:], hq, hkv, dd)) == rules
        assert rawio.read_json(fit_dir / "metrics.json")["decision_table"] == rules
        d = Dispatcher(hq, hkv, dd, hw["gpu_name"], table)
        assert d.kind_specific
        for p in points:
            b = p["meff"] * hkv // hq
            for graph, cost in ((True, p["times"]), (False, eager_costs(p))):
                c = d.choose(p["prefix_len"], b, graph=graph)
                assert c == guarded_best(cost), (p["prefix_len"], p["meff"], graph)
                assert c == "paged" or cost[c] < cost["paged"]


def test_committed_h100_table_is_the_fit_of_its_own_calibration_for_every_shape():
    """conf/hardware/h100.yaml: every shape of the calibration grid has graph and eager rules, each exactly
    what runners.calibrate fits from the committed calibration_h100 points (no hand edit, no H200 rule),
    all of them measured on the H100; the guard holds at every point in its step kind's cost."""
    hw = yaml.safe_load((ROOT / "conf" / "hardware" / "h100.yaml").read_text())
    table = hw["decision_table"]
    assert hw["gpu_name"] == "NVIDIA H100 80GB HBM3" and {r["gpu"] for r in table} == {hw["gpu_name"]}
    cal = ROOT / "results" / "raw" / "calibration_h100"
    fits = sorted(cal.glob("fit-*"))
    assert {f.name[4:] for f in fits} == {"llama3_8b", "qwen25_14b", "qwen25_14b_tp2", "qwen25_32b_tp4"}
    cells = [c for c in cal.iterdir() if not c.name.startswith("fit-")]
    assert len(cells) == 160
    assert {rawio.read_json(c / "config.json")["provenance"]["gpu_name"] for c in cells} == {hw["gpu_name"]}
    n_rules = 0
    for fit_dir in fits:
        s = rawio.read_json(fit_dir / "config.json")["cell"]["shape"]
        key = (s["hq"], s["hkv"], s["d"])
        rules = [r for r in table if (r["num_q_heads"], r["num_kv_heads"], r["head_dim"]) == key]
        points = rawio.read_jsonl(fit_dir / "kernel.jsonl")
        assert len(points) == 40 and all("host_eager" in p for p in points)
        assert {r.get("graph") for r in rules} == {True, False}
        assert fit(points, hw["gpu_name"], Shape(s["name"], *key)) == rules
        d = Dispatcher(*key, hw["gpu_name"], table)
        for p in points:
            b = p["meff"] * key[1] // key[0]
            for graph, cost in ((True, p["times"]), (False, eager_costs(p))):
                c = d.choose(p["prefix_len"], b, graph=graph)
                assert c == guarded_best(cost) and (c == "paged" or cost[c] < cost["paged"])
        n_rules += len(rules)
    assert n_rules == len(table)


# ---------------------------------------------------------------- per-step host cost: a dict lookup
def test_choose_per_step_is_a_cache_hit_after_first_sight(monkeypatch):
    for table in (KIND_TABLE, [{"meff_min": 256, "choice": "dense"}, {"choice": "cascade"}]):
        d = Dispatcher(32, 8, 128, G, table)
        pol = GranikvPolicy(d)
        spec = [(4096, 64, 0), (4096, 300, -1), (2048, 7, 0)]
        for kind in (True, False):
            pol.graph_step = kind
            pol.choose(_classes(spec), 371)
        sizes = {k: len(d.decisions_for(k)) for k in (True, False)}
        for kind in (True, False):                     # hits are the builtin dict lookup, no Python frame
            assert type(d.decisions_for(kind)).__getitem__ is dict.__getitem__
            assert type(d.cold_decisions_for(kind)).__getitem__ is dict.__getitem__

        def boom(*a, **k):
            raise AssertionError("decided again: the per-step path must be a cache hit")

        monkeypatch.setattr(d, "_decide", boom)
        for _ in range(3):
            for kind in (True, False):
                pol.graph_step = kind
                cs = _classes(spec)
                pol.choose(cs, 371)
                assert d.choose_many([(c.prefix_len, c.n_real) for c in cs], graph=kind)
        assert {k: len(d.decisions_for(k)) for k in (True, False)} == sizes
        monkeypatch.undo()
    # an old table: one cache for both kinds, so eager steps never add entries (or misses) of their own
    d = Dispatcher(32, 8, 128, G, [{"choice": "cascade"}])
    d.choose(4096, 3)
    assert d.decisions_for(False) is d.decisions and len(d.decisions) == 1
    assert d.choose(4096, 3, graph=False) == "cascade" and len(d.decisions) == 1


# ---------------------------------------------------------------- plan(): the baseline's work when paged
def test_plan_of_a_guarded_paged_step_is_the_paged_baselines():
    sh = Shape("t", 8, 2, 16)
    _, _, batch = build_cell(sh, 64, 32, 2, 4, torch.float32, torch.device("cpu"))
    table = [{"graph": True, "choice": "cascade"}, {"graph": False, "choice": "paged"}]
    pol = GranikvPolicy(Dispatcher(8, 2, 16, G, table))
    pol.graph_step = False
    mine, base = build_plan(batch, pol, 4), build_plan(batch, PagedPolicy(), 4)
    assert mine.split == [] and mine.structure() == base.structure() == ()
    assert torch.equal(mine.rest_indices, base.rest_indices) and torch.equal(mine.rest_indptr, base.rest_indptr)
    assert torch.equal(mine.rest_indices, batch.kv_indices.int())            # whole slot lists: no gather
    pol.graph_step = True
    assert len(build_plan(batch, pol, 4).split) == 2                         # the graph kind does split


# ---------------------------------------------------------------- the engine passes the step kind
def test_engine_decides_eager_steps_with_the_eager_rules():
    from granikv.config import HardwareConfig, ModelConfig, RunConfig
    from granikv.engine.engine import Engine
    from granikv.config import system_config
    from granikv.request import Request

    tiny = dict(hidden_size=64, num_layers=1, num_heads=16, num_kv_heads=4, head_dim=16, intermediate_size=64,
                vocab_size=128, max_position_embeddings=256)
    table = [{"graph": True, "choice": "cascade"}, {"graph": False, "choice": "paged"}]
    rng = random.Random(3)
    prefix = [rng.randrange(128) for _ in range(40)]
    reqs = [Request(i, prefix + [rng.randrange(128) for _ in range(3)], 2 + i, shared_len=40, prefix_class=0)
            for i in range(7)]

    def run(pad):
        hw = HardwareConfig(kv_budget_tokens=2048, cuda_graph_max_bs=4, decision_table=table)
        eng = Engine(RunConfig(model=ModelConfig(**tiny), system=system_config("granikv"), hardware=hw),
                     pad_batches=pad)
        return [s for s in eng.run(reqs).steps if s["kind"] == "decode"]

    steps = run(True)
    seen = set()
    for s in steps:
        got = {d["backend"] for d in s["decisions"] if d["prefix_id"] >= 0}
        kind = "eager" if s["batch_size"] > 4 else "graph"        # above cuda_graph_max_bs: eager
        assert got == ({"paged"} if kind == "eager" else {"cascade"}), s
        seen.add(kind)
    assert seen == {"eager", "graph"}
    # unpadded (no graph sizes): every step is eager
    assert {d["backend"] for s in run(False) for d in s["decisions"] if d["prefix_id"] >= 0} == {"paged"}


# ---------------------------------------------------------------- the calibrator's CPU path
def test_calibrate_records_both_kinds_and_never_overwrites_an_older_cell(tmp_path):
    from runners.calibrate import run
    from runners.kernel_bench import BenchSpec

    spec = BenchSpec(hardware="cpu", device="cpu", dtype="float32", shapes=[Shape("t", 8, 2, 16)],
                     prefix_lens=[16], batches=[1, 4], num_prefixes=[1], suffix_len=4, backends=list(OPTIONS),
                     warmup=0, reps=1, layout_batch=1, layout_prefix_lens=[1], layout=False, dispatch_cost=False,
                     check_error=False, results_dir=str(tmp_path), sweep_name="calibration")
    own = {"hardware_yaml": str(tmp_path / "cpu.yaml"), "write_table": True}
    rep = run(spec, own)
    assert rep["done"] == 2 and rep["stale"] == 0
    root = tmp_path / "calibration"
    cell = root / "t-lp16-b4"
    m = rawio.read_json(cell / "metrics.json")
    for v in OPTIONS:
        assert m[f"time_ms_eager_{v}"] > 0 and m[f"host_ms_eager_{v}"] == 0.0 and m[f"graph_replayed_{v}"] is False
    pts = rawio.read_jsonl(root / "fit-t" / "kernel.jsonl")
    assert all(set(p) == {"prefix_len", "meff", "times", "times_eager", "host_eager"} for p in pts)
    table = yaml.safe_load((tmp_path / "cpu.yaml").read_text())["decision_table"]
    assert table == fit(pts, "cpu", Shape("t", 8, 2, 16))
    # a cell from before the eager host times: a plain run refuses to overwrite it and names the way out
    old = {k: v for k, v in m.items() if not k.startswith(("time_ms_eager_", "host_ms_eager_"))}
    rawio.write_json(cell / "metrics.json", old)
    with pytest.raises(ValueError, match="sweep_name=calibration_eager"):
        run(spec, own)
    assert rawio.read_json(cell / "metrics.json") == old
    # force=true measures it again in place (the other cell is kept)
    from dataclasses import replace
    rep = run(replace(spec, force=True), own)
    assert rep["done"] == 2 and "host_ms_eager_paged" in rawio.read_json(cell / "metrics.json")
