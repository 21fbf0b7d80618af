"""results/REPORT.md, for an evaluator: the claims table first (paper, ours, unit, n = repetitions, the
interval the run-to-run noise leaves our number, verdict), the verdict rule (analysis.claims.VERDICT_RULE),
the close calls, then one section per claim with its own numbers and the explanations measured for it
(step traces, kernel times, KV budgets: never a paragraph written for another claim), the campaign
coverage, and provenance (hardware, host sharing, graph capture, set-aside repetitions, KV budgets, code
versions) at the end. Also tables/claims.{csv,md}."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import engine_fidelity, headline_steps, in_sglang
from analysis.headline_steps import claim_steps_line
from analysis.amdahl import amdahl, amdahl_frame
from analysis.bounds import bound_line, calibration_line, kernel_pair_line
from analysis.clean import all_cells, set_aside_line
from analysis.claims import (CLOSE, EXCEEDED, INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, VERDICT_RULE, VERDICTS,
                             evaluate, paper_shown)
from analysis.common import (NOT_MEASURED, NULL, PAPER_HARDWARE, config_label, fmt, identity, parse_selectors, select,
                             show, with_derived, write_table)
from analysis.kernel import LAYOUT_BASE, LAYOUT_NUM, kernel_frame, layout_speedup
from analysis.multiprefix import storage_line
from analysis.sharegpt_matrix import peak_line
from analysis.load import Results


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


def roofline_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """One line of reasoning from our kernel numbers: layout speed-up s, bound classes, Amdahl bound."""
    if "s" not in cache:
        cache["s"], _ = layout_speedup(res)
        k = kernel_frame(res)
        cache["k"] = k
        cache["amdahl"] = amdahl_frame(res)
    s, k, am = cache["s"], cache["k"], cache["amdahl"]
    if k.empty:
        return "No kernel measurements under the results folder to reason from (run runners.kernel_bench)."
    parts = []
    if np.isfinite(s):
        parts.append(f"our kernel-isolated storage-layout speed-up is s={s:.2f} (geomean over shapes; paper 15.6)")
    num, base = select(k, LAYOUT_NUM), select(k, {**LAYOUT_NUM, **LAYOUT_BASE})
    for lab, d in (("paged-equivalent", num), ("HOT", base)):
        if not d.empty and d["bound"].notna().any():
            r = d.iloc[0]
            parts.append(f"{lab} layout ({r.get('cell.shape.name', '?')}, Lp={show(r.get('cell.prefix_len'))}, "
                         f"B={show(r.get('cell.batch'))}): "
                         f"{r['bound']}-bound, "
                         f"{r['tflops']:.0f} TFLOP/s ({r['pct_peak_flops']:.0f}% of the measured peak) and "
                         f"{r['tbps']:.2f} TB/s ({r['pct_peak_bw']:.0f}%)")
    label = config_label(claim["model"], int(claim["tp"])) if str(claim["tp"]).isdigit() else ""
    row = am[am["config"] == label] if not am.empty else am
    if not row.empty and np.isfinite(s):
        f = float(row["f_attention_share"].iloc[0])
        parts.append(f"with f={f:.3f} (profiled prefix-attention share, {label}) Amdahl bounds the end-to-end gain "
                     f"at {amdahl(f, s):.2f}x")
    return ("Roofline: " + "; ".join(parts) + ".") if parts else \
        "Kernel rows present but without the layout comparison or flops/bytes: no roofline reasoning possible."


def dispatch_line(res: Results, cache: dict) -> str:
    """The dispatcher's time in the engine against the same lookup in a tight loop (tables/dispatch_overhead)."""
    if "dispatch" not in cache:
        from analysis.dispatch_overhead import overhead_frame
        cache["dispatch"] = overhead_frame(res)
    t = cache["dispatch"]
    t = t[t["dispatch_from"] == "steps.jsonl"] if not t.empty else t
    if t.empty:
        return ""
    lookup = t["bench_lookup_us"].dropna()
    by_commit = ""
    if "commit" in t.columns and t["commit"].nunique() > 1:   # the versions themselves: the table's commit column
        by_commit = f" at {t['commit'].nunique()} code versions (each cell's: tables/dispatch_overhead)"
    return (f"In the engine the per-step dispatcher time (GranikvPolicy.choose inside the step plan: the table lookup "
            f"and writing each class's choice into its plan) is {t['dispatch_us_p50'].min():.1f}-"
            f"{t['dispatch_us_p50'].max():.1f} us p50 over {len(t)} cells{by_commit}"
            + (f", while the lookup alone in a tight loop on the same host takes {lookup.iloc[0]:.2f} us (kernel bench "
               "dispatch_cost); the rest is host work around the lookup in a running engine, not broken down further"
               if len(lookup) else "")
            + f"; as a share of the decode step it stays at {t['share_pct'].max():.3f}% or less (tables/dispatch_overhead).")


def steps_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """Where GraniKV's time goes against sglang_default, per Lp of the claim's configuration, from
    the headline cells' step traces (tables/headline_steps)."""
    if "steps" not in cache:
        cache["steps"] = headline_steps.breakdown(res)
    t = cache["steps"]
    label = config_label(claim["model"], int(claim["tp"])) if str(claim["tp"]).isdigit() else ""
    g = t[(t["config"] == label) & (t["system.name"] == "granikv")] if not t.empty else t
    g = g.dropna(subset=["decode_full_p50_ms_vs_sglang_default"]) if not g.empty else g
    if g.empty:
        return ""
    parts = [f"Lp={int(r['workload.prefix_len'])}: {r['decode_full_p50_ms_vs_sglang_default']:.2f}x / "
             f"{r['decode_s_vs_sglang_default']:.2f}x / {r['prefill_s_vs_sglang_default']:.2f}x"
             for _, r in g.iterrows()]
    line = ("Step breakdown (GraniKV over sglang_default: full-batch decode step p50 / total decode time / "
            "total prefill time; below 1 = GraniKV spends less): " + "; ".join(parts) + " (tables/headline_steps).")
    return line + split_pairs_line(t, label)


def split_pairs_line(t: pd.DataFrame, label: str, base: str = "sglang_default", lps: list[float] | None = None) -> str:
    """The Lp points of ``label`` (all, or ``lps``) where GraniKV and ``base`` were measured at
    different code versions, with their p50 prefill steps (same prompts, so they should match): such
    a pair may compare two device runs as much as two systems."""
    if "commit" not in t.columns:
        return ""
    g = t[t["config"] == label]
    if lps is not None:
        g = g[g["workload.prefix_len"].astype(float).isin(lps)]
    out = []
    for lp, h in g.groupby("workload.prefix_len", sort=True):
        a, b = h[h["system.name"] == "granikv"], h[h["system.name"] == base]
        if a.empty or b.empty or a["commit"].iloc[0] == b["commit"].iloc[0]:
            continue
        na, nb = (len(str(x["commit"].iloc[0]).split(",")) for x in (a, b))
        out.append(f"Lp={int(lp)} (GraniKV at {na} code version{'s' * (na > 1)}, {base} at {nb}; "
                   f"p50 prefill step {a['prefill_p50_ms'].iloc[0]:.1f} vs {b['prefill_p50_ms'].iloc[0]:.1f} ms)")
    if not out:
        return ""
    return (" Pairs measured at different code versions, i.e. in different device runs (tables/headline_steps "
            "names them): " + "; ".join(out) + ". Both systems prefill the same prompts, so a large gap between "
            "their prefill steps there points to the runs rather than the systems.")


# Vendor datasheet figures (dense bf16 tensor-core peak, HBM bandwidth): what an absolute time can be
# compared against across GPUs. Facts about the hardware, not results.
DATASHEET = {
    "A100-SXM4-40GB": {"tflops_bf16": 312.0, "hbm_tbps": 1.555},
    "NVIDIA H200": {"tflops_bf16": 989.0, "hbm_tbps": 4.8},
}


def absolute_line(ev: pd.DataFrame, claim: pd.Series) -> str:
    """For an absolute (hardware-dependent) claim: the datasheet ratios of our GPU to the paper's, our
    number's ratio to the paper's, and the hardware-independent ratio claim of the same cell, if any."""
    if "absolute" not in str(claim.get("comparison", "")):
        return ""
    ours, paper = pd.to_numeric(claim["ours"], errors="coerce"), pd.to_numeric(claim["paper_value"], errors="coerce")
    gpu = str(claim["our_hardware"]).split(",")[0].strip()
    a, b = DATASHEET.get(PAPER_HARDWARE), DATASHEET.get(gpu)
    parts = []
    if a and b:
        parts.append(f"Absolute numbers depend on the GPU: {gpu} over {PAPER_HARDWARE} is "
                     f"{b['hbm_tbps'] / a['hbm_tbps']:.2f}x in HBM bandwidth and {b['tflops_bf16'] / a['tflops_bf16']:.2f}x "
                     "in bf16 peak (vendor datasheets)")
    else:
        parts.append(f"Absolute numbers depend on the GPU (no datasheet entry for {gpu or '?'})")
    if np.isfinite(ours) and np.isfinite(paper) and ours > 0:
        parts.append(f"ours is {max(paper / ours, ours / paper):.2f}x {'lower' if ours < paper else 'higher'} than the paper's")
    sel = {k: v for k, v in parse_selectors(claim["selectors"]).items() if k != "system.name"}
    twins = ev[(ev["unit"] == "x") & (ev["id"] != claim["id"]) & (ev["metric"] == claim["metric"]) & ev["selectors"].map(
        lambda t: {k: v for k, v in parse_selectors(t).items() if k != "system.name"} == sel)]
    for _, t in twins.iterrows():
        parts.append(f"the hardware-independent claim on the same cell, `{t['id']}`, is {t['verdict']} "
                     f"(paper {paper_shown(t)}, ours {t['ours_shown'] or 'not measured'})")
    return "; ".join(parts) + "."


SHORT = 0.10        # a reproduced point claim this far on the weaker side of the paper's value gets explained


def off_paper(ev: pd.DataFrame) -> pd.DataFrame:
    """Reproduced or exceeded point and range claims (their number without the noise) more than SHORT away from
    the paper's value or range, either way: they get a measured explanation too.
    Adds ``side``: "short of" (weaker than the paper) or "beyond" (stronger); "below" / "above" for a
    claim that states no better direction (e.g. the size of a regression)."""
    if ev.empty:
        return ev.assign(side=pd.Series(dtype=str))
    lo = pd.to_numeric(ev["paper_value"], errors="coerce")
    hi = pd.to_numeric(ev["paper_value_hi"], errors="coerce").fillna(lo)
    ours = pd.to_numeric(ev["ours"], errors="coerce")
    below, above = ours < lo * (1 - SHORT), ours > hi * (1 + SHORT)
    side = np.where(ev["better"] == "higher", np.where(below, "short of", np.where(above, "beyond", "")),
                    np.where(ev["better"] == "lower", np.where(above, "short of", np.where(below, "beyond", "")),
                             np.where(below, "below", np.where(above, "above", ""))))   # no better side stated
    out = ev.assign(side=side)
    pv = out["point_verdict"] if "point_verdict" in out.columns else out["verdict"]
    return out[pv.isin((REPRODUCED, EXCEEDED)) & out["check"].isin(("point", "range")) & (out["side"] != "")]


def shares_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """At the claim's Lp: how the run splits into decode and prefill steps for GraniKV and the claim's
    baseline system, the full-batch decode step of each, and the ratio of decode time alone (what the
    prefix attention changes)."""
    if "steps" not in cache:
        cache["steps"] = headline_steps.breakdown(res)
    t = cache["steps"]
    lp = parse_selectors(claim["selectors"]).get("workload.prefix_len", "")
    base = parse_selectors(claim["baseline"]).get("system.name", "=sglang_default").lstrip("=")
    label = config_label(claim["model"], int(claim["tp"])) if str(claim["tp"]).isdigit() else ""
    if t.empty or not lp.startswith("=") or not lp[1:].isdigit():
        return ""
    at = t[(t["config"] == label) & (t["workload.prefix_len"].astype(float) == float(lp[1:]))].set_index("system.name")
    if not {"granikv", base} <= set(at.index):
        return ""
    g, d = at.loc["granikv"], at.loc[base]

    def split(r) -> str:
        rest = r["duration_s"] - r["decode_s"] - r["prefill_s"]
        return (f"{r['duration_s']:.1f} s = decode {r['decode_s']:.1f} s + prefill {r['prefill_s']:.1f} s "
                f"({r['prefill_s'] / r['duration_s']:.0%}) + outside steps {rest:.1f} s, full-batch decode step "
                f"{r['decode_full_p50_ms']:.1f} ms")
    pr = g["prefill_s"] / d["prefill_s"]
    same = 0.8 <= pr <= 1.25
    return (f"Where the time goes at Lp={lp[1:]} ({label}, repetitions averaged): GraniKV {split(g)}; "
            f"{base} {split(d)}. Decode steps alone: {base} / GraniKV = "
            f"{d['decode_s'] / g['decode_s']:.2f}x; GraniKV's prefill time is {pr:.2f}x {base}'s"
            + (", time both systems spend alike, which dilutes" if same else ", which moves")
            + f" the end-to-end ratio to {d['duration_s'] / g['duration_s']:.2f}x (tables/headline_steps)."
            + split_pairs_line(t, label, base, lps=[float(lp[1:])]))


def prefill_host_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """The claim's model measured in prefill isolation (tables/prefill_host), at its TP and at TP=1:
    step and host launch per layer, when both were measured on a GPU."""
    if "prefill_host" not in cache:
        from analysis.prefill_host import load as load_prefill
        cache["prefill_host"] = load_prefill(res.root) if Path(res.root).exists() else pd.DataFrame()
    p = cache["prefill_host"]
    if p.empty or not str(claim["tp"]).isdigit():
        return ""
    p = p[(p["model"] == claim["model"]) & (p["allreduce"] == "nccl") & ~p["gpu"].str.startswith("no GPU")]
    tp = int(claim["tp"])
    at, one = p[p["tp"] == tp], p[p["tp"] == 1]
    if at.empty or one.empty or tp == 1:
        return ""

    def rng(d: pd.DataFrame, col: str, f: str = ".0f") -> str:
        return f"{d[col].min():{f}}-{d[col].max():{f}}"
    return (f"Prefill steps measured alone (tables/prefill_host, one request of {rng(at, 'tokens')} new tokens): "
            f"at TP={tp} a step takes {rng(at, 'step_ms', '.1f')} ms, its host launch "
            f"{rng(at, 'per_layer_launch_us')} us per layer (all-reduce launches {rng(at, 'allreduce_launch_us')} us each, "
            f"2 per layer); at TP=1 {rng(one, 'step_ms', '.1f')} ms and {rng(one, 'per_layer_launch_us')} us per layer. "
            f"Small prefill steps are bound by the host, more so at TP={tp}, and every system runs the same prefill.")


def close_calls(ev: pd.DataFrame, close: float = CLOSE) -> list[str]:
    """REPORT lines for the verdicts within ``close`` (relative) of the value where they flip: a close call
    rests on the run-to-run spread of the cells behind it, so more repetitions may turn it."""
    m = pd.to_numeric(ev["margin"], errors="coerce")
    keep = ((m < close) & (ev["verdict"] != NOT_MEASURED)).to_numpy()
    cc = ev[keep].iloc[np.argsort(m[keep].to_numpy(), kind="stable")]
    if cc.empty:
        return []
    L = ["", f"## Close calls: within {close:.0%} of the value where the verdict flips", "",
         "Our number would change the verdict if it moved by less than this much; read these verdicts together "
         "with the repetitions behind them (tables/coverage.md names the missing ones)."]
    for _, c in cc.iterrows():
        n, reps = int(c["configs"]), int(c["n"] or 0)
        behind = f"{n} configuration{'s' if n != 1 else ''}" + (
            f", the fewest repetitions behind one: {reps}" if reps else "")
        flip = (f"it flips at {c['flips_at']:.4g}, {c['margin']:.1%} away" if np.isfinite(float(c["flips_at"]))
                else f"it turns on its {c['margin_note']} ({c['margin']:.1%})")
        who = str(c.get("decider", "") or "")
        L.append(f"- `{c['id']}`: ours {c['ours_shown']} ({behind}), **{c['verdict']}**; {flip} "
                 f"(paper {paper_shown(c)}).{' Deciding cells: ' + who + '.' if who else ''}")
    return L


def short_claim(text: str) -> str:
    """A claim's text without its parenthesised details and after its first ';': for the claims table."""
    import re
    out = text
    while True:                                   # innermost parentheses first
        nxt = re.sub(r"\s*\([^()]*\)", "", out)
        if nxt == out:
            break
        out = nxt
    return out.split(";")[0].strip()


def ours_compact(c: pd.Series) -> str:
    """Our number as the claims table shows it (the whole of it is in the claim's section)."""
    import re
    shown = str(c["ours_shown"])
    if not shown:
        return NOT_MEASURED
    if c["statistic"] == "amdahl_overshoot":
        m = re.search(r"predicted ([0-9.]+).*measured ([0-9.]+)", shown)
        return f"predicted {m.group(1)} vs measured {m.group(2)}" if m else shown
    if c["statistic"] == "roofline_shift":
        m = re.findall(r"(\w+)-bound", shown)
        return " -> ".join(m) + " bound" if m else shown
    if c["check"] == "true":
        return shown.split(":")[0]
    return shown.split(";")[0].split(" (")[0]


def paper_value_shown(c: pd.Series) -> str:
    """The paper's value without its unit (``>= 0.97``, ``1.05-1.15``, ``yes``)."""
    if c["check"] == "true":
        return "yes"
    op = {"bound_ge": ">= ", "bound_le": "<= "}.get(c["check"], "")
    return f"{op}{c['paper_value']}{'-' + c['paper_value_hi'] if c['paper_value_hi'] else ''}"


def spread_kind(c: pd.Series) -> str:
    """Where a claim's interval comes from, in a word: reps, noise, reps+noise (or '' without one)."""
    f = str(c.get("spread_from", ""))
    if str(c.get("spread_shown", "-")) in ("", "-"):
        return ""
    return "reps+noise" if f.startswith("min-max over repetitions;") and "where n=1" in f else \
        "reps" if f.startswith("min-max") else "noise" if f.startswith("n=1") else ""


def tally(ev: pd.DataFrame) -> str:
    """``15 reproduced, 7 exceeded, ...`` over the five verdicts, in their order."""
    counts = ev["verdict"].value_counts()
    return ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)


def explain(res: Results, ev: pd.DataFrame, c: pd.Series, cache: dict) -> list[str]:
    """The measured explanations of one claim, from its own cells: why it differs from the paper (its
    number, without the noise, is not reproduced), or how it lies more than SHORT from the paper's value."""
    pv = c.get("point_verdict", c["verdict"])
    if pv == NOT_REPRODUCED:
        if "tables/dispatch_overhead" in str(c["source"]):
            why = dispatch_line(res, cache)
        elif "absolute" in str(c.get("comparison", "")):
            why = absolute_line(ev, c)
        elif "granikv_cascade_only" in str(c.get("baseline", "")) and (kp := kernel_pair_line(res, c)):
            bl = bound_line(res, c) if c["check"] in ("bound_ge", "bound_le") else ""
            why = (bl + " " if bl else "") + kp
        elif c.get("statistic") == "peak_share" and (pl := peak_line(res, c)):
            why = pl
        elif c["check"] in ("bound_ge", "bound_le") and (bl := bound_line(res, c)):
            cal = calibration_line(res, c) if "tables/dispatch_routing" in str(c["source"]) else ""
            why = bl + (" " + cal if cal else "")
        elif "tables/multiprefix" in str(c["source"]) and (sl := storage_line(res, c)):
            why = sl
        elif "tables/limitation" in str(c["source"]) and (sl := claim_steps_line(res, c)):
            why = sl
        elif "tables/in_sglang" in str(c["source"]) and (il := in_sglang.claim_line(res, c)):
            why = il
        elif "tables/headline" in str(c["source"]):
            why = steps_line(res, c, cache)
        elif "tables/kernel" in str(c["source"]) or "tables/amdahl" in str(c["source"]):
            why = roofline_line(res, c, cache)
        else:
            why = ""
        return [f"Why it differs from the paper: {why}"] if why else []
    off = off_paper(ev[ev["id"] == c["id"]])
    if off.empty:
        return []
    src = str(c["source"])
    why = " ".join(x for x in (shares_line(res, c, cache), prefill_host_line(res, c, cache)) if x) \
        if "tables/headline" in src else roofline_line(res, c, cache) if "tables/kernel" in src else \
        in_sglang.claim_line(res, c) if "tables/in_sglang" in src else \
        storage_line(res, c) if "tables/multiprefix" in src else \
        claim_steps_line(res, c) if "tables/limitation" in src else ""
    side = off["side"].iloc[0]
    return [f"Ours is {side} the paper's value by more than {SHORT:.0%}." + (f" {why}" if why else "")]


def claim_section(res: Results, ev: pd.DataFrame, c: pd.Series, cache: dict) -> list[str]:
    """The REPORT's section of one claim: the claim, both numbers, repetitions and interval, the verdict
    with its margin, and the explanations measured for it (nothing written for another claim)."""
    L = ["", f"### `{c['id']}`", "", f"**{c['verdict']}**. {c['claim']} ({c['section']})", "",
         f"- Paper: {paper_shown(c)} on {PAPER_HARDWARE}. Ours: "
         + (f"{c['ours_shown']} on {c['our_hardware'] or '?'} (from {c['source']})." if c["verdict"] != NOT_MEASURED
            else f"{NOT_MEASURED}: {c['why']}")]
    if c["verdict"] == NOT_MEASURED:
        return L
    n, k = int(c["n"] or 0), int(c["configs"] or 0)
    reps = f"n = {n} repetition{'s' if n != 1 else ''}" if n else "repetitions not tracked by this statistic"
    L.append(f"- {reps}, over {k} configuration{'s' if k != 1 else ''}; interval "
             f"{c['spread_shown'] or '-'} ({c['spread_from'] or 'none'}).")
    v = []
    if c["verdict"] == INCONCLUSIVE:
        v.append(f"Inconclusive: the interval spans {c['between']} (without the noise: {c['point_verdict']}); "
                 "more repetitions of the deciding cells settle it.")
    if c.get("margin_shown"):
        v.append(f"Margin to the nearest threshold: {c['margin_shown']}.")
    if c.get("decider"):
        v.append(f"Deciding cells: {c['decider']}.")
    if v:
        L.append("- " + " ".join(v))
    L += [f"- {x}" for x in explain(res, ev, c, cache)]
    return L


def write_report(res: Results, out: Path, tables: list[str], figures: list[str]) -> pd.DataFrame:
    """Evaluate every claim and write ``out/REPORT.md`` and ``out/tables/claims.{csv,md}``."""
    ev = evaluate(res)
    hw = hardware_summary(res)
    n_fail = int((res.failures["state"] == "failed").sum()) if not res.failures.empty else 0
    n_part = int((res.failures["state"] == "partial").sum()) if not res.failures.empty else 0
    root = Path(res.root).resolve()
    repo = Path(__file__).resolve().parents[1]
    shown_root = root.relative_to(repo) if root.is_relative_to(repo) else Path(res.root)
    gpus = sorted({g.strip() for h in ev["our_hardware"] for g in str(h).split(",") if g.strip()})
    ours_hw = ", ".join(gpus) or "our hardware"
    L = ["# GraniKV reproduction report", "",
         f"Generated by `python -m analysis.reproduce` from `{shown_root}`: {len(all_cells(res))} finished cells"
         + (f" ({len(res.set_aside)} of them set aside, see Provenance)" if not res.set_aside.empty else "") + ", "
         f"{n_fail} failed, {n_part} unfinished; {len(res.kernels)} kernel rows. Paper: {PAPER_HARDWARE}; ours: "
         f"{ours_hw} (details under Provenance, at the end).", "",
         "## Claims", "",
         f"Verdicts over {len(ev)} claims: **{tally(ev)}**. *Exceeded* is counted apart from *reproduced*: a "
         "number more than 25% beyond the paper's shows the effect, but not at the paper's size, so it does not "
         "confirm the paper's number (the rule is below; each claim's section gives what we measured).", "",
         f"n: repetitions (the fewest behind one configuration of the number; - where the statistic does not "
         f"track them). interval: where our number may lie given the run-to-run noise (reps: min-max over the "
         f"repetitions; noise: n=1 widened by the sweep's measured noise), the same unit as the number.", "",
         f"| id | claim | paper ({PAPER_HARDWARE}) | ours ({ours_hw}) | unit | n | interval | verdict |",
         "|---|---|---|---|---|---|---|---|"]
    for _, c in ev.iterrows():
        kind = spread_kind(c)
        iv = f"{c['spread_shown']} ({kind})" if kind else "-"
        L.append(f"| [{c['id']}](#{c['id']}) | {short_claim(c['claim'])} | {paper_value_shown(c)} | {ours_compact(c)} | "
                 f"{c['unit']} | {int(c['n']) if c['n'] else '-'} | {iv} | **{c['verdict']}** |".replace("\n", " "))
    L += ["", "## Verdict rule", "", VERDICT_RULE]
    L += close_calls(ev)
    L += ["", "## Claim by claim", "",
          "Each claim's own numbers and the explanations measured for it; the tables and figures named under "
          "*from* hold the data."]
    cache: dict = {}
    for _, c in ev.iterrows():
        L += claim_section(res, ev, c, cache)
    from analysis import (beyond, beyond_plan, beyond_steps, coverage, distance_to_limit, multiclass, plan_host,
                          prefix_kernel)
    L += ["", "## Toward the hardware limit", "",
          "How far each system's decode step runs from the hardware, and GraniKV's dense prefix path kernel by "
          "kernel. The GEMM floor is every weight GEMM of one decode step timed alone as one CUDA graph "
          "(tables/gemm_floor.md).", ""]
    L += distance_to_limit.lines(distance_to_limit.frame(res))
    L += prefix_kernel.lines(prefix_kernel.frame(res))
    bt = beyond.beyond_frame(res)
    L += beyond.lines(bt)
    L += beyond_steps.miss_lines(bt, beyond_steps.steps_frame(res))
    L += beyond_plan.lines(beyond_plan.plan_frame(res))
    L += plan_host.lines(plan_host.frame(res))
    L += multiclass.lines(multiclass.frame(res), res)
    L += ["", "## Campaign coverage", "",
          "Every cell the campaign plans (`conf/campaign.yaml`, expanded as runners.run expands each sweep), "
          "against the raw results; cell by cell in tables/coverage_cells.md; the command, GPUs and time per claim "
          "in tables/claim_map.md. A cell measured with settings its preset has since changed is counted as "
          "measured and its changed settings are named.", ""]
    L += [f"- {x}" for x in coverage.lines(coverage.tables(res)[0])]
    L += ["", "## Failed and unfinished cells", ""]
    if res.failures.empty:
        L.append("None.")
    else:
        L += ["| sweep | cell | state | error |", "|---|---|---|---|"]
        for _, f in res.failures.iterrows():
            err = str(f["error"]).splitlines()[0][:160].replace("|", "/") if str(f["error"]) else ""
            L.append(f"| {f['sweep']} | {f['cell_id']} | {f['state']} | {err} |")
    L += ["", "## Provenance", "",
          f"- Paper hardware: {PAPER_HARDWARE} (one host).",
          f"- Our hardware (provenance of the raw results): {'; '.join(hw) if hw else 'none (no finished cells)'}.",
          *([f"- {conc}"] if (conc := concurrency_check(res)) else []),
          *([f"- {cap}"] if (cap := capture_check(res)) else []),
          *([f"- {sa}"] if (sa := set_aside_line(res)) else []),
          *([f"- {bud}"] if (bud := budget_check(res)) else []),
          *([f"- {srv}"] if (srv := engine_fidelity.provenance_line(res)) else [])]
    cv = code_versions(res)
    if cv:
        L += ["", "### Code versions behind the numbers", "",
              "Git commit of each finished cell (from its provenance), by sweep folder.", "",
              "| sweep | cells | commit: cells |", "|---|---|---|"] + cv
        if (Path(res.root) / "PROVENANCE_ERRATA.md").exists():
            L += ["", "Known provenance errors, with the evidence: "
                      f"`{shown_root / 'PROVENANCE_ERRATA.md'}`."]
    L += ["", "## Tables and figures", ""]
    L += [f"- tables/{t}.csv, tables/{t}.md" for t in tables]
    L += [f"- figures/{f}.png, figures/{f}.pdf, figures/{f}.csv (the data drawn)" for f in figures]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "REPORT.md").write_text("\n".join(L) + "\n")
    t = ev.assign(interval=[f"{r['spread_shown']} ({spread_kind(r)})" if spread_kind(r) else "-" for _, r in ev.iterrows()])
    cols = ["id", "section", "model", "tp", "comparison", "paper_value", "paper_value_hi", "unit", "ours_shown",
            "n", "configs", "interval", "spread_from", "our_hardware", "verdict", "point_verdict", "margin_shown", "why",
            "source"]
    write_table(t[cols].rename(columns={"margin_shown": "margin_to_flip", "spread_from": "interval_from"}), "claims", out,
                title="Claims: paper vs ours",
                note="n: repetitions (the fewest behind one configuration; 0: not tracked by the statistic); configs: "
                     "configurations pooled; interval: where our number may lie given the run-to-run noise (reps: "
                     "min-max over repetitions; noise: n=1 widened by the sweep's run-to-run noise); point_verdict: the "
                     "verdict without the noise. The rule: analysis/README.md, or the REPORT's Verdict rule.")
    return ev
