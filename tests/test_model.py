"""The decoder on its own: RoPE (incl. Llama-3 scaling), weights, TP sharding, the no-cache oracle."""
from __future__ import annotations
import math

import pytest
import torch
import torch.nn.functional as F

from granikv.config import ModelConfig
from granikv.engine.model import CausalLM, CausalReference, RotaryEmbedding, TPGroup, rope_inv_freq

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_bands():
    """High frequencies unchanged, low frequencies divided by `factor`, the band between in between."""
    plain = ModelConfig(head_dim=128, rope_theta=500000.0, max_position_embeddings=1024)
    scaled = ModelConfig(head_dim=128, rope_theta=500000.0, max_position_embeddings=1024,
                         rope_scaling=LLAMA31_SCALING)
    f0, f1 = rope_inv_freq(plain).double(), rope_inv_freq(scaled).double()
    wavelen = 2 * math.pi / f0
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(f1[high], f0[high])
    torch.testing.assert_close(f1[low], f0[low] / 8.0)
    assert bool(((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8.0)).all())
    # smooth interpolation: ratio f1/f0 is monotone non-increasing as wavelength grows
    r = (f1 / f0)
    assert bool((r[1:] <= r[:-1] + 1e-12).all())


def test_rope_is_relative():
    """<rope(q, m), rope(k, n)> depends only on m - n, and rotation keeps norms."""
    cfg = ModelConfig(head_dim=16, max_position_embeddings=256, rope_scaling=LLAMA31_SCALING)
    rope = RotaryEmbedding(cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)    # [n, H*D], one head

    def rq(m):
        return rope(torch.tensor([m]), q, k)[0]

    def rk(n):
        return rope(torch.tensor([n]), q, k)[1]

    def dot(m, n):
        return float((rq(m) * rk(n)).sum())
    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-4, abs=1e-5)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)
    torch.testing.assert_close(rq(55).norm(), q.norm())


def test_reference_attention_matches_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(9, 8, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    ours = CausalReference()(0, q, k, v)
    theirs = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1),
                                            v.repeat_interleave(4, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_weights_seeded_and_qwen_bias():
    cfg = ModelConfig(arch="qwen2", qkv_bias=True)
    a, b = CausalLM(cfg, TPGroup(1), 3, "cpu", torch.float32), CausalLM(cfg, TPGroup(1), 3, "cpu", torch.float32)
    c = CausalLM(cfg, TPGroup(1), 4, "cpu", torch.float32)
    assert torch.equal(a.layers[1].qkv_w, b.layers[1].qkv_w)
    assert not torch.equal(a.layers[1].qkv_w, c.layers[1].qkv_w)
    assert a.layers[0].qkv_b is not None and a.layers[0].qkv_b.abs().sum() > 0
    ids = torch.tensor([1, 2, 3, 4])
    h = a(ids, torch.arange(4), CausalReference())
    a.layers[0].qkv_b.zero_()
    assert not torch.allclose(h, a(ids, torch.arange(4), CausalReference()))
    llama = CausalLM(ModelConfig(), TPGroup(1), 3, "cpu", torch.float32)
    assert llama.layers[0].qkv_b is None


class _FakeTP(TPGroup):
    """Rank ``rank`` of ``size`` without a process group (for checking the weight shards only)."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_concatenate_to_tp1(tp):
    cfg = ModelConfig(num_heads=8, num_kv_heads=4, intermediate_size=128)
    full = CausalLM(cfg, TPGroup(1), 0, "cpu", torch.float32)
    parts = [CausalLM(cfg, _FakeTP(tp, r), 0, "cpu", torch.float32) for r in range(tp)]
    hq, hkv, d = 8 // tp, 4 // tp, 16
    L = full.layers[0]
    for r, p in enumerate(parts):
        q, k, v = p.layers[0].qkv_w.split([hq * d, hkv * d, hkv * d])
        fq, fk, fv = L.qkv_w.split([8 * d, 4 * d, 4 * d])
        assert torch.equal(q, fq[r * hq * d:(r + 1) * hq * d])
        assert torch.equal(k, fk[r * hkv * d:(r + 1) * hkv * d])
        assert torch.equal(v, fv[r * hkv * d:(r + 1) * hkv * d])
    torch.testing.assert_close(torch.cat([p.layers[0].o_w for p in parts], 1), L.o_w)
    torch.testing.assert_close(torch.cat([p.layers[0].down_w for p in parts], 1), L.down_w)
    torch.testing.assert_close(torch.cat([p.lm_head for p in parts], 0), full.lm_head)


@pytest.mark.parametrize("tied", [False, True])
def test_tp_shards_hold_only_their_own_storage(tied):
    """Every weight of a TP rank owns storage of its shard's size, not a view into the whole
    weight: a dim-0 slice (embedding, LM head) kept the full tensor alive, which is memory the KV
    budget (mem_fraction of free memory) then lacked (2.2 GiB per rank for Qwen2.5-32B at TP=4)."""
    cfg = ModelConfig(num_heads=8, num_kv_heads=4, intermediate_size=128, tie_word_embeddings=tied)
    m = CausalLM(cfg, _FakeTP(4, 1), 0, "cpu", torch.float32)
    for name, t in m.named_parameters():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    assert m.embed.shape[0] == cfg.vocab_size // 4


def test_tp_must_divide():
    with pytest.raises(ValueError, match="intermediate_size"):
        CausalLM(ModelConfig(num_heads=8, num_kv_heads=4, intermediate_size=130), _FakeTP(4, 0), 0, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="torchrun"):
        TPGroup(2)
