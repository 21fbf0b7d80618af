"""Claim explanations inside real SGLang: ITL, TTFT, prompt tokens prefilled, the plugin's counters."""
from __future__ import annotations
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import THROUGHPUT, parse_selectors, select, with_derived
from analysis.load import Results, load_steps
from analysis.measures.admission import with_held_back
from analysis.measures.sglang import BASE, PATHS, SYSTEMS, plugin_counters, prefer_current, variant_keys



def prefilled_tokens(res: Results, path: str) -> float:
    """Prompt tokens a server cell prefilled (its log's prefill batches, ``#new-token``), NaN without them."""
    s = load_steps(Path(res.root) / path)
    if s.empty or "kind" not in s.columns or "new_token" not in s.columns:
        return np.nan
    return float(pd.to_numeric(s.loc[s["kind"] == "prefill", "new_token"], errors="coerce").sum())


def held_back_sentence(res: Results, mine: pd.DataFrame, theirs: pd.DataFrame, a: str, b: str) -> str:
    """Where the claim's cells are one burst each and a server held a request back (analysis.measures.admission):
    one sentence, in how many cells of each side a request was admitted only after the rest of the burst had
    finished, and the makespan its tail added on the claim's side (three numbers at most, so that the REPORT's
    cut keeps it); "" elsewhere."""
    m, t = (with_held_back(df, res.root) for df in (mine, theirs))
    if m["held_back"].isna().all() or t["held_back"].isna().all() or (m["held_back"].sum() + t["held_back"].sum()) == 0:
        return ""

    def side(df, name, seconds):
        hit = df[df["held_back"] > 0]
        k, n = len(hit), len(df)
        said = f"every {name} cell" if k == n else f"no {name} cell" if k == 0 else f"{k} of {n} {name} cells"
        return said + (f" (+{hit['held_back_s'].mean():.2f} s each)" if seconds and k else "")
    return (f"A request held back until the rest of the burst had finished: {side(m, a, True)}; "
            f"{side(t, b, False)}. ")


def claim_line(res: Results, claim: pd.Series) -> str:
    """Why an in-SGLang claim lands where it does, from its own cells: the claim's system against its
    baseline system at the claim's point (ITL and TTFT p50, prompt tokens prefilled), and the plugin's
    counters (dense-row share, host plan per planned step, host time per replayed step where recorded), first, where a
    burst's server held a request back, that (held_back_sentence), and the cells of the claim's system that
    ran with earlier plugin settings, which the claim does not use. Empty where a side has no cell."""
    sel, base = parse_selectors(claim["selectors"]), parse_selectors(claim["baseline"])
    every = with_derived(res.cells) if not res.cells.empty else res.cells
    cells = prefer_current(every, res.config_columns) if not res.cells.empty else res.cells
    mine = select(cells, {**sel, "instrumented": "=False"}) if not cells.empty else cells
    theirs = select(cells, {**sel, **base, "instrumented": "=False"}) if not cells.empty else cells
    if mine.empty or theirs.empty:
        return ""
    a, b = mine["system"].iloc[0], theirs["system"].iloc[0]

    def avg(df, col):
        return float(pd.to_numeric(df[col], errors="coerce").mean()) if col in df.columns else np.nan

    pre_a, pre_b = ([prefilled_tokens(res, p) for p in df["path"]] if "path" in df.columns else [np.nan]
                    for df in (mine, theirs))
    pre_a, pre_b = (float(np.mean(v)) for v in (pre_a, pre_b))
    pc = plugin_counters(mine)
    line = (f"Inside SGLang, {a} against {b}: ITL p50 {avg(mine, 'itl_p50_ms'):.1f} vs {avg(theirs, 'itl_p50_ms'):.1f} ms, "
            f"TTFT p50 {avg(mine, 'ttft_p50_ms'):.0f} vs {avg(theirs, 'ttft_p50_ms'):.0f} ms, prompt tokens prefilled "
            f"{pre_a:.0f} vs {pre_b:.0f} (the servers' prefill batches)").replace("prefilled nan vs nan", "prefilled: not logged")
    if np.isfinite(pc["plan_us"]):
        shares = ", ".join(f"{pc[f'rows_{p}']:.1%} {p}" for p in PATHS if pc[f"rows_{p}"] > 0)
        line += f"; the plugin's decode rows: {shares}, host plan {pc['plan_us']:.0f} us per planned step"
    if np.isfinite(pc["own_p50_us"]):
        line += (f"; host time per replayed step: the plugin's own {pc['own_p50_us']:.0f} us median, "
                 f"{pc['own_p90_us']:.0f} us p90; {pc['host_p50_us']:.0f} us median with the rest decode's plan")
    older = select(every, {**sel, "instrumented": "=False"})
    older = older[~older.index.isin(mine.index)]
    if not older.empty:
        real = avg(theirs, THROUGHPUT)
        paper = next((p for p, (s_, _) in SYSTEMS.items() if s_ == a), BASE)
        keys = [f"system.{k}" for k in variant_keys(paper) if f"system.{k}" in older.columns]
        said = [f"{', '.join(f'{k[7:]}={r[k]}' for k in keys if r[k] not in ('', None) and r[k] == r[k])}: "
                f"{r[THROUGHPUT]:.0f} tok/s ({r[THROUGHPUT] / real:.2f}x)" for _, r in older.iterrows()]
        line += "; not used, measured with earlier plugin settings: " + "; ".join(said)
    return held_back_sentence(res, mine, theirs, a, b) + line + " (tables/in_sglang)."
