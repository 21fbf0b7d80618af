"""The oracle itself: reference attention vs a naive softmax, base-2 LSE, merge, prefill masks."""
import math

import pytest
import torch

from granikv.attention import reference as R


def naive(q, k, v, scale, mask=None):
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, dim=1)
    vv = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,lhd->nhl", q.float(), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :], -math.inf)
    lse2 = torch.logsumexp(s, -1) / math.log(2)
    return torch.einsum("nhl,lhd->nhd", torch.softmax(s, -1), vv), lse2


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (10, 2), (16, 2)])
def test_attention_matches_naive(hq, hkv):
    g = torch.Generator().manual_seed(hq)
    q, k, v = torch.randn(5, hq, 16, generator=g), torch.randn(37, hkv, 16, generator=g), torch.randn(37, hkv, 16, generator=g)
    o, lse = R.attention_ref(q, k, v)
    on, ln = naive(q, k, v, 1 / 4)
    torch.testing.assert_close(o, on, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ln, rtol=1e-5, atol=1e-5)


def test_empty_segment_is_identity_for_merge():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    o, lse = R.attention_ref(q, k, v)
    oe, le = R.attention_ref(q, k[:0], v[:0])
    assert torch.isinf(le).all() and (oe == 0).all()
    om, lm = R.merge_state(o, lse, oe, le)
    torch.testing.assert_close(om, o)
    torch.testing.assert_close(lm, lse)
    o0, l0 = R.merge_state(oe, le, oe, le)
    assert (o0 == 0).all() and torch.isinf(l0).all()


@pytest.mark.parametrize("split", [1, 7, 20, 39])
def test_merge_of_disjoint_segments_equals_whole(split):
    g = torch.Generator().manual_seed(split)
    q, k, v = torch.randn(4, 8, 16, generator=g), torch.randn(40, 2, 16, generator=g), torch.randn(40, 2, 16, generator=g)
    o, lse = R.attention_ref(q, k, v)
    oa, la = R.attention_ref(q, k[:split], v[:split])
    ob, lb = R.attention_ref(q, k[split:], v[split:])
    om, lm = R.merge_state(oa, la, ob, lb)
    torch.testing.assert_close(om, o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lm, lse, rtol=1e-5, atol=1e-5)
    # in place, with a mask selecting half of the rows
    oi, li = oa.clone(), la.clone()
    mask = torch.tensor([True, False, True, False])
    R.merge_state_in_place(oi, li, ob, lb, mask)
    torch.testing.assert_close(oi[mask], o[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(oi[~mask], oa[~mask])


def test_lse_is_base2():
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(8, 1, 4)          # all scores 0 -> lse = log2(8) = 3
    _, lse = R.attention_ref(q, k, k)
    assert abs(float(lse) - 3.0) < 1e-6


def test_prefill_causal_with_cached_prefix():
    g = torch.Generator().manual_seed(1)
    C, hkv, d = 64, 2, 8
    kc, vc = torch.randn(C, hkv, d, generator=g), torch.randn(C, hkv, d, generator=g)
    # request 0: 5 cached + 3 new tokens; request 1: 0 cached + 4 new
    s0 = torch.randperm(C, generator=g)[:8]
    s1 = torch.randperm(C, generator=g)[:4]
    q = torch.randn(7, 4, d, generator=g)
    o, lse = R.prefill_ref(q, kc, vc, torch.tensor([0, 3, 7]), torch.tensor([0, 8, 12]), torch.cat([s0, s1]))
    for j in range(3):      # new token j of request 0 sees slots 0..5+j
        oj, _ = R.attention_ref(q[j:j + 1], kc[s0[:6 + j]], vc[s0[:6 + j]])
        torch.testing.assert_close(o[j:j + 1], oj)
    for j in range(4):
        oj, _ = R.attention_ref(q[3 + j:4 + j], kc[s1[:j + 1]], vc[s1[:j + 1]])
        torch.testing.assert_close(o[3 + j:4 + j], oj)
    on, _ = R.prefill_ref(q, kc, vc, torch.tensor([0, 3, 7]), torch.tensor([0, 8, 12]), torch.cat([s0, s1]), causal=False)
    oa, _ = R.attention_ref(q[:3], kc[s0], vc[s0])
    torch.testing.assert_close(on[:3], oa)


def test_prefill_rejects_kv_shorter_than_queries():
    q = torch.randn(4, 2, 8)
    kc = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="kv_len"):
        R.prefill_ref(q, kc, kc, torch.tensor([0, 4]), torch.tensor([0, 2]), torch.tensor([0, 1]))


def test_prefill_attention_cpu_plan_run():
    from granikv.attention.prefill import PrefillAttention

    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(30, 2, 8, generator=g), torch.randn(30, 2, 8, generator=g)
    q = torch.randn(5, 4, 8, generator=g)
    qo, kvp, kvi = torch.tensor([0, 2, 5]), torch.tensor([0, 6, 9]), torch.randperm(30, generator=g)[:9]
    pa = PrefillAttention(4, 2, 8)
    with pytest.raises(RuntimeError):
        pa.run(q, kc, vc)
    pa.plan(qo, kvp, kvi)
    torch.testing.assert_close(pa.run(q, kc, vc), R.prefill_ref(q, kc, vc, qo, kvp, kvi)[0])
