"""Llama / Qwen2 decoder with random seeded weights and tensor parallelism (nano-vllm style).

Only the shape matters for measurement, so weights are drawn from a seeded generator on the
target device (no hub, no downloads). Every weight is drawn whole from a generator seeded by
(seed, parameter name) and then sliced for this TP rank, so TP=1 and TP=n hold the same
model and must produce the same tokens.

Attention is not computed here: each layer calls ``attn(layer, q, k, v)`` on an object the
caller passes in (the runner's KV-cache attention, or the no-cache causal reference), so the
same weights serve the engine and the correctness oracle.
"""
from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from granikv.config import ModelConfig
from granikv.engine.fused import LayerOps


class Attention(Protocol):
    """attn(layer, q [n, Hq_local, D], k [n, Hkv_local, D], v [n, Hkv_local, D]) -> o [n, Hq_local, D]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class TPGroup:
    """This process's place in the tensor-parallel group (size 1 = no torch.distributed)."""

    def __init__(self, size: int = 1):
        self.size = size
        if size > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"tp={size} needs torch.distributed: launch with "
                                   f"`torchrun --nproc_per_node={size} ...` (gloo on CPU, nccl on GPU)")
            if dist.get_world_size() != size:
                raise ValueError(f"config error at `tp`: tp={size} but the process group has "
                                 f"{dist.get_world_size()} ranks; set tp to the torchrun world size")
        self.rank = dist.get_rank() if size > 1 else 0
        # where the host-side collectives (the scheduler's clock) live: the CPU when the group has a
        # gloo side (runners.run inits "cpu:gloo,cuda:nccl"), else the GPU (a host sync per call)
        self.host_device = torch.device("cpu")
        if size > 1 and "gloo" not in str(dist.get_backend()):
            self.host_device = torch.device("cuda", torch.cuda.current_device())
        self._symm_buf: torch.Tensor | None = None   # [max_numel] symmetric-memory staging buffer
        self._symm_group = ""
        self._one_shot = None

    def use_symm_one_shot(self, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        """Route all-reduces of up to ``max_bytes`` (``dtype``, on ``device``) through torch's
        symmetric-memory one-shot kernel (each rank reads every peer's buffer over NVLink and sums;
        no NCCL launch), as SGLang routes small all-reduces through its custom all-reduce.

        Allocates one staging buffer of ``max_bytes`` per rank and exchanges its handles (a
        collective: every rank calls this). Larger messages keep NCCL."""
        if self.size == 1:
            return
        if torch.device(device).type != "cuda":
            raise ValueError("config error at `hardware.allreduce`: symm_one_shot needs CUDA tensors; use nccl")
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        if hasattr(symm_mem, "enable_symm_mem_for_group"):   # older torch needs it; newer deprecates it (harmless)
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group.group_name)
        numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        buf = symm_mem.empty(numel, dtype=dtype, device=device)     # [numel]
        symm_mem.rendezvous(buf, group=group)
        self._symm_buf, self._symm_group = buf, group.group_name
        self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_copy

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group; returns the result (``x`` itself on the NCCL path, a new tensor
        on the one-shot path: use the return value)."""
        if self.size == 1:
            return x
        buf = self._symm_buf
        if buf is not None and x.dtype == buf.dtype and x.device == buf.device and x.numel() <= buf.numel():
            x = x.contiguous()
            staged = buf.narrow(0, 0, x.numel()).view(x.shape)     # this rank's slot, shaped as x
            return self._one_shot(staged, x, "sum", self._symm_group)
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate each rank's ``x [..., n]`` along the last dim -> ``[..., n * size]`` (into ``out``
        when given)."""
        if self.size == 1:
            return x if out is None else out.copy_(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1) if out is None else torch.cat(parts, dim=-1, out=out)


class WeightSource:
    """Seeded random weights, drawn whole and sliced for this TP rank, with no stray GPU memory.

    ``draw(name, shape, std)`` fills one reused fp32 staging buffer from a generator seeded by
    (seed, name), rounds it into one reused ``dtype`` buffer and returns a view of that (valid until
    the next draw); ``shard`` / ``shard_into`` copy this rank's slice out into storage of its own.
    Both staging buffers are allocated once, before any parameter, and freed with this object, so
    the caching allocator never carves a parameter out of a freed temporary's segment: drawing each
    weight into a fresh tensor left parameters pinning those segments (2.5 GiB per rank cached yet
    unreleasable for Qwen2.5-32B at TP=4, seen 2026-11-30), and the KV budget lacked that memory.

    ``max_numel``: the largest weight's element count (the staging buffers' size)."""

    def __init__(self, seed: int, device, dtype, max_numel: int):
        self.seed, self.device, self.dtype = seed, device, dtype
        self._f32 = torch.empty(max_numel, device=device, dtype=torch.float32)   # [max_numel]
        self._low = torch.empty(max_numel, device=device, dtype=dtype)           # [max_numel]

    def draw(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """Whole weight ``shape`` ~ N(0, std^2), a view of the staging buffer (copy out what is kept)."""
        n = math.prod(shape)
        if n > self._f32.numel():
            raise ValueError(f"weight {name} {shape} exceeds the staging buffer ({self._f32.numel()} elements)")
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
        w = self._f32[:n].view(shape)
        w.normal_(0.0, std, generator=g)
        low = self._low[:n].view(shape)
        low.copy_(w)
        return low

    @staticmethod
    def slice(w: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
        """This rank's 1/tp.size slice of ``w`` along ``dim`` (a view)."""
        n = w.shape[dim] // tp.size
        return w.narrow(dim, tp.rank * n, n)

    def shard(self, name: str, shape: tuple[int, ...], std: float, dim: int, tp: TPGroup) -> torch.Tensor:
        """This rank's slice of weight ``name`` along ``dim``, in storage of its own (a copy, never a
        view: a dim-0 slice is contiguous, and ``.contiguous()`` would keep the whole weight alive)."""
        return self.slice(self.draw(name, shape, std), dim, tp).clone(memory_format=torch.contiguous_format)

    def shard_into(self, out: torch.Tensor, parts: list[tuple[str, tuple[int, ...], float]], tp: TPGroup) -> torch.Tensor:
        """Fill ``out`` with the dim-0 slices of ``parts`` (name, shape, std), concatenated in order
        (the fused qkv / gate_up projections), without a temporary per part."""
        row = 0
        for name, shape, std in parts:
            piece = self.slice(self.draw(name, shape, std), 0, tp)
            out[row:row + piece.shape[0]].copy_(piece)
            row += piece.shape[0]
        if row != out.shape[0]:
            raise ValueError(f"shard_into: the parts fill {row} of {out.shape[0]} rows")
        return out


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (returns (normed, new residual)); math in ``ops``."""

    def __init__(self, size: int, eps: float, device, dtype, ops: LayerOps | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops or LayerOps(False)
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (fp32), with Llama-3 rope scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type", "llama3"))
        if kind != "llama3":
            raise ValueError(f"config error at `model.rope_scaling.rope_type`: '{kind}' is not supported (llama3)")
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (HF Llama / Qwen2 ``rotate_half``) from a cos/sin cache ``[max_pos, D/2]``."""

    def __init__(self, cfg: ModelConfig, device, ops: LayerOps | None = None):
        super().__init__()
        self.ops = ops or LayerOps(False)
        self.head_dim = cfg.head_dim
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, rope_inv_freq(cfg).to(device))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        # FlashInfer's layout: [max_pos, D] fp32, cos first half, sin second half (fused path only)
        self.cos_sin = torch.cat([self.cos, self.sin], dim=-1) if self.ops.fused else None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, Hq*D], k [n, Hkv*D] (views of the qkv projection) -> ([n, Hq, D], [n, Hkv, D])."""
        return self.ops.rope(positions, q, k, self.head_dim, self.cos, self.sin, self.cos_sin)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; column-parallel in, row-parallel out, all-reduce after each."""

    def __init__(self, cfg: ModelConfig, idx: int, tp: TPGroup, src: WeightSource, ops: LayerOps | None = None):
        super().__init__()
        self.ops = ops or LayerOps(False)
        H, D, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        I = cfg.intermediate_size
        self.idx, self.tp = idx, tp
        self.hq, self.hkv, self.d = hq // tp.size, hkv // tp.size, D
        self.scale = D ** -0.5
        device, dtype = src.device, src.dtype
        pre = f"layers.{idx}."

        def p(t):
            return nn.Parameter(t, requires_grad=False)

        # q/k/v drawn separately and sharded by heads, then fused: [(hq+2hkv)_local * D, H]
        qkv_rows = (self.hq + 2 * self.hkv) * D
        self.qkv_w = p(src.shard_into(torch.empty(qkv_rows, H, device=device, dtype=dtype),
                                      [(pre + "q", (hq * D, H), H ** -0.5), (pre + "k", (hkv * D, H), H ** -0.5),
                                       (pre + "v", (hkv * D, H), H ** -0.5)], tp))
        if cfg.qkv_bias:
            self.qkv_b = p(src.shard_into(torch.empty(qkv_rows, device=device, dtype=dtype),
                                          [(pre + "qb", (hq * D,), 0.02), (pre + "kb", (hkv * D,), 0.02),
                                           (pre + "vb", (hkv * D,), 0.02)], tp))
        else:
            self.qkv_b = None
        self.o_w = p(src.shard(pre + "o", (H, hq * D), (hq * D) ** -0.5, 1, tp))           # [H, hq_local*D]
        self.gate_up_w = p(src.shard_into(torch.empty(2 * (I // tp.size), H, device=device, dtype=dtype),
                                          [(pre + "gate", (I, H), H ** -0.5), (pre + "up", (I, H), H ** -0.5)],
                                          tp))                                                # [2*I_local, H]
        self.down_w = p(src.shard(pre + "down", (H, I), I ** -0.5, 1, tp))                  # [H, I_local]
        self.in_norm = RMSNorm(H, cfg.rms_norm_eps, device, dtype, self.ops)
        self.post_norm = RMSNorm(H, cfg.rms_norm_eps, device, dtype, self.ops)

    def forward(self, positions, h, residual, rope: RotaryEmbedding, attn: Attention):
        # h, residual [n, H]
        if residual is None:
            residual, h = h, self.in_norm(h)
        else:
            h, residual = self.in_norm(h, residual)
        n = h.shape[0]
        qkv = F.linear(h, self.qkv_w, self.qkv_b)
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = rope(positions, q, k)                                         # [n, hq_local, D], [n, hkv_local, D]
        o = attn(self.idx, q.contiguous(), k, v.reshape(n, self.hkv, self.d))  # [n, hq_local, D]
        h = self.tp.all_reduce(F.linear(o.reshape(n, -1), self.o_w))
        h, residual = self.post_norm(h, residual)
        h = self.tp.all_reduce(F.linear(self.ops.silu_mul(F.linear(h, self.gate_up_w)), self.down_w))
        return h, residual


class CausalLM(nn.Module):
    """The decoder: vocab-parallel embedding and LM head, ``num_layers`` :class:`DecoderLayer`s."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, seed: int, device, dtype, fused_ops: bool = False):
        super().__init__()
        self.ops = LayerOps(fused_ops)       # FlashInfer's fused norm / RoPE / SiLU-mul (GPU) or torch
        for key, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                       ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
            if n % tp.size:
                raise ValueError(f"config error at `tp`: tp={tp.size} must divide model.{key}={n} "
                                 f"of model '{cfg.name}'")
        self.cfg, self.tp = cfg, tp
        self.vocab_local = cfg.vocab_size // tp.size
        H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        # the staging buffers first, so that no parameter lands in a segment a temporary frees
        src = WeightSource(seed, device, dtype,
                           max(V * H, I * H, cfg.num_heads * cfg.head_dim * H))
        self.embed = nn.Parameter(src.shard("embed", (V, H), 1.0, 0, tp), requires_grad=False)     # [V_local, H]
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = nn.Parameter(src.shard("lm_head", (V, H), H ** -0.5, 0, tp),
                                        requires_grad=False)                                     # [V_local, H]
        self.rope = RotaryEmbedding(cfg, device, self.ops)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, src, self.ops) for i in range(cfg.num_layers))
        del src   # the staging buffers' segments hold nothing else: the KV budget's empty_cache() returns them
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype, self.ops)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [n] -> [n, H]; each rank holds vocab rows [rank*V_local, (rank+1)*V_local)
        if self.tp.size == 1:
            return F.embedding(ids, self.embed)
        lo = self.tp.rank * self.vocab_local
        local = ids - lo
        mask = (local < 0) | (local >= self.vocab_local)
        h = F.embedding(local.masked_fill(mask, 0), self.embed).masked_fill(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """ids, positions [n] -> final hidden states [n, H]."""
        h, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, self.rope, attn)
        h, _ = self.norm(h, residual)
        return h

    def logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """h [m, H] -> fp32 logits [m, V] (vocab shards all-gathered, identical on every rank).
        ``out`` [m, V] fp32: written in place and returned (the fp32 conversion, or the all-gather's
        concatenation, writes there instead of into a new tensor: no extra traffic)."""
        x = F.linear(h, self.lm_head)
        if out is None:
            return self.tp.all_gather_last(x.float())
        if self.tp.size == 1:
            return out.copy_(x)
        return self.tp.all_gather_last(x.float(), out=out)


class CausalReference:
    """No-cache attention over one whole sequence (the oracle): causal softmax in fp32, GQA expanded."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, hq, d = q.shape
        g = hq // k.shape[1]
        kf = k.float().repeat_interleave(g, dim=1)   # [n, hq, D]
        vf = v.float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.float(), kf) * d ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)
        return o.to(q.dtype)


@torch.inference_mode()
def generate_reference(model: CausalLM, prompt_ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ``n`` tokens by a full forward over the whole sequence each step (no KV cache).

    Returns (tokens, logits per generated token [V] fp32). The correctness oracle.
    """
    dev = model.embed.device
    seq, out, logits = list(prompt_ids), [], []
    for _ in range(n):
        ids = torch.tensor(seq, dtype=torch.int64, device=dev)
        pos = torch.arange(len(seq), device=dev)
        lg = model.logits(model(ids, pos, CausalReference())[-1:])[0]
        tok = int(lg.argmax())
        out.append(tok)
        logits.append(lg)
        seq.append(tok)
    return out, logits
