"""Start, watch and stop a real SGLang server for a cell (``system.engine=sglang``).

    spec = server_spec(rc)                 # command line + environment, from the cell's config
    server = POOL.acquire(spec)            # reuse the live server of the same spec, else start one
    server.url, server.info()              # http://127.0.0.1:PORT, its /server_info (version, args)

One server runs at a time (it holds the GPUs): a cell whose spec differs from the live server's stops
that one first. Consecutive cells of a sweep share a server; the prefix cache is flushed between them
(granikv.serving.session). A server is started in its own process session (``setsid``), so it can
outlive the command that started it: with ``GRANIKV_SGLANG_KEEP=1`` the process leaves it running and
records it in ``$GRANIKV_SGLANG_STATE`` (default ``/tmp/granikv-sglang``); the next process adopts it
when its spec is the same, and stops it (by its process id) when not. Without the variable, the
process stops what it started when it exits.

Environment for the server process (the GPU-host recipe runners/gpu/sglang.sh sets them):
``GRANIKV_SGLANG_PYTHON`` (interpreter, default this one), ``GRANIKV_SGLANG_PYTHONPATH`` (prepended
to its PYTHONPATH: a private site dir holding SGLang and the versions it pins).

Failures raise :class:`ServerError` with the last lines of the server's log, never a hang: a server
that exits or is not healthy by ``system.server.start_timeout_s``, a busy port, an unknown launcher.
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from granikv.config import RunConfig
from granikv.serving.hf_config import write_model_dir
from granikv.sglang_plugin.settings import PluginSettings

STATE_ENV, KEEP_ENV = "GRANIKV_SGLANG_STATE", "GRANIKV_SGLANG_KEEP"
PYTHON_ENV, PYTHONPATH_ENV = "GRANIKV_SGLANG_PYTHON", "GRANIKV_SGLANG_PYTHONPATH"
# where granikv (and a dist-info naming its sglang.srt.plugins entry point) lies for a plugin server
# that runs without `pip install -e .` (runners/gpu/sglang.sh sets it)
PLUGIN_PATH_ENV = "GRANIKV_PLUGIN_PYTHONPATH"
DEFAULT_STATE = "/tmp/granikv-sglang"
LOG_TAIL = 40
# log text -> what to do about it (added to a start failure's message)
HINTS = (
    ("No module named 'sglang'", "SGLang is not importable by the server's python: `pip install -e '.[sglang]'`, "
                                 f"or set {PYTHONPATH_ENV} to a site dir holding it (runners/gpu/sglang.sh install)"),
    ("No module named", "a module the server needs is missing from its environment (see the line above)"),
    ("out of memory", "the GPU has too little free memory: another process (an earlier server?) holds it, "
                      "or lower hardware.mem_fraction"),
    ("address already in use", "the port is taken: set system.server.port=0 (a free port) or stop that process"),
)


class ServerError(RuntimeError):
    """The server did not start, died, or answered wrongly; ``log_tail`` holds its last log lines."""

    def __init__(self, msg: str, log_path: Optional[Path] = None, log_tail: Optional[list[str]] = None):
        self.log_path = str(log_path) if log_path else None
        self.log_tail = list(log_tail or [])
        shown = "".join(f"\n    | {ln}" for ln in self.log_tail[-12:])
        super().__init__(msg + (f"\n  server log {self.log_path}, last lines:{shown}" if self.log_tail else ""))

    def details(self) -> dict:
        """What failure.json records beside the error (the log lines that name the failure)."""
        return {"server_log": self.log_path, "server_log_tail": self.log_tail}


@dataclass(frozen=True)
class ServerSpec:
    """A server's command line (without the port) and the environment it adds; ``key`` names it."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    host: str
    port: int                 # 0 = a free port picked at start
    start_timeout_s: float

    def environ(self) -> dict[str, str]:
        """This process's environment with the spec's additions (its PYTHONPATH goes first)."""
        env = dict(os.environ)
        for k, v in self.env:
            env[k] = f"{v}{os.pathsep}{env['PYTHONPATH']}" if k == "PYTHONPATH" and env.get("PYTHONPATH") else v
        return env

    @property
    def key(self) -> str:
        blob = json.dumps([self.argv, self.env, self.host, self.port])
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


def state_dir() -> Path:
    return Path(os.environ.get(STATE_ENV) or DEFAULT_STATE)


def server_argv(rc: RunConfig, model_dir: Path) -> list[str]:
    """``python -m <launcher> ...`` for the cell (no --host/--port: added at start)."""
    sc, hw = rc.system.server, rc.hardware
    argv = [os.environ.get(PYTHON_ENV) or sys.executable, "-m", sc.launcher,
            "--model-path", str(model_dir), "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", hw.dtype, "--tp-size", str(rc.tp), "--random-seed", str(rc.seed),
            "--max-running-requests", str(hw.max_running_requests),
            "--attention-backend", sc.attention_backend,
            "--mem-fraction-static", str(hw.mem_fraction),
            "--chunked-prefill-size", str(hw.chunked_prefill_size),
            "--decode-log-interval", str(sc.decode_log_interval)]
    argv += ["--cuda-graph-max-bs", str(hw.cuda_graph_max_bs)] if hw.cuda_graph_max_bs > 0 else ["--disable-cuda-graph"]
    if hw.kv_budget_tokens is not None or hw.kv_budget_per_model:
        budget = hw.kv_budget_tokens if hw.kv_budget_tokens is not None else hw.kv_budget_per_model.get(rc.model.name)
        if budget is None:
            raise ValueError(f"config error at `hardware.kv_budget_per_model`: preset '{hw.name}' has no budget "
                             f"for model '{rc.model.name}'; add one")
        argv += ["--max-total-tokens", str(int(budget))]
    if sc.radix_cache_backend:
        argv += ["--radix-cache-backend", sc.radix_cache_backend]
    if sc.incremental_streaming:
        argv.append("--incremental-streaming-output")
    if not hw.overlap_schedule:
        argv.append("--disable-overlap-schedule")
    return argv + [str(a) for a in sc.extra_args]


def server_spec(rc: RunConfig) -> ServerSpec:
    """The spec of the server a cell needs (writes the model's config.json under the state dir)."""
    if rc.system.server is None:
        raise ValueError(f"config error at `system.server`: system '{rc.system.name}' has no server block")
    model_dir = write_model_dir(rc.model, state_dir() / "models", dtype=rc.hardware.dtype)
    env = [("PYTHONUNBUFFERED", "1")]   # the step trace is read from its log while it runs
    sc = rc.system.server
    argv = tuple(server_argv(rc, model_dir))
    paths = _server_paths(sc)
    if sc.uses_plugin:   # its settings in its env
        settings = PluginSettings.from_system(rc.system, hardware=rc.hardware.name,
                                              stats_file=str(plugin_stats_path(argv)))
        env += [("SGLANG_PLUGINS", "granikv"), *settings.to_env().items()]
    if paths:
        env.append(("PYTHONPATH", os.pathsep.join(paths)))
    return ServerSpec(argv, tuple(env), sc.host, int(sc.port), float(sc.start_timeout_s))


def _server_paths(sc) -> list[str]:
    """What goes first on the server's PYTHONPATH: $GRANIKV_SGLANG_PYTHONPATH, and for a plugin server
    granikv itself and its entry point ($GRANIKV_PLUGIN_PYTHONPATH)."""
    paths = [os.environ[PYTHONPATH_ENV]] if os.environ.get(PYTHONPATH_ENV) else []
    if sc.uses_plugin:
        paths += [p for p in (os.environ.get(PLUGIN_PATH_ENV) or "").split(os.pathsep) if p]
    return paths


_FIND_SPEC = ("import importlib.util, sys\ntry:\n    ok = importlib.util.find_spec(sys.argv[1]) is not None\n"
              "except Exception:\n    ok = False\nsys.exit(0 if ok else 3)")
_LAUNCHERS_SEEN: dict[tuple, bool] = {}


def check_launcher(rc: RunConfig) -> None:
    """The server's interpreter ($GRANIKV_SGLANG_PYTHON, else this one), with the server's PYTHONPATH and
    working folder, finds the module ``system.server.launcher`` (SGLang's, or a test's fake server);
    else a ValueError naming the key and the fix. Asked once per interpreter, path and module, in a child
    process: the check imports nothing into this one."""
    sc = rc.system.server
    if sc is None:
        raise ValueError(f"config error at `system.server`: system '{rc.system.name}' has no server block")
    python = os.environ.get(PYTHON_ENV) or sys.executable
    paths = _server_paths(sc)
    env = ServerSpec((), (("PYTHONPATH", os.pathsep.join(paths)),) if paths else (), "", 0, 0.0).environ()
    key = (python, sc.launcher, env.get("PYTHONPATH"), os.getcwd())
    if key not in _LAUNCHERS_SEEN:
        try:
            r = subprocess.run([python, "-c", _FIND_SPEC, sc.launcher], env=env, capture_output=True, timeout=120)
            _LAUNCHERS_SEEN[key] = r.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _LAUNCHERS_SEEN[key] = False
    if not _LAUNCHERS_SEEN[key]:
        where = f" with PYTHONPATH={env['PYTHONPATH']}" if env.get("PYTHONPATH") else ""
        raise ValueError(f"config error at `system.server.launcher`: system '{rc.system.name}' starts "
                         f"`python -m {sc.launcher}`, but {python}{where} cannot import `{sc.launcher}`; install "
                         f"SGLang (`pip install -e '.[sglang]'`), or set {PYTHON_ENV} / {PYTHONPATH_ENV} to an "
                         "environment that has it (runners/gpu/sglang.sh)")


def plugin_stats_path(argv: tuple[str, ...]) -> Path:
    """Where a plugin server's attention backend writes its path counters (one file per command line)."""
    return state_dir() / "plugin_stats" / (hashlib.sha1(json.dumps(list(argv)).encode()).hexdigest()[:16] + ".json")


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def http(method: str, url: str, timeout: float = 5.0, body: Optional[dict] = None) -> tuple[int, bytes]:
    """(status, body) of a GET or a POST (empty-bodied, or ``body`` as JSON); status 0 when nothing answered."""
    data = (json.dumps(body).encode() if body is not None else b"") if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() or b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    return http("GET", url, timeout)


def http_post(url: str, timeout: float = 30.0, body: Optional[dict] = None) -> tuple[int, bytes]:
    return http("POST", url, timeout, body)


class SGLangServer:
    """One server process (a session leader: its pid is its process group) and its log file."""

    def __init__(self, spec: ServerSpec, pid: int, port: int, log_path: Path,
                 proc: Optional[subprocess.Popen] = None, adopted: bool = False):
        self.spec, self.pid, self.port, self.log_path = spec, pid, port, Path(log_path)
        self.proc, self.adopted = proc, adopted
        self.started_s: Optional[float] = None   # launch -> healthy (seconds)
        self.ready_log_size: Optional[int] = None  # log bytes at ready (a server this process started)
        self._info: Optional[dict] = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def state_file(self) -> Path:
        return state_dir() / f"{self.spec.key}.json"

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, spec: ServerSpec) -> "SGLangServer":
        """Launch the server and wait until ``/health_generate`` answers 200 (or raise ServerError)."""
        root = state_dir() / spec.key
        root.mkdir(parents=True, exist_ok=True)
        log_path = root / "server.log"
        if spec.port and not _port_free(spec.host, spec.port):
            raise ServerError(f"port {spec.port} on {spec.host} is already in use (another server?): set "
                              "system.server.port=0 to pick a free port, or stop the process holding it")
        port = spec.port or _free_port(spec.host)
        argv = [*spec.argv, "--host", spec.host, "--port", str(port)]
        env = spec.environ()
        with open(log_path, "ab") as log:
            log.write(f"\n==== granikv: starting {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        srv = cls(spec, proc.pid, port, log_path, proc=proc)
        # recorded at once, not when ready: a process killed while its server starts (a `timeout`
        # SIGTERM runs no finally) leaves a record, and the next start stops that server by its pid
        # (ServerPool._stop_others) instead of failing for the GPU memory it holds
        record = {"pid": srv.pid, "port": port, "key": spec.key, "argv": argv, "log": str(log_path), "ready": False}
        srv.state_file.write_text(json.dumps(record))
        t0 = time.monotonic()
        try:
            srv.wait_ready(t0 + spec.start_timeout_s)
        except BaseException:
            srv.stop()
            raise
        srv.started_s = time.monotonic() - t0
        srv.ready_log_size = srv.log_size()   # the start-up section of the log ends here
        srv.state_file.write_text(json.dumps({**record, "ready": True, "start_s": srv.started_s}))
        return srv

    def wait_ready(self, deadline: float) -> None:
        while True:
            if not self.alive():
                code = self.proc.poll() if self.proc else None
                raise self.error(f"the server exited (code {code}) before it was ready")
            status, _ = http_get(self.url + "/health_generate", timeout=5.0)
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise self.error(f"the server was not healthy (GET /health_generate: {status or 'no answer'}) "
                                 f"after {self.spec.start_timeout_s:.0f} s (system.server.start_timeout_s)")
            time.sleep(0.5)

    @classmethod
    def adopt(cls, spec: ServerSpec) -> Optional["SGLangServer"]:
        """The live, healthy server an earlier process left running for this spec, if any."""
        f = state_dir() / f"{spec.key}.json"
        if not f.exists():
            return None
        st = json.loads(f.read_text())
        srv = cls(spec, int(st["pid"]), int(st["port"]), Path(st["log"]), adopted=True)
        if not st.get("ready", True):         # its starter died before it was ready: not ours to trust
            srv.stop()
            return None
        srv.started_s = st.get("start_s")     # launch -> healthy, as the process that started it saw it
        if srv.alive() and http_get(srv.url + "/health_generate", timeout=10.0)[0] == 200:
            return srv
        srv.stop()
        return None

    # ------------------------------------------------------------------ state
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _pid_alive(self.pid)

    def info(self) -> dict:
        """``/server_info`` (SGLang version, resolved server args, scheduler info), cached."""
        if self._info is None:
            status, body = http_get(self.url + "/server_info", timeout=30.0)
            if status != 200:
                raise self.error(f"GET /server_info answered {status or 'nothing'}")
            self._info = json.loads(body)
        return self._info

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Empty the radix cache; SGLang refuses while requests run, so retry until ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = http_post(self.url + "/flush_cache", timeout=30.0)
            if status == 200:
                return
            if not self.alive():
                raise self.error("the server died (POST /flush_cache)")
            if time.monotonic() > deadline:
                raise self.error(f"POST /flush_cache answered {status or 'nothing'} for {timeout_s:.0f} s: "
                                 f"{body.decode(errors='replace').strip()[:200]}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ log
    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_lines(self, start: int = 0, end: Optional[int] = None) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            data = f.read(None if end is None else max(end - start, 0))
        return data.decode(errors="replace").splitlines()

    def take_start_log(self, max_lines: int) -> Optional[list[str]]:
        """The start-up section of the log (its last ``max_lines`` lines), once, for a server this
        process started; None for an adopted one or once taken."""
        if self.ready_log_size is None:
            return None
        lines, self.ready_log_size = self.log_lines(0, self.ready_log_size)[-max_lines:], None
        return lines

    def log_tail(self, n: int = LOG_TAIL) -> list[str]:
        if not self.log_path.exists():
            return []
        return self.log_lines(max(self.log_size() - 64 * 1024, 0))[-n:]

    def error(self, msg: str) -> ServerError:
        tail = self.log_tail()
        hints = [h for pat, h in HINTS if any(pat.lower() in ln.lower() for ln in tail)][:1]
        return ServerError(msg + "".join(f"; {h}" for h in hints), self.log_path, tail)

    # ------------------------------------------------------------------ stop
    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (its pid), SIGKILL after ``timeout_s``; idempotent."""
        if self.alive():
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    break
                end = time.monotonic() + wait
                while self.alive() and time.monotonic() < end:
                    time.sleep(0.1)
                if not self.alive():
                    break
        try:  # the children of the group (SGLang's scheduler, detokenizer) may outlive the leader
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc is not None:
            self.proc.wait(timeout=5)
        self.state_file.unlink(missing_ok=True)


class ServerPool:
    """The one live server of this process, reused by consecutive cells of the same spec."""

    def __init__(self):
        self.current: Optional[SGLangServer] = None
        self.launches = 0
        atexit.register(self.close)

    def acquire(self, spec: ServerSpec) -> SGLangServer:
        cur = self.current
        if cur is not None and cur.spec.key == spec.key and cur.alive():
            return cur
        if cur is not None:
            cur.stop()
            self.current = None
        srv = SGLangServer.adopt(spec)
        if srv is None:
            self._stop_others()
            srv = SGLangServer.start(spec)
            self.launches += 1
        self.current = srv
        return srv

    def _stop_others(self) -> None:
        """Servers an earlier process left running (GRANIKV_SGLANG_KEEP) hold the GPU: stop them by pid."""
        for f in sorted(state_dir().glob("*.json")) if state_dir().exists() else []:
            try:
                st = json.loads(f.read_text())
                pid = int(st["pid"])
            except (ValueError, KeyError, OSError):
                f.unlink(missing_ok=True)
                continue
            dummy = ServerSpec((), (), "127.0.0.1", int(st.get("port", 0)), 1.0)
            old = SGLangServer(dummy, pid, int(st.get("port", 0)), Path(st.get("log", "")))
            old.stop()
            f.unlink(missing_ok=True)

    def close(self, keep: Optional[bool] = None) -> None:
        """Stop the live server, unless ``keep`` (default: ``GRANIKV_SGLANG_KEEP=1``) leaves it for the next process."""
        keep = os.environ.get(KEEP_ENV) == "1" if keep is None else keep
        if self.current is not None and not keep:
            self.current.stop()
        self.current = None


POOL = ServerPool()


def main(argv: list[str]) -> int:
    """``python -m granikv.serving.server stop``: stop every server recorded in the state dir."""
    if argv[:1] != ["stop"]:
        print("usage: python -m granikv.serving.server stop", file=sys.stderr)
        return 2
    n = len(list(state_dir().glob("*.json"))) if state_dir().exists() else 0
    POOL._stop_others()
    print(f"stopped {n} recorded server(s) under {state_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
