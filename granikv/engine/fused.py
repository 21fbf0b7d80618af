"""The elementwise ops of a decoder layer: plain torch (CPU, the oracle) or FlashInfer's fused kernels.

SGLang runs a Llama/Qwen2 layer's RMSNorm, residual add + RMSNorm, RoPE and SiLU*up as one fused
kernel each (sgl-kernel's ports of FlashInfer's ``rmsnorm``, ``fused_add_rmsnorm``,
``apply_rope_with_cos_sin_cache_inplace`` and ``silu_and_mul``). Written as torch expressions they
are ~45 small kernels per layer instead of ~6, which on the GPU adds launch gaps and memory passes
to every decode step of every system alike. ``LayerOps(fused=True)`` calls FlashInfer's kernels
(GPU only); ``fused=False`` is the torch math, the CPU reference the engine tests compare against.

Shapes: x, residual [n, H]; q [n, Hq*D], k [n, Hkv*D] (views of the qkv projection, row stride
(Hq+2Hkv)*D); gate_up [n, 2*I] (gate first) -> [n, I]; positions int64 [n].
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from granikv.attention import flashinfer_ops as fo

# FlashInfer 0.7.2 runs its norms as CuTe-DSL kernels when nvidia-cutlass-dsl is installed; the CUDA
# kernels (the ones sgl-kernel ports) are the SGLang-faithful choice. FlashInfer reads this when it
# is first imported, so it is set here, before this module (or anything it calls) imports it;
# runners/gpu/env.sh exports it too.
os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")


def resolve_fused(setting: str, device: torch.device | str) -> bool:
    """``hardware.fused_ops``: auto (fused where FlashInfer runs: CUDA) | on | off."""
    if setting == "off":
        return False
    avail = torch.device(device).type == "cuda" and fo.available()
    if setting == "on" and not avail:
        raise ValueError("config error at `hardware.fused_ops`: 'on' needs CUDA and flashinfer; "
                         "use auto or off on this machine")
    return avail


class LayerOps:
    """RMSNorm / add+RMSNorm / RoPE / SiLU-mul, torch or FlashInfer-fused (see the module doc)."""

    def __init__(self, fused: bool = False):
        self.fused = fused
        self._fi = None
        if fused:
            import flashinfer  # type: ignore
            import flashinfer.rope  # type: ignore  # noqa: F401  (apply_rope_with_cos_sin_cache_inplace)

            self._fi = flashinfer

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [n, H] -> x / rms(x) * weight (fp32 statistics)."""
        if self.fused:
            return self._fi.rmsnorm(x, weight, eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(x.dtype) * weight

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual). Fused: in place (residual += x; x = norm)."""
        if self.fused:
            self._fi.fused_add_rmsnorm(x, residual, weight, eps)
            return x, residual
        s = x + residual
        return self.rmsnorm(s, weight, eps), s

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
             cos: torch.Tensor, sin: torch.Tensor, cos_sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox RoPE of q [n, Hq*D] and k [n, Hkv*D] -> ([n, Hq, D], [n, Hkv, D]).

        ``cos``/``sin`` [max_pos, D/2] fp32; ``cos_sin`` = cat(cos, sin) [max_pos, D] fp32 (fused path)."""
        n = q.shape[0]
        if self.fused:
            self._fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cos_sin, is_neox=True)
            return q.view(n, -1, head_dim), k.view(n, -1, head_dim)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

        def rot(x):
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

        return rot(q.view(n, -1, head_dim)), rot(k.view(n, -1, head_dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] (gate | up) -> silu(gate) * up [n, I]."""
        if self.fused:
            return self._fi.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
