"""Run one measured cell (``-m``: a sweep of cells) and write its raw-result folder.

    python -m runners.run model=tiny hardware=cpu system=granikv workload=synthetic \
        workload.prefix_len=256 workload.batch=8 workload.output_len=16 \
        sweep_name=smoke results_dir=/tmp/r
    python -m runners.run -m sweep=synthetic_grid          # every cell of a paper experiment
    torchrun --nproc_per_node=2 -m runners.run -m sweep=headline_qwen25_14b   # tp=2: one process per rank

A cell goes to ``<results_dir>/<sweep_name>/<cell_id>/`` where ``cell_id`` is the cell's
Hydra overrides, sorted and sanitised (``system=granikv,workload.prefix_len=256``; keys that
do not change the measurement - results_dir, sweep_name, sweep, launcher, force, nvml, nsys - are left
out). It holds config.json (resolved config + provenance), workload.jsonl (the trace; token
ids regenerate from seed + workload), requests.jsonl.gz (with output_ids), steps.jsonl.gz (the
dispatch trace; gzip: granikv.rawio reads either form), metrics.json (written last: its presence marks the cell done) and
telemetry files when available (nvml.csv, trace.json.gz, profile.nsys-rep). A cell with
metrics.json is skipped unless ``force=true``; a forced rerun measures into
``<sweep_name>/.forced/<cell_id>/`` and only once it is complete moves the old cell aside, kept, to
``<sweep_name>/.superseded/<cell_id>.<UTC time>/`` (analysis reads neither dot folder as a cell;
tables/reruns lists the superseded ones). Temp files a killed write left in a cell are removed when
the cell is visited again. A failing cell writes failure.json (error, traceback, config) and a sweep
goes on; it ends with a summary line (measured, skipped, failed) and exits 1 when a cell failed.
Bad input fails before any work with the key named and exit 2, in a single run as in a sweep (a
sweep checks all its cells first, SweepPrecheck): values, KV fit, context length, a CUDA preset
without a GPU, a server system whose launcher its interpreter cannot import. A run without a sweep
preset names its folder (``sweep_name=`` or ``results_dir=``): nothing lands in results/raw/adhoc by
accident. Under torchrun every rank serves and rank 0 writes.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import DictConfig

from granikv import metrics as metrics_mod
from granikv import rawio, workloads
from granikv.config import RunConfig, register, to_run_config
from granikv.request import Request

register()

EXCLUDED_KEYS = {"results_dir", "sweep_name", "sweep", "launcher", "force", "nvml", "nsys"}
MAX_ID = 200
FORCED, SUPERSEDED = ".forced", ".superseded"   # beside the cells of a sweep: a forced rerun, the cells it replaced
MEASURED, SKIPPED, FAILED = "measured", "skipped", "failed"   # what a run did with its cell


class ConfigError(ValueError):
    """Bad input found before any work; the message names the key and the fix."""


# ---------------------------------------------------------------- cell identity
def cell_id(overrides: list[str]) -> str:
    """Sorted, sanitised overrides -> a folder name (``default`` when there are none)."""
    parts = []
    for o in overrides:
        key, _, val = o.partition("=")
        key = key.lstrip("+~")
        if key in EXCLUDED_KEYS or key.startswith("hydra.") or key.startswith("hydra/"):
            continue
        val = re.sub(r"[\[\]\s'\"]", "", val).replace(",", "-")
        parts.append(re.sub(r"[^A-Za-z0-9._=+-]", "_", f"{key}={val}"))
    cid = ",".join(sorted(parts)) or "default"
    if len(cid) > MAX_ID:
        cid = cid[: MAX_ID - 13] + "~" + hashlib.sha1(cid.encode()).hexdigest()[:12]
    return cid


def safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+,-]", "_", s) or "adhoc"


# ---------------------------------------------------------------- checks before work
def resolve(cfg: DictConfig | RunConfig) -> RunConfig:
    """Composed config -> RunConfig, with B as the concurrency cap (max_running_requests)."""
    try:
        rc = cfg if isinstance(cfg, RunConfig) else to_run_config(cfg)
    except ValueError as e:  # dataclass __post_init__ checks, or OmegaConf type errors
        raise ConfigError(str(e)) from e
    hw = dataclasses.replace(rc.hardware, max_running_requests=min(rc.hardware.max_running_requests,
                                                                   rc.workload.batch))
    return dataclasses.replace(rc, hardware=hw)


def kv_budget(rc: RunConfig) -> Optional[int]:
    """KV tokens this cell will have, when knowable before start-up (else None)."""
    hw, m = rc.hardware, rc.model
    if hw.kv_budget_tokens is not None:
        return int(hw.kv_budget_tokens)
    if hw.kv_budget_per_model:
        if m.name not in hw.kv_budget_per_model:
            raise ConfigError(f"config error at `hardware.kv_budget_per_model`: preset '{hw.name}' has no "
                              f"budget for model '{m.name}' (has {sorted(hw.kv_budget_per_model)}); add one")
        return int(hw.kv_budget_per_model[m.name])
    if hw.gpu_memory_gib > 0:  # SGLang's rule, weights ~ 2 B/param for bf16, split over TP
        attn = m.hidden_size * m.head_dim * 2 * (m.num_heads + m.num_kv_heads)   # q, k, v, o
        params = m.num_layers * (attn + 3 * m.hidden_size * m.intermediate_size) + 2 * m.vocab_size * m.hidden_size
        free = hw.gpu_memory_gib * 2**30 * hw.mem_fraction - 2 * params / rc.tp - 0.5 * 2**30
        per_tok = 2 * m.num_layers * (m.num_kv_heads // rc.tp) * m.head_dim * 2
        return max(int(free // per_tok), 0)
    return None


def check_workload(rc: RunConfig, requests: Optional[list[Request]] = None) -> None:
    """A workload that could never be served: a request longer than the model's context or
    the KV budget. Without ``requests`` the longest request is computed from the config."""
    if requests is not None and not requests:
        raise ConfigError("config error at `workload`: the workload has no requests "
                          "(workload.batch / workload.num_requests must be >= 1)")
    if requests:
        r = max(requests, key=lambda r: len(r.prompt_ids) + r.output_len)
        what, prompt, out = f"request {r.rid}", len(r.prompt_ids), r.output_len
    else:
        (prompt, out), what = workloads.longest_request(rc), "the longest request"
    need = prompt + out
    if need > rc.model.max_position_embeddings:
        raise ConfigError(f"config error at `workload.prefix_len`: {what} needs {need} positions "
                          f"(prompt {prompt} + output {out}) but model '{rc.model.name}' has "
                          f"max_position_embeddings={rc.model.max_position_embeddings}; "
                          "shorten prefix_len / suffix_len / output_len")
    budget = kv_budget(rc)
    if budget is not None and need > budget:
        raise ConfigError(f"config error at `hardware.kv_budget_tokens`: {what} needs {need} KV tokens "
                          f"(prompt {prompt} + output {out}) but hardware '{rc.hardware.name}' gives model "
                          f"'{rc.model.name}' (tp={rc.tp}) a budget of {budget}"
                          f"{'' if rc.hardware.kv_budget_tokens or rc.hardware.kv_budget_per_model else ' (estimated)'}; "
                          "shorten the workload (workload.prefix_len / suffix_len / output_len) or raise the budget")


def check_destination(sweep: Optional[str], overrides: list[str]) -> None:
    """A run without a sweep preset writes where it was told: ``sweep_name=`` or ``results_dir=`` on the
    command line (else it would land in results/raw/adhoc, beside the measured results)."""
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    if sweep is None and not given & {"sweep_name", "results_dir"}:
        raise ConfigError("config error at `sweep_name`: a run without a sweep preset (sweep=<name>) would write "
                          "into results/raw/adhoc, beside the measured results; name its folder: "
                          "sweep_name=<name> (results/raw/<name>) or results_dir=<folder>")


def check_writable(results_dir: str) -> Path:
    """The results folder exists or can be created, and a file can be written there."""
    root = Path(results_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config error at `results_dir`: '{results_dir}' is not writable ({e.strerror}); "
                          "pass results_dir=<a folder you can write>") from e
    return root


# ---------------------------------------------------------------- a whole sweep, before any cell
def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The override lists Hydra's basic sweeper will launch (sweeper params x CLI overrides)."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    axes: dict[str, list[str]] = {}
    for ov in OverridesParser.create().parse_overrides(args):
        key = ov.get_key_element()
        vals = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        axes[key] = [f"{key}={v}" for v in vals]
    return [list(p) for p in itertools.product(*axes.values())]


_GROUPS = {p.name for p in (Path(__file__).resolve().parents[1] / "conf").iterdir() if p.is_dir()}
_BASES: dict[tuple, DictConfig] = {}


def _compose_cached(overrides: list[str], compose) -> DictConfig:
    """Hydra composition of one cell, fast for big sweeps: compose once per distinct set of
    group choices (model=..., system=...), then set the plain ``key=value`` overrides on a
    copy (what Hydra does after choosing the groups). Anything else is composed in full."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(overrides)
    groups = [o for o in parsed if "." not in o.key_or_group and o.key_or_group in _GROUPS]
    values = [o for o in parsed if o not in groups]
    if any(o.is_add() or o.is_delete() or o.is_force_add() or o.key_or_group.startswith("hydra")
           for o in parsed):
        return compose(config_name="config", overrides=overrides)
    key = tuple(o.input_line for o in groups)
    if key not in _BASES:
        _BASES[key] = compose(config_name="config", overrides=list(key))
    cfg = _BASES[key].copy()
    for o in values:
        OmegaConf.update(cfg, o.key_or_group, o.value(), merge=False)
    return cfg


def _is_local(config: DictConfig) -> bool:
    """Hydra's basic launcher: the sweep's cells run in this process, on this host."""
    return str(config.hydra.launcher.get("_target_", "")).endswith("BasicLauncher")


class SweepPrecheck(Callback):
    """Hydra callback: before a multirun starts, check every cell (schema values, KV fit,
    context length; with the local launcher also the process count, the GPU and a server's
    launcher) and the results folder; any bad cell stops the sweep with its key named."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from hydra import compose

        bad, jobs = [], sweep_jobs(config)
        local = _is_local(config)
        try:
            check_destination(config.hydra.runtime.choices.get("sweep"), list(config.hydra.overrides.task))
            check_writable(str(config.results_dir))
        except ConfigError as e:
            bad.append(f"  {e}")
        for ov in jobs if not bad else []:
            try:
                rc = resolve(_compose_cached(ov, compose))
                check_workload(rc)
                if local:  # a cluster launcher starts the tp processes itself (on GPUs this host may not have)
                    check_world(rc)
                    check_gpu(rc)
                    check_server(rc)
            except ConfigError as e:
                bad.append(f"  {cell_id(ov)}: {e}")
        if bad:
            # Hydra turns a callback's Exception into a warning; SystemExit does stop the sweep
            try:
                print(f"[runners.run] {len(bad)} of {len(jobs)} cells are invalid; nothing was run:\n"
                      + "\n".join(bad), file=sys.stderr)
            finally:  # even if stderr is a closed pipe
                raise SystemExit(2)


class SweepSummary(Callback):
    """Hydra callback: a sweep ends with one line, ``N cells: a measured, b skipped, c failed``, and exit
    status 1 when a cell failed. Cells run by this process report what they did (``main``'s return
    value); a cell run elsewhere (a cluster launcher's job) is read from its folder (done or failed)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.outcomes: dict[str, str] = {}

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        if job_return.status == JobStatus.COMPLETED and isinstance(job_return.return_value, tuple):
            cell, outcome = job_return.return_value
            self.outcomes[cell] = outcome
        else:
            self.outcomes[f"job {len(self.outcomes)}"] = FAILED

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from hydra import compose

        outcomes = dict(getattr(self, "outcomes", {}))
        jobs = sweep_jobs(config)
        if len(outcomes) < len(jobs):   # jobs that ran in other processes: their folders tell
            for ov in jobs:
                cfg = _compose_cached(ov, compose)
                cell = Path(str(cfg.results_dir)) / safe_name(str(cfg.sweep_name)) / cell_id(ov)
                if str(cell) not in outcomes:
                    outcomes[str(cell)] = MEASURED if rawio.cell_state(cell) == "done" else FAILED
        n = {k: sum(v == k for v in outcomes.values()) for k in (MEASURED, SKIPPED, FAILED)}
        if os.environ.get("RANK", "0") == "0":
            print(f"[runners.run] sweep {config.sweep_name}: {len(outcomes)} cells: {n[MEASURED]} measured, "
                  f"{n[SKIPPED]} skipped, {n[FAILED]} failed"
                  + (" (each has a failure.json; the same command retries them)" if n[FAILED] else ""), flush=True)
        if n[FAILED]:
            raise SystemExit(1)   # Hydra turns a callback's Exception into a warning


def check_gpu(rc: RunConfig) -> None:
    """A CUDA preset needs a GPU here, and its GPU model (HardwareConfig.check_gpu). A server cell's
    client creates no CUDA context: it counts the GPUs through NVML (its server may run another torch)."""
    if rc.hardware.device != "cuda":
        return
    import torch

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    elif rc.system.engine != "granikv" and rawio.gpu_count_nvml() > 0:
        return
    else:
        raise ConfigError(f"config error at `hardware.device`: hardware '{rc.hardware.name}' runs on CUDA but this "
                          f"host has no GPU torch can use (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'}); run it on a GPU host, or pass hardware=cpu "
                          "(with model=tiny) to try the pipeline on a CPU")
    try:
        rc.hardware.check_gpu(gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_server(rc: RunConfig) -> None:
    """A server system (``system.engine=sglang``): its launcher module is importable by the server's
    interpreter (granikv.serving.server.check_launcher)."""
    if rc.system.engine == "granikv":
        return
    from granikv.serving.server import check_launcher   # loads the plugin's settings (torch): server cells only

    try:
        check_launcher(rc)
    except ValueError as e:
        raise ConfigError(str(e)) from e


# ---------------------------------------------------------------- tensor parallelism (torchrun)
def check_world(rc: RunConfig) -> int:
    """tp must equal the number of processes torchrun (or a SLURM job: tasks_per_node=tp)
    started; 1 without either."""
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        from submitit.helpers import TorchDistributedEnvironment  # launcher=slurm: one task per rank

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rc.system.engine != "granikv":   # a server runs its own TP ranks: one client process drives it
        if world != 1:
            raise ConfigError(f"config error at `system.engine`: engine={rc.system.engine} starts its own "
                              f"tp={rc.tp} ranks; run this cell in one process (no torchrun)")
        return 1
    if world != rc.tp:
        raise ConfigError(f"config error at `tp`: tp={rc.tp} but {world} process(es) run this cell; launch "
                          f"tp>1 as `torchrun --nproc_per_node={rc.tp} -m runners.run ...` (tp=1 without torchrun)")
    return world


def init_tp(rc: RunConfig) -> int:
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl on GPU, gloo on CPU), one
    GPU per rank; return this process's rank. Every rank runs the engine; rank 0 writes."""
    world = check_world(rc)
    if world == 1:
        return 0
    import torch
    import torch.distributed as dist

    if rc.hardware.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        # GPU: NCCL for the model's CUDA tensors, gloo for host tensors (the scheduler's clock), so
        # the step loop never waits on the GPU stream for a collective (SGLang's CPU group)
        dist.init_process_group("cpu:gloo,cuda:nccl" if rc.hardware.device == "cuda" else "gloo")
        atexit.register(_leave_tp)
    return dist.get_rank()


def _leave_tp() -> None:
    """Tear the process group down before the interpreter exits (torch asks for it); idempotent.
    Registered with atexit for launchers that exit early; the normal end is finish_tp_process()."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_tp_process() -> None:
    """End of a launcher's ``__main__`` block, every file already written and closed: leave the
    process group, flush, and in a torchrun rank (WORLD_SIZE > 1) end the process with os._exit(0).

    Why: a TP rank sometimes aborted during interpreter shutdown after all its work was done
    ("terminate called without an active exception", SIGABRT, no Python frame left), which made
    torchrun report a failed run. Measured with runners.prefill_bench at TP=2 on CPU, which runs a
    torch.profiler pass per rank: 4 aborts in 18 runs with the process group left to an atexit hook,
    1 in 27 with it destroyed after main() returns, 0 in 10 without the profiler, and 0 in 32 with
    os._exit after the destroy (it skips the C++ teardown where the abort happens). Single-process
    runs return normally."""
    import logging
    import sys

    _leave_tp()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(0)


def _barrier() -> None:
    """All TP ranks finish a cell (rank 0 has written it) before any looks at the next."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- one cell
def _is_server(config: dict) -> bool:
    return str(((config or {}).get("system") or {}).get("engine", "granikv")) != "granikv"


def default_engine(rc: RunConfig):
    """Our compact engine, or for ``system.engine=sglang`` a real SGLang server (granikv.serving)."""
    if rc.system.engine == "sglang":
        from granikv.serving.session import ServerEngine

        return ServerEngine(rc)
    from granikv.engine.engine import Engine

    return Engine(rc)


def _request_rows(requests: list[Request], records) -> list[dict]:
    by_rid = {r.rid: r for r in requests}
    rows = []
    for rec in records:
        req = by_rid.get(rec.rid)
        t = rec.token_times_s
        rows.append({"rid": rec.rid, "arrival_s": rec.arrival_s, "first_token_s": t[0] if t else None,
                     "finish_s": t[-1] if t else None, "prompt_len": rec.prompt_len,
                     "output_len": len(rec.output_ids), "shared_len": req.shared_len if req else None,
                     "cached_len": rec.cached_len, "prefix_class": rec.prefix_class,
                     "prefix_where": rec.prefix_where, "warmup": rec.warmup, "output_ids": rec.output_ids,
                     "token_times_s": t, **({"extra": rec.extra} if rec.extra else {})})
    return rows


def _engine_stats(stats: dict) -> dict:
    """Engine stats merged into metrics.json (dispatch_counts is recomputed from steps)."""
    return {k: v for k, v in stats.items() if k != "dispatch_counts"}


def run_cell(cfg: DictConfig | RunConfig, overrides: list[str], multirun: bool = False,
             engine_factory: Callable[[RunConfig], object] = default_engine) -> Path:
    """Run (or skip) one cell; return its folder. Config errors raise ConfigError before any
    work in a single run; in a sweep they are written as failure.json like any failure."""
    return run_cell_outcome(cfg, overrides, multirun, engine_factory)[0]


def _sweep_temp_files(cell: Path) -> None:
    """Remove a killed write's leftover temp files from ``cell`` (no writer of this cell is running)."""
    for tmp in rawio.remove_temp_files(cell):
        print(f"[runners.run] removed a killed write's temp file: {tmp}")


def run_cell_outcome(cfg: DictConfig | RunConfig, overrides: list[str], multirun: bool = False,
                     engine_factory: Callable[[RunConfig], object] = default_engine) -> tuple[Path, str]:
    """``run_cell``, and what it did with the cell: MEASURED, SKIPPED or FAILED."""
    t_begin = time.monotonic()          # the cell's wall clock starts here: its phases go to metrics.json
    root = check_writable(str(cfg.results_dir))
    cell = root / safe_name(str(cfg.sweep_name)) / cell_id(overrides)
    try:
        rc = resolve(cfg)
    except ConfigError as e:
        if not multirun:
            raise
        _fail(cell, e, {"cell_kind": "serving", "cell": {"cell_id": cell.name, "overrides": list(overrides)}},
              kind="config_error")
        return cell, FAILED
    if rawio.cell_state(cell) == "done" and not rc.force:
        _sweep_temp_files(cell)          # a finished cell no rank writes again
        print(f"[runners.run] skip (metrics.json exists; force=true reruns): {cell}")
        return cell, SKIPPED
    config = {**dataclasses.asdict(rc), "cell_kind": "serving",
              "cell": {"cell_id": cell.name, "overrides": list(overrides)}}
    try:
        check_workload(rc)                   # from the config alone: fails fast on long sweeps
        requests = workloads.build(rc)
        check_workload(rc, requests)
        check_gpu(rc)
        check_server(rc)
        rank = init_tp(rc)
    except ConfigError as e:
        if not multirun:
            raise
        _fail(cell, e, config, kind="config_error")
        return cell, FAILED
    if rank == 0:   # only the writer, before it writes: under torchrun another rank sweeping the cell could
        _sweep_temp_files(cell)      # take the temp file rank 0 is writing right now

    from granikv.telemetry import ENV_GUARD, nsys_command, nsys_path

    if rc.nsys and rc.tp == 1 and nsys_path() and not os.environ.get(ENV_GUARD):
        cell.mkdir(parents=True, exist_ok=True)
        cmd = nsys_command(cell, overrides, nsys_path())
        print(f"[runners.run] nsys: {' '.join(cmd)}")
        subprocess.run(cmd, env={**os.environ, ENV_GUARD: "1"}, check=False)
        return cell, MEASURED if rawio.cell_state(cell) == "done" else FAILED
    # force=true on a finished cell: measured beside it; the old cell stays in place until the new is complete
    forced = rawio.cell_state(cell) == "done"
    target = cell.parent / FORCED / cell.name if forced else cell
    if forced and rank == 0 and target.exists():
        shutil.rmtree(target)                # an earlier forced rerun that never completed: no result
    outcome = MEASURED
    try:
        _measure(rc, target, config, requests, engine_factory, rank, (t_begin, time.monotonic()))
        if forced and rank == 0:
            old = supersede(cell, target)
            print(f"[runners.run] the previous result of {cell.name} is kept in {old}")
    except Exception as e:  # noqa: BLE001 - recorded in failure.json; the sweep goes on
        outcome = FAILED
        if rank == 0:
            _fail(target, e, config)
        if not multirun:
            raise
    _barrier()
    return cell, outcome


def supersede(cell: Path, new: Path) -> Path:
    """Move the finished ``cell`` aside, kept, to ``<sweep>/.superseded/<cell_id>.<UTC time>/``, then the
    complete ``new`` folder into its place; return where the old cell now is."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    old, n = cell.parent / SUPERSEDED / f"{cell.name}.{stamp}", 1
    while old.exists():
        old, n = cell.parent / SUPERSEDED / f"{cell.name}.{stamp}-{n}", n + 1
    old.parent.mkdir(parents=True, exist_ok=True)
    os.replace(cell, old)
    os.replace(new, cell)
    return old


def _fail(cell: Path, e: BaseException, config: dict, kind: str = "exception") -> None:
    details = e.details() if callable(getattr(e, "details", None)) else {}   # a server's log lines
    rawio.write_json(cell / "failure.json", {
        "error": f"{type(e).__name__}: {e}", "kind": kind,
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "config": config, "provenance": rawio.provenance(cuda_probe=not _is_server(config)), **details})
    print(f"[runners.run] FAILED {cell}: {type(e).__name__}: {e}", file=sys.stderr)


def _measure(rc: RunConfig, cell: Path, config: dict, requests: list[Request], engine_factory,
             rank: int = 0, t_cell: tuple[float, float] | None = None) -> None:
    """Serve the cell; rank 0 writes every file (metrics.json last), other TP ranks only serve.

    ``telemetry.cell_phases_s`` in metrics.json is where the cell's wall time went; ``t_cell``: the cell's
    first step (before its workload is built) and the start of this call. ``prepare`` (workload, checks,
    TP init), ``engine`` (the engine built, or the server started or reused), ``serve`` (the warm-up and
    the measured run), ``write`` (the traces written before metrics.json)."""
    t_begin, t_called = (time.monotonic(),) * 2 if t_cell is None else t_cell
    from tqdm import tqdm

    from granikv.telemetry import ENV_GUARD, NvmlSampler, StepProfiler, nsys_path

    lead = rank == 0
    server = rc.system.engine != "granikv"
    if lead:
        for stale in ("metrics.json", "failure.json"):
            (cell / stale).unlink(missing_ok=True)
        rawio.write_jsonl(cell / "workload.jsonl", workloads.trace_rows(requests))
    engine = engine_factory(rc)           # a server cell starts (or reuses) its server here
    t_ready = time.monotonic()
    if lead:   # after the engine: a server cell's provenance names the server's version and arguments
        extra = engine.provenance() if callable(getattr(engine, "provenance", None)) else {}
        rawio.write_json(cell / "config.json", {**config, "provenance": {**rawio.provenance(cuda_probe=not server),
                                                                         **extra}})
    # no CUDA context in a server cell's client process: the server owns the GPU memory
    prof = StepProfiler(cell / "trace.json.gz", rc.profile_steps if lead else 0,
                        cuda=rc.hardware.device == "cuda" and not server)
    prof.prime()   # the profiler's one-time start-up before the run, not between two measured steps
    total = sum(r.output_len for r in requests)
    with tqdm(total=total, unit="tok", desc=cell.name[:48], mininterval=0.5, leave=False, disable=not lead) as bar, \
            NvmlSampler(cell / "nvml.csv", enabled=rc.nvml and lead) as nvml:
        def on_step(step: dict) -> None:
            if step.get("kind") == "decode":
                bar.update(int(step.get("num_tokens", step.get("batch_size", 0))))
            prof.on_step(step)

        if os.environ.get(ENV_GUARD) and rc.hardware.device == "cuda":
            import torch  # under nsys: record_function ranges (prefill_step / decode_step) as NVTX

            with torch.autograd.profiler.emit_nvtx():
                result = engine.run(requests, on_step=on_step)
        else:
            result = engine.run(requests, on_step=on_step)
        prof.finish()
    t_served = time.monotonic()
    if not lead:
        return
    if callable(getattr(engine, "log_tail", None)):   # a server cell keeps the end of the server's log
        (cell / "server_log_tail.txt").write_text("\n".join(engine.log_tail()) + "\n")
    for name in ("start_log", "warmup_log"):          # and, where it has them, its start-up and warm-up lines
        lines = getattr(engine, name, None)
        if lines:
            (cell / f"server_{name}.txt").write_text("\n".join(lines) + "\n")
    trace = getattr(engine, "trace", None)            # a server cell: SGLang's own trace (profile_steps > 0)
    if trace is not None:
        shutil.copyfile(trace, cell / "trace.json.gz")
        shutil.rmtree(trace.parent, ignore_errors=True)   # the server's output folder (a temp folder of its own)
    rawio.write_jsonl(cell / "requests.jsonl", _request_rows(requests, result.records), compress=True)
    rawio.write_jsonl(cell / "steps.jsonl", result.steps, compress=True)
    m = metrics_mod.summarize(result.records, result.steps, result.stats)
    phases = {"prepare": t_called - t_begin, "engine": t_ready - t_called, "serve": t_served - t_ready,
              "write": time.monotonic() - t_served}
    telemetry = {**nvml.summary(), **prof.summary(), "cell_phases_s": {k: round(v, 3) for k, v in phases.items()},
                 "nsys_note": ("captured (profile.nsys-rep)" if os.environ.get(ENV_GUARD)
                               else "nsys not on PATH; not captured" if rc.nsys and not nsys_path() else None)}
    rawio.write_json(cell / "metrics.json", {**_engine_stats(result.stats), **m, "telemetry": telemetry})
    tput = m["output_throughput_tok_s"]
    print(f"[runners.run] wrote {cell} ({m['num_requests']} requests, "
          f"{'n/a' if tput is None or math.isnan(tput) else f'{tput:.1f}'} output tok/s)")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> tuple[str, str]:
    """One cell; returns (its folder, MEASURED | SKIPPED | FAILED) for SweepSummary. Exit 2 on a config error."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    try:
        if not multirun:   # a sweep checks this in SweepPrecheck, before any cell
            check_destination(hc.runtime.choices.get("sweep"), list(hc.overrides.task))
        cell, outcome = run_cell_outcome(cfg, list(hc.overrides.task), multirun=multirun)
    except ConfigError as e:
        print(f"[runners.run] {e}", file=sys.stderr)
        sys.exit(2)
    return str(cell), outcome


if __name__ == "__main__":
    main()
    finish_tp_process()
