"""What a statistic measures a claim in: the frames, built once, and the outcome it returns."""
from __future__ import annotations
from dataclasses import dataclass, field

import pandas as pd

from analysis.common import SHORT, select, show
from analysis.load import Results
from analysis.measures.amdahl import amdahl_frame
from analysis.measures.dispatch import overhead_frame, with_dispatch
from analysis.measures.kernels import kernel_frame
from analysis.measures.sglang import prefer_current
from analysis.measures.traces import trace_frame
from analysis.verdict.noise import claim_noise






@dataclass
class Outcome:
    """Our number for one claim: ``value`` (float or bool, NaN when not measured), how it is shown,
    how many configurations it pools, why it is missing, and the GPUs it was measured on."""

    value: object = float("nan")
    shown: str = ""
    n: int = 0           # configurations pooled
    why: str = ""
    gpus: list[str] = field(default_factory=list)
    reps: int = 0        # fewest repetitions behind one of its configurations (0 = not tracked by the statistic)
    margin: float = float("nan")   # qualitative claims: the relative change that would flip the verdict
    margin_note: str = ""          # ... and where it is
    decider: str = ""              # the configuration(s) the number turns on, with their repetitions
    lo: object = float("nan")      # the interval our number may lie in (repetitions' min-max, or the noise);
    hi: object = float("nan")      # for a qualitative claim: its truth at the pessimistic / optimistic end
    spread_from: str = ""          # how the interval was obtained (or why there is none)


class Context:
    """The frames claims are measured in, built once from a Results (lazily)."""

    def __init__(self, res: Results):
        self.res = res
        self._frames: dict[str, pd.DataFrame] = {}
        self._derived: dict[str, pd.DataFrame] = {}

    @classmethod
    def over(cls, res: Results, cells: pd.DataFrame) -> "Context":
        """A Context over ``res`` whose ``cells`` frame is ``cells``, already built (a subset of another
        Context's, say); its other frames are built from ``res`` when asked for."""
        ctx = cls(res)
        ctx._frames["cells"] = cells
        return ctx

    def frame(self, name: str) -> pd.DataFrame:
        if name not in self._frames:
            if name == "cells":  # serving cells without profiler / nsys instrumentation; the plugin's
                # cells with today's settings where a configuration has them (in_sglang.prefer_current)
                df = with_dispatch(self.res.cells)
                df = select(df, {"kind": "=serving", "instrumented": "=False"}) if not df.empty else df
                df = prefer_current(df, self.res.config_columns)
            elif name == "kernels":
                df = kernel_frame(self.res)
            elif name == "trace":
                df = trace_frame(self.res)
            else:
                df = overhead_frame(self.res)
            self._frames[name] = df
        return self._frames[name]

    def amdahl(self) -> pd.DataFrame:
        """analysis.amdahl.amdahl_frame of the Results (one per claim checked against it otherwise)."""
        if "amdahl" not in self._derived:
            self._derived["amdahl"] = amdahl_frame(self.res)
        return self._derived["amdahl"]

    def noise(self, frame: str, metric: str, rows: pd.DataFrame) -> tuple[float, str]:
        """See :func:`claim_noise`."""
        return claim_noise(self, frame, metric, rows)


def why_empty(df: pd.DataFrame, sel: dict[str, str], what: str) -> str:
    """Which selector leaves nothing, and which values exist for it instead."""
    if df.empty:
        return f"no {what} under the results folder"
    cur = df
    for key, cond in sel.items():
        if key not in cur.columns:
            return f"no {what} has `{key}`"
        nxt = select(cur, {key: cond})
        if nxt.empty:
            vals = sorted(cur[key].dropna().unique(), key=lambda v: (isinstance(v, str), v if not isinstance(v, str) else 0, str(v)))
            shown = ", ".join(show(v) for v in vals[:8]) + (" ..." if len(vals) > 8 else "")
            return f"no {what} with {key}{cond} (the {len(cur)} {what}s that pass the selectors before it have {key} in {{{shown}}})"
        cur = nxt
    return f"no {what} matched"


def gpus_of(*dfs: pd.DataFrame) -> list[str]:
    out = set()
    for d in dfs:
        if d is not None and "provenance.gpu_name" in d.columns:
            out |= {str(g) if g is not None and g == g else "no GPU (CPU)" for g in d["provenance.gpu_name"]}
    return sorted(out)


WHAT = {"cells": "cell", "kernels": "kernel row", "trace": "profiled cell",
        "steps": "serving cell of a dispatching system"}


LABEL_KEYS = ("model.name", "tp", "hardware.name", "workload.num_prefixes", "workload.prefix_len", "workload.batch",
              "system")


def pair_label(p: pd.DataFrame, i) -> str:
    """One row of :func:`analysis.common.paired` for prose: the keys that tell it from the other pairs
    (Lp, B and system always), and the repetitions behind it and behind its baseline."""
    row = p.loc[i]
    keys = [k for k in LABEL_KEYS if k in p.columns and
            (k in ("workload.prefix_len", "workload.batch", "system") or p[k].nunique(dropna=False) > 1)]
    keys = [k for k in keys if not pd.isna(row[k])]
    n, nb = int(row["n_num"]), int(row["n_base"])
    return (", ".join(f"{SHORT.get(k, k)}={show(row[k])}" for k in keys)
            + f" ({n} repetition{'s' if n != 1 else ''}; its baseline {nb})")
