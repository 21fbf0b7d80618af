"""granikv.attention.sdpa_ops: the dense prefix call on torch's fused attention, GQA-packed and split
over interleaved KV chunks, equals one attention of q over the slab. CPU: the packing, chunking and
merge through torch's CPU flash kernel; GPU (pytest -m gpu): the cuDNN and FlashAttention-2 kernels,
alone and as the dense backend's prefix call (eager and CUDA-graph replay)."""
import math

import pytest
import torch

from attn_util import flashinfer_available, make_step, rel_err
from granikv.attention import reference as R
from granikv.attention import sdpa_ops as S


@pytest.mark.parametrize("n,hq,hkv,d,length", [(5, 8, 2, 16, 64), (3, 10, 2, 16, 48), (4, 4, 4, 8, 32),
                                               (1, 32, 8, 16, 128)])
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_matches_one_attention_on_cpu(n, hq, hkv, d, length, splits):
    g = torch.Generator().manual_seed(n * 100 + splits)
    q, k, v = (torch.randn(*s, generator=g) for s in ((n, hq, d), (length, hkv, d), (length, hkv, d)))
    o, lse = S.sdpa_prefill_split(q, k, v, d ** -0.5, splits)
    ro, rl = R.attention_ref(q, k, v, d ** -0.5)
    assert o.shape == (n, hq, d) and lse.shape == (n, hq) and lse.dtype == torch.float32
    assert rel_err(o, ro) < 1e-5
    assert torch.allclose(lse, rl, atol=1e-5)                        # base 2, as FlashInfer's


def test_pack_and_unpack_are_inverse_maps():
    n, hkv, g, d, s = 3, 2, 4, 5, 2
    q = torch.arange(n * hkv * g * d, dtype=torch.float32).view(n, hkv * g, d)
    qp = S.pack_queries(q, hkv, s)                                   # [1, s*Hkv, n*G, D]
    assert qp.shape == (1, s * hkv, n * g, d) and qp.is_contiguous()
    for c in range(s):
        for h in range(hkv):
            for r in range(n * g):
                assert torch.equal(qp[0, c * hkv + h, r], q[r // g, h * g + r % g])
    lse = torch.randn(1, s * hkv, n * g)
    o, sv = S.unpack_states(qp, lse, n, hkv, s)
    assert torch.equal(o[:, 0], q) and torch.equal(o[:, 1], q)
    assert torch.allclose(sv[1, 0, 3] / S.LOG2E, lse[0, 0, 1 * g + 3])   # request 1, head 3 of chunk 0


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_unpack_states_returns_contiguous_states(g, layout):
    # FlashInfer's merge_states rejects strided states; at G = 1 (MHA) the unpacking reshape is a view,
    # and torch's kernels return o in either memory layout.
    n, hkv, s, d = 5, 2, 4, 8
    o = torch.randn(1, n * g, s * hkv, d).transpose(1, 2) if layout == "bshd" else torch.randn(1, s * hkv, n * g, d)
    lse = torch.randn(1, s * hkv, n * g)
    ov, sv = S.unpack_states(o, lse, n, hkv, s)
    assert ov.is_contiguous() and sv.is_contiguous()
    assert ov.shape == (n, s, hkv * g, d) and sv.shape == (n, s, hkv * g)
    # chunk c, kv head h, request i, group row j sits at o[0, c * Hkv + h, i * G + j]
    assert torch.equal(ov[3, 2, 1 * g + (g - 1)], o[0, 2 * hkv + 1, 3 * g + (g - 1)])


def test_chunk_kv_is_a_free_view_with_interleaved_keys():
    k = torch.randn(8, 2, 4)
    kc = S.chunk_kv(k, 4)                                            # [1, 4*2, 2, 4]
    assert kc.data_ptr() == k.data_ptr() and kc.shape == (1, 8, 2, 4)
    assert torch.equal(kc[0, 3 * 2 + 1, 1], k[4 * 1 + 3, 1])          # chunk 3, kv head 1, key t'=1 -> t = 4*1+3


def test_merge_chunks_is_the_log_sum_exp_merge():
    g = torch.Generator().manual_seed(0)
    o, s = torch.randn(3, 4, 2, 5, generator=g), torch.randn(3, 4, 2, generator=g)
    mo, ms = S.merge_chunks(o, s)
    w = torch.softmax(s * math.log(2.0), dim=1)
    assert torch.allclose(mo, (o * w.unsqueeze(-1)).sum(1), atol=1e-6)
    assert torch.allclose(ms, torch.logsumexp(s * math.log(2.0), dim=1) / math.log(2.0), atol=1e-6)


@pytest.mark.parametrize("kw,msg", [({"kernel": "triton"}, "kernel must be one of"), ({"splits": 3}, "splits"),
                                    ({"splits": 0}, "splits")])
def test_bad_arguments_name_the_fix(kw, msg):
    q, k = torch.randn(2, 4, 8), torch.randn(16, 2, 8)
    with pytest.raises(ValueError, match=msg):
        S.sdpa_prefill_split(q, k, k, 0.3, **kw)


needs_gpu = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", S.SDPA_KERNELS)
@pytest.mark.parametrize("shape", [(32, 8, 128), (20, 4, 128), (8, 8, 128)])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_gpu_kernels_match_reference(kernel, shape, splits):
    hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(splits)
    q = torch.randn(200, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(4096, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(4096, hkv, d, device="cuda", generator=g).bfloat16()
    o, lse = S.sdpa_prefill_split(q, k, v, d ** -0.5, splits, kernel)
    ro, rl = R.attention_ref(q.float(), k.float(), v.float(), d ** -0.5)
    assert rel_err(o.float(), ro) <= 2e-2
    assert torch.allclose(lse, rl, atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", S.SDPA_KERNELS)
def test_gpu_dense_backend_with_torch_kernel_eager_and_replayed(kernel):
    from granikv.attention.bench import capture_graph
    from granikv.attention.decode import make_backend

    hq, hkv, d = 32, 8, 128
    k, v, batch = make_step(4, hkv, d, [1024], [64], [True], dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch.batch_size, hq, d, device="cuda").bfloat16()
    ref = R.paged_decode_ref(q.float(), k.float(), v.float(), batch.kv_indptr, batch.kv_indices)[0]
    be = make_backend("dense", hq, hkv, d, "cuda", torch.bfloat16, dense_kernel=kernel)
    be.plan(batch)
    assert rel_err(be.run(q, k, v), ref) <= 2e-2
    gb = make_backend("dense", hq, hkv, d, "cuda", torch.bfloat16, cuda_graph=True, dense_kernel=kernel)
    gb.plan(batch)
    graph, out = capture_graph(lambda: gb.run(q, k, v))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref2 = R.paged_decode_ref(q.float(), k.float(), v.float(), batch.kv_indptr, batch.kv_indices)[0]
    assert rel_err(out, ref2) <= 2e-2
