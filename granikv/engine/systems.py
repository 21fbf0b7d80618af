"""The systems under test as compositions of storage, prefix policy and dispatch (DESIGN.md).

| system          | storage                      | backend = policy (granikv.attention.policy) | dispatch            |
| sglang_default  | paged (hot_fraction 0)       | paged     PagedPolicy                       | none                |
| sglang_cascade  | paged                        | cascade   BatchCascadePolicy                | batch-global        |
| hydragen        | paged                        | hydragen  HydragenPolicy                    | none                |
| granikv         | HOT slab + COLD (0.2)        | granikv   GranikvPolicy (table dispatcher)  | per class, by table |

Every system runs one decode attention (granikv.attention.decode.DecodeAttention): the systems
differ in the policy's ``choose`` alone.

The presets are ``conf/system/<name>.yaml`` (granikv.config.system_config reads one).
Ablations are settings of the same parts, never new code paths: ``granikv`` with
``dispatch=dense_only|cascade_only|paged_only``, or with ``hot_fraction=0`` (no HOT: every
prefix takes the paged fallback), or with ``hot_split=dynamic`` (``granikv_dynamic``: the HOT/COLD
boundary starts at hot_fraction and moves online, granikv.kv.split_policy).
"""
from __future__ import annotations

import torch

from granikv.config import HardwareConfig, ModelConfig, SystemConfig


def validate(system: SystemConfig) -> None:
    """Baselines run on paged storage; only the granikv backend reads HOT slabs."""
    if system.backend != "granikv" and system.hot_fraction > 0:
        raise ValueError(f"config error at `system.hot_fraction`: backend '{system.backend}' "
                         f"({system.name}) runs on paged storage; set hot_fraction=0 "
                         f"(HOT storage is only used by backend=granikv)")
    if system.backend != "granikv" and system.dispatch != "table":
        raise ValueError(f"config error at `system.dispatch`: dispatch applies to backend=granikv only "
                         f"(got backend '{system.backend}')")


def build_backend(system: SystemConfig, model: ModelConfig, hw: HardwareConfig, tp: int,
                  device: torch.device, dtype: torch.dtype, cuda_graph: bool):
    """The system's DecodeAttention for this TP rank's heads (granikv.attention.decode.make_backend).

    granikv's dispatcher reads ``hardware.decision_table`` for this GPU and per-rank shape.
    """
    from granikv.attention.decode import make_backend

    validate(system)
    hq, hkv = model.num_heads // tp, model.num_kv_heads // tp
    dispatcher = None
    if system.backend == "granikv":
        from granikv.attention.dispatch import Dispatcher

        dispatcher = Dispatcher.from_hardware(hw, hq, hkv, model.head_dim, mode=system.dispatch)
    return make_backend(system, hq, hkv, model.head_dim, device=device, dtype=dtype,
                        dispatcher=dispatcher, cuda_graph=cuda_graph)
