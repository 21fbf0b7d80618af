"""torch.profiler capture of a window of engine steps -> ``trace.json.gz`` (gzipped Chrome trace).

Gzipped because a 10-step window of an 8B model is ~17 MB of JSON (~1.5 MB compressed) and raw
results travel to the GPU host with every call (64 MiB limit); Perfetto opens .json.gz directly.

Used as (part of) the engine's ``on_step`` callback: the profiler starts after step
``start_step`` and stops ``num_steps`` decode steps later, so the window covers steady-state
decode, not start-up. If the run ends first, whatever was captured is still exported and
``note`` says the window was short.
"""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Optional


class StepProfiler:
    """Profile ``num_steps`` decode steps beginning after step index ``start_step``."""

    def __init__(self, path: str | Path, num_steps: int, start_step: int = 5, cuda: bool = False):
        self.path, self.num_steps, self.start_step, self.cuda = Path(path), int(num_steps), int(start_step), cuda
        self.captured, self.note = 0, ""
        self._prof: Optional[object] = None
        self._done = num_steps <= 0
        if self._done:
            self.note = "disabled (profile_steps=0)"

    def _begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()

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
        self.note = (f"{self.captured} decode steps after step {self.start_step}"
                     + ("" if self.captured >= self.num_steps else f" (run ended; {self.num_steps} asked)"))

    def summary(self) -> dict:
        return {"trace_json": self.path.name if self.path.exists() else None,
                "profiled_decode_steps": self.captured, "profile_note": self.note}
