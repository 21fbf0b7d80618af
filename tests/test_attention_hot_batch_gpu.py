"""granikv.attention.hot_batch on the GPU: one ragged launch over the HOT groups against the fp32 reference of
each group, eagerly and as a captured graph replayed over many random plans. Run on the GPU host:
pytest -m gpu tests/test_attention_hot_batch_gpu.py"""
import math
import random

import pytest
import torch

from attn_util import flashinfer_available
from granikv.attention import flashinfer_ops as fo
from granikv.attention import reference as R
from granikv.attention.bench import capture_graph
from granikv.attention.hot_batch import HotBatch, HotGroup, plan_hot_batch

pytestmark = pytest.mark.gpu
needs_fi = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")
HQ, HKV, D = 32, 8, 128


def _random_groups(rng, rows, g_max, region, fold):
    """1..g_max groups splitting ``rows`` rows (one run from row 0), slabs at random aligned places in the region,
    with random gaps between them."""
    n = rng.randint(1, g_max)
    cuts = sorted(rng.sample(range(1, rows), n - 1))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
    lps = [fold * rng.randint(1, 96) for _ in range(n)]
    slack = (region - sum(lps)) // fold
    gaps = sorted(rng.randint(0, slack) for _ in range(n))
    out, r, used = [], 0, 0
    for lp, b, gap in zip(lps, sizes, gaps):
        out.append(HotGroup(gap * fold + used, lp, r, b))
        used += lp
        r += b
    return out


def _check(o, lse, q, k, v, gs, scale):
    for g in gs:
        ref_o, ref_l = R.attention_ref(q[g.row_start:g.row_start + g.rows].float(),
                                       k[g.hot_start:g.hot_start + g.prefix_len].float(),
                                       v[g.hot_start:g.hot_start + g.prefix_len].float(), scale)
        got = o[g.row_start:g.row_start + g.rows].float()
        err = float((got - ref_o).norm() / ref_o.norm())
        assert err < 1e-2, (g, err)
        assert torch.allclose(lse[g.row_start:g.row_start + g.rows], ref_l, atol=2e-2, rtol=1e-3), g


@needs_fi
@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("fold", [1, 4])
def test_captured_launch_replays_any_plan_of_its_segment_count(backend, fold):
    """ONE capture, then 30 random plans (1..4 groups, random slabs and gaps in a fixed region, the captured
    segment count padded): each replay matches the reference of every group; the output is poisoned first."""
    rng = random.Random(1234 + fold)
    dev = torch.device("cuda")
    rows, region, g_max = 96, 4 * 96 * 8 * fold, 4
    torch.manual_seed(0)
    k = torch.randn(region, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(region, HKV, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(rows, HQ, D, device=dev, dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    seg = 2 * g_max + 1
    hb = HotBatch(fo.workspace(dev), HQ, HKV, D, torch.bfloat16, scale, backend=backend, max_segments=seg)
    gs = _random_groups(rng, rows, g_max, region, fold)
    hb.plan(plan_hot_batch(gs, fold=fold, max_segments=seg, region=(0, region)))
    eager_o, eager_l = hb.run(q, k, v)
    _check(eager_o, eager_l, q, k, v, gs, scale)
    graph, (o, lse) = capture_graph(lambda: hb.run(q, k, v))
    for _ in range(30):
        gs = _random_groups(rng, rows, g_max, region, fold)
        hb.plan(plan_hot_batch(gs, fold=fold, max_segments=seg, region=(0, region)))
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        _check(o, lse, q, k, v, gs, scale)
