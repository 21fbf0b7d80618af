"""The GPU model a cell ran on, as the analysis keeps cells of two GPU models apart.

``gpu`` is a column of every finished cell and kernel row (``analysis.load`` adds it): the cell's
``provenance.gpu_name`` (``NVIDIA H200``, ``NVIDIA H100 80GB HBM3``), or :data:`NO_GPU` for a cell run
without one. It is an identity column (``analysis.common.identity``): repetitions pool, ratios pair,
noise is measured and reruns supersede only within one GPU model. Claims are evaluated once per GPU
model (:func:`only_gpu`), :data:`PRIMARY_GPU` first (the README's and REPORT's verdict counts are its rows).
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

GPU = "gpu"
PROVENANCE_GPU = "provenance.gpu_name"
PRIMARY_GPU = "NVIDIA H200"     # the GPU model the campaign ran on: each claim's first row
NO_GPU = "no GPU (CPU)"


def gpu_names(df: pd.DataFrame, column: str | None = None) -> pd.Series:
    """Per row: the GPU model (``column``; by default ``gpu`` where the frame has it, else
    ``provenance.gpu_name``; NO_GPU where it names none)."""
    if df.empty:
        return pd.Series(dtype=object, index=df.index)
    column = column or (GPU if GPU in df.columns else PROVENANCE_GPU)
    src = df[column] if column in df.columns else pd.Series(None, index=df.index, dtype=object)
    return src.map(lambda g: str(g).strip() if isinstance(g, str) and str(g).strip() else NO_GPU).astype(object)


def add_gpu(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (as loaded) with ``gpu`` from its provenance; a raw field named ``gpu`` (a bench's own record)
    is kept as ``metrics.gpu``."""
    if df.empty:
        return df
    if GPU in df.columns:
        df = df.rename(columns={GPU: f"metrics.{GPU}"})
    return df.assign(**{GPU: gpu_names(df, PROVENANCE_GPU)})


def with_gpu(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its ``gpu`` column (from ``provenance.gpu_name`` where it has none): the key a table
    groups by so that two GPU models never pool."""
    return df if GPU in df.columns else df.assign(**{GPU: gpu_names(df)})


def ordered(gpus) -> list[str]:
    """GPU model names, each once: PRIMARY_GPU first, then by name."""
    return sorted(set(gpus), key=lambda g: (g != PRIMARY_GPU, g))


def gpus_of_results(res) -> list[str]:
    """The GPU models of a Results' finished cells and kernel rows: PRIMARY_GPU first, then by name."""
    found = set()
    for df in (res.cells, res.set_aside, res.kernels):
        if not df.empty:
            found |= set(gpu_names(df))
    return ordered(found)


def one_gpu(df: pd.DataFrame) -> tuple[pd.DataFrame, str | None, list[str]]:
    """(rows, name, others): the rows of ``df`` (a table with a ``gpu`` column) on its first GPU model
    (:func:`ordered`; rows naming none count as NO_GPU), its name, and the other GPU models ``df`` holds: a
    figure that draws one GPU model names the others."""
    if df.empty:
        return df, None, []
    names = gpu_names(df)
    first, *others = ordered(names)
    return df[names == first], first, others


def primary_gpu(res) -> str:
    """The GPU model of each claim's first row: PRIMARY_GPU, or where the results hold none of its cells
    (a CPU smoke run), the GPU model of most of their cells."""
    names = pd.concat([gpu_names(d) for d in (res.cells, res.kernels) if not d.empty] or [pd.Series(dtype=object)])
    if names.empty or PRIMARY_GPU in set(names):
        return PRIMARY_GPU
    counts = names.value_counts()
    return sorted(counts.index, key=lambda g: (-counts[g], g))[0]


def only_gpu(res, gpu: str):
    """The Results ``res`` (analysis.load.Results) restricted to the cells and kernel rows of one GPU
    model; failures, which may not record one, stay as they are."""
    def keep(df: pd.DataFrame) -> pd.DataFrame:
        return df if df.empty else df[gpu_names(df) == gpu].reset_index(drop=True)
    return replace(res, cells=keep(res.cells), set_aside=keep(res.set_aside), kernels=keep(res.kernels))
