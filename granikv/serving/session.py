"""ServerEngine: a cell served by a real SGLang server, shaped like our Engine (``run -> RunResult``).

    engine = ServerEngine(rc)            # acquires the server (granikv.serving.server.POOL)
    result = engine.run(requests)        # warm-up, flush, measured replay; records + SGLang's steps
    engine.provenance()                  # {"sglang": version, "engine": {argv, server args, versions}}

The run matches our engine's: the warm-up pass serves the first ``warmup_requests`` requests all
at t=0 with staggered output lengths (granikv.workloads.warmup_requests, not measured), the radix
cache is flushed before and after it, and the measured replay starts from an empty cache with the
trace's own arrivals. Every request must come back with exactly its ``output_len`` tokens; a short
answer, an error or a dead server raises ServerError naming the server's log lines. ``steps`` are
SGLang's logged prefill and decode batches of the measured window (granikv.serving.sglang_log).
With ``profile_steps`` > 0, SGLang's own profiler traces that many steps from the first decode step of the
measured replay (granikv.serving.profile): ``trace`` names the file, ``stats['server_trace']`` says how it went.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from granikv.config import RunConfig
from granikv.request import Request, RunResult
from granikv.serving.client import Replay, ReplayClient, ReplayError
from granikv.serving.profile import ServerProfile
from granikv.serving.server import POOL, ServerError, ServerPool, server_spec
from granikv.serving.sglang_log import parse_steps
from granikv.sglang_plugin.path_stats import STAGES, hist_quantiles
from granikv.workloads import warmup_requests

# /server_info keys kept in provenance.engine.server_info (the rest is per-request internal state)
INFO_DROP = ("internal_states",)
VERSION_PACKAGES = ("sglang", "sglang-kernel", "flashinfer-python", "torch", "transformers")
START_LOG_LINES = 400   # at most this many lines of a server's start-up / warm-up log go with a cell


class ServerEngine:
    """One cell on a real server: acquire (start or reuse), then ``run`` like granikv's Engine."""

    def __init__(self, cfg: RunConfig, pool: Optional[ServerPool] = None):
        self.cfg = cfg
        self.spec = server_spec(cfg)
        self.server = (pool or POOL).acquire(self.spec)
        self.info = self.server.info()
        self.start_log: Optional[list[str]] = None    # set by run(): see there
        self.trace: Optional[Path] = None             # SGLang's trace of profile_steps steps (run(), profile_steps > 0)
        self.warmup_log: Optional[list[str]] = None

    def provenance(self) -> dict:
        """What config.json's provenance adds for a server cell: the engine, its version and args."""
        info = {k: v for k, v in self.info.items() if k not in INFO_DROP}
        return {"sglang": self.info.get("version"),
                "engine": {"name": "sglang", "version": self.info.get("version"),
                           "argv": [*self.spec.argv, "--host", self.spec.host, "--port", str(self.server.port)],
                           "env": dict(self.spec.env), "pid": self.server.pid, "adopted": self.server.adopted,
                           "start_s": self.server.started_s, "packages": server_packages(self.spec),
                           "server_info": info}}

    def _replay(self, client: ReplayClient, requests: list[Request], what: str) -> Replay:
        try:
            rep = client.replay(requests)
        except ReplayError as e:
            raise self.server.error(f"{what}: {e}") from e
        if not self.server.alive():
            raise self.server.error(f"{what}: the server died during the replay")
        if rep.errors:
            raise self.server.error(f"{what}: {len(rep.errors)} of {len(requests)} requests failed, first: {rep.errors[0]}")
        short = [(r.rid, len(rec.output_ids), r.output_len) for r, rec in zip(requests, rep.records)
                 if len(rec.output_ids) != r.output_len]
        if short:
            shown = ", ".join(f"request {rid}: {got} of {want}" for rid, got, want in short[:5])
            raise self.server.error(f"{what}: {len(short)} of {len(requests)} requests answered a number of tokens "
                                    f"other than asked ({shown})")
        return rep

    def run(self, requests: list[Request], on_step=None) -> RunResult:
        """Warm-up (not measured), flush, the measured replay; ``on_step`` is not called (the server
        steps on its own; its logged batches come back as ``steps``)."""
        sc, srv = self.cfg.system.server, self.server
        client = ReplayClient(srv.url, incremental=sc.incremental_streaming, timeout_s=sc.request_timeout_s,
                              send_prefix_len=sc.send_prefix_len)
        srv.flush_cache()
        warm_stats = None
        self.start_log = srv.take_start_log(START_LOG_LINES)   # the first cell of a server started here
        self.warmup_log = None
        if self.cfg.warmup_requests > 0:
            warm = warmup_requests(requests, self.cfg.warmup_requests, self.cfg.model.max_position_embeddings)
            w0 = srv.log_size()
            w = self._replay(client, warm, "warm-up")
            warm_stats = {"requests": len(w.records), "duration_s": w.duration_s}
            # what the server said while warming up, less its batch lines: JIT builds of kernels
            # (a cold FlashInfer module takes minutes) show here, with their time stamps
            self.warmup_log = [ln for ln in srv.log_lines(w0, srv.log_size())
                               if " batch, #" not in ln][-START_LOG_LINES:]
            srv.flush_cache()
        start = srv.log_size()
        before = self.plugin_stats()
        profile = None
        if self.cfg.profile_steps > 0:
            profile = ServerProfile(srv, self.cfg.profile_steps, Path(tempfile.mkdtemp(prefix="granikv-trace-")))
            profile.start(start)
        t0 = time.perf_counter()
        rep = self._replay(client, requests, "measured replay")
        wall = time.perf_counter() - t0
        self.trace = profile.finish() if profile is not None else None
        if profile is not None and self.trace is None:
            shutil.rmtree(profile.out_dir, ignore_errors=True)
        time.sleep(0.2)                       # the last batch lines reach the (unbuffered) log
        plugin = stats_delta(before, self.plugin_stats(wait_newer_than=before)) if sc.uses_plugin else None
        steps = parse_steps(srv.log_lines(start, srv.log_size()), sc.decode_log_interval)
        decode = [s for s in steps if s["kind"] == "decode"]
        stats = {"engine": "sglang", "duration_s": wall, "replay_duration_s": rep.duration_s,
                 "client_max_send_lag_s": rep.max_send_lag_s, "client_chunks": rep.chunks,
                 "kv_budget_tokens": self.info.get("max_total_num_tokens"),
                 "server_pid": srv.pid, "server_adopted": srv.adopted, "server_start_s": srv.started_s,
                 "num_logged_steps": len(steps), "num_logged_decode_steps": len(decode),
                 "logged_decode_cuda_graph_share": (sum(bool(s.get("cuda_graph")) for s in decode) / len(decode)
                                                    if decode else None),
                 "cached_prompt_tokens": sum(r.cached_len for r in rep.records)}
        if profile is not None:
            stats["server_trace"] = profile.note
        if warm_stats is not None:
            stats["warmup"] = warm_stats
        if sc.uses_plugin:
            stats["plugin"] = plugin
        return RunResult(rep.records, steps, stats)

    def plugin_stats(self, wait_newer_than: Optional[dict] = None, timeout_s: float = 5.0) -> Optional[dict]:
        """The plugin server's path counters (granikv.sglang_plugin.path_stats), None when it writes
        none; ``wait_newer_than``: wait (up to ``timeout_s``; the backend writes every 2 s) for a file
        that counts more steps than that one."""
        path = dict(self.spec.env).get("GRANIKV_STATS_FILE")
        if not path:
            return None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                cur = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                cur = None
            old = (wait_newer_than or {}).get("steps", -1)
            if wait_newer_than is None or (cur is not None and cur.get("steps", 0) > old) \
                    or time.monotonic() > deadline:
                return cur
            time.sleep(0.25)

    def log_tail(self) -> list[str]:
        return self.server.log_tail()


def stats_delta(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """The plugin counters of the measured window: ``after - before`` for every count and host time
    (nested dicts key by key); None when the server wrote none."""
    if after is None:
        return None
    if before is None or before.get("pid") != after.get("pid"):
        before = {}

    def sub(a, b):
        if isinstance(a, dict):
            return {k: sub(v, (b or {}).get(k) if isinstance(b, dict) else None) for k, v in a.items()}
        if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
            return a - b
        return a

    out = sub(after, before)
    out["pid"] = after.get("pid")
    n = max(int(out.get("split_steps") or 0), 1)
    out["per_split_step_us"] = {k: out.get(f"{k}_us", 0.0) / n for k in STAGES}
    if "replay_steps" in out:
        out["per_replay_step_us"] = (out.get("replay_host_us") or 0.0) / max(int(out["replay_steps"] or 0), 1)
    if isinstance(out.get("replay_hist"), dict):      # the window's quantiles, from its own histograms
        out["replay_quantiles_us"] = {s: hist_quantiles(h) for s, h in out["replay_hist"].items()}
    out.pop("max_batch", None)
    out["max_batch_since_start"] = after.get("max_batch")
    return out


def server_packages(spec) -> dict:
    """Versions of the packages the server's python imports (its PYTHONPATH first), asked of that python."""
    import json
    import subprocess

    env = spec.environ()
    code = ("import json, importlib.metadata as m\nout = {}\nfor p in %r:\n    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))" % (VERSION_PACKAGES,))
    try:
        r = subprocess.run([spec.argv[0], "-c", code], capture_output=True, text=True, env=env, timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return {"error": str(e)}


__all__ = ["ServerEngine", "ServerError"]
