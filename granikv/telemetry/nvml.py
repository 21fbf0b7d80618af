"""NVML sampler: a background thread writing SM clock, memory used, power and utilisation of
every visible GPU at ~10 Hz to ``nvml.csv``. On a machine without a GPU (or without NVML) it
does nothing and says why in ``note``."""
from __future__ import annotations

import csv
import os
import threading
import time
from pathlib import Path
from typing import Optional

FIELDS = ("t_s", "gpu", "sm_clock_mhz", "mem_used_mib", "power_w", "gpu_util_pct", "mem_util_pct")


class NvmlSampler:
    """Context manager: ``with NvmlSampler(cell_dir / "nvml.csv", enabled=cfg.nvml) as s: ...``.

    ``t_s`` is seconds since the sampler started (time.perf_counter); rows are written as they
    are taken to ``<path>.partial`` and renamed to ``path`` on exit, so a killed run leaves no
    file that looks complete. ``samples`` counts rows; ``note`` explains a no-op.
    """

    def __init__(self, path: str | Path, enabled: bool = True, period_s: float = 0.1):
        self.path, self.period_s = Path(path), period_s
        self.enabled, self.note, self.samples = enabled, "", 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._handles: list = []
        self._nvml = None

    def _init(self) -> bool:
        if not self.enabled:
            self.note = "disabled (nvml=false)"
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no driver / no GPU
            self.note = f"no NVML on this machine ({type(e).__name__}: {e}); nvml.csv not written"
            return False
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            self.note = "NVML found no GPU; nvml.csv not written"
            return False
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        idx = [int(x) for x in vis.split(",") if x.strip().isdigit()] if vis else list(range(n))
        self._nvml = pynvml
        self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in idx if i < n]
        return bool(self._handles)

    def _row(self, t: float, i: int, h) -> list:
        p = self._nvml
        util = p.nvmlDeviceGetUtilizationRates(h)
        return [f"{t:.3f}", i, p.nvmlDeviceGetClockInfo(h, p.NVML_CLOCK_SM),
                p.nvmlDeviceGetMemoryInfo(h).used // 2**20, p.nvmlDeviceGetPowerUsage(h) / 1e3,
                util.gpu, util.memory]

    def _loop(self) -> None:
        t0 = time.perf_counter()
        tmp = self.path.with_name(self.path.name + ".partial")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(FIELDS)
            while not self._stop.is_set():
                t = time.perf_counter() - t0
                for i, h in self._handles:
                    try:
                        w.writerow(self._row(t, i, h))
                        self.samples += 1
                    except Exception as e:  # noqa: BLE001 - a counter not supported on this GPU
                        self.note = f"sampling error: {type(e).__name__}: {e}"
                self._stop.wait(self.period_s)
        os.replace(tmp, self.path)

    def __enter__(self) -> "NvmlSampler":
        if self._init():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self.note = self.note or f"{self.samples} samples at {1 / self.period_s:.0f} Hz"

    def summary(self) -> dict:
        """What to record in the cell's stats."""
        return {"nvml_csv": self.path.name if self._thread is not None else None,
                "nvml_samples": self.samples, "nvml_note": self.note}
