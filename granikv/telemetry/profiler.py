"""torch.profiler capture of a window of engine steps -> ``trace.json.gz`` (gzipped Chrome trace).

Gzipped because a 10-step window of an 8B model is ~17 MB of JSON (~1.5 MB compressed) and raw
results travel to the GPU host with every call (64 MiB limit); Perfetto opens .json.gz directly.

Used as (part of) the engine's ``on_step`` callback: the profiler starts after step
``start_step`` and stops ``num_steps`` decode steps later, so the window covers steady-state
decode, not start-up. If the run ends first, whatever was captured is still exported and
``note`` says the window was short.

The profiler's own host time falls between two steps, inside the measured run: its first start in
a process (CUPTI initialisation) took 3.7-6.4 s on the H200 (2026-11-30), its stop and export
0.5-0.9 s. ``prime()`` pays the first before the run, and ``overhead_s`` (start + stop + export,
in metrics as ``profiler_overhead_s``) says what was left inside it.
"""
from __future__ import annotations

import gzip
import shutil
import time
from pathlib import Path
from typing import Optional


_primed: set[bool] = set()   # the activity sets (cuda or not) whose profiler this process has started once


class StepProfiler:
    """Profile ``num_steps`` decode steps beginning after step index ``start_step``."""

    def __init__(self, path: str | Path, num_steps: int, start_step: int = 5, cuda: bool = False):
        self.path, self.num_steps, self.start_step, self.cuda = Path(path), int(num_steps), int(start_step), cuda
        self.captured, self.note = 0, ""
        self.overhead_s = 0.0        # profiler start + stop + export, spent between the run's steps
        self.prime_s: Optional[float] = None
        self._prof: Optional[object] = None
        self._done = num_steps <= 0
        if self._done:
            self.note = "disabled (profile_steps=0)"

    def _activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])

    def prime(self) -> None:
        """Start and stop an empty profile once per process (before the measured run), so that the
        profiler's one-time initialisation does not land between two measured steps."""
        if self._done or self.cuda in _primed:
            return
        from torch.profiler import profile

        t0 = time.perf_counter()
        with profile(activities=self._activities(), record_shapes=False, with_stack=False):
            pass
        self.prime_s = time.perf_counter() - t0
        _primed.add(self.cuda)

    def _begin(self) -> None:
        from torch.profiler import profile

        t0 = time.perf_counter()
        self._prof = profile(activities=self._activities(), record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self.overhead_s += time.perf_counter() - t0

    def on_step(self, step: dict) -> None:
        """Engine step callback."""
        if self._done:
            return
        if self._prof is None:
            if step.get("step", 0) >= self.start_step:
                self._begin()
            return
        if step.get("kind", "decode") == "decode":
            self.captured += 1
        if self.captured >= self.num_steps:
            self.finish()

    def finish(self) -> None:
        """Stop and export (idempotent); call at the end of the run too."""
        if self._done:
            return
        self._done = True
        if self._prof is None:
            self.note = f"run ended before step {self.start_step}; no trace"
            return
        t0 = time.perf_counter()
        self._prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(".tmp." + self.path.name.removesuffix(".gz"))
        self._prof.export_chrome_trace(str(tmp))
        if self.path.suffix == ".gz":
            gz = tmp.with_name(tmp.name + ".gz")
            with open(tmp, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            tmp.unlink()
            tmp = gz
        tmp.replace(self.path)
        self.overhead_s += time.perf_counter() - t0
        self.note = (f"{self.captured} decode steps after step {self.start_step}"
                     + ("" if self.captured >= self.num_steps else f" (run ended; {self.num_steps} asked)"))

    def summary(self) -> dict:
        return {"trace_json": self.path.name if self.path.exists() else None,
                "profiled_decode_steps": self.captured, "profile_note": self.note,
                "profiler_overhead_s": self.overhead_s if self.num_steps > 0 else None,
                "profiler_prime_s": self.prime_s}
