"""The plugin's own settings (environment variables) and how a request names its shared prefix.

No SGLang import. See the package docstring (:mod:`granikv.sglang_plugin`) for the user's view.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from granikv.config import CASCADE_IMPLS, DECODE_PLANS

logger = logging.getLogger(__name__)

ENV_HOT_FRACTION = "GRANIKV_HOT_FRACTION"
ENV_PREFIX_LEN = "GRANIKV_PREFIX_LEN"
ENV_HARDWARE = "GRANIKV_HARDWARE"
ENV_STATS_FILE = "GRANIKV_STATS_FILE"
ENV_CASCADE_IMPL = "GRANIKV_CASCADE_IMPL"
ENV_DECODE_PLAN = "GRANIKV_DECODE_PLAN"
ENV_HOT_SPLIT = "GRANIKV_HOT_SPLIT"
ENV_HOT_MIN_FRACTION = "GRANIKV_HOT_MIN_FRACTION"
ENV_HOT_MAX_FRACTION = "GRANIKV_HOT_MAX_FRACTION"
ENV_COLD_WATERMARK = "GRANIKV_COLD_WATERMARK"
PREFIX_PARAM = "granikv_prefix_len"  # the key in a request's sampling_params.custom_params

DEFAULT_HOT_FRACTION = 0.2
# the batch-global cascade's GPU path: composed, the faster one, is the SGLang-Cascade baseline's
# (conf/system/sglang_cascade.yaml)
DEFAULT_CASCADE_IMPL = "composed"
# how the attention backends re-plan FlashInfer's decode wrappers each step: fast, as SGLang's own
# FlashInfer backend re-plans its decode graphs (granikv.attention.flashinfer_ops.plan_decode)
DEFAULT_DECODE_PLAN = "fast"


@dataclass(frozen=True)
class PluginSettings:
    """``hot_fraction``: share of SGLang's token pool taken as the HOT region, in [0, 1) (0: no
    HOT region, every prefix COLD: the paged baseline through the same code). ``prefix_len``:
    the shared-prefix length of a request that names none (0: such a request has none).
    ``hardware``: where the ``granikv`` attention backend's decision table comes from: ``auto``
    (the ``conf/hardware`` preset whose ``gpu_name`` is this GPU's), a preset name (``h200``) or a
    YAML file path. ``stats_file``: where the attention backends write their path counters as
    JSON (empty: not written). ``cascade_impl``: how ``granikv_cascade`` runs its batch-global
    cascade: ``composed`` (FlashInfer batch prefill + tensor-core decode + merge, the default) or
    ``multilevel`` (FlashInfer's MultiLevelCascadeAttentionWrapper). ``decode_plan``: how the
    attention backends re-plan FlashInfer's decode wrappers each step: ``fast`` (FlashInfer's
    ``fast_decode_plan`` after a wrapper's first ``plan()``, as SGLang's FlashInfer backend does; the
    default) or ``flashinfer`` (the wrapper's ``plan()`` every step). ``hot_split``: ``static`` (the
    HOT region keeps ``hot_fraction`` of the pool) or ``dynamic`` (it grows into free slots above it
    on a HOT miss and gives free slots at its end back under COLD pressure, between
    ``hot_min_fraction`` and ``hot_max_fraction`` of the pool, keeping ``cold_watermark`` of it free
    for COLD; the rules of :class:`granikv.kv.SplitPolicy`, as in the engine)."""

    hot_fraction: float = DEFAULT_HOT_FRACTION
    prefix_len: int = 0
    hardware: str = "auto"
    stats_file: str = ""
    cascade_impl: str = DEFAULT_CASCADE_IMPL
    decode_plan: str = DEFAULT_DECODE_PLAN
    hot_split: str = "static"
    hot_min_fraction: float = 0.0
    hot_max_fraction: float = 0.5
    cold_watermark: float = 0.05

    def __post_init__(self):
        if isinstance(self.hot_fraction, bool) or not isinstance(self.hot_fraction, (int, float)) \
                or not 0.0 <= float(self.hot_fraction) < 1.0:
            raise ValueError(f"{ENV_HOT_FRACTION} must be a number in [0, 1), got {self.hot_fraction!r}")
        if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int) or self.prefix_len < 0:
            raise ValueError(f"{ENV_PREFIX_LEN} must be an int >= 0, got {self.prefix_len!r}")
        if self.cascade_impl not in CASCADE_IMPLS:
            raise ValueError(f"{ENV_CASCADE_IMPL} must be one of {CASCADE_IMPLS}, got {self.cascade_impl!r}")
        if self.decode_plan not in DECODE_PLANS:
            raise ValueError(f"{ENV_DECODE_PLAN} must be one of {DECODE_PLANS}, got {self.decode_plan!r}")
        if self.hot_split not in ("static", "dynamic"):
            raise ValueError(f"{ENV_HOT_SPLIT} must be static or dynamic, got {self.hot_split!r}")
        for env, v in ((ENV_HOT_MIN_FRACTION, self.hot_min_fraction), (ENV_HOT_MAX_FRACTION, self.hot_max_fraction),
                       (ENV_COLD_WATERMARK, self.cold_watermark)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) < 1.0:
                raise ValueError(f"{env} must be a number in [0, 1), got {v!r}")
        if self.hot_split == "dynamic" and not self.hot_min_fraction <= self.hot_fraction <= self.hot_max_fraction:
            raise ValueError(f"{ENV_HOT_SPLIT}=dynamic needs {ENV_HOT_MIN_FRACTION} <= {ENV_HOT_FRACTION} <= "
                             f"{ENV_HOT_MAX_FRACTION}, got {self.hot_min_fraction}, {self.hot_fraction}, "
                             f"{self.hot_max_fraction}")

    def split_policy(self, pool_size: int):
        """The dynamic split's :class:`granikv.kv.SplitPolicy` over a pool of ``pool_size`` slots
        (None with the static split)."""
        if self.hot_split != "dynamic":
            return None
        from granikv.kv.split_policy import SplitPolicy
        return SplitPolicy.from_fractions(pool_size, self.hot_fraction, self.hot_min_fraction,
                                          self.hot_max_fraction, self.cold_watermark)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PluginSettings":
        env = os.environ if environ is None else environ
        frac = env.get(ENV_HOT_FRACTION, "").strip()
        plen = env.get(ENV_PREFIX_LEN, "").strip()
        try:
            hot_fraction = float(frac) if frac else DEFAULT_HOT_FRACTION
        except ValueError:
            raise ValueError(f"{ENV_HOT_FRACTION} must be a number in [0, 1), got {frac!r}") from None
        try:
            prefix_len = int(plen) if plen else 0
        except ValueError:
            raise ValueError(f"{ENV_PREFIX_LEN} must be an int >= 0, got {plen!r}") from None
        fractions = {}
        for key, name, default in ((ENV_HOT_MIN_FRACTION, "hot_min_fraction", 0.0),
                                   (ENV_HOT_MAX_FRACTION, "hot_max_fraction", 0.5),
                                   (ENV_COLD_WATERMARK, "cold_watermark", 0.05)):
            raw = env.get(key, "").strip()
            try:
                fractions[name] = float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{key} must be a number in [0, 1), got {raw!r}") from None
        return cls(hot_fraction, prefix_len, env.get(ENV_HARDWARE, "").strip() or "auto",
                   env.get(ENV_STATS_FILE, "").strip(), env.get(ENV_CASCADE_IMPL, "").strip() or DEFAULT_CASCADE_IMPL,
                   env.get(ENV_DECODE_PLAN, "").strip() or DEFAULT_DECODE_PLAN,
                   env.get(ENV_HOT_SPLIT, "").strip() or "static", **fractions)


def shared_prefix_len(custom_params: Any, prompt_len: int, settings: PluginSettings) -> int:
    """The number of leading prompt tokens a request declares shared (0: none), at most its
    prompt's length.

    ``custom_params[PREFIX_PARAM]`` (an int >= 0) wins; a request without it gets
    ``settings.prefix_len`` when its prompt is at least that long, else 0. A malformed value is
    ignored with a warning (a bad request must not stop the scheduler): the request has none.
    """
    value = None
    if isinstance(custom_params, Mapping) and PREFIX_PARAM in custom_params:
        value = custom_params[PREFIX_PARAM]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            logger.warning("granikv: ignoring custom_params[%r]=%r (an int >= 0 is expected)", PREFIX_PARAM, value)
            return 0
        return min(value, prompt_len)
    if settings.prefix_len and prompt_len >= settings.prefix_len:
        return settings.prefix_len
    return 0
