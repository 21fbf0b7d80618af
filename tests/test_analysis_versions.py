"""A claim's code versions: the commits of our code its cells (numerator and baseline) ran, named per system when
they are several, real SGLang's own cells aside; and the REPORT's list of the claims that span versions."""
from __future__ import annotations

import pandas as pd

from analysis.common import parse_selectors
from analysis.report.claims import spanning, spanning_commits, versions_line
from analysis.common import code_version
from analysis.load import Results
from analysis.verdict.context import Context
from analysis.verdict.versions import at_version, claim_versions, newest_first

A, B, C = "a" * 40, "b" * 40, "c" * 40


def _cells(rows: list[tuple[str, int, str, bool]]) -> pd.DataFrame:
    return pd.DataFrame([{"system.name": s, "workload.prefix_len": lp, "provenance.git_commit": commit,
                          "provenance.git_dirty": dirty, "output_throughput_tok_s": 1.0}
                         for s, lp, commit, dirty in rows])


SEL = parse_selectors("workload.prefix_len=16384;system.name=granikv")
BASE = parse_selectors("system.name=sglang_default")


def test_one_commit_is_one_version():
    f = _cells([("granikv", 16384, A, False), ("granikv", 16384, A, False), ("sglang_default", 16384, A, False)])
    v = claim_versions(f, SEL, BASE)
    assert (v.shown, v.spans, v.counted) == ("aaaaaaa", False, "one commit")


def test_a_baseline_of_another_commit_spans_and_is_named_per_system():
    f = _cells([("granikv", 16384, A, False), ("sglang_default", 16384, B, False), ("sglang_default", 16384, C, False)])
    v = claim_versions(f, SEL, BASE)
    assert v.spans and v.shown == "3 versions: granikv aaaaaaa; sglang_default bbbbbbb, ccccccc"
    assert v.counted == "3 commits: granikv 1 commit; sglang_default 2 commits"


def test_cells_outside_the_selection_do_not_count():
    # another Lp at another commit: not this claim's cells
    f = _cells([("granikv", 16384, A, False), ("sglang_default", 16384, A, False), ("granikv", 512, B, False)])
    assert not claim_versions(f, SEL, BASE).spans


def test_real_sglang_is_not_our_code_and_a_dirty_tree_is_its_own_version():
    f = _cells([("granikv", 16384, A, False), ("sglang_server", 16384, B, False)])
    v = claim_versions(f, SEL, parse_selectors("system.name=sglang_server"))
    assert (v.shown, v.spans) == ("aaaaaaa", False)
    assert list(code_version(_cells([("granikv", 1, A, True)]))) == ["aaaaaaa+"]
    f = _cells([("granikv", 16384, A, True), ("sglang_default", 16384, A, False)])
    assert claim_versions(f, SEL, BASE).spans


def test_the_report_lists_spanning_claims_and_only_those_with_their_commits_under_provenance():
    ev = pd.DataFrame([
        {"id": "one", "gpu": "NVIDIA H200", "verdict": "reproduced", "code_versions": "aaaaaaa",
         "code_versions_counted": "one commit", "spans_versions": False},
        {"id": "two", "gpu": "NVIDIA H200", "verdict": "reproduced", "spans_versions": True,
         "code_versions": "2 versions: granikv aaaaaaa; sglang_default bbbbbbb",
         "code_versions_counted": "2 commits: granikv 1 commit; sglang_default 1 commit",
         "one_version": "1.93 (reproduced) at bbbbbbb"},
        {"id": "gone", "gpu": "NVIDIA H200", "verdict": "not measured", "code_versions": "",
         "code_versions_counted": "", "spans_versions": True}])
    ev["primary"] = True
    lines = spanning(ev)
    rows = [x for x in lines if x.startswith("| [")]
    assert len(rows) == 1 and "[`two`](#two)" in rows[0] and "| 2 commits |" in rows[0]
    assert rows[0].endswith("| 1.93 (reproduced) |")                       # at one version, its commit left out
    assert "1 of the claims above" in " ".join(lines) and "bbbbbbb" not in " ".join(lines)   # no commit in prose
    prov = [x for x in spanning_commits(ev) if x.startswith("| two")]
    assert len(prov) == 1 and "bbbbbbb" in prov[0]
    assert spanning(ev.iloc[[0]]) == [] and spanning_commits(ev.iloc[[0]]) == []
    assert versions_line(ev.iloc[0]) == "Code version: one commit."
    assert versions_line(ev.iloc[1]).startswith("Code versions: 2 commits: granikv 1 commit")


def test_versions_newest_first_and_one_version_keeps_real_sglang():
    """A claim's versions, the one measured last first; a Context cut to one version holds that version's cells
    of our code and real SGLang's own cells of any commit, nothing else."""
    f = _cells([("granikv", 16384, A, False), ("sglang_default", 16384, B, False), ("granikv", 16384, B, False),
                ("sglang_server", 16384, C, False)])
    f["provenance.started_at"] = ["2026-01-03", "2026-01-01", "2026-01-02", "2026-01-04"]
    assert newest_first(f, SEL, BASE) == ["aaaaaaa", "bbbbbbb"]      # real SGLang's commit is not ours
    res = Results(root=".", cells=f, failures=pd.DataFrame(), kernels=pd.DataFrame())
    cut = at_version(Context.over(res, f), "bbbbbbb")
    assert sorted(cut.frame("cells")["system.name"]) == ["granikv", "sglang_default", "sglang_server"]
    assert set(cut.frame("cells")["provenance.git_commit"]) == {B, C} and len(cut.res.cells) == 3
