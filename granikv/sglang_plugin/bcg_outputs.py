"""Dataclass outputs for SGLang's breakable CUDA graphs (AROUND hooks, registered by :func:`load`).

SGLang 0.5.17's ``BreakableCudaGraphBackend`` (``sglang/srt/model_executor/runner_backend/
breakable_cuda_graph_backend.py``) keeps a captured step's output in a buffer it builds and fills
with ``_alloc_full_buffer``, ``_copy_output_to_buffer`` and ``_slice_output``, which know tensors,
``PPProxyTensors``, lists and tuples only. A decode step of a causal LM returns a
``LogitsProcessorOutput`` (a dataclass: ``next_token_logits [bs, vocab]``, ``hidden_states``, ...),
so ``--cuda-graph-backend-decode breakable`` fails at capture with "Unsupported BCG output type".
These hooks treat a dataclass instance field by field: its tensor fields are allocated, copied and
sliced along dim 0 as tensors are; its other fields (None, lists) are kept as the captured step
left them. Anything else goes to SGLang's own method unchanged.

No SGLang import: the hooks get the original method and its arguments (``HookRegistry``'s AROUND
signature ``hook(original_fn, self, output, ...)``).
"""
from __future__ import annotations

import dataclasses

import torch

TARGET = "sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend.BreakableCudaGraphBackend"


def _is_instance(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _tensor_fields(x) -> dict:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if torch.is_tensor(getattr(x, f.name))}


def alloc_full_buffer(original, self, output, size):
    """A buffer shaped like ``output`` with ``size`` leading rows (tensor fields ``[size, ...]``)."""
    if _is_instance(output):
        return dataclasses.replace(output, **{k: v.new_empty((size, *v.shape[1:]))
                                              for k, v in _tensor_fields(output).items()})
    return original(self, output, size)


def copy_output_to_buffer(original, self, output, output_buffer, num_tokens):
    """Copy the first ``num_tokens`` rows of every tensor field of ``output`` into ``output_buffer``."""
    if _is_instance(output) or _is_instance(output_buffer):
        if type(output) is not type(output_buffer):
            raise ValueError(f"BCG output structure changed between capture sizes: {type(output)} vs "
                             f"{type(output_buffer)}")
        src, dst = _tensor_fields(output), _tensor_fields(output_buffer)
        if src.keys() != dst.keys():
            raise ValueError(f"BCG output fields changed between capture sizes: {sorted(src)} vs {sorted(dst)}")
        for k, v in src.items():
            dst[k][:num_tokens].copy_(v[:num_tokens])
        return None
    return original(self, output, output_buffer, num_tokens)


def slice_output(original, self, output, num_tokens):
    """``output`` with every tensor field cut to its first ``num_tokens`` rows."""
    if _is_instance(output):
        return dataclasses.replace(output, **{k: v[:num_tokens] for k, v in _tensor_fields(output).items()})
    return original(self, output, num_tokens)


HOOKS = {f"{TARGET}._alloc_full_buffer": alloc_full_buffer,
         f"{TARGET}._copy_output_to_buffer": copy_output_to_buffer,
         f"{TARGET}._slice_output": slice_output}
