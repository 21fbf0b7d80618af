"""README.md as an evaluator reads it: short, the two commands of a fresh machine first, no commit hashes or
issue numbers, and every number it quotes equal to the regenerated tables: its claims table and tally
(results/tables/claims.csv), each main claim linked to its rerun command (results/tables/rerun.md), the
campaign's GPU-hours (results/tables/gpu_hours.csv) and the engine-fidelity ratios (engine_fidelity.csv)."""
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
    rows = _rows(_section("Results at a glance"), "claim | paper (A100) | ours (H200)")
    assert len(rows) >= 8
    _check_claim_rows(rows, ev, full)


def _check_claim_rows(rows: list[list[str]], ev: pd.DataFrame, full: pd.DataFrame) -> None:
    """Each README row equals its claim's row of ``ev`` (one GPU model's rows of claims.csv); a verdict is marked
    with a dagger exactly where the claim's cells span several commits of our code (code_versions)."""
    for name, paper, ours, unit, n, interval, verdict in rows:
        m = re.fullmatch(r"\[`(\w+)`\]\(results/tables/rerun\.md#(\w+)\)", name)
        assert m and m.group(1) == m.group(2), f"{name}: not a link to its rerun command"
        cid = m.group(1)
        r = ev[ev["id"] == cid].iloc[0]
        row = pd.Series({**full.loc[cid].to_dict(), **r.to_dict()})
        spans = " versions: " in str(r.get("code_versions", ""))     # cells of several commits: marked with a dagger
        assert verdict.endswith("†") == spans, (cid, verdict, r.get("code_versions"))
        assert (paper, ours, unit, n, interval, verdict.rstrip("†")) == \
            (paper_value_shown(row), ours_compact(row), r["unit"], r["n"], r["interval"], r["verdict"]), cid


def test_h100_claims_are_its_own_rows_every_one_shown():
    """The README's H100 table: every claim evaluated on the H100 (claims.csv's H100 rows), each equal to its
    row there, never to the H200's."""
    ev = _table("claims")
    h100 = ev[ev["gpu"].str.contains("H100")]
    rows = _rows(_section("Results at a glance"), "claim | paper (A100) | ours (H100)")
    assert sorted(re.search(r"#(\w+)\)", r[0]).group(1) for r in rows) == sorted(h100["id"])
    _check_claim_rows(rows, h100, load_claims().set_index("id"))


def test_main_claims_link_to_their_rerun_command():
    rr = _table("rerun")
    text = (TABLES / "rerun.md").read_text()
    for (name, *_rest) in _rows(_section("Results at a glance"), "claim | paper (A100) | ours (H200)"):
        cid = re.search(r"#(\w+)\)", name).group(1)
        assert f"\n## {cid}\n" in text, cid                     # the anchor the link names
        cmds = rr.loc[rr["claim"] == cid, "command"]
        assert len(cmds) and all(c.startswith(("python -m runners.", "torchrun ")) for c in cmds), cid
    head = rr[rr["claim"] == "headline_llama8b"]["command"]
    assert any("workload.prefix_len=16384" in c for c in head)    # the deciding cells alone, not the whole sweep


def test_gpu_hours_line_is_the_generated_one():
    from analysis.exhibits.campaign.claim_map import gpu_hours_line
    g = _table("gpu_hours").astype({"gpus": int, "gpu_hours": float})
    line = gpu_hours_line(g)
    assert line in _section("Claim map"), line
    assert line in (TABLES / "gpu_hours.md").read_text()
    ex = _table("experiments")
    assert set(g["gpus"]) == {int(x) for x in ex["gpus"]}


def test_engine_fidelity_numbers_are_the_generated_ones():
    """The README's fidelity row and every "within N% of real SGLang" (README, docs) from engine_fidelity.csv."""
    t = _table("engine_fidelity")
    t = t[(t["workload.kind"] == "sharegpt") & (t["status"] == "measured")]
    t = t[t["gpu"] == "NVIDIA H200"]                 # the README's row is the H200's ("on the same H200")
    assert "on the same H200" in _section("Baselines")
    rows = {r[0]: r[1:] for r in _rows(_section("Baselines"), "Lp")}
    ours = next(v for k, v in rows.items() if "sglang_default" in k)
    gran = next(v for k, v in rows.items() if k.startswith("GraniKV"))
    assert ours == list(t["ours/real"]) and gran == list(t["granikv/real"])
    worst = max(abs(float(x) - 1) for x in t["ours/real"])
    within = int(-(-round(worst * 100, 6) // 1))                     # the percentage rounded up
    for doc in (README, ROOT / "docs" / "real_sglang.md"):
        said = re.findall(r"within (\d+)% of real SGLang", doc.read_text().replace("\n", " "))
        assert said and all(int(x) == within for x in said), (doc.name, said, within)
    # the H100's range, its own rows (the engine's sglang_default over real SGLang on that GPU)
    h = _table("engine_fidelity")
    h = h[(h["workload.kind"] == "sharegpt") & (h["status"] == "measured") & h["gpu"].str.contains("H100")]
    pct = sorted(round((float(x) - 1) * 100, 1) for x in h["ours/real"])
    for doc in (README, ROOT / "docs" / "findings.md"):
        said = re.findall(r"(\d+\.\d)-(\d+\.\d)% above (?:it|real SGLang's) on the H100|on the H100, (\d+\.\d)-(\d+\.\d)% above",
                          doc.read_text().replace("\n", " "))
        assert said, doc.name
        assert all([float(x) for x in m if x] == [pct[0], pct[-1]] for m in said), (doc.name, said, pct)


def test_dispatch_share_is_the_claims_number_everywhere():
    """The dispatcher's share of the decode step: one number (the claim's, over GraniKV's cells) wherever
    README, findings.md and the REPORT (with its claim details) state it."""
    ev = _table("claims")
    ev = ev[ev["gpu"] == ev["gpu"].iloc[0]].set_index("id")      # the primary GPU model's rows (they come first)
    share = ev.loc["dispatch_overhead_share", "ours_shown"].split(" ")[0]
    docs = [README, ROOT / "docs" / "findings.md", ROOT / "results" / "REPORT.md", TABLES / "claim_details.md"]
    said = []
    for d in docs:   # another GPU model's section (REPORT) or table (README) states that GPU's own share
        text = re.sub(r"### `\w+ on [^`]+`.*?(?=\n### |\Z)", "", d.read_text(), flags=re.S)
        text = re.sub(r"\nOn the H100, its own rows.*?(?=\n\n[^|])", "", text, flags=re.S).replace("\n", " ")
        said += [(d.name, x) for x in re.findall(r"share of the decode step[^.]*?([0-9.]+)% (?:or less|in granikv's)", text)]
        said += [(d.name, x) for x in re.findall(r"`dispatch_overhead_share`[^|]*\| [^|]* \| ([0-9.]+) \|", text)]
    assert {n for n, _ in said} >= {"README.md", "findings.md", "claim_details.md"}, said
    assert all(x == share for _, x in said), (share, said)


IN_SGLANG_SYSTEMS = {"GraniKV": "granikv", "SGLang-Cascade": "sglang_cascade", "HydraGen": "hydragen"}
IN_SGLANG_COLUMNS = [("headline", "512"), ("headline", "2048"), ("headline", "8192"), ("headline", "16384"),
                     ("hetero k=4", None)]


def test_in_sglang_numbers_are_the_generated_ones():
    """Every ratio of the README's in-SGLang table (system, GPU model, graph form, n) is a measured row of
    in_sglang.csv with that key, and "not measured" is said exactly where no such row was measured."""
    t = _table("in_sglang")
    rows = _rows(_section("Baselines"), "system in SGLang")
    assert rows
    for row in rows:
        name, key, values = row[0], row[1], row[2:]
        gpu, graphs, n = [x.strip() for x in key.split(",", 2)]
        sel = t[(t["system"] == IN_SGLANG_SYSTEMS[name]) & t["gpu"].str.contains(gpu)
                & (t["decode_graphs"] == graphs)]
        assert len(values) == len(IN_SGLANG_COLUMNS), row
        for value, (kind, lp) in zip(values, IN_SGLANG_COLUMNS):
            at = sel[(sel["set"] == kind) & ((sel["workload.prefix_len"] == lp) if lp else True)]
            measured = at[at["status"] == "measured"]
            if value == "not measured":
                assert measured.empty, (row, kind, lp)
                continue
            assert value.rstrip("*") in set(measured["sglang_x"]), (row, kind, lp, list(measured["sglang_x"]))
            if n.isdigit():
                hit = measured[measured["sglang_x"] == value.rstrip("*")]
                assert str(n) in set(hit["n_sglang"]), (row, kind, lp, list(hit["n_sglang"]))


def test_claims_over_several_code_versions_are_counted_as_the_report_counts_them():
    ev = _table("claims")
    spans = ev[ev["code_versions"].str.contains(" versions: ") & (ev["verdict"] != "not measured")]
    said = re.search(r"two or more commits of our code \((\d+) today", _text().replace("\n", " "))
    assert said and int(said.group(1)) == len(spans)
    report = (ROOT / "results" / "REPORT.md").read_text()
    assert f"{len(spans)} of the claims above read cells measured at two or more commits" in report
