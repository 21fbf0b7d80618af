"""The SGLang plugin's captured decode step, path by path, against SGLang's own captured decode:
``python -m runners.graph_step_bench [hardware=h100] [overrides]``.

One cell per case: ``batch`` requests split evenly over classes of the given prefix lengths (rows in class
order), each prefix a HOT slab of the KV pool (aligned, ``gap`` slots apart), each request's own suffix
``suffix_min``..``suffix_max`` slots elsewhere in the pool. One attention layer, replayed from a CUDA graph
captured once per case, as SGLang replays its full decode graphs. Variants (``paths``):

- ``sglang``: SGLang's FlashInfer decode as its flashinfer backend captures it: ONE graph-mode batch decode
  over every request's whole slot list (tensor cores by SGLang's rule), no LSE;
- ``paged`` / ``cascade`` / ``dense``: the plugin's captured step (:class:`granikv.attention.graph_step.GraphStep`
  with the plugin's limits): the rest decode with LSE, then the prefix launches and one row merge, every
  class forced to that path (the plugin's ``GRANIKV_DISPATCH``). ``paged`` is what every step without a
  split costs the plugin: the captured prefix launches still run, over their lead segments only.

Per variant: device time of one replay (``time_ms``), the error against the ``sglang`` variant's output
(``rel_err``), the host time of the step's plan and load (``load_us``: ``plan_graph_step`` + ``GraphStep.load``
on a new plan object, the graph's buffers kept), the path each class ran, and (``profile``) the kernels of one
replay from a torch.profiler trace (``kernels``). Each cell also records ``table_choice``: what the hardware's
decision table's graph rules pick for its classes today.

Fit (``fit``): the one-class cells give points ``{prefix_len, meff, times}`` for ``runners.calibrate.fit``;
the rules are the plugin's graph rules (``graph: true``), written to ``<results_dir>/<sweep_name>/fit-<shape>/``
and, with ``write_table``, into ``conf/hardware/<hw>.yaml`` under the key ``plugin_graph_table`` (only that key
is rewritten; ``fit_only=true`` does this from the finished cells on any machine, measuring nothing). Cells: ``<results_dir>/<sweep_name>/<case>/`` (granikv.rawio schema: config.json with
provenance, kernel.jsonl one row per variant, metrics.json); resumable, a failed cell writes failure.json and
the sweep goes on.
"""
from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from granikv import rawio
from granikv.attention import flashinfer_ops as fo
from granikv.attention.bench import Shape, capture_graph, kernel_profile, plan_host_time, time_fn
from granikv.attention.dispatch import Dispatcher
from granikv.attention.graph_step import GraphLimits, GraphStep, capture_plan, plan_graph_step
from granikv.attention.policy import make_policy
from runners.calibrate import fit
from runners.kernel_bench import check_preset_gpu, device_preset

TOOL = "graph_step_bench"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = ("sglang", "paged", "cascade", "dense")
FORCED = {"paged": "paged_only", "cascade": "cascade_only", "dense": "dense_only"}


@dataclass
class Case:
    """One cell: classes of the given prefix lengths, ``batch`` rows split evenly over them."""

    name: str
    prefix_lens: list[int]
    batch: int


@dataclass
class Limits:
    """The plugin's captured-step limits (granikv.sglang_plugin.settings: graph_groups, graph_cascades,
    dense_fold, dense_fold_min_len, dense_backend)."""

    groups: int = 8
    cascades: int = 8
    dense_fold: int = 2
    dense_fold_min_len: int = 12288
    dense_backend: str = "auto"


@dataclass
class GraphStepSpec:
    """The resolved config, checked before any work."""

    hardware: str
    gpu_name: str
    device: str
    dtype: str
    shape: Shape
    cases: list[Case]
    suffix_min: int
    suffix_max: int
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    limits: Limits = field(default_factory=Limits)
    gap: int = 64
    warmup: int = 5
    reps: int = 30
    profile: bool = True
    sweep_name: str = "graph_step"
    results_dir: str = "results/raw"
    seed: int = 0
    force: bool = False
    cuda_graph: bool = True
    l2_flush: bool = True
    decision_table: Optional[list] = None
    write_table: bool = False
    hardware_yaml: str = ""
    time_budget_s: float = 0.0         # > 0: no cell starts after this many seconds (the first always does)
    fit_only: bool = False             # measure nothing: fit the finished cells (and write the table), on any machine

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"config error at `{TOOL}.device`: '{self.device}' must be cpu or cuda")
        if self.device == "cuda" and not self.fit_only and not torch.cuda.is_available():
            raise ValueError(f"config error at `hardware`: hardware={self.hardware} needs a CUDA GPU; use hardware=cpu")
        if self.dtype not in DTYPES:
            raise ValueError(f"config error at `{TOOL}.dtype`: '{self.dtype}' not in {tuple(DTYPES)}")
        if not self.cases:
            raise ValueError(f"config error at `{TOOL}.cases`: list at least one {{name, prefix_lens, batch}}, "
                             f"or give grid_prefix_lens and grid_batches")
        for i, c in enumerate(self.cases):
            if not c.prefix_lens or any(lp <= 0 for lp in c.prefix_lens) or c.batch < len(c.prefix_lens):
                raise ValueError(f"config error at `{TOOL}.cases[{i}]`: need positive prefix_lens and batch >= "
                                 f"their count, got {c}")
        if not 1 <= self.suffix_min <= self.suffix_max:
            raise ValueError(f"config error at `{TOOL}.suffix_min` / `suffix_max`: need 1 <= suffix_min <= "
                             f"suffix_max, got {self.suffix_min}, {self.suffix_max}")
        bad = [p for p in self.paths if p not in PATHS]
        if bad or "sglang" not in self.paths:
            raise ValueError(f"config error at `{TOOL}.paths`: a subset of {PATHS} that holds sglang (the "
                             f"reference of rel_err), got {self.paths}")
        for name, low in (("gap", 0), ("reps", 1), ("warmup", 0), ("time_budget_s", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"config error at `{TOOL}.{name}`: must be >= {low}, got {getattr(self, name)}")


def resolve(cfg: Any) -> GraphStepSpec:
    """Hydra config -> spec: the ``presets[<hardware device>]`` entry overlaid with the non-null keys; the
    grid (``grid_prefix_lens`` x ``grid_batches``, one class each) before the listed ``cases``."""
    from omegaconf import OmegaConf

    hw, merged = device_preset(OmegaConf.to_container(cfg, resolve=True), TOOL)
    lps, bs = merged.pop("grid_prefix_lens", None) or [], merged.pop("grid_batches", None) or []
    merged["shape"] = Shape(**merged["shape"])
    merged["limits"] = Limits(**(merged.get("limits") or {}))
    grid = [Case(f"lp{lp}-b{b}", [lp], b) for lp in lps for b in bs]
    merged["cases"] = grid + [Case(**x) for x in merged.get("cases") or []]
    if merged.get("hardware_yaml") in (None, ""):
        merged["hardware_yaml"] = str(Path(__file__).resolve().parents[1] / "conf" / "hardware" / f"{hw['name']}.yaml")
    spec = GraphStepSpec(hardware=hw["name"], gpu_name=hw.get("gpu_name") or "",
                         decision_table=hw.get("decision_table"), **merged)
    if spec.device == "cuda" and not spec.fit_only:
        check_preset_gpu(hw)
    return spec


@dataclass
class Layout:
    """A case laid out in one KV pool: per class its HOT slab start; per row its slot list."""

    starts: list[int]        # [k] slab start per class
    rows: list[list[int]]    # [B] each request's slots: its class's slab, then its own suffix
    ids: list[int]           # [B] prefix id per row (the class index)
    pool: int                # slots in the pool


def layout(case: Case, spec: GraphStepSpec, align: int, gen: torch.Generator) -> Layout:
    """Slabs in address order from ``align`` (the dummy keys before it), ``gap`` apart; then each row's suffix,
    a run of its own slots, rows' runs in a shuffled order (SGLang allocates a request's tokens as they come)."""
    k, b = len(case.prefix_lens), case.batch
    per = [b // k + (i < b % k) for i in range(k)]
    starts, addr = [], align
    for lp in case.prefix_lens:
        starts.append(addr)
        addr = -(-(addr + lp + spec.gap) // align) * align
    suf = torch.randint(spec.suffix_min, spec.suffix_max + 1, (b,), generator=gen).tolist()
    order = torch.randperm(b, generator=gen).tolist()
    own: list[list[int]] = [[] for _ in range(b)]
    for r in order:
        own[r] = list(range(addr, addr + suf[r]))
        addr += suf[r]
    ids = [c for c, n in enumerate(per) for _ in range(n)]
    rows = [list(range(starts[c], starts[c] + case.prefix_lens[c])) + own[r] for r, c in enumerate(ids)]
    return Layout(starts, rows, ids, addr)


class DecodeLists:
    """A graph-mode FlashInfer batch decode (SGLang's decode wrapper under full graphs) over each row's slots
    from ``skip[r]`` on, its buffers sized for the case; planned on the host per variant (the timing is the
    replay's)."""

    def __init__(self, b: int, nnz: int, spec: GraphStepSpec, dev: torch.device, ws: torch.Tensor):
        i32 = dict(dtype=torch.int32, device=dev)
        self.bufs = {"indptr": torch.zeros(b + 1, **i32), "indices": torch.zeros(nnz, **i32),
                     "last_page_len": torch.ones(b, **i32)}
        s = spec.shape
        self.w = fo.make_decode_wrapper(ws, fo.use_tensor_cores(s.hq, s.hkv, DTYPES[spec.dtype]), self.bufs)
        self.s, self.dtype = s, DTYPES[spec.dtype]

    def plan(self, rows: list[list[int]], skip: list[int], dev: torch.device) -> None:
        lists = [r[k:] for r, k in zip(rows, skip)]
        ip = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).int()
        idx = torch.tensor([v for x in lists for v in x], dtype=torch.int32).to(dev)
        fo.plan_decode(self.w, ip, idx, torch.ones(len(rows), dtype=torch.int32), self.s.hq, self.s.hkv, self.s.d,
                       self.dtype, self.dtype, 1 / math.sqrt(self.s.d))


def bench_case(spec: GraphStepSpec, case: Case, dev: torch.device) -> tuple[list[dict], dict]:
    """The variants' rows and the cell's own facts (table_choice, pool size)."""
    s, dt, lim_s = spec.shape, DTYPES[spec.dtype], spec.limits
    gen = torch.Generator().manual_seed(spec.seed)
    folds = (1, lim_s.dense_fold) if lim_s.dense_fold > 1 else (1,)
    lay = layout(case, spec, max(max(folds), 16), gen)
    b, group, scale = case.batch, s.hq // s.hkv, 1 / math.sqrt(s.d)
    torch.manual_seed(spec.seed)
    kc = torch.randn(lay.pool, s.hkv, s.d, device=dev, dtype=dt)                   # [C, Hkv, D]
    vc = torch.randn(lay.pool, s.hkv, s.d, device=dev, dtype=dt)
    q = torch.randn(b, s.hq, s.d, device=dev, dtype=dt)                            # [B, Hq, D]
    width = max(len(r) for r in lay.rows)
    table = torch.zeros(b, width, dtype=torch.int32)                              # [B, W] SGLang's req_to_token
    for r, slots in enumerate(lay.rows):
        table[r, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
    table = table.to(dev)
    rpi = torch.arange(b, device=dev)
    ws = fo.workspace(dev)
    nnz = sum(len(r) for r in lay.rows)
    lens = [case.prefix_lens[c] for c in lay.ids]
    hots = [lay.starts[c] for c in lay.ids]
    graphed = spec.cuda_graph and dev.type == "cuda"
    lim = GraphLimits(batch=b, folds=folds, fold_min_len=lim_s.dense_fold_min_len, groups=lim_s.groups,
                      cascades=lim_s.cascades, region_len=lay.pool, cascade_slots=lay.pool)

    def policy(mode: str):
        p = make_policy("granikv", Dispatcher(s.hq, s.hkv, s.d, spec.gpu_name, spec.decision_table, mode))
        p.graph_step = True
        return p

    table_plan = plan_graph_step(lay.ids, lens, hots, lim, policy("table"), group)
    facts = {"table_choice": [c.choice for c in table_plan.classes], "pool_slots": lay.pool, "kv_slots": nnz}
    # SGLang: one decode over the whole slot lists, no LSE
    ref_dec = DecodeLists(b, nnz, spec, dev, ws)
    ref_dec.plan(lay.rows, [0] * b, dev)

    def sglang_step():
        return ref_dec.w.run(q, fo.paged(kc, vc))

    # the plugin: rest decode with LSE, then the captured prefix launches and the merge
    rest = DecodeLists(b, nnz, spec, dev, ws)
    gs = GraphStep(lim, s.hq, s.hkv, s.d, dt, dev, scale, backend=lim_s.dense_backend, workspace=ws)
    gs.load(capture_plan(lim), table, rpi)
    rest.plan(lay.rows, [0] * b, dev)

    def plugin_step():
        o, lse = rest.w.run(q, fo.paged(kc, vc), return_lse=True)
        gs.run(q, kc, vc, o, lse)
        return o

    runs = {"sglang": capture_graph(sglang_step) if graphed else (None, None)}
    if any(p != "sglang" for p in spec.paths):
        runs["plugin"] = capture_graph(plugin_step) if graphed else (None, None)
    ref = None
    out_rows = []
    for path in spec.paths:
        row: dict[str, Any] = {"path": path, "case": case.name, "prefix_lens": case.prefix_lens, "batch": b,
                               "graph": graphed}
        try:
            if path == "sglang":
                g, out = runs["sglang"]
                fn = g.replay if graphed else sglang_step
                row["choices"] = ["paged"] * len(case.prefix_lens)
            else:
                pol = policy(FORCED[path])
                p = plan_graph_step(lay.ids, lens, hots, lim, pol, group)
                row["choices"] = [c.choice for c in p.classes]
                gs.load(p, table, rpi)
                rest.plan(lay.rows, p.skip, dev)
                row["load_us"] = plan_host_time(
                    lambda: gs.load(plan_graph_step(lay.ids, lens, hots, lim, pol, group), table, rpi), dev,
                    reps=spec.reps, warmup=1)["plan_us"]
                gs.load(p, table, rpi)                   # the timed plan object again
                g, out = runs["plugin"]
                fn = g.replay if graphed else plugin_step
            res = fn() if not graphed else (fn(), out)[1]
            res = res.float().clone()
            if path == "sglang":
                ref = res
            row["rel_err"] = float((res - ref).norm() / ref.norm()) if ref is not None else None
            row.update(time_fn(fn, dev, spec.warmup, spec.reps, spec.l2_flush))
            if spec.profile and dev.type == "cuda":
                row["kernels"] = kernel_profile(fn, dev, calls=5, l2_flush=spec.l2_flush)[:12]
        except Exception as e:  # noqa: BLE001 - one variant failing (a backend's limit) is a row, not a cell
            row["error"] = f"{type(e).__name__}: {e}"
        out_rows.append(row)
    return out_rows, facts


def metrics_of(rows: list[dict], facts: dict) -> dict:
    """Per path its time over SGLang's, and the fastest of the plugin's paths."""
    t = {r["path"]: r["time_ms"] for r in rows if "time_ms" in r}
    base = t.get("sglang")
    ours = {p: v for p, v in t.items() if p != "sglang"}
    best = min(ours, key=ours.get) if ours else None
    return {**facts, "time_ms": t, "over_sglang": {p: v / base for p, v in ours.items()} if base else {},
            "best_path": best, "best_over_sglang": ours[best] / base if best and base else None,
            "variants_failed": [r["path"] for r in rows if "error" in r]}


def fit_points(root: Path, cases: list[Case], group: int) -> list[dict]:
    """``runners.calibrate.fit`` points from the finished one-class cells: every forced path timed."""
    pts = []
    for c in cases:
        d = root / c.name
        if len(c.prefix_lens) != 1 or rawio.cell_state(d) != "done":
            continue
        t = rawio.read_json(d / "metrics.json")["time_ms"]
        if all(p in t for p in FORCED):
            pts.append({"prefix_len": c.prefix_lens[0], "meff": c.batch * group, "times": {p: t[p] for p in FORCED}})
    return pts


def run(spec: GraphStepSpec) -> dict:
    root = Path(spec.results_dir) / spec.sweep_name
    dev = torch.device(spec.device)
    prov = rawio.provenance(cuda_probe=not spec.fit_only)
    report: dict[str, Any] = {"done": [], "skipped": [], "failed": [], "not_started": [], "rules": None}
    t0 = time.monotonic()
    for case in spec.cases:
        d = root / case.name
        if spec.fit_only or (not spec.force and rawio.cell_state(d) == "done"):
            report["skipped"].append(case.name)
            continue
        if spec.time_budget_s and (report["done"] or report["failed"]) and time.monotonic() - t0 > spec.time_budget_s:
            report["not_started"].append(case.name)
            continue
        cell = {"cell_id": case.name, "kind": "graph_step", "shape": asdict(spec.shape), **asdict(case)}
        rawio.write_json(d / "config.json", {**asdict(spec), "cell": cell, "provenance": prov})
        try:
            rows, facts = bench_case(spec, case, dev)
            rawio.write_jsonl(d / "kernel.jsonl", rows)
            rawio.write_json(d / "metrics.json", {"cell_id": case.name, **metrics_of(rows, facts)})
            if (d / "failure.json").exists():
                (d / "failure.json").unlink()
            report["done"].append(case.name)
        except Exception as e:  # noqa: BLE001 - a failed cell is recorded and the sweep goes on
            rawio.write_json(d / "failure.json", {"cell_id": case.name, "error": f"{type(e).__name__}: {e}",
                                                  "traceback": traceback.format_exc(), "config": cell})
            report["failed"].append(case.name)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    pts = fit_points(root, spec.cases, spec.shape.hq // spec.shape.hkv)
    if spec.fit_only and not pts:
        raise ValueError(f"config error at `{TOOL}.fit_only`: no finished one-class cell under {root} to fit; "
                         f"measure them first (fit_only=false on the GPU)")
    if pts:
        gpu = spec.gpu_name or (torch.cuda.get_device_name(0) if dev.type == "cuda" and not spec.fit_only else "*")
        rules = [{**r, "graph": True} for r in fit(pts, gpu, spec.shape)]
        write_fit_cell(root / f"fit-{spec.shape.name}", spec, prov, pts, rules)
        report["rules"] = rules
        if spec.write_table:
            write_plugin_table(Path(spec.hardware_yaml), rules, spec.shape, gpu)
    return report


def write_fit_cell(fd: Path, spec: GraphStepSpec, prov: dict, pts: list[dict], rules: list[dict]) -> None:
    """The fit as a cell of its own (kind ``graph_step_fit``: kernel.jsonl one row per point, metrics.json the
    points and rules), as runners.calibrate writes its ``fit-<shape>``. A fit cell that holds these points and
    rules already is left as it is; any other is moved aside to ``<sweep>/.superseded/<id>.<UTC time>/`` first."""
    want = {"cell_id": fd.name, "points": pts, "rules": rules}
    if (fd / "metrics.json").exists():
        if rawio.exists(fd / "kernel.jsonl") and rawio.read_json(fd / "metrics.json") == json.loads(json.dumps(want)):
            return
        aside = fd.parent / ".superseded" / f"{fd.name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        fd.rename(aside)
    rawio.write_json(fd / "config.json", {**asdict(spec), "cell": {"cell_id": fd.name, "kind": "graph_step_fit",
                                                                   "shape": asdict(spec.shape)}, "provenance": prov})
    rawio.write_jsonl(fd / "kernel.jsonl", pts)
    rawio.write_json(fd / "metrics.json", want)


def write_plugin_table(path: Path, rules: list[dict], shape: Shape, gpu: str) -> None:
    """Rewrite the key ``plugin_graph_table`` of a hardware yaml: this shape's and GPU's rules replaced, the
    rest of the file kept as it is."""
    text = path.read_text()
    existing = (yaml.safe_load(text) or {}).get("plugin_graph_table") or []
    kept = [r for r in existing if not (r.get("gpu") == gpu and (r.get("num_q_heads"), r.get("num_kv_heads"),
                                                                 r.get("head_dim")) == (shape.hq, shape.hkv, shape.d))]
    block = yaml.safe_dump({"plugin_graph_table": kept + rules}, sort_keys=False, default_flow_style=None)
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.startswith("plugin_graph_table:")), None)
    if start is None:
        path.write_text(text + ("" if text.endswith("\n") else "\n") + block)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in (" ", "-", "\n", "")), len(lines))
    path.write_text("".join(lines[:start]) + block + "".join(lines[end:]))


def _main(cfg) -> None:
    spec = resolve(cfg)
    rep = run(spec)
    root = Path(spec.results_dir) / spec.sweep_name
    for case in spec.cases:
        if rawio.cell_state(root / case.name) == "done":
            m = rawio.read_json(root / case.name / "metrics.json")
            t = " ".join(f"{p} {v:.4f}" for p, v in m["time_ms"].items())
            print(f"{case.name:22s} ms/layer: {t}  table: {m['table_choice']}  best: {m['best_path']}")
    if rep["rules"]:
        for r in rep["rules"]:
            print(f"rule: Lp [{r.get('lp_min', 0)}, {r.get('lp_max')}) Meff [{r.get('meff_min', 0)}, "
                  f"{r.get('meff_max')}) -> {r['choice']}")
    print(f"{TOOL}: wrote {len(rep['done'])} cells, {len(rep['failed'])} failed, {len(rep['skipped'])} already "
          f"done, {len(rep['not_started'])} past the time budget -> {root}")
    if rep["failed"] or rep["not_started"]:
        raise SystemExit(1)


if __name__ == "__main__":
    import hydra

    from granikv.config import register

    register()
    hydra.main(config_path="../conf", config_name=TOOL, version_base=None)(_main)()
