"""README.md as an evaluator reads it: short, the two commands of a fresh machine first, no commit hashes or
issue numbers, and every number of its claims table, tally and claim map equal to the regenerated tables
(results/tables/claims.csv, results/tables/experiments.csv)."""
from __future__ import annotations
import re
from pathlib import Path
import pandas as pd
import pytest

from analysis.verdict.evaluate import load_claims
from analysis.verdict.rule import VERDICTS
from analysis.paper import paper_value_shown
from analysis.report.claims import ours_compact

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TABLES = ROOT / "results" / "tables"


def _text() -> str:
    return README.read_text()


def _section(title: str) -> str:
    text = _text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _rows(section: str, first: str) -> list[list[str]]:
    """The rows of the markdown table in ``section`` whose header starts with ``| first``."""
    lines = section.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(f"| {first}"))
    out = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        out.append([c.strip() for c in ln.strip().strip("|").split(" | ")])
    return out


def _table(name: str) -> pd.DataFrame:
    p = TABLES / f"{name}.csv"
    if not p.exists():
        pytest.skip(f"results/tables/{name}.csv not generated yet (make reproduce)")
    return pd.read_csv(p, dtype=str, keep_default_na=False)


def test_short_and_the_two_commands_first():
    text = _text()
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 16 * 1024
    head = "\n".join(text.splitlines()[:20])
    assert head.index("make reproduce") < head.index("make test")
    for title in ("Results at a glance", "Requirements", "Kick the tires", "Claim map", "The full campaign",
                  "Baselines", "How to read the REPORT", "Layout"):
        assert f"## {title}" in text, title


def test_no_commit_hashes_or_issue_numbers():
    text = _text() + (ROOT / "docs" / "findings.md").read_text()
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, hashes
    assert not re.search(r"(issue|#)\s*#?\d", text, re.IGNORECASE)


def test_report_names_commits_only_in_its_provenance_section():
    """The REPORT's claims and explanations speak of code versions; the commits are in Provenance."""
    p = ROOT / "results" / "REPORT.md"
    if not p.exists():
        pytest.skip("results/REPORT.md not generated yet (make reproduce)")
    prose = p.read_text().split("\n## Provenance")[0]
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, hashes[:5]


def test_local_links_exist():
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", _text()):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


def test_claims_and_tally_match_the_regenerated_table():
    ev = _table("claims")
    ev = ev[ev["gpu"] == ev["gpu"].iloc[0]]        # the primary GPU model's rows: the README's counts
    full = load_claims().set_index("id")
    counts = ev["verdict"].value_counts()
    tally = ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)
    assert f"Verdicts over {len(ev)} claims: **{tally}**" in _text()
    rows = _rows(_section("Results at a glance"), "claim")
    assert len(rows) >= 8
    for cid, paper, ours, unit, n, interval, verdict in rows:
        cid = cid.strip("`")
        r = ev[ev["id"] == cid].iloc[0]
        row = pd.Series({**full.loc[cid].to_dict(), **r.to_dict()})
        assert (paper, ours, unit, n, interval, verdict) == \
            (paper_value_shown(row), ours_compact(row), r["unit"], r["n"], r["interval"], r["verdict"]), cid


def test_claim_map_matches_the_experiments_table():
    ex = _table("experiments").set_index("experiment")
    rows = _rows(_section("Claim map"), "experiment")
    assert [r[0].strip("`") for r in rows] == list(ex.index)
    for name, gpus, minutes, mb, command in rows:
        e = ex.loc[name.strip("`")]
        assert (gpus, minutes, mb, command.strip("`")) == \
            (e["gpus"], e["gpu_time_min"] or "-", e["disk_mb"], e["command"]), name
