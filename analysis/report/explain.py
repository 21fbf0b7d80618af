"""Why a claim's number differs from the paper's, from the measurements behind that claim alone."""
from __future__ import annotations
import numpy as np
import pandas as pd

from analysis.common import PAPER_HARDWARE, parse_selectors
from analysis.load import Results
from analysis.paper import paper_shown
from analysis.report.bounds import bound_line, calibration_line, kernel_pair_line, peak_line
from analysis.report.kernels import dispatch_line, roofline_line
from analysis.report.sglang import claim_line
from analysis.report.steps import claim_steps_line, prefill_host_line, shares_line, steps_line, storage_line
from analysis.verdict.rule import EXCEEDED, NOT_REPRODUCED, REPRODUCED


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
            il = claim_line(res, c) if "tables/in_sglang" in str(c["source"]) else ""
            why = " ".join(x for x in (bl, cal, il) if x)
        elif "tables/multiprefix" in str(c["source"]) and (sl := storage_line(res, c)):
            why = sl
        elif "tables/limitation" in str(c["source"]) and (sl := claim_steps_line(res, c)):
            why = sl
        elif "tables/in_sglang" in str(c["source"]) and (il := claim_line(res, c)):
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
        claim_line(res, c) if "tables/in_sglang" in src else \
        storage_line(res, c) if "tables/multiprefix" in src else \
        claim_steps_line(res, c) if "tables/limitation" in src else ""
    side = off["side"].iloc[0]
    return [f"Ours is {side} the paper's value by more than {SHORT:.0%}." + (f" {why}" if why else "")]
