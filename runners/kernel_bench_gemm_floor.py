"""GEMM floor of one decode step: ``python -m runners.kernel_bench_gemm_floor [hardware=h200] [overrides]``.

The weight GEMMs of one decode step of a model, on one TP shard, for M tokens (M = B running
requests, one token each): per layer the fused QKV projection (with Qwen2's bias), the O
projection, the fused gate+up projection and the down projection, times ``num_layers``, plus the LM
head (vocab-parallel), with the shapes and the layout of ``granikv.engine.model`` (column-parallel
in, row-parallel out: hq/tp, hkv/tp, intermediate/tp, vocab/tp per shard). Every layer has its own
weights (as in the model: the step streams all of them from HBM). Nothing else of the step is run:
no attention, norms, RoPE, activation, sampling, all-reduce. On a GPU (``hardware=h200``: bf16) the
whole step is captured as ONE CUDA graph and its replays are timed; on a CPU (``hardware=cpu``, the
tiny model, float32) it runs eagerly so the tests exercise the code path: such cells say
``device: cpu`` and ``graph: false`` and go to the sweep ``gemm_floor_cpu``; analysis never uses
them as a floor.

One folder per (model, tp, M) point, ``<results_dir>/<sweep_name>/<model>-tp<tp>-m<M>/`` (granikv.rawio
schema, kind ``kernel``; resumable: a cell whose metrics.json exists is skipped unless ``force``):

- ``config.json``: the resolved spec, ``cell`` (cell_id, kind ``gemm_floor``, model name, tp, the
  model's resolved conf/model config, ``batch`` = M, ``shape.name`` = ``<model>_tp<tp>``, device,
  dtype), the measured peaks (granikv.attention.bench.measure_peaks) and provenance.
- ``kernel.jsonl``: row ``backend=step`` (every GEMM of the step; the CUDA-graph replay on GPU,
  else eager), then, with ``parts``, one row per GEMM kind (``qkv``, ``o``, ``gate_up``, ``down``
  over all layers, ``lm_head``), each its own graph. Fields: time_ms (median), time_ms_mean,
  time_ms_min, time_ms_eager (step row), graph, graph_error, flops (2*M*K*N summed; bias adds
  not counted), bytes (weights + activations in and out, read/written once), weight_bytes,
  tflops, tbps, tflops_frac_peak, tbps_frac_peak, m, num_gemms.
- ``metrics.json``: ``step_ms`` (the floor), ``step_tflops``, ``step_flops``, ``step_graph``,
  ``step_ms_eager``, ``weight_bytes``, ``<kind>_ms``, ``parts_sum_ms``, ``device``, peaks.

A failed cell writes failure.json and the sweep goes on; ``time_budget_s`` stops starting new
cells (a rerun resumes).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from granikv import rawio
from granikv.attention.bench import capture_graph, measure_peaks, sync, time_fn
from granikv.config import ModelConfig

TOOL = "kernel_bench_gemm_floor"
MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARTS = ("qkv", "o", "gate_up", "down", "lm_head")


def model_options() -> list[str]:
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def load_model(name: str, key: str = f"{TOOL}.models[].model") -> ModelConfig:
    """conf/model/<name>.yaml as a checked ModelConfig (its ``defaults`` list dropped)."""
    from omegaconf import OmegaConf

    path = MODEL_DIR / f"{name}.yaml"
    if not isinstance(name, str) or not path.exists():
        raise ValueError(f"config error at `{key}`: '{name}' is not a conf/model option ({model_options()})")
    d = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    d.pop("defaults", None)
    return ModelConfig(**d)


@dataclass
class GemmPoint:
    """One (model, TP degree) of the sweep: the GEMMs of one TP shard of that model."""

    model: str
    tp: int = 1


def shard_gemms(cfg: ModelConfig, tp: int) -> list[tuple[str, int, int, bool, int]]:
    """(kind, K = in features, N = out features, bias, count per step) of one TP shard's weight GEMMs."""
    H, D = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads // tp, cfg.num_kv_heads // tp
    inter, vocab, L = cfg.intermediate_size // tp, cfg.vocab_size // tp, cfg.num_layers
    return [("qkv", H, (hq + 2 * hkv) * D, bool(cfg.qkv_bias), L), ("o", hq * D, H, False, L),
            ("gate_up", H, 2 * inter, False, L), ("down", inter, H, False, L), ("lm_head", H, vocab, False, 1)]


def work(cfg: ModelConfig, tp: int, m: int, elt: int, kinds=PARTS) -> dict:
    """FLOPs (2*M*K*N per GEMM), weight bytes, bytes (weights + M rows in and out) and GEMM count of ``kinds``."""
    flops = wbytes = abytes = n = 0
    for kind, k, nout, bias, count in shard_gemms(cfg, tp):
        if kind in kinds:
            flops += 2 * m * k * nout * count
            wbytes += (k * nout + (nout if bias else 0)) * elt * count
            abytes += m * (k + nout) * elt * count
            n += count
    return {"flops": flops, "weight_bytes": wbytes, "bytes": wbytes + abytes, "num_gemms": n}


@dataclass
class GemmFloorSpec:
    """The resolved config (preset + overrides), checked before any work."""

    hardware: str
    device: str
    dtype: str
    models: list[GemmPoint]
    batches: list[int]
    warmup: int
    reps: int
    sweep_name: str = "gemm_floor"
    results_dir: str = "results/raw"
    seed: int = 0
    force: bool = False
    time_budget_s: float = 0.0
    cuda_graph: bool = True
    l2_flush: bool = True
    parts: bool = True
    cells: Optional[list[str]] = None
    model_configs: dict = field(default_factory=dict)   # filled by __post_init__: name -> resolved conf/model dict

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"config error at `{TOOL}.device`: preset device '{self.device}' must be cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"config error at `hardware`: hardware={self.hardware} needs a CUDA GPU; use hardware=cpu here")
        if self.dtype not in DTYPES:
            raise ValueError(f"config error at `{TOOL}.dtype`: '{self.dtype}' not in {tuple(DTYPES)}")
        if not isinstance(self.models, list) or not self.models:
            raise ValueError(f"config error at `{TOOL}.models`: must be a non-empty list of {{model, tp}}, got {self.models!r}")
        pts = []
        for i, p in enumerate(self.models):
            if isinstance(p, dict):
                unknown = set(p) - {"model", "tp"}
                if unknown or "model" not in p:
                    raise ValueError(f"config error at `{TOOL}.models[{i}]`: needs keys model (and tp), got {sorted(p)}")
                p = GemmPoint(**p)
            if not isinstance(p, GemmPoint):
                raise ValueError(f"config error at `{TOOL}.models[{i}]`: must be {{model: <conf/model option>, tp: <int>}}")
            cfg = load_model(p.model, f"{TOOL}.models[{i}].model")
            if not isinstance(p.tp, int) or isinstance(p.tp, bool) or p.tp < 1:
                raise ValueError(f"config error at `{TOOL}.models[{i}].tp`: must be a positive int, got {p.tp!r}")
            for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
                if getattr(cfg, key) % p.tp:
                    raise ValueError(f"config error at `{TOOL}.models[{i}].tp`: tp={p.tp} must divide "
                                     f"model.{key}={getattr(cfg, key)} of model '{p.model}'")
            self.model_configs[p.model] = asdict(cfg)
            pts.append(p)
        self.models = pts
        if not self.batches or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in self.batches):
            raise ValueError(f"config error at `{TOOL}.batches`: must be a non-empty list of positive ints (M), "
                             f"got {self.batches!r}")
        if not isinstance(self.reps, int) or self.reps < 1:
            raise ValueError(f"config error at `{TOOL}.reps`: must be an int >= 1, got {self.reps!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"config error at `{TOOL}.warmup`: must be an int >= 0, got {self.warmup!r}")
        if not self.sweep_name:
            raise ValueError(f"config error at `{TOOL}.sweep_name`: must be set (the preset's or an override)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def model(self, name: str) -> ModelConfig:
        return ModelConfig(**self.model_configs[name])


def resolve(cfg: Any) -> GemmFloorSpec:
    """Merge the hardware preset (conf/kernel_bench_gemm_floor.yaml ``presets``) with the overrides."""
    from omegaconf import OmegaConf

    from runners.kernel_bench import merge_preset

    c = OmegaConf.to_container(cfg, resolve=True)
    # kernel_bench's preset rule (the hardware option's own preset, else its device's); it expects `shapes`
    merged = merge_preset({**c, "shapes": []}, TOOL)
    merged.pop("shapes")
    return GemmFloorSpec(**merged)


class DecodeGemms:
    """One TP shard's weights (every layer its own) and the activations of an M-token decode step."""

    def __init__(self, cfg: ModelConfig, tp: int, device: torch.device, dtype: torch.dtype, seed: int):
        self.cfg, self.tp, self.device, self.dtype = cfg, tp, device, dtype
        g = torch.Generator(device=device).manual_seed(seed)
        gemms = {kind: (k, n, bias) for kind, k, n, bias, _ in shard_gemms(cfg, tp)}

        def w(kind: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            k, n, bias = gemms[kind]
            t = torch.empty(n, k, device=device, dtype=dtype).normal_(0.0, k ** -0.5, generator=g)
            b = torch.empty(n, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g) if bias else None
            return t, b

        self.layers = [{kind: w(kind) for kind in ("qkv", "o", "gate_up", "down")} for _ in range(cfg.num_layers)]
        self.lm_head = w("lm_head")[0]
        self.gemms = gemms

    def inputs(self, m: int) -> None:
        """Static input buffers of an M-token step (the graph reads them at replay)."""
        g = torch.Generator(device=self.device).manual_seed(m)
        H = self.cfg.hidden_size

        def r(cols: int) -> torch.Tensor:
            return torch.empty(m, cols, device=self.device, dtype=self.dtype).normal_(generator=g)

        self.x = r(H)                                   # the layer input (after the norm)
        self.attn_out = r(self.gemms["o"][0])           # the attention output, [M, hq_local * D]
        self.act = r(self.gemms["down"][0])             # silu(gate) * up, [M, I_local]

    def step(self) -> torch.Tensor:
        """Every weight GEMM of one decode step, in the model's order."""
        h = self.x
        for layer in self.layers:
            F.linear(h, *layer["qkv"])
            h = F.linear(self.attn_out, layer["o"][0])
            F.linear(h, layer["gate_up"][0])
            h = F.linear(self.act, layer["down"][0])
        return F.linear(h, self.lm_head)

    def part(self, kind: str) -> Callable[[], torch.Tensor]:
        """One GEMM kind alone (over every layer, each with its own weights; lm_head once)."""
        if kind == "lm_head":
            return lambda: F.linear(self.x, self.lm_head)
        src = {"qkv": "x", "o": "attn_out", "gate_up": "x", "down": "act"}[kind]

        def run() -> torch.Tensor:
            a, out = getattr(self, src), None
            for layer in self.layers:
                out = F.linear(a, *layer[kind]) if kind == "qkv" else F.linear(a, layer[kind][0])
            return out
        return run


def _timed(spec: GemmFloorSpec, fn: Callable[[], torch.Tensor], eager: bool) -> dict:
    """time_fn of ``fn``: the replay of its CUDA graph on a GPU with cuda_graph on (eager time too when
    ``eager``), else eager. Keys: time_ms, time_ms_mean, time_ms_min, [time_ms_eager], graph, graph_error."""
    dev = torch.device(spec.device)
    out: dict = {"graph": False, "graph_error": None}
    t_eager = None
    if eager or spec.device != "cuda" or not spec.cuda_graph:
        t_eager = time_fn(fn, dev, spec.warmup, spec.reps, spec.l2_flush)
        out.update(t_eager)
        out["time_ms_eager"] = t_eager["time_ms"]
    if spec.device == "cuda" and spec.cuda_graph:
        try:
            g, _ = capture_graph(fn)
            g.replay()
            sync(dev)
            out.update({**time_fn(g.replay, dev, spec.warmup, spec.reps, spec.l2_flush), "graph": True})
            del g
        except Exception as e:  # noqa: BLE001 - recorded; the eager time stays the measurement
            if t_eager is None:
                raise
            out["graph_error"] = f"{type(e).__name__}: {e}"
    return out


def bench_cell(spec: GemmFloorSpec, gm: DecodeGemms, m: int, peaks: dict) -> tuple[list, dict]:
    cfg, tp, elt = gm.cfg, gm.tp, torch.empty((), dtype=spec.torch_dtype).element_size()
    gm.inputs(m)
    fns = [("step", gm.step, PARTS)] + ([(k, gm.part(k), (k,)) for k in PARTS] if spec.parts else [])
    rows = []
    for name, fn, kinds in fns:
        t = _timed(spec, fn, eager=name == "step")
        w = work(cfg, tp, m, elt, kinds)
        tf = w["flops"] / (t["time_ms"] * 1e-3) / 1e12
        tb = w["bytes"] / (t["time_ms"] * 1e-3) / 1e12
        rows.append({"backend": name, **t, **w, "m": m, "tflops": tf, "tbps": tb,
                     "tflops_frac_peak": tf / peaks["peak_tflops"], "tbps_frac_peak": tb / peaks["peak_tbps"]})
    step = rows[0]
    metrics = {"step_ms": step["time_ms"], "step_ms_eager": step.get("time_ms_eager"), "step_graph": step["graph"],
               "step_graph_error": step["graph_error"], "step_flops": step["flops"], "step_tflops": step["tflops"],
               "weight_bytes": step["weight_bytes"], "num_gemms": step["num_gemms"], "m": m, "device": spec.device,
               "dtype": spec.dtype, **peaks}
    for r in rows[1:]:
        metrics[f"{r['backend']}_ms"] = r["time_ms"]
    if spec.parts:
        metrics["parts_sum_ms"] = sum(r["time_ms"] for r in rows[1:])
    return rows, metrics


def cell_id(model: str, tp: int, m: int) -> str:
    return f"{model}-tp{tp}-m{m}"


def cell_list(spec: GemmFloorSpec) -> list[tuple[str, GemmPoint, int]]:
    cells = [(cell_id(p.model, p.tp, m), p, m) for p in spec.models for m in spec.batches]
    if spec.cells:
        unknown = set(spec.cells) - {c for c, _, _ in cells}
        if unknown:
            raise ValueError(f"config error at `{TOOL}.cells`: {sorted(unknown)} are not cells of this grid "
                             f"({[c for c, _, _ in cells]})")
        cells = [c for c in cells if c[0] in spec.cells]
    return cells


def run(spec: GemmFloorSpec) -> dict:
    """Run every cell not yet done; returns {'done': [...], 'skipped': [...], 'failed': [...], 'left': [...]}."""
    t_start = time.monotonic()
    root = Path(spec.results_dir) / spec.sweep_name
    cells = cell_list(spec)
    gpu = torch.cuda.get_device_name(0) if spec.device == "cuda" else None
    rawio.refuse_other_gpu(root, [c[0] for c in cells], gpu, TOOL)   # a cell id names no GPU model
    todo = [c for c in cells if spec.force or rawio.cell_state(root / c[0]) != "done"]
    todo_ids = {c[0] for c in todo}
    report = {"done": [], "skipped": [c[0] for c in cells if c[0] not in todo_ids], "failed": [], "left": []}
    if not todo:
        return report
    dev = torch.device(spec.device)
    torch.manual_seed(spec.seed)
    peaks = measure_peaks(dev, spec.torch_dtype)
    prov = rawio.provenance()
    spec_d = asdict(spec)
    gm, key = None, None
    for cid, p, m in todo:
        if spec.time_budget_s and time.monotonic() - t_start > spec.time_budget_s:
            report["left"].append(cid)
            continue
        d = root / cid
        mcfg = spec.model(p.model)
        cell = {"cell_id": cid, "kind": "gemm_floor", "model": asdict(mcfg), "tp": p.tp, "batch": m,
                "shape": {"name": f"{p.model}_tp{p.tp}"}, "device": spec.device, "dtype": spec.dtype}
        rawio.write_json(d / "config.json", {**spec_d, "cell": cell, "peaks": peaks, "provenance": prov})
        try:
            if key != (p.model, p.tp):      # the weights of one (model, tp) serve every M
                gm = key = None
                if spec.device == "cuda":
                    torch.cuda.empty_cache()
                gm, key = DecodeGemms(mcfg, p.tp, dev, spec.torch_dtype, spec.seed), (p.model, p.tp)
            rows, metrics = bench_cell(spec, gm, m, peaks)
            rawio.write_jsonl(d / "kernel.jsonl", rows)
            rawio.write_json(d / "metrics.json", {"cell_id": cid, **metrics})
            if (d / "failure.json").exists():
                (d / "failure.json").unlink()
            report["done"].append(cid)
        except Exception as e:  # noqa: BLE001 - a failed cell is recorded and the sweep goes on
            rawio.write_json(d / "failure.json", {"cell_id": cid, "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc(), "config": cell})
            report["failed"].append(cid)
            gm = key = None
        finally:
            if spec.device == "cuda":
                torch.cuda.empty_cache()
    return report


def summary(spec: GemmFloorSpec) -> str:
    """One line per finished cell: the step's floor (ms), TFLOP/s, graph or eager."""
    root = Path(spec.results_dir) / spec.sweep_name
    lines = [f"{'cell':28s} {'step_ms':>9s} {'TFLOP/s':>9s} {'GFLOP':>9s} graph"]
    for cid, _, _ in cell_list(spec):
        if rawio.cell_state(root / cid) == "done":
            m = rawio.read_json(root / cid / "metrics.json")
            lines.append(f"{cid:28s} {m['step_ms']:9.4f} {m['step_tflops']:9.2f} {m['step_flops'] / 1e9:9.2f} "
                         f"{'yes' if m['step_graph'] else 'no (' + spec.device + ')'}")
    return "\n".join(lines)


def _main(cfg) -> None:
    spec = resolve(cfg)
    rep = run(spec)
    root = Path(spec.results_dir) / spec.sweep_name
    print(summary(spec))
    print(f"{TOOL}: wrote {len(rep['done'])} cells, {len(rep['failed'])} failed, {len(rep['skipped'])} already done, "
          f"{len(rep['left'])} left for the next run (time budget) -> {root}")


if __name__ == "__main__":
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name=TOOL, version_base=None)(_main)()
