"""The Hugging Face ``config.json`` of a model preset, so a real server can build the same decoder.

SGLang reads only the architecture and shape from it; ``--load-format dummy`` fills the weights with
random values, as our engine does. Token ids are what both engines serve (``--skip-tokenizer-init``).
"""
from __future__ import annotations

import json
from pathlib import Path

from granikv.config import ModelConfig

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_config(m: ModelConfig, dtype: str = "bfloat16") -> dict:
    """``config.json`` fields of model ``m`` (Llama / Qwen2 family)."""
    if m.arch not in ARCHITECTURES:
        raise ValueError(f"config error at `model.arch`: '{m.arch}' has no Hugging Face architecture here "
                         f"(known: {sorted(ARCHITECTURES)})")
    arch, model_type = ARCHITECTURES[m.arch]
    cfg = {
        "architectures": [arch], "model_type": model_type, "torch_dtype": dtype,
        "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": m.rope_theta, "rope_scaling": dict(m.rope_scaling) if m.rope_scaling else None,
        "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": m.tie_word_embeddings,
        "hidden_act": "silu", "initializer_range": 0.02, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "use_cache": True,
    }
    if m.arch == "llama":
        cfg |= {"attention_bias": m.qkv_bias, "mlp_bias": False, "pretraining_tp": 1}
    else:  # Qwen2 always has q/k/v biases (modelled by qkv_bias=True in conf/model/qwen25_*.yaml)
        if not m.qkv_bias:
            raise ValueError(f"config error at `model.qkv_bias`: model '{m.name}' is qwen2, whose q/k/v "
                             "projections have biases; set qkv_bias: true")
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers}
    return cfg


def write_model_dir(m: ModelConfig, root: str | Path, dtype: str = "bfloat16") -> Path:
    """``<root>/<model name>/config.json`` (rewritten only when its content changes); returns the folder."""
    d = Path(root) / m.name
    d.mkdir(parents=True, exist_ok=True)
    text = json.dumps(hf_config(m, dtype), indent=2, sort_keys=True) + "\n"
    p = d / "config.json"
    if not p.exists() or p.read_text() != text:
        p.write_text(text)
    return d
