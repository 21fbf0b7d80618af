"""Per-step, per-prefix-class choice of the prefix path (dense / cascade / paged) from a decision table.

Table format (``HardwareConfig.decision_table``, written by ``runners.calibrate``): a list of rules,
each a dict with

    choice        dense | cascade | paged                         (required)
    gpu           GPU name as torch reports it, or "*" (default "*": any GPU)
    num_q_heads, num_kv_heads, head_dim    attention shape PER TP RANK (default: any)
    lp_min, lp_max        prefix length range [lp_min, lp_max)    (default 0, none)
    meff_min, meff_max    Meff = B_class * Hq/Hkv range [min, max) (default 0, none)
    classes_min, classes_max  range [min, max) of the step's prefix classes (classes with a prefix and a
                  real request; default 0, none): what the per-class options cost depends on how
                  many classes share the step (k dense calls against ONE batched cascade call for
                  all k), so ``runners.calibrate`` can fit rules per class count
    graph         true: the rule is for CUDA-graph-replayed decode steps only; false: for eager
                  steps only (above ``hardware.cuda_graph_max_bs``, or any step that is not
                  replayed); absent (or null): both kinds                (default: both)
    cold          only with ``choice: dense``: the path of a class whose prefix is NOT one HOT run
                  (admission fell back to COLD, so it cannot go dense): cascade | paged
                  (default cascade, the paged-storage fallback the policy has always taken)

The rules that match this dispatcher's GPU and shape are kept in table order; for a class the
FIRST rule whose step kind, Lp, Meff and class-count ranges contain it wins (ties = table order). When no rule
matches the GPU and shape at all, or none covers a (Lp, Meff) for the step's kind, the paper's A100
rule is used (Meff >= 1024 -> dense, else cascade) with a warning, once per dispatcher and reason.
A table without any ``graph`` key decides both step kinds alike: exactly as before the key existed;
one without any ``classes_*`` key decides a class alike whatever the step's class count.

The no-regression guard lives in the table, not in this module: ``runners.calibrate`` times every
option in graph-replayed AND in eager steps (eager: device time + host launch time) and writes, per
step kind, the option that was fastest with paged winning ties, so no rule it writes chooses an
option that was measured slower than paged there; between a point where paged won and one where
another option won, paged covers the gap; a dense rule's ``cold`` is the faster of cascade and
paged (see ``runners.calibrate.fit``). The runtime only follows the table for the step's kind: no
timings are consulted per step. Tables written before these keys hold neither, and decide as
before: one rule set for both kinds, and cascade for a COLD prefix where the table says dense.

Cost: choose() is a dict lookup after the first time a (Lp, B_class, classes) key is seen for a step kind
(one decision cache per kind, and ONE shared cache when the table has no kind-specific rule),
choose_many() one lookup per class of a step; no device work at all (measured by
``python -m runners.kernel_bench``, cell ``dispatch_cost``).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

PATH_CHOICES = ("dense", "cascade", "paged")
COLD_CHOICES = ("cascade", "paged")       # what a dense rule's class takes when its prefix is not in HOT
MODES = ("table", "table_one_class", "dense_only", "cascade_only", "paged_only")
RULE_KEYS = ("choice", "gpu", "num_q_heads", "num_kv_heads", "head_dim", "lp_min", "lp_max", "meff_min", "meff_max",
             "classes_min", "classes_max", "graph", "cold")
RANGES = (("lp_min", "lp_max"), ("meff_min", "meff_max"), ("classes_min", "classes_max"))
PAPER_THRESHOLD = 1024
GRAPH, EAGER = True, False                # the step kinds (``graph`` argument / rule key)


def paper_rule(meff: int) -> str:
    """The paper's A100 rule: dense when Meff >= 1024, else cascade."""
    return "dense" if meff >= PAPER_THRESHOLD else "cascade"


def check_table(table: Optional[list[dict[str, Any]]], where: str = "hardware.decision_table") -> list[dict]:
    """Validate a decision table; raise ValueError naming the entry and field."""
    if table is None:
        return []
    if not isinstance(table, (list, tuple)):
        raise ValueError(f"{where}: must be a list of rule dicts, got {type(table).__name__}")
    out = []
    for i, r in enumerate(table):
        r = dict(r)
        bad = [k for k in r if k not in RULE_KEYS]
        if bad:
            raise ValueError(f"{where}[{i}]: unknown key(s) {bad}; allowed: {RULE_KEYS}")
        if r.get("choice") not in PATH_CHOICES:
            raise ValueError(f"{where}[{i}].choice: '{r.get('choice')}' is not one of {PATH_CHOICES}")
        for k in ("num_q_heads", "num_kv_heads", "head_dim") + tuple(k for pair in RANGES for k in pair):
            v = r.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{where}[{i}].{k}: must be a non-negative int or absent, got {v!r}")
        for lo, hi in RANGES:
            if r.get(hi) is not None and r.get(hi) <= r.get(lo, 0):
                raise ValueError(f"{where}[{i}]: {hi}={r[hi]} must be > {lo}={r.get(lo, 0)} (ranges are [min, max))")
        g = r.get("graph")
        if g is not None and not isinstance(g, bool):
            raise ValueError(f"{where}[{i}].graph: must be true (CUDA-graph-replayed steps), false (eager steps) "
                             f"or absent (both), got {g!r}")
        cold = r.get("cold")
        if cold is not None:
            if r["choice"] != "dense":
                raise ValueError(f"{where}[{i}].cold: only a dense rule has a cold path (choice is '{r['choice']}')")
            if cold not in COLD_CHOICES:
                raise ValueError(f"{where}[{i}].cold: '{cold}' is not one of {COLD_CHOICES}")
        out.append(r)
    return out


def plugin_table(decision_table: Optional[list[dict[str, Any]]],
                 plugin_graph_table: Optional[list[dict[str, Any]]]) -> list[dict]:
    """The table the SGLang plugin decides with: its own graph rules (``hardware.plugin_graph_table``,
    fitted by ``runners.graph_step_bench`` on the plugin's captured step, whose kernels are not the
    engine's) for every GPU and shape they name, then the decision table's rules: its eager rules
    everywhere (the plugin's eager steps run the engine's code), its graph rules only for a GPU and
    shape the plugin table does not name. Without a plugin table: the decision table as it is."""
    own = check_table(plugin_graph_table, "hardware.plugin_graph_table")
    if not own:
        return check_table(decision_table)
    bad = [i for i, r in enumerate(own) if r.get("graph") is not True]
    if bad:
        raise ValueError(f"hardware.plugin_graph_table[{bad[0]}].graph: must be true (the plugin's captured step "
                         f"only); its eager steps take the decision table's eager rules")
    covered = {(str(r.get("gpu", "*")).lower(), r.get("num_q_heads"), r.get("num_kv_heads"), r.get("head_dim"))
               for r in own}
    out = list(own)
    for r in check_table(decision_table):
        key = (str(r.get("gpu", "*")).lower(), r.get("num_q_heads"), r.get("num_kv_heads"), r.get("head_dim"))
        if r.get("graph") is None:        # a rule for both kinds: its eager half always, its graph half if uncovered
            out.append({**r, "graph": False})
            if key not in covered:
                out.append({**r, "graph": True})
        elif r["graph"] is False or key not in covered:
            out.append(r)
    return out


class _DecisionCache(dict):
    """(prefix_len, batch_class[, classes]) -> choice for one step kind (and HOT or COLD prefixes); a key
    not seen yet is decided by the dispatcher's table (``classes``, the step's prefix-class count,
    defaults to 1). A plain dict for hits (no Python-level __getitem__)."""

    def __init__(self, dispatcher: "Dispatcher", graph: bool, cold: bool = False):
        super().__init__()
        self._dispatcher = dispatcher
        self._graph = graph
        self._cold = cold

    def __missing__(self, key: tuple) -> str:
        d = self._dispatcher
        # a class with no requests (only CUDA-graph pad rows) has nothing to decide: paged
        if key[1] > 0:
            # a COLD lookup follows the hot one of the same key (policy: only where that said dense):
            # a fallback is counted and warned about once, by the hot lookup
            classes = key[2] if len(key) > 2 else 1
            choice, cold = d._decide(key[0], key[1] * d.group, self._graph, count=not self._cold, classes=classes)
            choice = cold if self._cold else choice
        else:
            choice = "paged"
        self[key] = choice
        return choice


def rule_applies(rule: dict, gpu_name: str, shape: tuple[int, int, int]) -> bool:
    """Whether a table rule is for this GPU (``gpu`` "*" or missing: any) and per-rank attention
    ``shape`` (num_q_heads, num_kv_heads, head_dim; a missing key: any)."""
    gpu = rule.get("gpu", "*")
    if gpu not in ("*", None) and str(gpu).lower() != (gpu_name or "").lower():
        return False
    for key, val in zip(("num_q_heads", "num_kv_heads", "head_dim"), shape):
        if rule.get(key) is not None and rule[key] != val:
            return False
    return True


class Dispatcher:
    """Chooses dense / cascade / paged per prefix class from (Lp, B_class) and the step kind (CUDA-graph
    replayed or eager) for one GPU and shape.

    ``mode``: table (default) | table_one_class (the table as if every step held one prefix class: its
    rules for one class decide, whatever the step's class count) | dense_only | cascade_only | paged_only
    (the ablations).
    Callers that do not name a step kind get the graph kind (``graph=True``): with a table that has
    no ``graph`` key, both kinds decide alike, so such callers see exactly the old decisions.
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, gpu_name: str = "",
                 table: Optional[list[dict[str, Any]]] = None, mode: str = "table"):
        if mode not in MODES:
            raise ValueError(f"system.dispatch: '{mode}' is not one of {MODES}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"Dispatcher: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.mode = mode
        self.group = num_q_heads // num_kv_heads
        self.gpu_name = gpu_name or ""
        self.shape = (num_q_heads, num_kv_heads, head_dim)
        rules = check_table(table)
        # (lp_min, lp_max, meff_min, meff_max, classes_min, classes_max, choice, graph, cold path) of
        # the rules for this GPU and shape, in order; graph None = both step kinds
        self._rules = [(r.get("lp_min", 0), r.get("lp_max"), r.get("meff_min", 0), r.get("meff_max"),
                        r.get("classes_min", 0), r.get("classes_max"), r["choice"], r.get("graph"),
                        r.get("cold") or ("cascade" if r["choice"] == "dense" else r["choice"]))
                       for r in rules if self._matches(r)]
        # one cache per step kind, filled on first sight: (Lp, B_class) -> choice. A table without
        # kind-specific rules (or an ablation mode) decides both kinds alike: ONE shared cache.
        self.kind_specific = mode.startswith("table") and any(r[7] is not None for r in self._rules)
        # whether the step's class count can change a decision: callers then pass it (policy.GranikvPolicy)
        self.class_specific = mode == "table" and any(r[4] or r[5] is not None for r in self._rules)
        self._cache = _DecisionCache(self, GRAPH)
        self._eager_cache = _DecisionCache(self, EAGER) if self.kind_specific else self._cache
        # the path of a class whose prefix is not one HOT run, when its (hot) choice is dense
        self._cold_cache = _DecisionCache(self, GRAPH, cold=True)
        self._cold_eager_cache = _DecisionCache(self, EAGER, cold=True) if self.kind_specific else self._cold_cache
        self._warned: set[str] = set()
        self.fallbacks = 0

    @classmethod
    def from_hardware(cls, hw_cfg: Any, num_q_heads: int, num_kv_heads: int, head_dim: int,
                      mode: str = "table", gpu_name: Optional[str] = None, plugin: bool = False) -> "Dispatcher":
        """From a HardwareConfig: its decision_table (``plugin``: :func:`plugin_table`, the SGLang plugin's
        own graph rules first); the GPU name from the config, else torch."""
        name = gpu_name if gpu_name is not None else (getattr(hw_cfg, "gpu_name", "") or "")
        if not name:
            import torch

            if torch.cuda.is_available():
                name = torch.cuda.get_device_name(0)
        table = getattr(hw_cfg, "decision_table", None)
        if plugin:
            table = plugin_table(table, getattr(hw_cfg, "plugin_graph_table", None))
        return cls(num_q_heads, num_kv_heads, head_dim, name, table, mode)

    def _matches(self, r: dict) -> bool:
        return rule_applies(r, self.gpu_name, self.shape)

    @property
    def decisions(self) -> dict:
        """The graph-kind decision cache, read-only by convention: ``decisions[(prefix_len, batch_class,
        classes)]`` is ``choose(prefix_len, batch_class, classes=classes)`` (a key not seen yet is decided
        on access)."""
        return self._cache

    def decisions_for(self, graph: bool = GRAPH) -> dict:
        """The decision cache of one step kind (``graph`` True: CUDA-graph replayed, False: eager); the
        same object for both kinds when the table has no kind-specific rule."""
        return self._cache if graph else self._eager_cache

    def cold_decisions_for(self, graph: bool = GRAPH) -> dict:
        """Like ``decisions_for``, for a class whose prefix is not one HOT run: where the table says dense,
        the rule's ``cold`` path (default cascade); any other choice as is."""
        return self._cold_cache if graph else self._cold_eager_cache

    @property
    def has_table(self) -> bool:
        """True when the table has rules for this GPU and shape."""
        return bool(self._rules)

    def choose(self, prefix_len: int, batch_class: int, graph: bool = GRAPH, classes: int = 1) -> str:
        """Path for a class of ``batch_class`` requests sharing a ``prefix_len``-token prefix in a step
        of kind ``graph`` (True: CUDA-graph replayed, the default; False: eager) with ``classes``
        prefix classes (``batch_class`` 0, a class of CUDA-graph pad rows only: paged)."""
        return (self._cache if graph else self._eager_cache)[(prefix_len, batch_class, classes)]

    def choose_many(self, classes: list[tuple], graph: bool = GRAPH, count: int = 1) -> list[str]:
        """``choose`` for every (prefix_len, batch_class) of a step of ``count`` prefix classes, in one
        pass over the cache (a miss is decided in ``_DecisionCache.__missing__``)."""
        cache = self._cache if graph else self._eager_cache
        return [cache[(lp, b, count)] for lp, b in classes]

    def _decide(self, lp: int, meff: int, graph: bool = GRAPH, count: bool = True,
                classes: int = 1) -> tuple[str, str]:
        """(choice, path when the prefix is not in HOT) of the first rule for this step kind covering
        (lp, meff, classes); the paper's rule (cold: cascade) when none does (``count``: count it in
        ``fallbacks`` and warn)."""
        if self.mode == "table_one_class":
            classes = 1
        if not self.mode.startswith("table"):
            c = self.mode[:-len("_only")]
            return c, ("cascade" if c == "dense" else c)
        for lp_lo, lp_hi, m_lo, m_hi, k_lo, k_hi, choice, kind, cold in self._rules:
            if (kind is None or kind == graph) and lp >= lp_lo and (lp_hi is None or lp < lp_hi) \
                    and meff >= m_lo and (m_hi is None or meff < m_hi) \
                    and classes >= k_lo and (k_hi is None or classes < k_hi):
                return choice, cold
        c = paper_rule(meff)
        if not count:
            return c, ("cascade" if c == "dense" else c)
        self.fallbacks += 1
        reason = "no_rules" if not self._rules else "uncovered"
        if reason not in self._warned:
            self._warned.add(reason)
            kind = f" for {'graph' if graph else 'eager'} steps" if self.kind_specific else ""
            what = (f"no decision-table rules for GPU '{self.gpu_name or 'unknown'}' and shape "
                    f"Hq/Hkv/D={self.shape}" if reason == "no_rules" else
                    f"decision table does not cover Lp={lp}, Meff={meff}, {classes} class(es){kind} "
                    f"(GPU '{self.gpu_name}', shape {self.shape})")
            warnings.warn(f"{what}: using the paper's A100 rule (Meff >= {PAPER_THRESHOLD} -> dense, else cascade); "
                          "run `python -m runners.calibrate` on this GPU to fit a table", RuntimeWarning, stacklevel=3)
        return c, ("cascade" if c == "dense" else c)
