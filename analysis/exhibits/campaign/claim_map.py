"""Claim map: from each claim of results/paper/claims.csv to the experiment that measures it, the command
that runs it on a machine of your own, the GPUs of one host it needs, the GPU time and disk its cells took
here, and where its output lands.

An experiment is a campaign item (``conf/campaign.yaml``: a ``runners.run`` sweep with its overrides) or,
for what the campaign does not list, a bench folder of ``results/raw`` (``runners.kernel_bench``,
``runners.engine_bench``). A claim maps to every campaign item whose planned cells (``runners.campaign.expand``)
its selectors and its baseline's select, plain cells for a ``cells`` claim and profiled ones for a ``trace``
claim (an Amdahl claim needs both: the plain pair and the profiled SGLang-default cell); a ``steps`` claim
(the dispatcher's cost, the worst over every dispatching serving cell) maps to the sweep made for it,
``dispatch_overhead``. Measured cells or kernel rows of the claim in folders no item plans add their bench.

A claim has a row per GPU model it is evaluated on (analysis.verdict.evaluate: the primary GPU model's first,
column ``gpu``), each from that GPU model's cells alone (analysis.gpu.only_gpu): the primary GPU model's row
maps to the items that plan the claim's cells and the benches holding its cells; another GPU model's row to
the items and benches whose folders hold that GPU model's cells of the claim.

Time: the GPU time the experiment's finished cells recorded here (metrics ``warmup.duration_s`` +
``duration_s``: warm-up and measured run, summed over its cells; process start-up and model construction
are not recorded and come on top); a planned cell not measured yet counts the mean of the measured ones
(``time_note`` says how many). Disk: the bytes of its cells' folders under results/raw.

Writes tables/claim_map.{csv,md} (one row per claim and experiment), tables/experiments.{csv,md}
(one row per experiment, with the claims it feeds), tables/gpu_hours.{csv,md} (the campaign's recorded time
by GPU count, the README's line) and tables/rerun.{csv,md} (per claim, the command that reruns its deciding
cells alone: the experiment's command with its sweep axes narrowed to those cells' values; one heading per
claim in the markdown, so that a link can name the claim).
"""
from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.clean import all_cells
from analysis.common import norm_value, parse_selectors, select, with_derived, write_table
from analysis.gpu import GPU, only_gpu
from analysis.load import Results
from analysis.paper import deciding_folders, deciding_selections
from analysis.registry import register_exhibit
from analysis.verdict.context import Context
from analysis.verdict.evaluate import evaluate, load_claims
from runners.campaign import expand, load_campaign


NAME = "claim_map"
TABLES = (NAME, "experiments", "gpu_hours", "rerun")
FIGURES: tuple[str, ...] = ()
FRAME_SWEEPS = {"steps": ("dispatch_overhead",)}   # frame -> the sweep presets made for it


def planned_frame(items) -> pd.DataFrame:
    """One row per planned cell of ``items``: its flattened settings, ``item``, ``sweep`` (folder) and the
    derived columns of :func:`analysis.common.with_derived` (system, config, meff, instrumented)."""
    rows = []
    for it in items:
        for c in expand(it):
            rows.append({**c.settings, "item": it.id, "sweep": c.sweep_name, "kind": "serving", "_identity": c.identity,
                         "_overrides": c.overrides})
    return with_derived(pd.DataFrame(rows)) if rows else pd.DataFrame()


def _select_known(df: pd.DataFrame, sel: dict[str, str]) -> pd.DataFrame:
    """``select`` on the selectors whose keys ``df`` has (a planned cell has no metrics or kernel fields)."""
    return select(df, {k: v for k, v in sel.items() if k in df.columns})


def claim_items(claim: pd.Series, planned: pd.DataFrame) -> list[str]:
    """The campaign items that measure ``claim`` (see the module docstring), in campaign order."""
    if planned.empty or claim["frame"] == "kernels":
        return []
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    if claim["frame"] == "steps":
        pre = FRAME_SWEEPS["steps"]
        d = planned[planned["sweep"].str.startswith(pre)]
        d = _select_known(d, {k: v for k, v in sel.items() if k.startswith("system")})
    else:
        inst = "=True" if claim["frame"] == "trace" else "=False"
        d = pd.concat([_select_known(planned, {**sel, "instrumented": inst}),
                       _select_known(planned, {**sel, **base, "instrumented": inst})])
        if claim["statistic"] == "amdahl_overshoot":   # f comes from the profiled sglang_default cell
            prof = {k: v for k, v in sel.items() if not k.startswith("system")}
            d = pd.concat([d, _select_known(planned, {**prof, "system.name": "=sglang_default", "instrumented": "=True"})])
    order = list(dict.fromkeys(planned["item"]))
    got = set(d["item"])
    return [i for i in order if i in got]


def on_gpu(planned: pd.DataFrame, gpu: str) -> pd.DataFrame:
    """The planned cells that run on ``gpu``: their preset names that GPU model, or none (any GPU)."""
    if planned.empty or "hardware.gpu_name" not in planned.columns:
        return planned
    name = planned["hardware.gpu_name"].fillna("").astype(str)
    return planned[(name == gpu) | (name == "")]


def claim_folders(claim: pd.Series, ctx, steps: bool = False) -> list[str]:
    """Folders of results/raw whose cells (or kernel rows) the claim reads in ``ctx`` (a verdict Context); a
    claim over decode-step rows names none (its sweeps are FRAME_SWEEPS') unless ``steps``: then the folders
    whose cells served its systems."""
    frame = "cells" if claim["statistic"] == "amdahl_overshoot" else claim["frame"]
    if frame == "steps":
        if not steps:
            return []
        df = ctx.frame("steps")
        if df.empty or "sweep" not in df.columns:
            return []
        sel = {k: v for k, v in parse_selectors(claim["selectors"]).items() if k.startswith("system")}
        return sorted(set(_select_known(df, sel)["sweep"].dropna().astype(str)))
    df = ctx.frame(frame)
    if df.empty or "sweep" not in df.columns:
        return []
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    d = pd.concat([select(df, sel), select(df, {**sel, **base})])
    return sorted(set(d["sweep"].dropna()))


def claim_experiments(claim: pd.Series, ctx, planned: pd.DataFrame) -> list[str]:
    """The experiments of one claim's row (``claim``: a row of analysis.verdict.evaluate, ``ctx``: its GPU
    model's Context): on the primary GPU model, the campaign items that plan its cells (:func:`claim_items`);
    on another, the items whose folders hold its cells there; then, on either, the bench folders outside the
    campaign that hold them."""
    planned_sweeps = set(planned["sweep"]) if not planned.empty else set()
    planned = on_gpu(planned, claim[GPU])     # an item of another GPU model's preset never measures this row
    if claim["primary"]:
        folders = claim_folders(claim, ctx)
        items = claim_items(claim, planned)
    else:
        folders = claim_folders(claim, ctx, steps=True)
        held = set(planned.loc[planned["sweep"].isin(folders), "item"]) if not planned.empty else set()
        items = [i for i in dict.fromkeys(planned["item"]) if i in held] if held else []
    return items + [f for f in folders if f not in planned_sweeps]


class _Finished:
    """The finished cells, per sweep folder, with their identity values normalised once: planned cells of
    an item are matched against them by config values, as analysis.coverage does."""

    def __init__(self, cells: pd.DataFrame, keys: list[str]):
        self.by_sweep = {}
        for sweep, g in (cells.groupby("sweep", sort=False) if not cells.empty else []):
            cols = {k: [norm_value(x) for x in g[k]] if k in g.columns else [None] * len(g) for k in keys}
            self.by_sweep[sweep] = (g.reset_index(drop=True), cols)

    def matching(self, sweep: str, identity: dict) -> pd.DataFrame:
        if sweep not in self.by_sweep:
            return pd.DataFrame()
        g, cols = self.by_sweep[sweep]
        keep = np.ones(len(g), dtype=bool)
        for k, v in identity.items():
            want = norm_value(v)
            keep &= np.fromiter((x == want for x in cols[k]), dtype=bool, count=len(g))
        return g[keep]


def _cell_seconds(c: pd.DataFrame) -> pd.Series:
    """GPU time a finished cell recorded: warm-up + measured run (NaN where it recorded neither)."""
    w = pd.to_numeric(c["warmup.duration_s"], errors="coerce") if "warmup.duration_s" in c.columns else 0.0
    d = pd.to_numeric(c["duration_s"], errors="coerce") if "duration_s" in c.columns else np.nan
    return pd.Series(np.asarray(d, dtype=float) + np.nan_to_num(np.asarray(w, dtype=float) if not np.isscalar(w) else w),
                     index=c.index)


def _bytes(root: Path, paths) -> int:
    total = 0
    for p in sorted(set(paths)):
        d = Path(root) / p
        if d.is_dir():
            total += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    return total


def item_rows(res: Results, items, planned: pd.DataFrame) -> list[dict]:
    """One row per campaign item: command, GPUs, planned / measured cells, GPU time, disk, raw folder."""
    cells = all_cells(res)
    ident_keys = sorted({k for d in planned["_identity"] for k in d}) if not planned.empty else []
    narrow = cells[[c for c in ["sweep", "path", "duration_s", "warmup.duration_s", *ident_keys] if c in cells.columns]] \
        if not cells.empty else cells
    finished = _Finished(narrow, ident_keys)
    rows = []
    for it in items:
        mine = planned[planned["item"] == it.id] if not planned.empty else planned
        secs, paths, measured = [], [], 0
        for _, p in mine.iterrows():
            m = finished.matching(p["sweep"], p["_identity"])
            if not m.empty:
                measured += 1
                secs.append(float(_cell_seconds(m).mean()))
                paths += list(m["path"])
        planned_n = len(mine)
        known = [s for s in secs if np.isfinite(s)]
        total = sum(known) + (planned_n - measured) * (np.mean(known) if known else np.nan)
        note = ("measured" if measured == planned_n else
                f"{measured} of {planned_n} cells measured; the others counted at their mean" if measured else
                "not measured yet")
        rows.append({"experiment": it.id, "what": it.what, "gpus": it.gpus, "command": it.local_command(),
                     "cells": planned_n, "measured": measured,
                     "gpu_time_min": total / 60 if known else np.nan, "time_note": note,
                     "disk_mb": _bytes(res.root, paths) / 1e6 if paths else np.nan,
                     "raw": ", ".join(f"results/raw/{s}/" for s in sorted(set(mine["sweep"])))})
    return rows


def bench_row(res: Results, ctx, sweep: str) -> dict:
    """An experiment outside the campaign: one results/raw folder of a bench, with the command its
    cells' config gives."""
    cells = all_cells(res)
    c = cells[cells["sweep"] == sweep] if not cells.empty else cells
    k = res.kernels[res.kernels["sweep"] == sweep] if not res.kernels.empty and "sweep" in res.kernels.columns \
        else pd.DataFrame()
    cmd, gpus, what = "", 1, "bench"
    if not c.empty and "bench.model" in c.columns and c["bench.model"].notna().any():
        b = c[c["bench.model"].notna()].iloc[0]
        tp = int(b.get("bench.tp") or 1)
        launch = f"torchrun --standalone --nproc_per_node={tp} -m runners.engine_bench" if tp > 1 \
            else "python -m runners.engine_bench"
        args = [("--model", "bench.model"), ("--hardware", "bench.hardware"), ("--prefix-len", "bench.prefix_len"),
                ("--batch", "bench.batch"), ("--output-len", "bench.output_len"), ("--out", "bench.out")]
        cmd = launch + "".join(f" {flag} {shlex.quote(str(_int(b[col])))}" for flag, col in args
                               if col in b.index and norm_value(b[col]) is not None)
        gpus, what = tp, "end-to-end engine bench (runners.engine_bench), one burst per system"
        secs = _cell_seconds(c)
        t = float(secs.sum()) / 60 if secs.notna().any() else np.nan
        paths = list(c["path"])
    else:
        kk = k if not k.empty else pd.DataFrame()
        hw = kk["hardware.name"].dropna().iloc[0] if "hardware.name" in kk.columns and kk["hardware.name"].notna().any() \
            else "h200"
        kind = kk["kind"].dropna().iloc[0] if "kind" in kk.columns and kk["kind"].notna().any() else "kernel"
        runner = "runners.calibrate" if kind == "calibration" else "runners.kernel_bench"
        cmd = f"python -m {runner} hardware={hw}" + (f" sweep_name={sweep}" if sweep not in ("kernel", "calibration") else "")
        what = ("dispatcher calibration (runners.calibrate)" if kind == "calibration"
                else "attention-layer microbenchmark (runners.kernel_bench)")
        t = np.nan
        paths = list(kk["path"].dropna().unique()) if "path" in kk.columns else []
    return {"experiment": sweep, "what": what, "gpus": gpus, "command": cmd,
            "cells": len(set(paths)), "measured": len(set(paths)), "gpu_time_min": t,
            "time_note": "measured" if np.isfinite(t) else "not recorded by this bench",
            "disk_mb": _bytes(res.root, paths) / 1e6 if paths else np.nan, "raw": f"results/raw/{sweep}/"}


def merged_overrides(cells: pd.DataFrame) -> list[str] | None:
    """The planned ``cells``' overrides as one multirun: each key with the values its cells take, in plan
    order (their product may hold more cells than ``cells``); None where a list value would have to be
    joined (the experiment's own command then)."""
    values: dict[str, list[str]] = {}
    for ov in cells["_overrides"]:
        for o in ov:
            k, v = o.split("=", 1)
            if k != "sweep" and v not in values.setdefault(k, []):
                values[k].append(v)
    if any(len(v) > 1 and any(ch in x for x in v for ch in ",[]") for v in values.values()):
        return None
    return [f"{k}={','.join(sorted(v, key=int) if all(x.isdigit() for x in v) else v)}" for k, v in values.items()]


def rerun_rows(res: Results, ev: pd.DataFrame, items, planned: pd.DataFrame, contexts: dict, exp: dict,
               names: dict[tuple[str, str], list[str]]) -> list[dict]:
    """Per claim row (``ev``: analysis.verdict.evaluate's, one per claim and GPU model; ``contexts``: GPU model ->
    its Context; ``names``: (claim, GPU model) -> its experiments) and experiment that holds its deciding cells:
    the command that reruns those cells alone."""
    by_id = {it.id: it for it in items}
    cells = all_cells(res)
    keys = sorted({k for d in planned["_identity"] for k in d}) if not planned.empty else []
    finished = _Finished(cells[[c for c in ["sweep", "path", *keys] if c in cells.columns]] if not cells.empty
                         else cells, keys)
    rows = []
    for _, c in ev.iterrows():
        frame = contexts[c[GPU]].frame(c["frame"])
        folders = deciding_folders(frame, c)
        used = set(pd.concat([select(frame, s) for s in deciding_selections(c)]).get("path", [])) \
            if not frame.empty else set()
        inst = "=True" if c["frame"] == "trace" else "=False"
        mine = names.get((c["id"], c[GPU]), [])
        sweeps_of = {n: sorted(set(planned.loc[planned["item"] == n, "sweep"])) if n in by_id else [n] for n in mine}
        holding = [n for n in mine if set(sweeps_of[n]) & set(folders)]
        narrowed, whole = [], []        # rows of the deciding cells alone; of a whole experiment where none plans them
        head = {"claim": c["id"], GPU: c[GPU], "verdict": c["verdict"]}
        for n in holding or mine:        # the experiments holding the deciding cells, else every one of the claim
            row = {**head, "experiment": n, "gpus": exp[n]["gpus"],
                   "cells": int(exp[n]["cells"]), "deciding": c["decider"] or "every cell of the claim's selection",
                   "raw": ", ".join(f"results/raw/{f}/" for f in folders if f in sweeps_of[n]) or exp[n]["raw"],
                   "command": exp[n]["command"]}
            if n not in by_id:
                narrowed.append(row)
                continue
            plan = planned[planned["item"] == n]
            near = pd.concat([_select_known(plan, {**s, "instrumented": inst}) for s in deciding_selections(c)])
            keep = [any(p in used for p in finished.matching(r["sweep"], r["_identity"]).get("path", []))
                    for _, r in near.iterrows()]
            near = near[keep] if any(keep) else near
            if near.empty:
                whole.append(row)
                continue
            ov = merged_overrides(near)
            narrowed.append({**row, "cells": len(near),
                             "command": by_id[n].local_command(ov) if ov is not None else row["command"]})
        rows += narrowed or whole or [{**head, "experiment": "none", "gpus": 0, "cells": 0,
                                       "deciding": c["decider"] or "-", "raw": "", "command": ""}]
    return rows


def write_rerun(rr: pd.DataFrame, out: Path) -> None:
    """tables/rerun.csv, and tables/rerun.md with one heading per claim (a link can name the claim)."""
    write_table(rr, "rerun", out)
    L = ["# Rerun one claim", "",
         "Per claim, the command that reruns its deciding cells alone, on GPUs of one host (`pip install -e "
         "'.[gpu]'`); then `python -m analysis.reproduce` re-reads them. A sweep skips cells whose folder holds "
         "`metrics.json`: add `force=true` to measure again over committed ones. deciding: the configuration(s) the "
         "verdict turns on (with its baseline); cells: the planned cells the command runs. A claim has a line per "
         "GPU model it was measured on, the primary GPU model's first, each from that GPU model's cells.", ""]
    for cid, g in rr.groupby("claim", sort=False):
        L += [f"## {cid}", ""]
        for gpu, h in g.groupby(GPU, sort=False):      # the primary GPU model's row first
            L += [f"{gpu}: **{h['verdict'].iloc[0]}**; deciding: {h['deciding'].iloc[0]}.", ""]
            if (h["experiment"] == "none").all():
                L += ["No experiment of the campaign or bench folder measures it.", ""]
            for _, r in h[h["experiment"] != "none"].iterrows():
                L += [f"- `{r['experiment']}` ({r['gpus']} GPU{'s' if int(r['gpus']) > 1 else ''}, {r['cells']} "
                      f"cell{'s' if int(r['cells']) != 1 else ''}, into {r['raw']}):", "", "  ```", f"  {r['command']}",
                      "  ```", ""]
    (Path(out) / "tables" / "rerun.md").write_text("\n".join(L))


def gpu_hours(ex: pd.DataFrame) -> pd.DataFrame:
    """The campaign's recorded time by GPU count: hours of a host with that many GPUs, and GPU-hours."""
    t = ex.assign(h=pd.to_numeric(ex["gpu_time_min"], errors="coerce") / 60)
    g = t.groupby("gpus", sort=True).agg(experiments=("experiment", "size"), unrecorded=("h", lambda x: int(x.isna().sum())),
                                         hours=("h", "sum"))
    g = g.reset_index()
    return g.assign(gpu_hours=g["hours"] * g["gpus"])[["gpus", "experiments", "unrecorded", "hours", "gpu_hours"]]


def gpu_hours_line(g: pd.DataFrame) -> str:
    """The README's line: ``GPU-hours by GPU count: 1 GPU: x h, 2 GPUs: y h, 4 GPUs: z h; in all: t h``; the total
    is the sum of the parts as shown (0.1 h), so the line adds up and reads the same from the rounded CSV."""
    shown = [round(float(v), 1) for v in g["gpu_hours"]]
    return "GPU-hours by GPU count: " + ", ".join(
        f"{int(r['gpus'])} GPU{'s' if int(r['gpus']) > 1 else ''}: {h:.1f} h" for h, (_, r) in zip(shown, g.iterrows())) \
        + f"; in all: {sum(shown):.1f} h"


def _int(v):
    return int(v) if isinstance(v, (float, np.floating)) and float(v).is_integer() else v


def tables(res: Results, ev: pd.DataFrame | None = None, claims: pd.DataFrame | None = None,
           campaign=None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(claim_map: one row per claim, GPU model and experiment, experiments: one row per experiment, rerun: per
    claim and GPU model, the command of its deciding cells, :func:`rerun_rows`). ``ev``: the claims' evaluation
    (:func:`analysis.verdict.evaluate.evaluate`: a row per claim and GPU model) when the caller has it already."""
    claims = load_claims() if claims is None else claims
    items = load_campaign() if campaign is None else campaign
    planned = planned_frame(items)
    ev = evaluate(res, claims) if ev is None else ev
    order = {cid: i for i, cid in enumerate(claims["id"])}     # per claim, its GPU models' rows in evaluate's order
    ev = ev[ev["id"].isin(order)].sort_values("id", key=lambda v: v.map(order), kind="stable")
    contexts = {g: Context(only_gpu(res, g)) for g in dict.fromkeys(ev[GPU])}
    exp = {r["experiment"]: r for r in item_rows(res, items, planned)}
    feeds: dict[str, list[str]] = {}
    names: dict[tuple[str, str], list[str]] = {}
    rows = []
    for _, c in ev.iterrows():
        ctx = contexts[c[GPU]]
        mine = names[(c["id"], c[GPU])] = claim_experiments(c, ctx, planned)
        for n in mine:
            if n not in exp:
                exp[n] = bench_row(res, ctx, n)
            if c["id"] not in feeds.setdefault(n, []):
                feeds[n].append(c["id"])
        for n in mine or [""]:
            e = exp.get(n, {})
            rows.append({"claim": c["id"], GPU: c[GPU], "verdict": c["verdict"], "experiment": n or "none",
                         "command": e.get("command", ""), "gpus": e.get("gpus", np.nan),
                         "gpu_time_min": e.get("gpu_time_min", np.nan), "time_note": e.get("time_note", ""),
                         "raw": e.get("raw", ""), "read_from": c["source"]})
    cm = pd.DataFrame(rows, columns=["claim", GPU, "verdict", "experiment", "command", "gpus", "gpu_time_min",
                                     "time_note", "raw", "read_from"])
    ex = pd.DataFrame([{**r, "claims": ", ".join(feeds.get(r["experiment"], []))} for r in exp.values()],
                      columns=["experiment", "what", "gpus", "cells", "measured", "gpu_time_min", "time_note", "disk_mb",
                               "command", "raw", "claims"])
    rr = pd.DataFrame(rerun_rows(res, ev, items, planned, contexts, exp, names),
                      columns=["claim", GPU, "verdict", "experiment", "gpus", "cells", "deciding", "raw", "command"])
    return cm, ex, rr


@register_exhibit(NAME, figures=FIGURES, tables=TABLES, kind="claims")
def build(res: Results, out: Path, figures: bool = True, ev: pd.DataFrame | None = None) -> pd.DataFrame:
    """Write tables/claim_map, tables/experiments, tables/gpu_hours and tables/rerun; return the claim map."""
    cm, ex, rr = tables(res, ev)
    digits = {"gpu_time_min": 1, "disk_mb": 1}
    write_table(cm, NAME, out, digits, title="Claim map: claim -> experiment -> command -> GPUs -> time -> output",
                note="One row per claim, GPU model and experiment that measures it (tables/experiments.md: the same per "
                     "experiment); gpu: the GPU model the claim's row is measured on (the primary GPU model's first). "
                     "command: runs the experiment on a machine of your own, resumable (finished cells are skipped; "
                     "on our GPU host the campaign ran through runners/gpu/sweep.sh, tables/coverage.md). gpus: GPUs of "
                     "one host. gpu_time_min: GPU minutes the experiment's cells recorded on our H200s (warm-up + "
                     "measured run; process start-up comes on top). raw: where its cells land; read_from: the "
                     "tables and figures `make reproduce` reads the claim into.")
    write_table(ex, "experiments", out, digits, title="Experiments: what each measures, GPUs, time, disk, command",
                note="Campaign items (conf/campaign.yaml) first, then the benches outside it. cells / measured: planned "
                     "cells and those with a finished cell in results/raw. gpu_time_min: recorded warm-up + measured "
                     "run, summed (cells not measured yet counted at the mean of the others); disk_mb: the size of "
                     "its cells' folders. claims: the claims of results/paper/claims.csv it feeds.")
    g = gpu_hours(ex)
    write_table(g, "gpu_hours", out, {"hours": 1, "gpu_hours": 1}, title="The campaign's GPU time by GPU count",
                note=f"{gpu_hours_line(g)}. hours: recorded warm-up + measured run of every experiment on a host with "
                     "that many GPUs (tables/experiments.md; process start-up comes on top); gpu_hours: hours x GPUs; "
                     "unrecorded: experiments whose bench records no time (counted as 0).")
    write_rerun(rr, out)
    return cm
