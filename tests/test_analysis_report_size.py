"""results/REPORT.md stays short for an evaluator (under 50 KB): per claim both numbers, the interval, the
deciding cells by their results/raw folder and at most three numbers of explanation; what it leaves out is in
generated documents beside the tables (each claim in full, beyond the paper, coverage, provenance), linked."""
from __future__ import annotations
import re
from pathlib import Path

import pytest

from analysis.report.claims import EXPLAINED, NUMBER, gist

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "results" / "REPORT.md"
TABLES = ROOT / "results" / "tables"


def _report() -> str:
    if not REPORT.exists():
        pytest.skip("results/REPORT.md not generated yet (make reproduce)")
    return REPORT.read_text()


def _sections(text: str) -> dict[str, str]:
    body = text.split("\n## Claim by claim", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"\n### `(\w+(?: on [^`]+)?)`\n", body)     # a claim's row on another GPU model: "<id> on <GPU>"
    return dict(zip(parts[1::2], parts[2::2]))


def test_report_is_under_50_kb():
    assert len(_report().encode()) <= 50 * 1024


def test_each_claim_section_is_short_and_names_its_folder():
    text = _report()
    secs = _sections(text)
    links = re.findall(r"^\| \[\w+\]\(#([\w-]+)\) \|", text, re.M)        # the claims table's rows, in order
    assert links and [t.lower().replace(" ", "-") for t in secs] == links and any(" on " in t for t in secs)
    # another GPU model's row without an explanation has no section: its table row links to it in full
    details = (TABLES / "claim_details.md").read_text()
    for slug in re.findall(r"^\| \[\w+\]\(tables/claim_details\.md#([\w-]+)\) \|", text, re.M):
        assert "-on-" in slug and f"### `{slug.split('-on-')[0]} on " in details, slug
    for title, sec in secs.items():
        cid = title.split(" on ")[0]
        assert f"(tables/claim_details.md#{cid})" in sec and f"(tables/rerun.md#{cid})" in sec, cid
        if sec.strip().startswith("**not measured**"):
            continue
        assert "paper " in sec and "ours " in sec, cid
        why = [ln for ln in sec.splitlines()
               if ln.startswith("- ") and not ln.startswith(("- Deciding cells", "- More:", "- Cells in", "- [in full]"))]
        assert sum(len(NUMBER.findall(ln.split(": ", 1)[-1])) for ln in why) <= EXPLAINED, (cid, why)
    folders = [s for s in secs.values() if re.search(r"(Deciding cells: .*, in|- Cells in) `[\w.-]+/`", s)]
    assert len(folders) >= len(secs) - 3                    # every measured claim but the bench-only ones
    for title, sec in secs.items():                          # another GPU model's row: short, its GPU in the heading
        if " on " in title and not sec.strip().startswith("**not measured**"):
            assert len(sec.encode()) < 600 and title.split(" on ")[1] not in sec, title


def test_what_the_report_leaves_out_is_linked_and_generated():
    text = _report()
    for doc in ("claim_details", "beyond_the_paper", "campaign_coverage", "provenance", "rerun"):
        assert f"tables/{doc}.md" in text, doc
        assert (TABLES / f"{doc}.md").exists(), doc
    details = (TABLES / "claim_details.md").read_text()
    for cid in _sections(text):
        assert f"### `{cid}`" in details, cid
    prov = (TABLES / "provenance.md").read_text()
    assert "## Provenance" in text and "Code versions behind the numbers" in prov and "Paper hardware" in prov
    assert "## Beyond the paper" in (TABLES / "beyond_the_paper.md").read_text()


def test_gist_keeps_three_numbers_and_whole_sentences():
    text = ("Ours is short of the paper's value by more than 10%. Where the time goes at Lp=16384: GraniKV 53.4 s = "
            "decode 29.3 s + prefill 21.6 s. Decode steps alone: a / b = 2.06x; prefill 0.91x, so 1.62x "
            "(tables/headline_steps). Both prefill the same prompts, 4 of them.")
    g = gist(text)
    assert g.startswith("Ours is short of the paper's value: Decode steps alone")
    assert len(NUMBER.findall(g.split(": ", 1)[1])) <= EXPLAINED and "53.4" not in g and "4 of them" not in g
    assert gist("Why it differs from the paper: Lp=512: 1.0x / 1.1x / 0.9x / 0.8x (tables/headline_steps).") == \
        "Why it differs: measured in tables/headline_steps."
    assert "Both" not in gist("Why it differs from the paper: a 1, 2, 3, 4, 5. Both systems prefill alike.")
