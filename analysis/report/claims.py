"""The REPORT's claims: the table's cells, the close calls, and one section per claim."""
from __future__ import annotations
import re

import numpy as np
import pandas as pd

from analysis.common import NOT_MEASURED, PAPER_HARDWARE
from analysis.load import Results
from analysis.paper import paper_shown
from analysis.verdict.rule import CLOSE, INCONCLUSIVE, VERDICTS


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
         "with the repetitions behind them (each claim's section names its deciding cells; tables/coverage.md "
         "the missing ones)."]
    for _, c in cc.iterrows():
        n, reps = int(c["configs"]), int(c["n"] or 0)
        behind = f"{n} configuration{'s' if n != 1 else ''}" + (f", n = {reps}" if reps else "")
        flip = (f"it flips at {c['flips_at']:.4g}, {c['margin']:.1%} away" if np.isfinite(float(c["flips_at"]))
                else f"it turns on its {c['margin_note']} ({c['margin']:.1%})")
        L.append(f"- `{anchor(c)}`: ours {c['ours_shown']} ({behind}), **{c['verdict']}**; {flip} "
                 f"(paper {paper_shown(c)}).")
    return L


ANOTHER_GPU = "same claim, this GPU"   # the claims table's text of another GPU model's row


def short_claim(text: str) -> str:
    """A claim's text without its parenthesised details and after its first ';': for the claims table."""
    out = text
    while True:                                   # innermost parentheses first
        nxt = re.sub(r"\s*\([^()]*\)", "", out)
        if nxt == out:
            break
        out = nxt
    return out.split(";")[0].strip()


def ours_compact(c: pd.Series) -> str:
    """Our number as the claims table shows it (the whole of it is in the claim's section)."""
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


def spread_kind(c: pd.Series) -> str:
    """Where a claim's interval comes from, in a word: reps, noise, reps+noise (or '' without one)."""
    f = str(c.get("spread_from", ""))
    if str(c.get("spread_shown", "-")) in ("", "-"):
        return ""
    return "reps+noise" if f.startswith("min-max over repetitions;") and "where n=1" in f else \
        "reps" if f.startswith("min-max") else "noise" if f.startswith("n=1") else ""


def primary_rows(ev: pd.DataFrame) -> pd.DataFrame:
    """The claims' rows on the primary GPU model (analysis.verdict.evaluate ``primary``): one per claim."""
    return ev[ev["primary"].astype(bool)] if "primary" in ev.columns else ev


def anchor(c: pd.Series) -> str:
    """A claim row's REPORT heading: its id, and on another GPU model than the primary one, that GPU model."""
    return c["id"] if bool(c.get("primary", True)) else f"{c['id']} on {c['gpu']}"


def tally(ev: pd.DataFrame) -> str:
    """``15 reproduced, 7 exceeded, ...`` over the five verdicts, in their order (the primary GPU model's rows)."""
    counts = primary_rows(ev)["verdict"].value_counts()
    return ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)


def versions_line(c: pd.Series) -> str:
    """The versions of our code a claim's cells ran, counted (the commits are in tables/provenance), and what
    several of them mean ("" when not recorded)."""
    counted = str(c.get("code_versions_counted", "") or "")
    if not counted:
        return ""
    if not bool(c.get("spans_versions", False)):
        return "Code version: one commit."
    return (f"Code versions: {counted} (tables/provenance). The number compares or pools cells of different code; a "
            "rerun of every system it reads at one commit makes it one code's.")


def _spans(ev: pd.DataFrame) -> pd.DataFrame:
    if "spans_versions" not in ev.columns:
        return ev.iloc[0:0]
    return ev[ev["spans_versions"].fillna(False).astype(bool) & (ev["verdict"] != NOT_MEASURED)]


def spanning(ev: pd.DataFrame) -> list[str]:
    """REPORT lines: the claims whose cells span two or more versions of our code, counted (none: no line)."""
    s = _spans(ev)
    if s.empty:
        return []
    return ["", "## Claims over several code versions", "",
            f"{len(s)} of the claims above read cells measured at two or more commits of our code (the engine or "
            "the plugin; real SGLang's own cells aside): a ratio of two systems measured at different commits, or "
            "repetitions of one system pooled across commits. Their verdicts stand as computed, but none of these "
            "numbers is one code version's. *At one version*: the claim measured again on the cells of the last "
            "commit that holds all of it (information). The commits, per system: "
            "[tables/provenance.md](tables/provenance.md).", "",
            "| id | GPU | verdict | commits | at one version |", "|---|---|---|---|---|"] + \
        [f"| [`{anchor(c)}`](#{anchor(c).lower().replace(' ', '-')}) | {str(c['gpu']).removeprefix('NVIDIA ')} | "
         f"{c['verdict']} | {str(c['code_versions_counted']).split(':')[0]} | {_one_version_shown(c)} |"
         for _, c in s.iterrows()]


def _one_version_shown(c: pd.Series) -> str:
    """The claim's number and verdict at one code version, for prose (the commit left out: it is in
    tables/provenance.md); "none holds it" where no one version does."""
    one = str(c.get("one_version", "") or "")
    if not one or one.startswith("no one version"):
        return "none holds it"
    shown = one.rsplit(" at ", 1)[0]
    return shown if len(shown) <= 40 else shown[shown.rfind("(", 0, len(shown) - 1):]


def spanning_commits(ev: pd.DataFrame) -> list[str]:
    """tables/provenance.md lines: the same claims with the commits per system (none: no line)."""
    s = _spans(ev)
    if s.empty:
        return []
    return ["", "## Claims over several code versions", "",
            "The commits of our code each claim's cells ran, per system (real SGLang's own cells aside).", "",
            "| id | GPU | commits | at one version |", "|---|---|---|---|"] + \
        [f"| {c['id']} | {c['gpu']} | {c['code_versions']} | {c.get('one_version', '')} |" for _, c in s.iterrows()]


def claim_section(c: pd.Series, why: list[str]) -> list[str]:
    """One claim in full (tables/claim_details.md): the claim, both numbers, repetitions and interval, the
    verdict with its margin, and ``why``, the explanations measured for it (:func:`explain`: nothing written for
    another claim)."""
    L = ["", f"### `{anchor(c)}`", "", f"**{c['verdict']}**. {c['claim']} ({c['section']})", "",
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
    if (ver := versions_line(c)):
        v.append(ver)
    if v:
        L.append("- " + " ".join(v))
    L += [f"- {x}" for x in why]
    return L


NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*")
EXPLAINED = 3        # numbers of explanation a claim's REPORT section carries; the rest is in tables/claim_details


def gist(text: str, budget: int = EXPLAINED) -> str:
    """An explanation cut to ``budget`` numbers: its framing ("Ours is short of ... by more than 10%.", "Why it
    differs from the paper:") and then its sentences in order, each kept whole if its numbers still fit; where
    none fits, the tables it was measured in."""
    framing, rest = "", text
    if rest.startswith("Why it differs from the paper: "):
        framing, rest = "Why it differs: ", rest[len("Why it differs from the paper: "):]
    elif rest.startswith("Ours is ") and ". " in rest:
        head, rest = rest.split(". ", 1)
        framing = head.split(" by more than")[0] + ": "
    kept = []
    for sentence in re.split(r"(?<=[.)])\s+(?=[A-Z])", rest):
        n = len(NUMBER.findall(sentence))
        if kept and n > budget:           # what follows the kept sentences leans on them: no skipping past
            break
        if n <= budget and (kept or n):   # the first kept sentence carries a number of its own
            kept.append(sentence)
            budget -= n
    if not kept:
        tables = list(dict.fromkeys(re.findall(r"tables/\w+", rest)))
        kept = [f"measured in {', '.join(tables)}." if tables else "see the claim in full."]
    return framing + " ".join(kept)


def has_section(c: pd.Series, why: list[str]) -> bool:
    """Whether a claim row gets a section of the REPORT's own: every primary GPU model's row; another GPU model's
    row where an explanation was measured for it (else the claims table's row says it all, and links to the
    row in full in tables/claim_details.md)."""
    return bool(c.get("primary", True)) or bool(why)


def claim_brief(c: pd.Series, why: list[str], folders: list[str]) -> list[str]:
    """The REPORT's short section of one claim: both numbers, the interval, the margin, the deciding cells with
    their results/raw folders, and at most EXPLAINED numbers of ``why`` (:func:`explain`); the claim in full is in
    tables/claim_details.md, its rerun command in tables/rerun.md."""
    more = f"[in full](tables/claim_details.md#{c['id']}), [rerun](tables/rerun.md#{c['id']})"
    head = ["", f"### `{anchor(c)}`", ""]
    if c["verdict"] == NOT_MEASURED:
        return head + [f"**{NOT_MEASURED}**: {c['why']} ({more})."]
    n = int(c["n"] or 0)
    kind = spread_kind(c)
    iv = f"interval {c['spread_shown']} ({kind}{f', n = {n}' if n else ''})" if kind else \
        f"no interval ({f'n = {n}, ' if n else ''}{c['spread_from'] or 'none'})"
    ours = str(c["ours_shown"]) if len(str(c["ours_shown"])) <= 100 else ours_compact(c)
    text = (f"**{c['verdict']}**: paper {paper_shown(c)}, ours {ours} ({c['our_hardware'] or '?'}); {iv}"
            + (f"; spans {c['between']}" if c["verdict"] == INCONCLUSIVE else "")
            + (f"; margin {c['margin_shown']}" if c.get("margin_shown") else "") + ".")
    where = ", ".join(f"`{f}/`" for f in folders[:3]) + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")
    cells = f"Deciding cells: {c['decider'] or 'every cell of the claim'}" + (f", in {where}" if where else "")
    if not bool(c.get("primary", True)):   # another GPU model's row: the primary row's section says the rest
        return head + [text.replace(f" ({c['our_hardware']})", ""), "",
                       f"- {f'Cells in {where}; ' if where else ''}{more}.", *[f"- {gist(x)}" for x in why]]
    return head + [text, "", f"- {cells}; from {c['source']}; {more}.", *[f"- {gist(x)}" for x in why]]
