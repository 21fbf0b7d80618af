"""granikv.attention.hot_batch: the ragged plan of the dense groups (host arithmetic) and its run on the
FlashInfer stand-in against the engine's per-group dense calls (the CPU reference)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attn_util import fake_fi_module  # noqa: F401  (a fixture)
from granikv.attention import reference as R
from granikv.attention.hot_batch import HotBatch, HotGroup, plan_hot_batch


def _groups(draw_sizes, gaps, fold, rows):
    """Slabs in address order with the given gaps (multiples of fold), rows as one run from row 0."""
    out, addr, r = [], gaps[0] * fold, 0
    for (lp, b), gap in zip(zip(draw_sizes, rows), gaps[1:] + [0]):
        out.append(HotGroup(addr, lp * fold, r, b))
        addr += lp * fold + gap * fold
        r += b
    return out


def test_plan_segments_gaps_and_padding():
    gs = [HotGroup(64, 32, 0, 3), HotGroup(128, 64, 3, 2)]          # a gap [96, 128) between the slabs
    p = plan_hot_batch(gs, fold=4)
    assert (p.region_start, p.region_len, p.row_start, p.rows) == (64, 128, 0, 5)
    assert p.qo_indptr == (0, 3, 3, 5) and p.kv_indptr == (0, 8, 16, 32)
    p = plan_hot_batch(list(reversed(gs)), fold=4, max_segments=6, region=(0, 256))
    assert p.qo_indptr == (0, 0, 3, 3, 5, 5, 5) and p.kv_indptr == (0, 16, 24, 32, 48, 64, 64)
    empty = plan_hot_batch([], fold=2, max_segments=3, region=(0, 16))
    assert empty.rows == 0 and empty.qo_indptr == (0, 0, 0, 0) and empty.kv_indptr == (0, 8, 8, 8)


@pytest.mark.parametrize("groups,kw,field", [
    ([HotGroup(2, 8, 0, 1)], {"fold": 4}, "hot_batch.fold"),
    ([HotGroup(0, 8, 0, 1)], {"fold": 3}, "hot_batch.fold"),
    ([HotGroup(0, 8, 0, 1), HotGroup(4, 8, 1, 1)], {}, "overlap"),
    ([HotGroup(0, 8, 0, 1), HotGroup(8, 8, 2, 1)], {}, "one run"),
    ([HotGroup(0, 8, 0, 1), HotGroup(16, 8, 1, 1)], {"max_segments": 2}, "hot_batch.max_segments"),
    ([HotGroup(0, 8, 0, 1)], {"region": (8, 8)}, "hot_batch.region"),
])
def test_plan_refuses_bad_input_naming_the_field(groups, kw, field):
    with pytest.raises(ValueError, match=field):
        plan_hot_batch(groups, **kw)


def _per_group_ref(q, k, v, gs, scale):
    return [R.attention_ref(q[g.row_start:g.row_start + g.rows], k[g.hot_start:g.hot_start + g.prefix_len],
                            v[g.hot_start:g.hot_start + g.prefix_len], scale) for g in gs]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5)), min_size=0, max_size=5),
       st.lists(st.integers(0, 3), min_size=6, max_size=6), st.sampled_from([1, 2, 4]), st.integers(0, 3),
       st.integers(0, 2**31 - 1))
def test_run_matches_the_per_group_dense_calls(fake_fi_module, sizes, gaps, fold, pad, seed):
    """Any group count (0..5), gaps between slabs, a fixed region and padded segments: the one ragged launch
    gives every group's rows the state of the engine's per-group dense call."""
    torch.manual_seed(seed)
    hq, hkv, d = 4, 2, 8
    gs = _groups([s[0] for s in sizes], gaps[:len(sizes) + 1] if sizes else [gaps[0]], fold, [s[1] for s in sizes])
    rows = sum(g.rows for g in gs)
    cap = (max((g.hot_start + g.prefix_len for g in gs), default=0) // fold + 2) * fold
    k, v = torch.randn(cap, hkv, d), torch.randn(cap, hkv, d)
    q = torch.randn(rows + 2, hq, d)
    scale = 1 / math.sqrt(d)
    nseg = 2 * len(gs) + 2 + pad
    hb = HotBatch(torch.empty(1), hq, hkv, d, torch.float32, scale, max_segments=nseg)
    hb.plan(plan_hot_batch(gs, fold=fold, max_segments=nseg, region=(0, cap)))
    if not gs:
        return
    o, lse = hb.run(q, k, v)
    for g, (o_ref, l_ref) in zip(gs, _per_group_ref(q, k, v, gs, scale)):
        a = g.row_start - gs[0].row_start
        torch.testing.assert_close(o[a:a + g.rows], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[a:a + g.rows], l_ref, rtol=1e-5, atol=1e-5)


def test_graph_buffers_are_rewritten_in_place_by_each_plan(fake_fi_module):
    """A graph-mode wrapper keeps its indptr buffers (their storage is what a captured launch reads) and each
    plan rewrites them: the second plan's groups are served from the same buffers."""
    hq, hkv, d = 2, 1, 4
    hb = HotBatch(torch.empty(1), hq, hkv, d, torch.float32, 0.5, max_segments=4)
    bufs = (hb.wrapper.qo_buf.data_ptr(), hb.wrapper.kv_buf.data_ptr())
    k, v, q = torch.randn(32, hkv, d), torch.randn(32, hkv, d), torch.randn(4, hq, d)
    for gs in ([HotGroup(0, 8, 0, 4)], [HotGroup(8, 4, 0, 1), HotGroup(16, 16, 1, 3)]):
        hb.plan(plan_hot_batch(gs, max_segments=4, region=(0, 32)))
        assert (hb.wrapper.qo_buf.data_ptr(), hb.wrapper.kv_buf.data_ptr()) == bufs
        o, _ = hb.run(q, k, v)
        for g, (o_ref, _) in zip(gs, _per_group_ref(q, k, v, gs, 0.5)):
            torch.testing.assert_close(o[g.row_start:g.row_start + g.rows], o_ref)
    with pytest.raises(ValueError, match="hot_batch.plan"):
        hb.plan(plan_hot_batch([HotGroup(0, 8, 0, 4)], max_segments=3, region=(0, 32)))


def test_bench_writes_a_cell_per_case_with_every_variant(fake_fi_module, tmp_path):
    """runners.hot_batch_bench on CPU (the stand-in): one cell per case, the per-group row and a batched row per
    fold that divides every Lp, each within float32 error of the reference; a rerun skips finished cells."""
    from hydra import compose, initialize_config_dir

    from granikv import rawio
    from granikv.config import register
    from runners import hot_batch_bench as hbb

    register()
    conf = str((__import__("pathlib").Path(__file__).resolve().parents[1] / "conf"))
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose("hot_batch_bench", overrides=[f"results_dir={tmp_path}", "folds=[1,2,4,64]"])
    spec = hbb.resolve(cfg)
    assert hbb.run(spec)["done"] == ["lp64", "hetero_k3"]
    for case in spec.cases:
        rows = rawio.read_jsonl(tmp_path / "hot_batch_cpu" / case.name / "kernel.jsonl")
        names = [r["backend"] for r in rows]
        assert names[0] == "per_group" and all("error" not in r for r in rows)
        want = [f"batched_auto_f{n}" for n in (1, 2, 4, 64) if all(lp % n == 0 for lp in case.prefix_lens)]
        assert names[1:] == want and all(r["rel_err"] < 1e-5 for r in rows)
        assert rawio.read_json(tmp_path / "hot_batch_cpu" / case.name / "config.json")["provenance"]["git_commit"]
    assert hbb.run(spec)["skipped"] == ["lp64", "hetero_k3"]
    with pytest.raises(ValueError, match="hot_batch_bench.folds"):
        hbb.resolve(compose_cfg(conf, tmp_path, ["folds=[3]"]))


def compose_cfg(conf, tmp_path, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf, version_base=None):
        return compose("hot_batch_bench", overrides=[f"results_dir={tmp_path}", *overrides])
