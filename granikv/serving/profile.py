"""SGLang's own torch.profiler trace of a measured replay's decode steps (``profile_steps`` > 0).

The server steps on its own, so the client cannot bracket a step. A watcher thread reads the server's log
from the replay's start; at its first ``Decode batch`` line it asks the server to profile
(``POST /start_profile`` with ``num_steps``: SGLang's scheduler records that many forward steps with CPU
and GPU activities, then writes ``<output_dir>/<profile_id>-TP-0.trace.json.gz`` and stops by itself).
``finish`` waits for that file. The trace covers the scheduler process: host time of the plan, the
launches and the graph replays of each step, and the GPU kernels.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional

from granikv.serving.server import SGLangServer, http_post

DECODE_LINE = "Decode batch"


class ServerProfile:
    """One trace of ``num_steps`` forward steps, started at the first decode step logged after ``log_start``."""

    def __init__(self, server: SGLangServer, num_steps: int, out_dir: Path, profile_id: str = "granikv"):
        if num_steps <= 0:
            raise ValueError(f"profile_steps: must be > 0 for a server trace, got {num_steps}")
        self.server, self.num_steps, self.out_dir, self.profile_id = server, num_steps, Path(out_dir), profile_id
        self.note = "not started"
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def trace_path(self) -> Path:
        return self.out_dir / f"{self.profile_id}-TP-0.trace.json.gz"

    def start(self, log_start: int) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._watch, args=(log_start,), daemon=True)
        self._thread.start()

    def _watch(self, pos: int) -> None:
        while not self._stop.is_set():
            end = self.server.log_size()
            if any(DECODE_LINE in ln for ln in self.server.log_lines(pos, end)):
                body = {"output_dir": str(self.out_dir), "num_steps": self.num_steps, "activities": ["CPU", "GPU"],
                        "profile_id": self.profile_id}
                status, answer = http_post(self.server.url + "/start_profile", timeout=60.0, body=body)
                self.note = (f"started at the first decode step ({self.num_steps} steps)" if status == 200 else
                             f"POST /start_profile answered {status or 'nothing'}: "
                             f"{answer.decode(errors='replace')[:200]}")
                return
            pos = end
            time.sleep(0.05)
        self.note = "no decode step was logged during the replay"

    def finish(self, timeout_s: float = 120.0) -> Optional[Path]:
        """The trace file once SGLang has written it (None, with ``note`` saying why, when it did not)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=65.0)
        if not self.note.startswith("started"):
            return None
        deadline = time.monotonic() + timeout_s
        size = -1
        while time.monotonic() < deadline:
            if self.trace_path.exists():
                now = self.trace_path.stat().st_size
                if now == size and now > 0:          # stopped growing: the export finished
                    self.note += "; written"
                    return self.trace_path
                size = now
            time.sleep(0.5)
        self.note += f"; no trace at {self.trace_path} after {timeout_s:.0f} s (did the replay run {self.num_steps} steps?)"
        return None
