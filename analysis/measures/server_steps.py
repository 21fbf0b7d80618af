"""A SGLang server's decode steps in its own torch.profiler trace (``trace.json.gz`` of a server cell with
``profile_steps`` > 0, written by SGLang's ``/start_profile``).

SGLang marks each forward step on the GPU timeline with a ``gpu_user_annotation`` named
``step[DECODE bs=<B>]`` (``step[EXTEND ...]`` for a prefill). A full-graph decode step is the host's work for
that step (the batch's metadata: index lists, re-plans, the plugin's plan and buffer loads, each a few small
launches) followed by one ``cudaGraphLaunch`` whose kernels carry its correlation id. Per decode step:

- ``span_ms``: the annotation's length on the GPU timeline;
- ``busy_ms``: kernel time inside it, by class (:data:`CLASSES`, first match wins, on the kernel's name);
- ``pre_graph_ms``: from the step's start to its graph's first kernel: the GPU waits on the host's preparation
  of the step (the overlap scheduler did not hide it);
- ``idle_ms``: span less busy time (pre-graph wait included).

Under torch.profiler the host runs slower (every op is recorded), so host-side times compare only between traces
taken the same way; kernel times are the GPU's own.
"""
from __future__ import annotations

import bisect
import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

import pandas as pd

# kernel class -> name pattern; the first that matches names the class (the prefix launches are FlashInfer
# prefill kernels, whose template names mention cutlass: they are matched before the GEMMs)
CLASSES = (("prefix", re.compile(r"PrefillWithKVCacheKernel")),
           ("rows", re.compile(r"_gather_q_kernel|_merge_rows_kernel|_gather_rows_kernel")),
           ("attention", re.compile(r"BatchPrefillWithPagedKVCache|BatchDecode|MergeStates|merge_state", re.I)),
           ("gemm", re.compile(r"nvjet|gemm|cublas|cutlass|splitKreduce", re.I)),
           ("other", re.compile(r".")))
STEP = re.compile(r"^step\[DECODE bs=(\d+)")
COLUMNS = ["step", "batch", "span_ms", "busy_ms", "pre_graph_ms", "idle_ms", "kernels",
           *[f"{c}_ms" for c, _ in CLASSES]]


def kernel_class(name: str) -> str:
    """The class (:data:`CLASSES`) of a kernel named ``name``."""
    return next(c for c, pat in CLASSES if pat.search(name))


def decode_steps(path: str | Path) -> pd.DataFrame:
    """One row per decode step of the trace at ``path`` (:data:`COLUMNS`; module doc); parsed once per file
    version. An empty frame when the trace holds no annotated decode step."""
    st = Path(path).stat()
    return _decode_steps(str(path), st.st_mtime_ns, st.st_size).copy()


@lru_cache(maxsize=32)
def _decode_steps(path: str, mtime_ns: int, size: int) -> pd.DataFrame:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    starts = [e["ts"] for e in kernels]
    graphs = {e.get("args", {}).get("correlation") for e in events
              if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"}
    steps = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and STEP.match(str(e.get("name", "")))),
                   key=lambda e: e["ts"])
    rows = []
    for i, s in enumerate(steps):
        a, b = s["ts"], s["ts"] + s.get("dur", 0)
        inside = kernels[bisect.bisect_left(starts, a):bisect.bisect_left(starts, b)]
        by = {c: 0.0 for c, _ in CLASSES}
        for k in inside:
            by[kernel_class(str(k.get("name", "")))] += k.get("dur", 0)
        first = next((k["ts"] for k in inside if k.get("args", {}).get("correlation") in graphs), None)
        busy = sum(by.values())
        rows.append({"step": i, "batch": int(STEP.match(s["name"]).group(1)), "span_ms": (b - a) / 1e3,
                     "busy_ms": busy / 1e3, "pre_graph_ms": (first - a) / 1e3 if first is not None else float("nan"),
                     "idle_ms": (b - a - busy) / 1e3, "kernels": len(inside),
                     **{f"{c}_ms": v / 1e3 for c, v in by.items()}})
    return pd.DataFrame(rows, columns=COLUMNS)
