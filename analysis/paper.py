"""The paper's claims (results/paper/claims.csv): the file, checked against its schema, and a paper
value as the figures draw it (:func:`paper_claims`) and the REPORT writes it (:func:`paper_shown`).
What a claim's ``statistic`` computes and how its verdict is reached is analysis.verdict's."""
from __future__ import annotations
import re
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import SHORT, config_label, parse_selectors, select


CLAIMS_CSV = Path(__file__).resolve().parents[1] / "results" / "paper" / "claims.csv"


CHECKS = ("point", "range", "bound_ge", "bound_le", "true")
FRAMES = ("cells", "kernels", "trace", "steps")
# the configuration every claim's selectors name in full, per frame: a key -> the claim column its value must
# equal ("" : any value), so that no cell of another model, TP, hardware preset or workload feeds the claim
# (the GPU model is the row's own: analysis.verdict.evaluate measures each GPU model's cells apart)
CONFIGURATION = {"cells": {"model.name": "model", "tp": "tp", "hardware.name": "", "workload.kind": ""},
                 "kernels": {"cell.shape.name": "model", "hardware": ""}}   # a kernel bench's preset: `hardware`
CONFIGURATION["trace"] = CONFIGURATION["steps"] = CONFIGURATION["cells"]


def check_configuration(r: pd.Series, where: str) -> None:
    """Raise ValueError where claim ``r``'s selectors leave part of its configuration open (CONFIGURATION)."""
    sel = parse_selectors(r["selectors"])
    for key, col in CONFIGURATION[r["frame"]].items():
        cond = sel.get(key, "")
        if not cond.startswith("=") or cond[1:] in ("", "notnull", "max"):
            want = f"{key}={r[col]}" if col else f"{key}=<value>[|<value>...]"
            raise ValueError(f"{where}: field `selectors` does not name `{key}` (a {r['frame']} claim selects its "
                             f"cells by model, TP, hardware preset and workload). Fix: add `{want}` to its selectors")
        if col and cond[1:] != str(r[col]):
            raise ValueError(f"{where}: field `selectors` has `{key}{cond}` but the claim's `{col}` is "
                             f"'{r[col]}'. Fix: make the two agree")
        if key in parse_selectors(r["baseline"]):
            raise ValueError(f"{where}: field `baseline` overrides `{key}`: the baseline is the same configuration "
                             "of another system or workload point. Fix: drop it from the baseline")


def read_claims(path: str | Path = CLAIMS_CSV) -> pd.DataFrame:
    """claims.csv, checked: unique ids, known checks and frames, numbers where needed (the statistic's
    name is checked where the statistics are: analysis.verdict.evaluate.load_claims)."""
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    need = ["id", "section", "claim", "model", "tp", "frame", "selectors", "metric", "statistic", "baseline", "check",
            "paper_value", "paper_value_hi", "unit", "better", "comparison", "source"]
    miss = [c for c in need if c not in df.columns]
    if miss:
        raise ValueError(f"{path}: missing columns {miss}")
    if df["id"].duplicated().any():
        raise ValueError(f"{path}: duplicate ids {sorted(df.loc[df['id'].duplicated(), 'id'])}")
    for _, r in df.iterrows():
        where = f"{path}: claim `{r['id']}`"
        if r["check"] not in CHECKS:
            raise ValueError(f"{where}: field `check` is '{r['check']}', not one of {CHECKS}")
        if r["frame"] not in FRAMES:
            raise ValueError(f"{where}: field `frame` is '{r['frame']}', not cells | kernels | trace | steps")
        if r["check"] != "true":
            float(r["paper_value"])  # raises with the value in the message
        parse_selectors(r["selectors"]), parse_selectors(r["baseline"])
        check_configuration(r, where)
    return df


def paper_shown(c: pd.Series) -> str:
    """The paper's value as the report prints it (``>= 0.97 x``, ``1.05-1.15 x``, ``yes``)."""
    if c["check"] == "true":
        return "yes"
    v, hi, u = c["paper_value"], c["paper_value_hi"], c["unit"]
    op = {"bound_ge": ">= ", "bound_le": "<= "}.get(c["check"], "")
    return f"{op}{v}{'-' + hi if hi else ''} {u}".strip()


def paper_claims(ids=None) -> pd.DataFrame:
    """results/paper/claims.csv with the selectors spelt out: ``config`` (model TP), ``lp``, ``batch``,
    ``k``, ``hardware``, ``system`` and ``base_system`` (the baseline's system, if it names one), ``value``
    and ``value_hi`` as numbers. ``ids``: only these claims (in claims.csv order)."""
    c = read_claims()
    if ids is not None:
        c = c[c["id"].isin(list(ids))]
    rows = []
    for _, r in c.iterrows():
        sel, base = parse_selectors(r["selectors"]), parse_selectors(r["baseline"])

        def val(d, k):
            v = d.get(k, "")
            return v[1:] if v.startswith("=") else None
        num = lambda x: float(x) if x not in (None, "") else np.nan  # noqa: E731
        rows.append({"id": r["id"], "check": r["check"], "unit": r["unit"], "metric": r["metric"],
                     "workload": val(sel, "workload.kind"), "statistic": r["statistic"],
                     "config": config_label(r["model"], int(r["tp"])) if str(r["tp"]).isdigit() else None,
                     "lp": num(val(sel, "workload.prefix_len")), "batch": num(val(sel, "workload.batch")),
                     "k": num(val(sel, "workload.num_prefixes")), "hardware": val(sel, "hardware.name"),
                     "system": val(sel, "system.name"), "base_system": val(base, "system.name"),
                     "value": num(r["paper_value"]), "value_hi": num(r["paper_value_hi"])})
    return pd.DataFrame(rows, columns=["id", "check", "unit", "metric", "workload", "statistic", "config", "lp", "batch",
                                       "k", "hardware", "system", "base_system", "value", "value_hi"])


def paper_value_shown(c: pd.Series) -> str:
    """The paper's value without its unit (``>= 0.97``, ``1.05-1.15``, ``yes``)."""
    if c["check"] == "true":
        return "yes"
    op = {"bound_ge": ">= ", "bound_le": "<= "}.get(c["check"], "")
    return f"{op}{c['paper_value']}{'-' + c['paper_value_hi'] if c['paper_value_hi'] else ''}"


LONG_KEYS = {v: k for k, v in SHORT.items()}   # "Lp" -> "workload.prefix_len", as a claim's deciding cells name them


def deciding_selections(c: pd.Series) -> list[dict[str, str]]:
    """The selectors of a claim's deciding cells: the claim's own and its baseline's, each narrowed to the
    configurations its ``decider`` names (``Lp=16384, B=256, system=granikv (...) and Lp=1024, ...``); the
    claim's whole selection where it names none."""
    pins: dict[str, list[str]] = {}
    for part in str(c.get("decider", "") or "").split(" and "):
        for key, value in re.findall(r"(\w+)=([^,\s()]+)", part.split(" (")[0]):
            if key in LONG_KEYS and value not in pins.setdefault(LONG_KEYS[key], []):
                pins[LONG_KEYS[key]].append(value)
    sel = {**parse_selectors(c["selectors"]), **{k: "=" + "|".join(v) for k, v in pins.items()}}
    base = parse_selectors(c["baseline"])
    return [sel, {**sel, **base}] if base else [sel]


def deciding_folders(frame: pd.DataFrame, c: pd.Series) -> list[str]:
    """The results/raw folders (sweep names) that hold a claim's deciding cells in ``frame``, the frame the
    claim is measured in (analysis.verdict.context.Context.frame)."""
    if frame.empty or "sweep" not in frame.columns:
        return []
    d = pd.concat([select(frame, s) for s in deciding_selections(c)])
    return sorted(set(d["sweep"].dropna().astype(str)))
