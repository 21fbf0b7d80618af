"""The plugin attention backends' own counters (which path each decode step took, and what planning
it cost on the host), and where the ``granikv`` backend's decision table comes from.

No SGLang import. The counters are written as one JSON object to ``GRANIKV_STATS_FILE`` (atomic
replace, at most every ``interval_s`` and at exit), so a benchmark reads them after a run: the
per-step dispatch cost inside SGLang's step is ``dispatch_us / split_steps``.
"""
from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

CONF_HARDWARE = Path(__file__).resolve().parents[2] / "conf" / "hardware"

# host-time fields (``<stage>_us``) averaged per split step in ``per_split_step_us``
STAGES = ("prefix", "dispatch", "plan", "index", "make", "load")
# why a decode step ran SGLang's own paged path instead of a plan of ours
PAGED_REASONS = ("no_prefix", "no_split", "staged_mismatch", "no_cpu_seq_lens", "full_graph_replay", "capture")
# host time of every replayed decode step, by stage, as a histogram (:class:`HostHistogram`): ``total`` the whole
# replay-metadata host time with the prefix read; ``own`` the plugin's part of it (``total`` less ``index``, the
# rest decode's index list and FlashInfer plan, which SGLang's own replay does alike)
REPLAY_STAGES = ("total", "own", "prefix", "make", "load", "index")
BINS_PER_OCTAVE = 8


def host_bin(us: float) -> int:
    """The histogram bin of a host time: bin k holds ``(2**((k-1)/8), 2**(k/8)]`` us (bin 0: <= 1 us)."""
    return max(0, math.ceil(math.log2(us) * BINS_PER_OCTAVE)) if us > 1.0 else 0


def hist_quantiles(hist: dict, qs: tuple = (0.5, 0.9, 0.99)) -> dict:
    """``{"p50": us, ...}`` of a histogram ``{str(bin): count}`` (each quantile the upper edge of its bin: within
    9%, never below the true value); ``{}`` when it is empty."""
    items = sorted((int(k), int(v)) for k, v in hist.items() if int(v) > 0)
    n = sum(v for _, v in items)
    if not n:
        return {}
    out, seen, it = {}, 0, iter(items)
    k = 0
    for q in qs:
        while seen < q * n:
            k, v = next(it)
            seen += v
        out[f"p{round(q * 100)}"] = 2.0 ** (k / BINS_PER_OCTAVE)
    return out


class GcClock:
    """The Python garbage collector's pauses in this process (``gc.callbacks``): per generation, how many and
    their total ms, so that a host-time spike can be told from the plugin's own work."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._t0: Optional[float] = None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = min(int(info.get("generation", 0)), 2)
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def to_dict(self) -> dict:
        return {f"gen{g}": {"count": self.count[g], "ms": self.ms[g]} for g in range(3)}

    def close(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)


@dataclass
class PathStats:
    """Counts since the server started, for one attention backend instance (one TP rank).

    ``steps``: decode steps seen (eager or replayed); ``split_steps``: steps that ran a plan of
    ours (at least one class off the paged path), ``graph_steps`` of them replayed from a full decode
    CUDA graph; ``paged_steps[reason]``: steps that ran SGLang's
    paged path, by reason (:data:`PAGED_REASONS`); ``classes`` / ``rows``: prefix classes and their
    request rows by chosen path, over split steps. Host time (microseconds, summed over split
    steps): ``prefix_us`` reading the requests' prefixes off the radix tree, ``dispatch_us`` the
    policy's choices (the dispatcher), ``plan_us`` the whole plan (both of those, the KV index
    build and FlashInfer's plan calls); the plan's stages apart: ``index_us`` (the step's KV index
    list and its copy to the device), ``make_us`` (the step plan: classes, policy, rest-of-request
    slots) and ``load_us`` (FlashInfer's plan calls on the plan). Full decode graphs: ``replay_steps``
    every replayed decode step (split or not) and ``replay_host_us`` their whole host time (reading the
    prefixes, the plan, the buffer load, the rest decode's index list and re-plan). ``prefix_memo``: the
    prefix read's memo (``granikv.sglang_plugin.step_prefixes.PrefixMemo``): requests taken from it
    (``hits``), read off the tree (``misses``), and steps taken whole (``whole``). ``replay_hist``: per stage of
    :data:`REPLAY_STAGES`, the replayed steps' host times as a histogram ``{str(bin): steps}`` (:func:`host_bin`),
    whose quantiles ``to_dict`` gives as ``replay_quantiles_us``; ``gc``: the process's garbage-collector pauses
    (:class:`GcClock`), when a clock is attached.
    """

    backend: str
    policy: str
    steps: int = 0
    split_steps: int = 0
    graph_steps: int = 0
    paged_steps: dict = field(default_factory=lambda: {r: 0 for r in PAGED_REASONS})
    classes: dict = field(default_factory=lambda: {"paged": 0, "cascade": 0, "dense": 0, "hydragen": 0})
    rows: dict = field(default_factory=lambda: {"paged": 0, "cascade": 0, "dense": 0, "hydragen": 0})
    prefix_us: float = 0.0
    dispatch_us: float = 0.0
    plan_us: float = 0.0
    index_us: float = 0.0
    make_us: float = 0.0
    load_us: float = 0.0
    max_batch: int = 0
    replay_steps: int = 0
    replay_host_us: float = 0.0
    prefix_memo: dict = field(default_factory=lambda: {"hits": 0, "misses": 0, "whole": 0})
    replay_hist: dict = field(default_factory=lambda: {s: {} for s in REPLAY_STAGES})

    def __post_init__(self):
        self.gc_clock: Optional[GcClock] = None     # attached by the backend (not a counter: left out of asdict)

    def paged(self, reason: str) -> None:
        if reason not in self.paged_steps:
            raise ValueError(f"PathStats.paged: unknown reason {reason!r}; one of {PAGED_REASONS}")
        self.steps += 1
        self.paged_steps[reason] += 1

    def split(self, decisions: list[dict], prefix_us: float, dispatch_us: float, plan_us: float,
              index_us: float = 0.0, make_us: float = 0.0, load_us: float = 0.0, graph: bool = False) -> None:
        """One split step: ``decisions`` as ``StepPlan.decisions`` gives them (one dict per class);
        ``graph``: replayed from a full decode CUDA graph."""
        self.steps += 1
        self.split_steps += 1
        self.graph_steps += int(graph)
        for d in decisions:
            if d["prefix_id"] < 0:
                continue
            self.classes[d["backend"]] += 1
            self.rows[d["backend"]] += int(d["batch"])
        self.max_batch = max(self.max_batch, sum(int(d["batch"]) for d in decisions))
        self.prefix_us += prefix_us
        self.dispatch_us += dispatch_us
        self.plan_us += plan_us
        self.index_us += index_us
        self.make_us += make_us
        self.load_us += load_us

    def memo(self, hits: int, misses: int, whole: int) -> None:
        """The prefix memo's counts so far (they are the memo's own running totals)."""
        self.prefix_memo = {"hits": int(hits), "misses": int(misses), "whole": int(whole)}

    def replay(self, host_us: float, stages: Optional[dict] = None) -> None:
        """One replayed decode step of a full decode graph (split or not): its host time, and ``stages`` (us by
        stage of :data:`REPLAY_STAGES` but ``total`` and ``own``, which come from ``host_us``) into the histograms."""
        self.replay_steps += 1
        self.replay_host_us += host_us
        times = dict(stages or {}, total=host_us)
        if "index" in times:
            times["own"] = host_us - times["index"]
        for stage, us in times.items():
            h = self.replay_hist[stage]
            k = str(host_bin(us))
            h[k] = h.get(k, 0) + 1

    def to_dict(self) -> dict:
        d = asdict(self)
        n = max(self.split_steps, 1)
        d["per_split_step_us"] = {k: getattr(self, f"{k}_us") / n for k in STAGES}
        d["per_replay_step_us"] = self.replay_host_us / max(self.replay_steps, 1)
        d["replay_quantiles_us"] = {s: hist_quantiles(h) for s, h in self.replay_hist.items()}
        if self.gc_clock is not None:
            d["gc"] = self.gc_clock.to_dict()
        return d


class StatsWriter:
    """Writes a :class:`PathStats` to ``path`` (JSON, atomic replace): at the first call, then at most
    every ``interval_s``."""

    def __init__(self, path: str, interval_s: float = 2.0):
        self.path = Path(path) if path else None
        self.interval_s = float(interval_s)
        self._last: float | None = None   # monotonic time of the last write (the clock starts at boot, not 0)

    def maybe_write(self, stats: PathStats, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"pid": os.getpid(), **stats.to_dict()}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def load_hardware(spec: str, gpu_name: str, conf_dir: Path = CONF_HARDWARE) -> Optional[SimpleNamespace]:
    """The hardware preset the ``granikv`` backend takes its decision table from.

    ``spec``: ``auto`` (the preset in ``conf_dir`` whose own ``gpu_name`` equals ``gpu_name``; None
    when no preset names this GPU: the dispatcher then uses the paper's A100 rule, and says so), a
    preset name (``conf_dir/<name>.yaml``) or a path to a YAML file. A preset's keys override those
    of the presets its Hydra ``defaults`` list names (``a100_40gb`` takes ``h200``'s table). Raises ValueError naming
    ``GRANIKV_HARDWARE`` for a file that does not exist or has no ``decision_table``.
    """
    import yaml

    def read(p: Path, seen: tuple = ()) -> dict:
        """The preset's keys over those of the presets its Hydra ``defaults`` list names."""
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"GRANIKV_HARDWARE: {p} is not a YAML mapping")
        merged: dict = {}
        for base in data.pop("defaults", None) or []:
            if isinstance(base, str) and base != "_self_":
                q = p.parent / f"{base}.yaml"
                if q in seen:
                    raise ValueError(f"GRANIKV_HARDWARE: {p} `defaults` names {base!r}: a cycle")
                if q.is_file():        # other entries are ConfigStore schemas (no decision table)
                    merged.update(read(q, seen + (p,)))
        merged.update(data)
        return merged

    if spec == "auto":       # the preset that names this GPU itself (not one that inherits it, e.g. a KV budget)
        for p in sorted(conf_dir.glob("*.yaml")):
            own = yaml.safe_load(p.read_text()) or {}
            if isinstance(own, dict) and own.get("gpu_name") and own.get("gpu_name") == gpu_name:
                data = read(p)
                return SimpleNamespace(name=data.get("name", p.stem), gpu_name=gpu_name,
                                       decision_table=data.get("decision_table"),
                                       plugin_graph_table=data.get("plugin_graph_table"), source=str(p))
        return None
    p = Path(spec) if spec.endswith((".yaml", ".yml")) or os.sep in spec else conf_dir / f"{spec}.yaml"
    if not p.is_file():
        known = sorted(q.stem for q in conf_dir.glob("*.yaml"))
        raise ValueError(f"GRANIKV_HARDWARE={spec!r}: no such file {p}; give a YAML path or one of {known}, or auto")
    data = read(p)
    if not data.get("decision_table"):
        raise ValueError(f"GRANIKV_HARDWARE={spec!r}: {p} has no decision_table (run `python -m runners.calibrate`)")
    return SimpleNamespace(name=data.get("name", p.stem), gpu_name=data.get("gpu_name") or gpu_name,
                           decision_table=data["decision_table"], plugin_graph_table=data.get("plugin_graph_table"),
                           source=str(p))


def describe(hw: Optional[Any]) -> str:
    return "the paper's A100 rule (no preset for this GPU)" if hw is None else f"{hw.name} ({hw.source})"
