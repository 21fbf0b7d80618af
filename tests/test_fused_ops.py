"""granikv.engine.fused: the fused-op path's calling convention, against a FlashInfer stand-in that
implements FlashInfer's documented semantics (in-place add+norm and RoPE, cos|sin cache layout,
gate-first SiLU-mul) with torch; the kernels themselves are checked on the GPU (test_engine_gpu)."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from granikv.config import HardwareConfig, ModelConfig
from granikv.engine.fused import LayerOps, resolve_fused
from granikv.engine.model import CausalLM, TPGroup


def _fake_fi():
    m = types.ModuleType("flashinfer")

    def rmsnorm(x, w, eps=1e-6, out=None, enable_pdl=None):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def fused_add_rmsnorm(x, residual, w, eps=1e-6, enable_pdl=None):
        residual.add_(x)
        x.copy_(rmsnorm(residual, w, eps))

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox and cos_sin_cache.dtype == torch.float32 and positions.dtype == torch.int64
        half = cos_sin_cache.shape[1] // 2
        c, s = cos_sin_cache[positions, :half].unsqueeze(1), cos_sin_cache[positions, half:].unsqueeze(1)
        for t in (query, key):
            v = t.view(t.shape[0], -1, head_size)      # a view of the caller's tensor: written in place
            x1, x2 = v.float().chunk(2, dim=-1)
            v.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))

    def silu_and_mul(x, out=None, enable_pdl=None):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    m.rmsnorm, m.fused_add_rmsnorm, m.silu_and_mul = rmsnorm, fused_add_rmsnorm, silu_and_mul
    m.rope = types.ModuleType("flashinfer.rope")
    m.rope.apply_rope_with_cos_sin_cache_inplace = apply_rope_with_cos_sin_cache_inplace
    return m


@pytest.fixture
def fake_fi(monkeypatch):
    m = _fake_fi()
    monkeypatch.setitem(sys.modules, "flashinfer", m)
    monkeypatch.setitem(sys.modules, "flashinfer.rope", m.rope)
    return m


@pytest.mark.parametrize("arch,bias", [("llama", False), ("qwen2", True)])
def test_fused_path_equals_torch_path(fake_fi, arch, bias):
    """Same weights, same forward: the fused convention (in-place norms/RoPE on qkv views) == torch."""
    cfg = ModelConfig(arch=arch, qkv_bias=bias, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16,
                      hidden_size=64, intermediate_size=96, vocab_size=300)
    ref = CausalLM(cfg, TPGroup(1), 5, "cpu", torch.float32)
    fused = CausalLM(cfg, TPGroup(1), 5, "cpu", torch.float32, fused_ops=True)
    assert fused.ops.fused and not ref.ops.fused
    from granikv.engine.model import CausalReference

    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11)
    a = ref.logits(ref(ids, pos, CausalReference()))
    b = fused.logits(fused(ids, pos, CausalReference()))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_ops_really_in_place(fake_fi):
    ops = LayerOps(True)
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    want_r = x + r
    want = LayerOps(False).rmsnorm(want_r, w, 1e-5)
    y, r2 = ops.add_rmsnorm(x, r, w, 1e-5)
    assert y is x and r2 is r
    torch.testing.assert_close(r, want_r)
    torch.testing.assert_close(y, want)   # (joined by `and` before: assert_close returns None, so this never ran)


def test_fused_setting_resolves_and_errors():
    assert resolve_fused("auto", "cpu") is False and resolve_fused("off", "cpu") is False
    with pytest.raises(ValueError, match="hardware.fused_ops"):
        resolve_fused("on", "cpu")
    with pytest.raises(ValueError, match="hardware.fused_ops"):
        HardwareConfig(fused_ops="yes")
