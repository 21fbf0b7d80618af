"""Shared pieces of the table / figure modules: selection, rep aggregation, pairing, output.

Vocabulary: a *cell* is one measured folder (one repetition); cells that differ only in
``META_KEYS`` (rep, seed, paths, ...) are repetitions of one *configuration*. Ratios pair a
configuration with its baseline (e.g. the same config with ``system.name=sglang_default``).
Tables are written with fixed float formatting and sorted rows, so they are byte-stable.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from itertools import product
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd


os.environ.setdefault("MPLBACKEND", "Agg")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from analysis.gpu import GPU  # noqa: E402
from granikv.config import SYSTEMS  # noqa: E402

NOT_MEASURED = "not measured"
PAPER_HARDWARE = "A100-SXM4-40GB"
# (model, tp) of the paper's three headline configurations
PAPER_CONFIGS = (("llama3_8b", 1), ("qwen25_14b", 2), ("qwen25_32b", 4))
LPS = (512, 1024, 2048, 4096, 8192, 16384)      # headline Lp sweep (the grid adds 16K to Tables 6-8)
GRID_B = (8, 32, 128, 256)                       # Tables 6-8
SHAREGPT_B = (256, 512, 1024)                    # B=256 headline; B up to 1024 (Tables 9-11, B.2)
# keys that tell repetitions of one configuration apart, never two configurations
META_KEYS = ("rep", "seed", "sweep_name", "results_dir", "force", "profile_steps", "nvml", "nsys", "cell_kind")
META_PREFIXES = ("cell.", "provenance.")  # cell id / overrides: one per folder, never a config
# keys that runners.run derives from others (max_running_requests = min(preset, workload.batch)):
# they never tell two configurations apart on their own
IMPLIED_KEYS = ("hardware.max_running_requests",)
# caps and policies on cached CUDA-graph state: they change when a graph is captured, never what a step
# computes; the cell's metrics say what they did (cuda_graphs_evicted, cuda_graph_capture_s,
# eager_decode_reasons): cells run before the option existed pool with later ones
CAPACITY_KEYS = ("hardware.cuda_graph_max_graphs", "hardware.cuda_graph_capture_at")
SHORT = {"model.name": "model", "tp": "tp", "workload.prefix_len": "Lp", "workload.batch": "B",
         "workload.num_prefixes": "k", "hardware.name": "hardware", "workload.kind": "workload"}
THROUGHPUT = "output_throughput_tok_s"
NULL = "<null>"  # stands for a missing config value in group keys (pandas drops NaN keys otherwise)
# the workload cells of the headline sweep and of the synthetic grid (B.1)
HEADLINE_CELLS = {"workload.kind": "=sharegpt", "workload.batch": "=256", "workload.num_prefixes": "=1"}
THROUGHPUT_DIGITS = {"mean": 1, "sd": 1, "min": 1, "max": 1, "tpot_p50_ms": 2, "ttft_p50_ms": 1}
GRID_CELLS = {"workload.kind": "=synthetic", "workload.num_prefixes": "=1"}


# GPU vendor datasheet peaks (dense, no sparsity), used where the cell's hardware preset leaves
# peak_tflops / peak_tbps unset (0.0). Not measurements.
#   NVIDIA H200 SXM (H200 datasheet): 989 TFLOP/s BF16 dense tensor core (1,979 with sparsity), 4.8 TB/s HBM3e.
#   NVIDIA H100 SXM 80GB (H100 datasheet): 989 TFLOP/s BF16 dense tensor core (1,979 with sparsity), 3.35 TB/s HBM3.
#   NVIDIA A100 SXM4 40GB (A100 datasheet): 312 TFLOP/s BF16 dense tensor core, 1,555 GB/s HBM2.
H200_PEAK_TFLOPS, H200_PEAK_TBPS = 989.0, 4.8
H100_PEAK_TFLOPS, H100_PEAK_TBPS = 989.0, 3.35
A100_40GB_PEAK_TFLOPS, A100_40GB_PEAK_TBPS = 312.0, 1.555
VENDOR_PEAKS = {"NVIDIA H200": (H200_PEAK_TFLOPS, H200_PEAK_TBPS),
                "NVIDIA H100 80GB HBM3": (H100_PEAK_TFLOPS, H100_PEAK_TBPS),
                "NVIDIA A100-SXM4-40GB": (A100_40GB_PEAK_TFLOPS, A100_40GB_PEAK_TBPS)}


def with_derived(cells: pd.DataFrame) -> pd.DataFrame:
    """Add ``system`` (= system.name: sglang_default, granikv_dense_only, ...), ``config``
    (model and TP), ``meff`` (= B x Hq/Hkv, the dispatcher's M for one prefix class) and
    ``instrumented`` (profiler or nsys on: timings not comparable with plain cells)."""
    df = cells.copy()
    if df.empty:
        return df
    df["system"] = df["system.name"].astype(str) if "system.name" in df.columns else "?"
    prof = df["profile_steps"].fillna(0).astype(float) > 0 if "profile_steps" in df.columns else False
    nsys = df["nsys"].fillna(False).astype(bool) if "nsys" in df.columns else False
    df["instrumented"] = prof | nsys
    if {"model.name", "tp"} <= set(df.columns):
        df["config"] = [config_label(m, t) for m, t in zip(df["model.name"], df["tp"])]
    if {"workload.batch", "model.num_heads", "model.num_kv_heads"} <= set(df.columns):
        df["meff"] = df["workload.batch"] * (df["model.num_heads"] // df["model.num_kv_heads"])
    return df


def config_label(model, tp) -> str | None:
    """``llama3_8b TP=1``: one model/TP configuration, as the tables name it (None if unknown)."""
    if model is None or tp is None or (isinstance(tp, float) and math.isnan(tp)) or model != model:
        return None
    return f"{model} TP={int(tp)}"


PAPER_CONFIG_LABELS = tuple(config_label(m, t) for m, t in PAPER_CONFIGS)


def _coerce(s: str):
    for t in (int, float):
        try:
            return t(s)
        except ValueError:
            pass
    return s


OPS = (">=", "<=", "!=", "=", "<", ">", "~")


def parse_selectors(text: str | float | None) -> dict[str, str]:
    """``"a=1;b>=2"`` -> ``{"a": "=1", "b": ">=2"}``.

    Operators: ``= != < <= > >=`` and ``~`` (substring). Values: a number or text, ``x|y``
    (any of), ``null`` / ``notnull``, ``max`` (the largest value left after the other selectors).
    """
    out: dict[str, str] = {}
    if text is None or (isinstance(text, float) and math.isnan(text)) or not str(text).strip():
        return out
    for part in str(text).split(";"):
        part = part.strip()
        pos = [(part.find(o), o) for o in OPS if o in part]
        if not pos:
            raise ValueError(f"selector `{part}` has no operator (use key=value)")
        i, op = min(pos, key=lambda t: (t[0], -len(t[1])))
        out[part[:i].strip()] = op + part[i + len(op):].strip()
    return out


def _match(col: pd.Series, op: str, raw: str, mask: pd.Series) -> pd.Series:
    if raw in ("null", "notnull"):
        m = col.isna() if raw == "null" else col.notna()
        return ~m if op == "!=" else m
    if raw == "max":
        return col == col[mask].max()
    if op == "~":
        return col.astype(str).str.contains(raw, regex=False)
    values = [_coerce(v) for v in raw.split("|")]
    if any(isinstance(v, str) for v in values) or col.dtype == object:
        col, values = col.astype(str), [str(v) for v in values]
    if op in ("=", "!="):
        m = col.isin(values)
        return ~m if op == "!=" else m
    v = values[0]
    return {"<": col < v, "<=": col <= v, ">": col > v, ">=": col >= v}[op]


def select(df: pd.DataFrame, selectors: dict[str, str]) -> pd.DataFrame:
    """Rows of ``df`` matching every selector; a selector on a missing column matches nothing."""
    mask = pd.Series(True, index=df.index)
    for key, cond in sorted(selectors.items(), key=lambda kv: kv[1].endswith("max")):  # max last
        if key not in df.columns:
            return df.iloc[0:0]
        op = next(o for o in OPS if cond.startswith(o))
        mask &= _match(df[key], op, cond[len(op):], mask).fillna(False).astype(bool)
    return df[mask]


def identity(df: pd.DataFrame, config_cols: Iterable[str]) -> list[str]:
    """Columns that identify a configuration (config keys present in ``df``, minus META_KEYS, and the GPU
    model ``gpu`` where ``df`` has it: cells of two GPU models are never one configuration)."""
    cols = set(config_cols) | ({GPU} if GPU in df.columns else set())
    return sorted(c for c in cols if c in df.columns and c not in META_KEYS + IMPLIED_KEYS + CAPACITY_KEYS
                  and not c.startswith(META_PREFIXES))


def aggregate(df: pd.DataFrame, keys: list[str], metric: str) -> pd.DataFrame:
    """Repetitions -> one row per ``keys``: ``mean``, ``sd`` (ddof=1), ``min``, ``max``, ``n``."""
    cols = keys + ["mean", "sd", "min", "max", "n"]
    if df.empty or metric not in df.columns:
        return pd.DataFrame(columns=cols)
    k = df[keys].astype(object)
    d = k.where(k.notna(), NULL)
    d[metric] = df[metric]
    g = d.groupby(keys, dropna=False, sort=True)[metric]
    stats = pd.DataFrame({"mean": g.mean(), "sd": g.std(ddof=1), "min": g.min(), "max": g.max(), "n": g.count()})
    # the group keys as columns in one go (reset_index inserts them one at a time: slow for a wide identity)
    out = pd.concat([stats.index.to_frame(index=False), stats.reset_index(drop=True)], axis=1)
    return out[cols]


# hardware keys that are a system's own setting, set only in that system's cells (the SGLang plugin's graph
# rules): a pair that frees the system frees them too
SYSTEM_SETTINGS = ("hardware.plugin_graph_table",)


def paired(df: pd.DataFrame, config_cols: Iterable[str], num_sel: dict[str, str],
           base_over: dict[str, str], metric: str) -> pd.DataFrame:
    """Configs matching ``num_sel`` paired with their baseline (``num_sel`` updated by ``base_over``).

    Pairs match on every identity column except the overridden keys (overriding a ``system.``
    key frees all ``system.*`` columns, ``system`` and :data:`SYSTEM_SETTINGS`). Returns the identity columns of the
    numerator plus ``num``, ``base``, ``ratio`` (= num / base, of rep means), ``n_num``, ``n_base``
    and the repetitions' extremes ``num_min``, ``num_max``, ``base_min``, ``base_max``.
    """
    ids = identity(df, config_cols) + (["system"] if "system" in df.columns else [])
    free = set(base_over)
    if any(k.startswith("system") for k in free):
        free |= {c for c in ids if c.startswith("system") or c in SYSTEM_SETTINGS}
    keys = [c for c in ids if c not in free]
    cols = ids + ["num", "base", "ratio", "n_num", "n_base", "num_min", "num_max", "base_min", "base_max"]
    num = aggregate(select(df, num_sel), ids, metric)
    base = aggregate(select(df, {**num_sel, **base_over}), ids, metric)
    if num.empty or base.empty:
        return pd.DataFrame(columns=cols)
    base = base.groupby(keys, dropna=False, sort=True).agg(base=("mean", "mean"), n_base=("n", "sum"),
                                                           base_min=("min", "min"), base_max=("max", "max")).reset_index()
    out = num.rename(columns={"mean": "num", "n": "n_num", "min": "num_min", "max": "num_max"}).merge(base, on=keys,
                                                                                                   how="inner")
    out["ratio"] = out["num"] / out["base"]
    return out[cols].reset_index(drop=True)


def geomean(x: Iterable[float]) -> float:
    a = np.asarray([v for v in x if v is not None and np.isfinite(v) and v > 0], dtype=float)
    return float(np.exp(np.log(a).mean())) if a.size else float("nan")


def show(v) -> str:
    """A config value for prose: 512.0 -> '512', text as is."""
    if isinstance(v, (float, np.floating)) and np.isfinite(v) and float(v).is_integer():
        return str(int(v))
    return str(v)


def fmt(x, nd: int = 2) -> str:
    """Fixed formatting: '' for missing, ints as ints, floats with ``nd`` decimals."""
    if x is None or (isinstance(x, float) and not np.isfinite(x)) or x is pd.NA or x == NULL:
        return ""
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.{nd}f}"
    return str(x)


def system_table(cells: pd.DataFrame, config_cols: list[str], sel: dict[str, str], dims: list[str],
                 expected: dict[str, Iterable] | None = None, systems: Iterable[str] = SYSTEMS,
                 metric: str = THROUGHPUT) -> pd.DataFrame:
    """Per (dims, system): rep mean/sd/min/max/n of ``metric``, ratios to sglang_default and
    sglang_cascade in the same configuration, TPOT p50 and TTFT p50 (rep means); plus a
    ``not measured`` row for every expected (dims, system) combination without a cell (measured
    cells outside the expected grid are kept as they are). Instrumented cells are left out, and so
    are the cells of systems not in ``systems``.

    Config keys that vary inside the selection but are not in ``dims`` (e.g. hardware presets)
    are added as extra columns, so two different configurations are never pooled.
    """
    df = select(with_derived(cells), {**sel, "instrumented": "=False"}) if not cells.empty else cells
    systems = tuple(systems)
    if not df.empty:     # another system's cells in the same sweep folder (e.g. a server run beside the engine's)
        df = df[df["system"].isin(systems)]
    ids = identity(df, config_cols)
    implied = {"config": ("model.", "tp")}  # dims standing for several config keys
    covered = tuple(p for d in dims for p in implied.get(d, ()))
    extra = [c for c in ids if c not in dims and not c.startswith(("system.",) + covered)
             and (c == GPU or df[c].astype(str).nunique() > 1)]   # the GPU model: always a column
    keys = dims + extra + ["system"]
    rows = []
    if not df.empty:
        agg = aggregate(df, keys, metric)
        for m, name in (("tpot_p50_ms", "tpot_p50_ms"), ("ttft_p50_ms", "ttft_p50_ms")):
            agg = agg.merge(aggregate(df, keys, m)[keys + ["mean"]].rename(columns={"mean": name}), on=keys, how="left")
        for base in ("sglang_default", "sglang_cascade"):
            b = agg[agg["system"] == base][dims + extra + ["mean"]].rename(columns={"mean": f"_b_{base}"})
            agg = agg.merge(b, on=dims + extra, how="left")
            agg[f"ratio_vs_{base}"] = agg["mean"] / agg[f"_b_{base}"]
        agg = agg.merge(code_versions(df, keys), on=keys, how="left")
        agg["status"] = "measured"
        rows = agg.drop(columns=[c for c in agg.columns if c.startswith("_b_")]).to_dict("records")
    measured = {tuple(r[d] for d in dims + ["system"]) for r in rows}
    if expected:
        values = [list(expected[d]) if d in expected else sorted({r[d] for r in rows}, key=str) for d in dims]
        for combo in product(*values, list(systems)):
            if combo not in measured:
                rows.append({**dict(zip(dims + ["system"], combo)), "n": 0, "status": NOT_MEASURED})
    cols = keys + ["n", "mean", "sd", "min", "max", "ratio_vs_sglang_default", "ratio_vs_sglang_cascade",
                   "tpot_p50_ms", "ttft_p50_ms", "code", "status"]
    out = pd.DataFrame(rows, columns=cols)
    return sort_rows(out, keys)


def code_version(cells: pd.DataFrame) -> pd.Series:
    """Per cell, the code version it ran: its commit, short, with "+" when measured with uncommitted changes;
    "unknown" without provenance."""
    if cells.empty or "provenance.git_commit" not in cells.columns:
        return pd.Series("unknown", index=cells.index, dtype=object)
    commit = cells["provenance.git_commit"].astype(object).where(cells["provenance.git_commit"].notna(), "unknown")
    dirty = cells["provenance.git_dirty"].astype(str).str.lower().eq("true") if "provenance.git_dirty" in cells.columns \
        else pd.Series(False, index=cells.index)
    return commit.astype(str).str[:7] + dirty.map({True: "+", False: ""})


def code_versions(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per ``keys``: ``code``, the code version its repetitions were measured at (:func:`code_version`)
    or "N versions" when they span several; "unknown" without provenance."""
    k = df[keys].astype(object)
    d = k.where(k.notna(), NULL)
    if "provenance.git_commit" not in df.columns:
        return d.drop_duplicates().assign(code="unknown")
    d["_v"] = code_version(df)
    g = d.groupby(keys, dropna=False, sort=True)["_v"].agg(lambda v: v.iloc[0] if v.nunique() == 1
                                                           else f"{v.nunique()} versions")
    return g.rename("code").reset_index()


def sort_rows(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Deterministic order: numbers numerically, text alphabetically, missing last."""
    if df.empty:
        return df.reset_index(drop=True)
    order = df[keys].apply(lambda c: c.map(lambda v: (1, 0.0, "") if v is None or (isinstance(v, float) and math.isnan(v))
                                               else (0, float(v), "") if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                                               else (0, 0.0, str(v))))
    idx = sorted(range(len(df)), key=lambda i: tuple(order.iloc[i]))
    return df.iloc[idx].reset_index(drop=True)


def rename_short(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns={k: v for k, v in SHORT.items() if k in df.columns})


# config values that are long JSON lists (a calibrated decision table): markdown tables show a digest
LONG_JSON_KEYS = ("hardware.decision_table",)


def json_digest(v: object) -> object:
    """A JSON list as ``<n> rules #<sha1[:8]>`` (other values unchanged)."""
    if not isinstance(v, str) or not v.startswith("["):
        return v

    try:
        n = len(json.loads(v))
    except ValueError:
        return v
    return f"{n} rules #{hashlib.sha1(v.encode()).hexdigest()[:8]}"


def write_table(df: pd.DataFrame, name: str, out: Path, digits: dict[str, int] | None = None,
                title: str = "", note: str = "") -> pd.DataFrame:
    """Write ``out/tables/<name>.csv`` and ``.md`` with fixed formatting; return the text frame."""
    digits = digits or {}

    def integral(col: pd.Series) -> bool:  # config values that NaN elsewhere turned into floats
        v = [x for x in col if isinstance(x, (float, np.floating)) and np.isfinite(x)]
        return bool(v) and all(float(x).is_integer() for x in v)

    def shown(c: str) -> list[str]:
        col = df[c]
        as_int = c not in digits and integral(col)   # once per column, not per value
        return [fmt(int(v) if as_int and isinstance(v, (float, np.floating)) and np.isfinite(v) else v, digits.get(c, 2))
                for v in col]

    text = pd.DataFrame({c: shown(c) for c in df.columns}, columns=list(df.columns))
    tdir = Path(out) / "tables"
    tdir.mkdir(parents=True, exist_ok=True)
    text.to_csv(tdir / f"{name}.csv", index=False, lineterminator="\n")
    lines = [f"# {title or name}", ""]
    if note:
        lines += [note, ""]
    shown = text.copy()
    for c in shown.columns:
        if c in LONG_JSON_KEYS:  # the CSV keeps the whole JSON; the markdown a digest that still tells tables apart
            shown[c] = [json_digest(v) for v in shown[c]]
    lines.append("| " + " | ".join(shown.columns) + " |")
    lines.append("|" + "|".join("---" for _ in shown.columns) + "|")
    lines += ["| " + " | ".join(str(v).replace("|", "/") for v in r) + " |" for r in shown.itertuples(index=False)]
    if text.empty:
        lines.append(f"\n({NOT_MEASURED}: no cells of this kind under the results folder)")
    (tdir / f"{name}.md").write_text("\n".join(lines) + "\n")
    return text


def save_figure(fig, name: str, out: Path, data: pd.DataFrame | None = None) -> None:
    """Write ``out/figures/<name>.png`` and ``.pdf`` (no timestamps in the PDF) and close ``fig``;
    ``data``: the values drawn, written beside them as ``<name>.csv`` (fixed formatting)."""
    fdir = Path(out) / "figures"
    fdir.mkdir(parents=True, exist_ok=True)
    fig.savefig(fdir / f"{name}.png", dpi=130, bbox_inches="tight")
    fig.savefig(fdir / f"{name}.pdf", bbox_inches="tight", metadata={"CreationDate": None, "ModDate": None})
    plt.close(fig)
    if data is not None:
        text = pd.DataFrame({c: [fmt(v, 4) for v in data[c]] for c in data.columns}, columns=list(data.columns))
        text.to_csv(fdir / f"{name}.csv", index=False, lineterminator="\n")


def placeholder_figure(name: str, out: Path, why: str) -> None:
    """A figure that says plainly that its data was not measured (never an invented curve)."""
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.axis("off")
    ax.text(0.5, 0.5, f"{name}: {NOT_MEASURED}\n{why}", ha="center", va="center", wrap=True)
    save_figure(fig, name, out)


def norm_value(v):
    """Config values as the raw results and the plan both give them: numbers as float, NaN/None as None."""
    if v is None or (isinstance(v, (float, np.floating)) and math.isnan(v)):
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    return v
