"""The plugin's own settings (environment variables) and how a request names its shared prefix.

No SGLang import. See the package docstring (:mod:`granikv.sglang_plugin`) for the user's view.
"""
from __future__ import annotations

import logging
import os
from dataclasses import MISSING, fields, make_dataclass
from typing import Any, Mapping

from granikv.config import DISPATCH, SystemConfig, check_split
from granikv.kv.split_policy import SplitPolicy

logger = logging.getLogger(__name__)

PREFIX_PARAM = "granikv_prefix_len"  # the key in a request's sampling_params.custom_params

# SystemConfig's fields the plugin reads: a plugin server's cell passes them from its system (server_spec)
SYSTEM_FIELDS = ("hot_fraction", "cascade_impl", "decode_plan", "hot_split", "hot_min_fraction", "hot_max_fraction",
                 "cold_watermark", "dispatch")
# the plugin's defaults where they are not SystemConfig's (an SGLang server started by hand): the batch-global
# cascade's composed GPU path, the SGLang-Cascade baseline's (conf/system/sglang_cascade.yaml); fast decode
# re-plans, as SGLang's own FlashInfer backend re-plans its decode graphs (granikv.attention.flashinfer_ops)
PLUGIN_DEFAULTS = {"cascade_impl": "composed", "decode_plan": "fast"}
# the plugin's own settings, no system field: (name, type, default), placed after hot_fraction
OWN_FIELDS = (("prefix_len", "int", 0), ("hardware", "str", "auto"), ("stats_file", "str", ""),
              ("graph_groups", "int", 8), ("graph_cascades", "int", 8), ("dense_fold", "int", 2),
              ("dense_fold_min_len", "int", 12288), ("dense_backend", "str", "auto"), ("hydragen_scratch", "int", 65536),
              ("row_bucket", "int", 32))
DENSE_BACKENDS = ("auto", "fa2", "fa3")
_PARSE = {"float": float, "int": int, "str": str}   # a field's declared type -> how its variable is read
_WHAT = {"float": "a number", "int": "an int", "str": "a string"}


def env_name(name: str) -> str:
    """The environment variable of a setting: ``GRANIKV_`` + its name in capitals."""
    return f"GRANIKV_{name.upper()}"


ENV_HOT_FRACTION = env_name("hot_fraction")
ENV_PREFIX_LEN = env_name("prefix_len")


def _spec() -> list[tuple[str, str, Any]]:
    """PluginSettings' fields in order: SystemConfig's SYSTEM_FIELDS (its types; its defaults unless
    PLUGIN_DEFAULTS) with OWN_FIELDS after the first (so ``PluginSettings(hot_fraction, prefix_len)``)."""
    system = {f.name: f for f in fields(SystemConfig)}
    taken = [(n, system[n].type, PLUGIN_DEFAULTS.get(n, system[n].default)) for n in SYSTEM_FIELDS]
    for n, t, d in taken:
        if d is MISSING or t not in _PARSE:
            raise TypeError(f"SystemConfig.{n} (in SYSTEM_FIELDS) needs a default and a type in {sorted(_PARSE)}")
    return [taken[0], *OWN_FIELDS, *taken[1:]]


class _Settings:
    """PluginSettings' behaviour (its fields are made from SystemConfig's by :func:`_spec`)."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, str) if f.type == "str" else isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or (f.type == "int" and not isinstance(v, int)):
                raise ValueError(f"config error at `{env_name(f.name)}`: must be {_WHAT[f.type]}, got {v!r}")
        if self.prefix_len < 0:
            raise ValueError(f"config error at `{ENV_PREFIX_LEN}`: must be an int >= 0, got {self.prefix_len!r}")
        for name in ("graph_groups", "hydragen_scratch", "row_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"config error at `{env_name(name)}`: must be an int >= 1, got {getattr(self, name)!r}")
        if self.graph_cascades < 0 or self.dense_fold_min_len < 0:
            raise ValueError(f"config error at `{env_name('graph_cascades')}` / `{env_name('dense_fold_min_len')}`: "
                             "must be ints >= 0")
        if self.dense_fold not in (1, 2, 4, 8):
            raise ValueError(f"config error at `{env_name('dense_fold')}`: must be 1, 2, 4 or 8, got {self.dense_fold!r}")
        if self.dense_backend not in DENSE_BACKENDS:
            raise ValueError(f"config error at `{env_name('dense_backend')}`: must be one of {DENSE_BACKENDS}, "
                             f"got {self.dense_backend!r}")
        if self.dispatch not in DISPATCH:
            raise ValueError(f"config error at `{env_name('dispatch')}`: must be one of {DISPATCH} (table: the "
                             f"calibrated dispatcher; *_only: every prefix class on that path), got {self.dispatch!r}")
        check_split(self, env_name)

    @classmethod
    def from_system(cls, system: SystemConfig, **own: Any):
        """The settings of a plugin server of ``system`` (its SYSTEM_FIELDS), with the plugin's own in ``own``."""
        return cls(**{n: getattr(system, n) for n in SYSTEM_FIELDS}, **own)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None):
        """The settings of the environment (``os.environ`` by default): each field from its
        :func:`env_name` variable, unset or empty = the field's default."""
        env = os.environ if environ is None else environ
        got = {}
        for f in fields(cls):
            raw = env.get(env_name(f.name), "").strip()
            if raw:
                try:
                    got[f.name] = _PARSE[f.type](raw)
                except ValueError:
                    raise ValueError(f"config error at `{env_name(f.name)}`: must be {_WHAT[f.type]}, got {raw!r}") from None
        return cls(**got)

    def to_env(self) -> dict[str, str]:
        """Every field as its environment variable, read back by :meth:`from_env` to equal settings."""
        return {env_name(f.name): repr(float(v)) if f.type == "float" else str(v)
                for f in fields(self) for v in [getattr(self, f.name)]}

    def split_policy(self, pool_size: int):
        """The dynamic split's :class:`granikv.kv.SplitPolicy` over a pool of ``pool_size`` slots
        (None with the static split)."""
        if self.hot_split != "dynamic":
            return None
        return SplitPolicy.from_fractions(pool_size, self.hot_fraction, self.hot_min_fraction,
                                          self.hot_max_fraction, self.cold_watermark)


PluginSettings = make_dataclass("PluginSettings", _spec(), bases=(_Settings,), frozen=True)
PluginSettings.__module__ = __name__
PluginSettings.__doc__ = """The plugin's settings, each read from its environment variable :func:`env_name`.

``hot_fraction``: share of SGLang's token pool taken as the HOT region, in [0, 1) (0: no
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
for COLD; the rules of :class:`granikv.kv.SplitPolicy`, as in the engine). ``dispatch``: the ``granikv``
backend's dispatcher, as the engine's ``system.dispatch``: ``table`` (the calibrated decision table, the
default) or an ablation that sends every prefix class one way (``dense_only``, ``cascade_only``,
``paged_only``; ``table_one_class``: the table as if each step held one class).

Full decode CUDA graphs (:mod:`granikv.attention.graph_step`): a captured step holds ``graph_groups``
dense groups per dense launch and ``graph_cascades`` cascade classes (a class beyond them takes the next
path: dense -> cascade -> paged). Two dense launches are captured when ``dense_fold`` > 1: one plain, one
folding ``dense_fold`` keys of a head into one (more CTAs for long prefixes); a class of at least
``dense_fold_min_len`` tokens takes the folded one, and HOT slabs start on multiples of ``dense_fold``.
``dense_backend``: FlashInfer's backend of the dense launches (``auto``: fa3 on Hopper).
``hydragen_scratch``: tokens of the scratch the HydraGen backend gathers a step's prefixes into.
``row_bucket``: the query rows of a launch's last class are planned in multiples of it (the rows past the
class are other rows of the step, whose outputs go unread), so FlashInfer re-plans that launch on the host
only when the class crosses a multiple, not whenever a request joins or leaves it. 32 rows are one query
tile of 128 packed heads at 4 query heads per KV head: a class's tiles stay as many (1: exact rows).

The fields of SYSTEM_FIELDS are SystemConfig's (name, type; default unless PLUGIN_DEFAULTS), and
are checked by the same rules (granikv.config.check_split)."""


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
