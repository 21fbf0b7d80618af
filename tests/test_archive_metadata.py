"""What an archived release carries for its Available badge: the license, CITATION.cff (the artifact, and the
paper it reproduces) and .zenodo.json (the archive's metadata), each parseable, with the keys their readers need,
and one license throughout; README says how to archive a release."""
from __future__ import annotations
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SPDX = "Apache-2.0"
PAPER = {"arxiv": "2608.15584", "authors": [("Jinhyun", "Jeon"), ("Sungjoo", "Yoo")], "year": 2026}


def test_license_is_the_full_apache_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability." in text
    assert "Copyright 2026 the granikv-repro authors" in text and "[yyyy]" not in text


def test_citation_cff_cites_the_artifact_and_the_paper():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    for key in ("cff-version", "message", "title", "authors", "type", "version", "license"):
        assert cff.get(key), key
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["license"] == SPDX
    if "doi" in cff:                                     # set once a release is archived
        assert re.fullmatch(r"10\.5281/zenodo\.\d+", str(cff["doi"])), cff["doi"]
    papers = [r for r in cff.get("references", []) + [cff.get("preferred-citation") or {}]
              if PAPER["arxiv"] in json.dumps(r)]
    assert papers, "the paper is neither under references nor the preferred citation"
    p = papers[0]
    assert p["type"] == "article" and p["year"] == PAPER["year"] and "GraniKV" in p["title"]
    assert [(a["given-names"], a["family-names"]) for a in p["authors"]] == PAPER["authors"]


def test_zenodo_json_describes_the_archive():
    z = json.loads((ROOT / ".zenodo.json").read_text())
    for key in ("title", "description", "creators", "license", "related_identifiers", "upload_type"):
        assert z.get(key), key
    assert z["upload_type"] == "software" and z["license"] == SPDX
    assert all(c.get("name") for c in z["creators"])
    rel = [r for r in z["related_identifiers"] if PAPER["arxiv"] in r["identifier"]]
    assert rel and rel[0]["scheme"] == "arxiv" and rel[0]["relation"] == "isSupplementTo"
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert z["version"] == str(cff["version"]) and z["title"] == cff["title"]


def test_readme_says_how_to_archive_a_release():
    text = (ROOT / "README.md").read_text()
    sec = text[text.index("## Archiving a release"):]
    sec = sec[:sec.find("\n## ", 1) if "\n## " in sec[1:] else None]
    for what in ("git tag", "git archive", "results/raw", "Zenodo", "CITATION.cff", "doi"):
        assert what in sec, what
