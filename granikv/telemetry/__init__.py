"""Telemetry attached to a measured cell: NVML sampling (nvml.csv), a torch.profiler window
(trace.json.gz), nsys wrapping (*.nsys-rep). The dispatch trace itself is the engine's
per-step records, saved as steps.jsonl by runners.run."""
from granikv.telemetry.nsys import ENV_GUARD, nsys_command, nsys_path
from granikv.telemetry.nvml import NvmlSampler
from granikv.telemetry.profiler import StepProfiler

__all__ = ["ENV_GUARD", "NvmlSampler", "StepProfiler", "nsys_command", "nsys_path"]
