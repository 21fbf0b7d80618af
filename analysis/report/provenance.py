"""The REPORT's provenance: hardware, host sharing, graph capture, KV budgets, real SGLang, code versions."""
from __future__ import annotations
import json

import numpy as np
import pandas as pd

from analysis.clean import all_cells
from analysis.common import NULL, fmt, identity, select, with_derived
from analysis.load import Results
from analysis.measures.sglang import BASE, SYSTEMS



def hardware_summary(res: Results) -> list[str]:
    """``<gpu> x<count>: <n> cells`` per distinct provenance, from the finished cells and kernel rows."""
    frames = [f for f in (all_cells(res), res.kernels.drop_duplicates("path") if not res.kernels.empty else res.kernels)
              if not f.empty and "provenance.gpu_name" in f.columns]
    if not frames:
        return []
    d = pd.concat([f[["path", "provenance.gpu_name", "provenance.gpu_count"]] for f in frames]).drop_duplicates("path")
    d = d.fillna({"provenance.gpu_name": "no GPU (CPU)"})
    conc = res.cells.set_index("path")["provenance.concurrent_sweeps"] \
        if "provenance.concurrent_sweeps" in res.cells.columns else pd.Series(dtype=float)
    out = []
    for (g, n), grp in d.groupby(["provenance.gpu_name", "provenance.gpu_count"], dropna=False, sort=True):
        shared = pd.to_numeric(conc.reindex(grp["path"]), errors="coerce")
        k = int((shared > 1).sum())
        note = (f" ({k} of them while another sweep ran on the host's other GPU; provenance "
                "concurrent_sweeps)") if k else ""
        out.append(f"{g}{f' x{fmt(n)}' if n and n == n else ''}: {len(grp)} cells{note}")
    return out


def concurrency_check(res: Results, metric: str = "output_throughput_tok_s", step_metric: str = "tpot_p50_ms") -> str:
    """Configurations measured both alone and while another sweep shared the host
    (provenance.concurrent_sweeps > 1): the ratio of their mean ``metric``, shared / alone, so a
    bias from sharing the host is visible before the repetitions are pooled; and the same ratio of
    ``step_metric`` (the median per-token step), which tells GPU-side from host-side slowdowns.
    Plain cells only: a profiled (instrumented) run is slower by design and is no twin of a plain one."""
    c = res.cells
    col = "provenance.concurrent_sweeps"
    if c.empty or col not in c.columns or metric not in c.columns:
        return ""
    step = step_metric if step_metric in c.columns else None
    c = c[c["kind"] == "serving"] if "kind" in c.columns else c
    c = c[~with_derived(c)["instrumented"].to_numpy(dtype=bool)] if not c.empty else c
    shared = pd.to_numeric(c[col], errors="coerce").fillna(1) > 1
    if not shared.any():
        return ""
    keys = identity(c, res.config_columns)
    vals = [metric] + ([step] if step else [])
    d = pd.concat([c[keys].astype(object).where(c[keys].notna(), NULL), c[vals],
                   pd.Series(shared.to_numpy(), index=c.index, name="shared")], axis=1)   # one concat: no fragmented inserts

    def by_sharing(col: str) -> pd.DataFrame:
        t = d.groupby(keys + ["shared"], dropna=False)[col].mean().unstack("shared")
        return t.dropna(subset=[False, True]) if {False, True} <= set(t.columns) else t.iloc[0:0]
    m = by_sharing(metric)
    n_shared = int(shared.sum())
    if m.empty:
        return (f"{n_shared} cells ran while another sweep shared the host; no configuration was also measured "
                "alone, so the effect of sharing is not measured.")
    r = (m[True] / m[False]).to_numpy()
    hosts = ""
    if "provenance.gpu_count" in c.columns or "provenance.cpu_model" in c.columns:
        alone_cpu = c.loc[~shared.to_numpy(), "provenance.cpu_model"] if "provenance.cpu_model" in c.columns else None
        if alone_cpu is not None and alone_cpu.isna().any():
            hosts = (" Some alone cells predate the recorded CPU model (provenance.cpu_model), so a different host "
                     "may account for part of the difference.")
    st = ""
    if step:
        ms = by_sharing(step)
        if not ms.empty:
            q = (ms[True] / ms[False]).to_numpy()
            st = (f"; {step} (the median per-token step) shared / alone: median {np.median(q):.3f} "
                  f"(range {q.min():.3f}-{q.max():.3f})")
    return (f"Host sharing: {len(r)} configurations were measured both alone and while another sweep ran on the "
            f"host's other GPU; {metric} shared / alone: median {np.median(r):.3f} (range {r.min():.3f}-{r.max():.3f})"
            f"{st}.{hosts}")


def capture_check(res: Results, limit: float = 0.01) -> str:
    """CUDA-graph capture time that fell inside measured runs (a graph first needed after the warm-up),
    as a share of the run, by system. SGLang captures every graph before serving, so this time
    is ours alone; it is reported wherever it reaches ``limit`` of a run."""
    c = all_cells(res)
    need = {"cuda_graph_capture_s", "duration_s", "system.name"}
    if c.empty or not need <= set(c.columns):
        return ""
    c = c[(c["kind"] == "serving") if "kind" in c.columns else slice(None)]
    share = (pd.to_numeric(c["cuda_graph_capture_s"], errors="coerce")
             / pd.to_numeric(c["duration_s"], errors="coerce")).rename("share")
    commit = c["provenance.git_commit"].astype(str).str[:7] if "provenance.git_commit" in c.columns else \
        pd.Series("?", index=c.index)
    d = pd.concat([c["system.name"], share, commit.rename("commit")], axis=1).dropna()
    if d.empty or d["share"].max() < limit:
        return ""
    g = d.groupby("system.name")["share"].agg(["mean", "max", "size"])
    parts = [f"{name} mean {r['mean']:.1%}, max {r['max']:.1%} ({int(r['size'])} cells)" for name, r in g.iterrows()]
    bc = d.groupby("commit")["share"].agg(["max", "size"]).sort_values("max")
    by_commit = "; ".join(f"{k}: max {r['max']:.1%} ({int(r['size'])} cells)" for k, r in bc.iterrows())
    return ("CUDA-graph capture inside measured runs (graphs first needed after the warm-up; SGLang captures "
            "all before serving), share of run time: " + "; ".join(parts) + f". By code version: {by_commit}. "
            "It lengthens the runs of the systems that split prefix classes more than SGLang default's. The "
            "graph key held the batch's suffix-token count (power-of-two buckets) before 7094569, which sized the "
            "index buffer to the KV pool instead: too small for paged rows, which count the shared prefix once per "
            "row (a100_40gb budget at Lp=8K, B=256: a new key every step). Since 2d616dd one shared buffer holds "
            "(largest graph batch) x (longest possible row), as SGLang's max_bs x context length, and a burst "
            "needs no key after its warm-up (tests/test_engine_flashinfer_paths.py).")


def budget_check(res: Results, spread: float = 0.005, full: float = 0.95) -> str:
    """Sweeps whose cells got unequal KV budgets (metrics kv_budget_tokens; before 14dcf52 a cell could
    inherit memory an earlier cell of the same process left cached), and whether the budget could have
    mattered: a cell's pool is binding when its COLD peak reaches ``full`` of the COLD capacity or it
    evicted. Empty when every sweep's budgets agree within ``spread``."""
    c = res.cells
    need = {"kv_budget_tokens", "cold_peak_tokens", "cold_capacity_tokens", "evicted_tokens", "sweep"}
    if c.empty or not need <= set(c.columns):
        return ""
    c = c[c["kind"] == "serving"] if "kind" in c.columns else c
    keys = [k for k in ("sweep", "model.name", "tp", "hardware.name") if k in c.columns]
    parts, binding = [], []
    for key, g in c.groupby(keys, dropna=False, sort=True):
        b = pd.to_numeric(g["kv_budget_tokens"], errors="coerce").dropna()
        if b.empty or b.max() / b.min() - 1 <= spread:
            continue
        use = pd.to_numeric(g["cold_peak_tokens"], errors="coerce") / pd.to_numeric(g["cold_capacity_tokens"],
                                                                                  errors="coerce")
        ev = pd.to_numeric(g["evicted_tokens"], errors="coerce").fillna(0)
        bind = g[(use >= full) | (ev > 0)]
        parts.append(f"{key[0]}: {b.min() / 1e3:.0f}K-{b.max() / 1e3:.0f}K tokens over {len(g)} cells, COLD peak "
                     f"<= {use.max():.0%} of capacity")
        binding += [f"{key[0]}/{r['cell_id']}" for _, r in bind.iterrows()]
    if not parts:
        return ""
    verdict = ("In none of their cells did the pool fill (COLD peak below "
               f"{full:.0%} of its capacity, nothing evicted), so the unequal budgets did not limit admissions."
               if not binding else f"Cells whose pool filled or evicted (their budget mattered): {', '.join(binding)}.")
    return ("KV budgets unequal within a sweep (metrics kv_budget_tokens; cells run one after another in one "
            "process, fixed at 14dcf52 up to the guard's 2 GiB tolerance): " + "; ".join(parts) + ". " + verdict)


def code_versions(res: Results) -> list[str]:
    """One line per sweep folder: the git commits (and dirty flags) its finished cells were measured at.
    A sweep measured at more than one commit is flagged: its rows mix code versions."""
    frames = [f for f in (all_cells(res), res.kernels.drop_duplicates("path") if not res.kernels.empty else res.kernels)
              if not f.empty and "provenance.git_commit" in f.columns]
    if not frames:
        return []
    cols = ["path", "sweep", "provenance.git_commit", "provenance.git_dirty"]
    d = pd.concat([f[[c for c in cols if c in f.columns]] for f in frames]).drop_duplicates("path")
    if "provenance.git_dirty" not in d.columns:
        d["provenance.git_dirty"] = None
    out = []
    for sweep, g in d.groupby("sweep", sort=True):
        vers = []
        for (c, dirty), h in g.groupby(["provenance.git_commit", "provenance.git_dirty"], dropna=False, sort=True):
            tag = str(c)[:7] + (" (dirty)" if dirty is True or str(dirty).lower() == "true" else "")
            vers.append(f"{tag}: {len(h)}")
        flag = " **(mixed code versions)**" if g["provenance.git_commit"].nunique(dropna=False) > 1 else ""
        out.append(f"| {sweep or '(root)'} | {len(g)} | {'; '.join(vers)}{flag} |")
    return out


def provenance_line(res: Results) -> str:
    """The REPORT's provenance of the cells served by real SGLang (``sglang_server`` and the plugin's
    ``sglang_server_*`` systems): versions, the server's flags, code version."""
    c = select(with_derived(res.cells), {"system": f"~{SYSTEMS[BASE][0]}"}) if not res.cells.empty else res.cells
    if c.empty:
        return ""
    per = ", ".join(f"{s} {n}" for s, n in sorted(c["system"].value_counts().items()))

    def vals(col: str) -> str:
        return ", ".join(sorted({str(v) for v in c[col].dropna()})) if col in c.columns else "?"

    pk = [k for k in c.columns if k.startswith("provenance.engine.packages.")]
    pkgs = "; ".join(f"{k.rsplit('.', 1)[-1]} {vals(k)}" for k in sorted(pk))
    dirty = sorted({f for v in c.get("provenance.git_dirty_files", pd.Series(dtype=object)).dropna()
                    for f in (json.loads(v) if isinstance(v, str) and v.startswith("[") else
                              v if isinstance(v, list) else [v])})
    return (f"Real SGLang cells (`sglang_server`, and the plugin's systems inside it): {len(c)} ({per}), "
            f"SGLang {vals('provenance.sglang')} on "
            f"{vals('provenance.gpu_name')} (its python's packages: {pkgs or '?'}); the server's command line and "
            f"resolved `/server_info` are in each cell's config.json (`provenance.engine`). Code: "
            f"{vals('provenance.git_commit')}, with uncommitted changes only in {', '.join(dirty) or 'no file'} "
            "(`provenance.git_dirty_files`).")


def ignored_line(res: Results) -> str:
    """One REPORT line: the folders of the results root that conf/campaign.yaml does not name, not read."""
    if not res.ignored:
        return ""
    return (f"Folders ignored ({len(res.ignored)}): conf/campaign.yaml names neither an item's sweep folder nor a "
            "bench (`benches`) for them, so no table or claim reads their cells: "
            + ", ".join(f"`{p}`" for p in res.ignored) + ". Name the folder in conf/campaign.yaml to read it.")
