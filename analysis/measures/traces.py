"""torch.profiler traces of serving cells: kernel time and its prefix-attention part."""
from __future__ import annotations
import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

import pandas as pd

from analysis.common import with_derived
from analysis.load import Results






ATTENTION_KERNEL = re.compile(r"Decode|Prefill|MergeState|merge_state|[Aa]ttention|[Cc]ascade|flash", re.ASCII)


ANNOTATION = "prefix_attention"


def trace_times(path: Path) -> dict[str, float]:
    """``{kernel_ms, attention_ms, source}`` of one torch.profiler trace (see the module docstring);
    parsed once per file version (traces are large and several modules read them)."""
    st = Path(path).stat()
    return dict(_trace_times(str(path), st.st_mtime_ns, st.st_size))


@lru_cache(maxsize=256)
def _trace_times(path: str, mtime_ns: int, size: int) -> dict[str, float]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    kernels = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"
                   and str(e.get("name", "")).startswith(ANNOTATION))
    if not kernels:  # a CPU run: torch.profiler saw no GPU kernels
        return {"kernel_ms": float("nan"), "attention_ms": float("nan"), "source": "no GPU kernel events"}
    total = sum(e.get("dur", 0) for e in kernels) / 1e3
    if spans:
        def inside(e):
            return any(a <= e["ts"] < b for a, b in spans)
        attn, source = sum(e.get("dur", 0) for e in kernels if inside(e)) / 1e3, "annotation"
    else:
        attn = sum(e.get("dur", 0) for e in kernels if ATTENTION_KERNEL.search(str(e.get("name", "")))) / 1e3
        source = "kernel names"
    return {"kernel_ms": total, "attention_ms": attn, "source": source}


def trace_frame(res: Results) -> pd.DataFrame:
    """One row per profiled serving cell that has a trace.json: its config plus trace_times()."""
    cells = with_derived(res.cells)
    if cells.empty or "profile_steps" not in cells.columns:
        return pd.DataFrame()
    prof = cells[(cells["kind"] == "serving") & (cells["profile_steps"].fillna(0) > 0)]
    rows = []
    for _, r in prof.iterrows():
        found = [Path(res.root) / r["path"] / n for n in ("trace.json.gz", "trace.json")]
        p = next((f for f in found if f.exists()), None)
        if p is not None:
            rows.append({**r.to_dict(), **trace_times(p)})
    df = pd.DataFrame(rows)
    if not df.empty:
        df["share"] = df["attention_ms"] / df["kernel_ms"]
    return df


def eager_steps(cells: pd.DataFrame) -> pd.Series:
    """Per cell: its decode steps ran without CUDA graphs (``hardware.cuda_graph_max_bs`` = 0)."""
    if "hardware.cuda_graph_max_bs" not in cells.columns:
        return pd.Series(False, index=cells.index)
    return pd.to_numeric(cells["hardware.cuda_graph_max_bs"], errors="coerce").fillna(1) == 0
