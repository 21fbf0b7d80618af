"""Raw-result folders -> tidy pandas frames, schema-checked against granikv.rawio.

A cell is any folder under the results root holding ``config.json``, ``metrics.json`` or
``failure.json``. ``load_results(root)`` returns a :class:`Results` with

- ``cells``: one row per finished cell (``metrics.json`` present): ``sweep``, ``cell_id``,
  ``path``, ``kind``, the config flattened with dots (``workload.prefix_len``), provenance as
  ``provenance.<key>``, and every metric under its own name (``dispatch_counts.<backend>``);
- ``failures``: one row per failed (``failure.json``) or unfinished cell, with the error;
- ``kernels``: one row per line of every ``kernel.jsonl`` (kernel and calibration cells): the
  line's fields as ``k.<field>``, with the cell's flattened config beside them.

``load_steps(cell_path)`` reads one cell's dispatch trace (``steps.jsonl``, or ``.jsonl.gz``); ``read_rows(path,
skip=TOKEN_LISTS)`` reads a ``requests.jsonl`` without decoding its per-token lists. Anything that does not match
the schema raises :class:`granikv.rawio.SchemaError` naming the file and the field (a truncated or
otherwise unreadable JSON file too). A file in a cell folder that no runner writes (``KNOWN_FILES``) is
listed in one warning per load. ``superseded`` lists the cells a forced rerun moved aside, kept, to
``<sweep>/.superseded/<cell_id>.<UTC time>/`` (hidden folders are never read as cells).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.gpu import add_gpu
from analysis.integrity import check_duplicates, check_summary, request_digest
from granikv.rawio import (CELL_KINDS, PROVENANCE_KEYS, REQUIRED_FILES, SERVING_METRICS, SchemaError, applicable_table,
                           data_path, exists as rawio_exists, flatten, read_json, read_jsonl)

CELL_MARKERS = ("config.json", "metrics.json", "failure.json")
# what the runners write into a cell folder (a .jsonl also as .jsonl.gz); anything else is listed in a warning
KNOWN_FILES = re.compile(r"(config|metrics|failure|prefill_host|summary)\.json|"
                         r"(requests|steps|workload|kernel)\.jsonl(\.gz)?|nvml\.csv|trace\.json(\.gz)?|"
                         r"profile\.nsys-rep|server_[a-z_]+\.txt")
SUPERSEDED = ".superseded"   # runners.run: <sweep>/.superseded/<cell_id>.<UTC time>/, a cell a forced rerun replaced


@dataclass
class Results:
    """Everything under one results root, as tidy frames (see the module docstring)."""

    root: Path
    cells: pd.DataFrame
    failures: pd.DataFrame
    kernels: pd.DataFrame
    config_columns: list[str] = field(default_factory=list)  # flattened config keys (no provenance)
    kernel_columns: list[str] = field(default_factory=list)  # fields of kernel.jsonl rows
    # finished serving cells left out of the tables and claims (analysis.clean.prefer_clean), with why
    set_aside: pd.DataFrame = field(default_factory=pd.DataFrame)
    # finished cells a forced rerun replaced (kept under <sweep>/.superseded/): sweep, cell_id, path, rows as `cells`
    superseded: pd.DataFrame = field(default_factory=pd.DataFrame)
    # top-level folders of the root that no campaign item or bench names (load_results ``folders``): not read
    ignored: list[str] = field(default_factory=list)


def find_cells(root: str | Path, folders=None) -> list[Path]:
    """Every cell folder under ``root`` (sorted); hidden folders (temp files, .hydra) skipped; ``folders``
    (a set of names): only those top-level folders of ``root``."""
    root = Path(root)
    cells = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and (folders is None or Path(dirpath) != root or d in folders))
        if any(m in filenames for m in CELL_MARKERS):
            cells.append(Path(dirpath))
    return sorted(cells)


FIX = ("raw results are written only by runners.run / runners.kernel_bench: rerun the cell "
       "(force=true) or move the folder out of the results tree; never edit it by hand")


def _need(cond: bool, path: Path, fld: str, what: str) -> None:
    if not cond:
        raise SchemaError(f"{path}: field `{fld}` {what}. Fix: {FIX}")


def _read_dict(path: Path) -> dict:
    try:
        obj = read_json(path)
    except (SchemaError, UnicodeDecodeError) as e:   # truncated by a kill, or not text at all
        raise SchemaError(f"{path}: cannot be read as JSON ({e}). Fix: {FIX}") from e
    _need(isinstance(obj, dict), path, "<top level>", f"must be a JSON object, got {type(obj).__name__}")
    return obj


def _read_config(path: Path) -> dict:
    """config.json; runners.engine_bench nests the RunConfig under ``config`` (lifted to the top)."""
    cfg = _read_dict(path)
    if isinstance(cfg.get("config"), dict) and "model" not in cfg:
        cfg = {**cfg["config"], **{k: v for k, v in cfg.items() if k != "config"}}
        bench = cfg.get("bench")
        if isinstance(bench, dict) and isinstance(cfg.get("workload"), dict):
            # engine_bench cells written before its RunConfig carried the workload (2026-11-30) hold the
            # dataclass default there; what the bench served is its `bench` arguments (burst, one prefix).
            wl = {**cfg["workload"], "kind": "synthetic", "arrival": "burst", "num_prefixes": 1}
            wl.update({k: bench[k] for k in ("prefix_len", "batch", "suffix_len", "output_len") if k in bench})
            cfg = {**cfg, "workload": wl}
    return cfg


def cell_kind(cell: Path, config: dict) -> str:
    """``config['cell_kind']`` when given, else ``kernel`` for a folder with kernel.jsonl, else ``serving``."""
    kind = config.get("cell_kind")
    if kind is not None:
        _need(kind in CELL_KINDS, cell / "config.json", "cell_kind", f"is '{kind}', must be one of {CELL_KINDS}")
        return kind
    return "kernel" if rawio_exists(cell / "kernel.jsonl") else "serving"


def check_config(path: Path, config: dict) -> None:
    """config.json: a provenance object with every key of rawio.PROVENANCE_KEYS."""
    prov = config.get("provenance")
    _need(isinstance(prov, dict), path, "provenance",
          "is missing or not an object (write it with granikv.rawio.provenance())")
    for k in PROVENANCE_KEYS:
        _need(k in prov, path, f"provenance.{k}", "is missing (write it with granikv.rawio.provenance())")


def check_metrics(path: Path, kind: str, metrics: dict) -> None:
    """metrics.json of a serving cell: every rawio.SERVING_METRICS key, numbers (dispatch_counts: object)."""
    if kind != "serving":
        return
    for k in SERVING_METRICS:
        _need(k in metrics, path, k, "is missing (see granikv.rawio.SERVING_METRICS)")
        v = metrics[k]
        if k == "dispatch_counts":
            _need(isinstance(v, dict), path, k, f"must be an object backend -> steps, got {type(v).__name__}")
        else:
            _need(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), path, k,
                  f"must be a number or null, got {v!r}")


def _load_cell(root: Path, cell: Path) -> tuple[str, dict, list[dict], list[str], str | None]:
    """-> (state, row, kernel rows, flattened config keys, request digest). state: done | failed | partial.
    A finished serving cell's metrics.json is checked against its requests.jsonl (analysis.integrity)."""
    rel = cell.relative_to(root)
    base = {"sweep": str(rel.parent) if str(rel.parent) != "." else "", "cell_id": cell.name, "path": str(rel)}
    cfg_path = cell / "config.json"
    config = _read_config(cfg_path) if cfg_path.exists() else None
    if (cell / "metrics.json").exists():
        _need(config is not None, cfg_path, "<file>", "is missing beside metrics.json (a finished cell needs its config)")
        check_config(cfg_path, config)
        kind = cell_kind(cell, config)
        for f in REQUIRED_FILES[kind]:
            _need(rawio_exists(cell / f), cell / f, "<file>", f"is missing: a finished {kind} cell needs {REQUIRED_FILES[kind]}")
        metrics = _read_dict(cell / "metrics.json")
        check_metrics(cell / "metrics.json", kind, metrics)
        digest = None
        if kind == "serving":
            rows = read_rows(cell / "requests.jsonl", skip=TOKEN_LISTS)
            check_summary(cell, metrics, rows)
            digest = request_digest(rows)
        flat_cfg = flatten(applicable_table(config) if kind == "serving" else config)
        row = {**base, "kind": kind, **flat_cfg}
        for k, v in flatten(metrics).items():  # a metric named like a config key (engine stats: tp)
            if k not in row:
                row[k] = v
            elif row[k] != v:
                row[f"metrics.{k}"] = v
        krows = []
        if rawio_exists(cell / "kernel.jsonl"):
            kpath = cell / "kernel.jsonl"
            for i, r in enumerate(read_jsonl(kpath), 1):
                _need(isinstance(r, dict), kpath, f"line {i}", "must be a JSON object")
                krows.append({**base, "kind": kind, **flat_cfg, **{f"k.{k}": v for k, v in flatten(r).items()}})
            _need(len(krows) > 0, kpath, "<file>", "has no rows (a kernel cell must record its measurements)")
        return "done", row, krows, [k for k in flat_cfg if not k.startswith("provenance.")], digest
    if (cell / "failure.json").exists():
        fpath = cell / "failure.json"
        failure = _read_dict(fpath)
        _need("error" in failure, fpath, "error", "is missing (failure.json must say what went wrong)")
        cfg = config if config is not None else failure.get("config") or {}
        cfg = {k: v for k, v in cfg.items() if k != "provenance"} if isinstance(cfg, dict) else {}
        return "failed", {**base, "state": "failed", "error": str(failure["error"]), **flatten(cfg)}, [], [], None
    cfg = {k: v for k, v in (config or {}).items() if k != "provenance"}
    return "partial", {**base, "state": "partial",
                       "error": "unfinished: neither metrics.json nor failure.json (interrupted run?)",
                       **flatten(cfg)}, [], [], None


# config keys added after cells were committed, with the value those older cells ran with (the key's
# default, which kept the earlier behaviour): filled in so that old and new cells of one
# configuration group together instead of splitting on a missing value
ADDED_CONFIG_DEFAULTS = {"system.cascade_impl": "multilevel", "system.decode_plan": "flashinfer",
                         "system.dense_kernel": "flashinfer", "hardware.allreduce": "nccl",
                         "hardware.allreduce_symm_max_mib": 8.0, "hardware.cuda_graph_max_graphs": 0,
                         "hardware.cuda_graph_capture_at": 1, "system.engine": "granikv",
                         "system.hot_split": "static", "system.hot_min_fraction": 0.0,
                         "system.hot_max_fraction": 0.5, "system.cold_watermark": 0.05}
# the same for keys of a server cell's system.server block (cells that have one: system.server.launcher set)
ADDED_SERVER_DEFAULTS = {"system.server.radix_cache_backend": "", "system.server.send_prefix_len": False}


def unknown_files(cell: Path) -> list[str]:
    """Files of a cell folder that no runner writes (``KNOWN_FILES``), e.g. a killed write's temp file."""
    return sorted(p.name for p in cell.iterdir() if p.is_file() and not KNOWN_FILES.fullmatch(p.name))


def find_superseded(root: str | Path) -> list[Path]:
    """Every ``<sweep>/.superseded/<cell_id>.<UTC time>/`` folder under ``root`` (sorted)."""
    return sorted(p for p in Path(root).rglob(f"{SUPERSEDED}/*") if p.is_dir()) if Path(root).exists() else []


def _superseded_frame(root: Path) -> pd.DataFrame:
    """One row per finished superseded cell: ``sweep`` and ``cell_id`` of the cell it was (its config says),
    ``path`` where it is kept, then its config and metrics as in ``cells``. A kept cell that does not load
    (it was set aside for its malformed files) has no row."""
    rows = []
    for old in find_superseded(root):
        try:
            state, row, *_ = _load_cell(root, old)
        except SchemaError:          # kept aside because its own form was wrong (e.g. a fit cell without rows)
            continue
        if state == "done":
            cid = row.get("cell.cell_id") or old.name.rsplit(".", 1)[0]
            rows.append({**row, "sweep": str(old.relative_to(root).parent.parent), "cell_id": cid})
    return pd.DataFrame(rows)


def load_results(root: str | Path = "results/raw", folders=None) -> Results:
    """Load every cell under ``root`` (a missing root is an empty result, not an error). ``folders`` (a set of
    names, e.g. runners.campaign.named_folders()): only those top-level folders are read, the others are
    listed in ``Results.ignored``; None reads every folder. Two serving cells with the same request records
    raise SchemaError (analysis.integrity.check_duplicates)."""
    root = Path(root)
    done, failed, kernels = [], [], []
    config_cols: set[str] = set()
    serving_cols: set[str] = set()
    kernel_cols: set[str] = set()
    unknown: list[str] = []
    digests: dict[str, str] = {}
    ignored = sorted(str(root / d.name) for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                     and d.name not in folders) if folders is not None and root.exists() else []
    for cell in find_cells(root, folders) if root.exists() else []:
        unknown += [str(cell.relative_to(root) / f) for f in unknown_files(cell)]
        state, row, krows, keys, digest = _load_cell(root, cell)
        if digest is not None:
            digests[row["path"]] = digest
        (done if state == "done" else failed).append(row)
        kernels.extend(krows)
        config_cols.update(keys)
        if state == "done" and row.get("kind") == "serving":
            serving_cols.update(keys)
        kernel_cols.update(k for r in krows for k in r if k.startswith("k."))
    # a serving cell's metric named like another kind's config key (the engine's stats `device`, `dtype`,
    # kernel cells' config keys) is a metric there, not a configuration: kept as `metrics.<key>`, so that
    # cells of two engines (one reporting such a stat, one not) still pair on their configurations
    for row in done:
        if row.get("kind") == "serving":
            for k in [k for k in row if k in config_cols and k not in serving_cols]:
                row[f"metrics.{k}"] = row.pop(k)
    check_duplicates(digests)
    cells = pd.DataFrame(done)
    if not cells.empty:
        cells = add_gpu(cells)
        cells = cells.sort_values(["sweep", "cell_id"], kind="stable").reset_index(drop=True)
        for key, value in ADDED_CONFIG_DEFAULTS.items():   # cells written before the key existed ran its default
            if key in cells.columns:
                cells[key] = cells[key].astype(object).where(cells[key].notna(), value)
        served = cells["system.server.launcher"].notna() if "system.server.launcher" in cells.columns else None
        for key, value in ADDED_SERVER_DEFAULTS.items():
            if key in cells.columns and served is not None:
                cells[key] = cells[key].astype(object).where(cells[key].notna() | ~served, value)
    failures = pd.DataFrame(failed, columns=None if failed else ["sweep", "cell_id", "path", "state", "error"])
    if not failures.empty:
        failures = failures.sort_values(["sweep", "cell_id"], kind="stable").reset_index(drop=True)
    if unknown:
        warnings.warn(f"{len(unknown)} file(s) in cell folders under {root} that no runner writes, not read: "
                      + ", ".join(unknown[:10]) + (", ..." if len(unknown) > 10 else "")
                      + ". A `.<name>.*.tmp` is a killed write's leftover (rerunning the sweep command removes it); "
                      "move anything else out of the results tree", stacklevel=2)
    kframe = add_gpu(pd.DataFrame(kernels))
    return Results(root=root, cells=cells, failures=failures, kernels=kframe, config_columns=sorted(config_cols),
                   kernel_columns=sorted(kernel_cols), superseded=_superseded_frame(root), ignored=ignored)


def load_steps(cell_path: str | Path, explode: str | None = None) -> pd.DataFrame:
    """One cell's dispatch trace (steps.jsonl), one row per step.

    ``explode``: a column holding a list of per-class objects (e.g. ``classes``): one row per
    (step, class), the class's fields as ``<explode>.<field>`` columns.
    """
    path = Path(cell_path) / "steps.jsonl"
    if not rawio_exists(path):
        raise SchemaError(f"{path}: `<file>` is missing (a serving cell records its steps)")
    rows = read_jsonl(path)
    for i, r in enumerate(rows, 1):
        _need(isinstance(r, dict), path, f"line {i}", "must be a JSON object")
    df = pd.DataFrame(rows)
    if explode is not None and explode in df.columns:
        df = df.explode(explode, ignore_index=True)
        inner = pd.json_normalize(df[explode].map(lambda x: x if isinstance(x, dict) else {}).tolist())
        inner.columns = [f"{explode}.{c}" for c in inner.columns]
        df = pd.concat([df.drop(columns=[explode]), inner], axis=1)
    return df


# requests.jsonl keys holding one number per generated token (token ids, token times): nine tenths of the file
TOKEN_LISTS = ("output_ids", "token_times_s")
_NUMBERS = re.compile(r"[-+0-9.eE, ]*")


def _skip_list(line: str, key: str) -> str:
    """``line`` (one JSON object) with ``"<key>": [numbers]`` replaced by ``"<key>": null``; unchanged where
    the key is absent or its value is anything but a flat list of plain numbers."""
    head = f'"{key}": ['
    i = line.find(head)
    if i < 0:
        return line
    start = i + len(head)
    j = line.find("]", start)
    if j < 0 or not _NUMBERS.fullmatch(line, start, j):
        return line
    return f'{line[:i]}"{key}": null{line[j + 1:]}'


def read_rows(path: str | Path, skip: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a ``.jsonl`` file (or its ``.gz``), as ``granikv.rawio.read_jsonl`` reads them, except that each
    key in ``skip`` whose value is a flat list of numbers reads as None, undecoded: a table that needs a
    request's arrival and first-token times reads requests.jsonl several times faster without its per-token lists."""
    path = data_path(path)
    rows = []
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            short = line
            for key in skip:
                short = _skip_list(short, key)
            try:
                rows.append(json.loads(short))
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}:{i}: not valid JSON ({e})") from e
    return rows
