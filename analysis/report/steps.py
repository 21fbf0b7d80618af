"""Claim explanations from step traces: where a run's time goes, decode against prefill."""
from __future__ import annotations
import json
from pathlib import Path

import pandas as pd

from analysis.common import config_label, parse_selectors, select, with_derived
from analysis.load import Results
from analysis.measures.prefill import load as load_prefill
from analysis.measures.steps import baseline_cell, breakdown, steps_vs


def steps_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """Where GraniKV's time goes against sglang_default, per Lp of the claim's configuration, from
    the headline cells' step traces (tables/headline_steps)."""
    if "steps" not in cache:
        cache["steps"] = breakdown(res)
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


def shares_line(res: Results, claim: pd.Series, cache: dict) -> str:
    """At the claim's Lp: how the run splits into decode and prefill steps for GraniKV and the claim's
    baseline system, the full-batch decode step of each, and the ratio of decode time alone (what the
    prefix attention changes)."""
    if "steps" not in cache:
        cache["steps"] = breakdown(res)
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
        cache["prefill_host"] = load_prefill(res.root, res.ignored) if Path(res.root).exists() else pd.DataFrame()
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


def claim_steps_line(res: Results, claim: pd.Series) -> str:
    """For a GraniKV-over-sglang_default claim: the step trace of each GraniKV cell the claim selects
    against sglang_default's in the same configuration. Empty without such a pair."""
    cells = with_derived(res.cells)
    if cells.empty:
        return ""
    g = select(cells, {**parse_selectors(claim["selectors"]), "system.name": "=granikv", "instrumented": "=False"})
    parts = []
    for _, r in g.iterrows():
        b = baseline_cell(res, r)
        if b is not None:
            parts.append(steps_vs(res, r, b))
    return ("Step trace, GraniKV vs sglang_default (steps.jsonl): " + "; ".join(parts) + ".") if parts else ""


def _count(r: pd.Series, key: str) -> int:
    """A count metric of one cell; absent in metrics.json (no such admission in that run) = 0."""
    v = r.get(key)
    return 0 if v is None or pd.isna(v) else int(v)


def storage_line(res: Results, claim: pd.Series) -> str:
    """For a multi-prefix claim: where GraniKV put the prefixes and which path served them, from the
    claim's GraniKV cells (HOT capacity and peak, first admissions to HOT / COLD, class-steps per path),
    with TTFT / TPOT p50 against the claim's baseline system (sglang_default where the baseline names none) in
    the same configuration. Empty without such a cell."""
    cells = with_derived(res.cells)
    if cells.empty:
        return ""
    sel = parse_selectors(claim["selectors"])
    g = select(cells, {**sel, "system.name": "=granikv", "instrumented": "=False"})
    if g.empty:
        return ""
    # the claim's baseline system where it names one (GraniKV over SGLang-Cascade: against SGLang-Cascade)
    bsys = parse_selectors(claim.get("baseline", "")).get("system.name", "=sglang_default").lstrip("=")
    parts = []
    for _, r in g.iterrows():
        paths = {c.split(".", 1)[1]: int(r[c]) for c in r.index if c.startswith("dispatch_counts.") and r[c] > 0}
        vs = ""
        b = baseline_cell(res, r, bsys)
        if b is not None:
            vs = (f"; TTFT p50 {r['ttft_p50_ms'] / 1e3:.1f} s vs {b['ttft_p50_ms'] / 1e3:.1f} s, TPOT p50 "
                  f"{r['tpot_p50_ms']:.1f} vs {b['tpot_p50_ms']:.1f} ms ({bsys}); " + steps_vs(res, r, b))
        lens = r.get("workload.prefix_lens")        # a list written as text ("[2048, 4096]") or null
        if isinstance(lens, str):
            lens = json.loads(lens)
        k = int(r["workload.num_prefixes"])
        total = sum(lens) if isinstance(lens, (list, tuple)) else k * int(r["workload.prefix_len"])
        parts.append(f"k={k}, {total / 1e3:.1f}K prefix tokens against a HOT pool of "
                     f"{r['hot_capacity_tokens'] / 1e3:.1f}K (peak {r['hot_peak_tokens'] / 1e3:.1f}K used; first "
                     f"admissions: {_count(r, 'admissions.hot')} HOT, {_count(r, 'admissions.cold')} COLD), "
                     f"class-steps by path {paths}{vs}")
    return "GraniKV's storage and paths (metrics.json): " + "; ".join(parts) + "."
