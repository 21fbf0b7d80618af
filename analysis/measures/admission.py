"""Requests a burst's server held back: admitted only after another request of the same burst had finished.

In a burst of B requests with one fixed output length and a concurrency cap of B, every request can decode
from the first step on, and all of them finish within a few steps of each other. A request whose first token
comes after another request of the burst has finished was held back by the server's admission (SGLang's
scheduler, for one, stops admitting once a prefill batch runs out of KV budget, ``batch_is_full``, and tries
again only when a running request finishes). Such a request then decodes nearly alone after the rest, and
the burst's makespan grows by that tail.

Per cell (``held_back``): the number of measured requests held back, and the seconds their tail added to the
burst's makespan (the last finish less the last finish of the requests not held back). Defined only for cells
of a single burst with one output length (``workload.arrival`` burst, ``workload.output_len`` set,
``workload.num_requests`` unset or at most ``workload.batch``); NaN elsewhere, where a late admission is the
normal continuous-batching order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import TOKEN_LISTS, read_rows
from granikv.rawio import data_path

COLUMNS = ("held_back", "held_back_s")


def held_back(cell: str | Path) -> tuple[float, float]:
    """(requests held back, seconds their tail added to the makespan) of one cell folder's requests.jsonl; NaN
    without one, or without a finished measured request. Requests that never got a token are left out."""
    path = Path(cell) / "requests.jsonl"
    if not data_path(path).exists():
        return np.nan, np.nan
    rows = [r for r in read_rows(path, skip=TOKEN_LISTS)
            if not r.get("warmup") and r.get("first_token_s") is not None and r.get("finish_s") is not None]
    if not rows:
        return np.nan, np.nan
    first_done = min(r["finish_s"] for r in rows)
    late = [r for r in rows if r["first_token_s"] > first_done]
    if not late:
        return 0.0, 0.0
    rest = [r["finish_s"] for r in rows if r["first_token_s"] <= first_done]
    return float(len(late)), max(r["finish_s"] for r in rows) - max(rest)


def is_single_burst(cells: pd.DataFrame) -> pd.Series:
    """Per cell: a single burst of requests with one output length (where ``held_back`` is defined)."""
    def col(name):
        return cells[name] if name in cells.columns else pd.Series(None, index=cells.index, dtype=object)
    n, batch = pd.to_numeric(col("workload.num_requests"), errors="coerce"), pd.to_numeric(col("workload.batch"),
                                                                                           errors="coerce")
    return ((col("workload.arrival").astype(str) == "burst") & col("workload.output_len").notna()
            & (n.isna() | (n <= batch)))


def with_held_back(cells: pd.DataFrame, root: str | Path) -> pd.DataFrame:
    """``cells`` with the COLUMNS (NaN where not a single burst); each burst cell's requests.jsonl is read once."""
    out = cells.assign(**{c: np.nan for c in COLUMNS})
    for i in out.index[is_single_burst(out)] if not out.empty else []:
        out.loc[i, list(COLUMNS)] = held_back(Path(root) / out.at[i, "path"])
    return out
