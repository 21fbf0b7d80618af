"""analysis.clean: repetitions whose measured run captured CUDA graphs are set aside only where the
same configuration has a clean repetition; bookkeeping (coverage, counts) still sees every cell."""
from __future__ import annotations
from pathlib import Path
import pandas as pd
import pytest

from analysis.clean import CAPTURE_LIMIT, all_cells, prefer_clean, set_aside_line
from analysis.common import aggregate, identity
from analysis.load import Results

COLS = ["system.name", "workload.prefix_len", "rep"]


def _res(rows: list[tuple]) -> Results:
    """rows: (system, Lp, rep, capture_s, duration_s, tok/s)."""
    cells = pd.DataFrame([{"sweep": "grid", "cell_id": f"rep={r},system={s},Lp={lp}", "path": f"grid/{s}/{lp}/{r}",
                           "kind": "serving", "system.name": s, "workload.prefix_len": lp, "rep": r,
                           "cuda_graph_capture_s": cap, "duration_s": dur, "output_throughput_tok_s": thr}
                          for s, lp, r, cap, dur, thr in rows])
    return Results(root=Path("."), cells=cells, failures=pd.DataFrame(), kernels=pd.DataFrame(), config_columns=COLS)


def test_affected_repetition_set_aside_only_beside_a_clean_one():
    res = _res([("granikv", 512, 0, 0.20, 2.0, 900.0),      # 10% of the run capturing: affected
                ("granikv", 512, 1, 0.00, 2.0, 1000.0),     # clean twin
                ("granikv", 1024, 0, 0.20, 2.0, 800.0),     # affected, no clean twin: kept
                ("sglang_default", 512, 0, float("nan"), 2.0, 700.0),   # capture unknown: counts as clean
                ("sglang_default", 512, 1, 0.01, 2.0, 710.0)])          # 0.5%: below the limit
    out = prefer_clean(res)
    assert list(out.set_aside["path"]) == ["grid/granikv/512/0"]
    assert out.set_aside["set_aside_for"].iloc[0] == "grid/granikv/512/1"
    assert out.set_aside["capture_share"].iloc[0] == pytest.approx(0.10)
    assert len(out.cells) == 4 and len(res.cells) == 5                  # the input is left as it was
    a = aggregate(out.cells, identity(out.cells, COLS), "output_throughput_tok_s").set_index(
        ["system.name", "workload.prefix_len"])
    assert a.loc[("granikv", 512), "mean"] == 1000.0 and a.loc[("granikv", 512), "n"] == 1
    assert a.loc[("granikv", 1024), "mean"] == 800.0
    assert a.loc[("sglang_default", 512), "n"] == 2
    assert sorted(all_cells(out)["path"]) == sorted(res.cells["path"])
    assert list(all_cells(out).columns) == list(res.cells.columns)
    line = set_aside_line(out)
    assert line.startswith("Repetitions set aside (1)") and "grid granikv: 1 (10.0%-10.0% of the run)" in line
    assert f"{CAPTURE_LIMIT:.0%}" in line


def test_set_aside_only_when_a_twin_is_clean():
    res = _res([("granikv", 512, 0, 0.0, 2.0, 1.0), ("granikv", 512, 1, 0.5, 2.0, 1.0)])
    res2 = _res([("granikv", 512, 0, 0.5, 2.0, 1.0), ("granikv", 1024, 0, 0.0, 2.0, 1.0)])
    assert len(prefer_clean(res).set_aside) == 1
    assert prefer_clean(res2) is res2 and set_aside_line(res2) == ""


def test_other_configurations_never_stand_in():
    # a clean cell of another Lp or system must not push an affected one out
    res = _res([("granikv", 512, 0, 0.5, 2.0, 1.0), ("granikv", 1024, 0, 0.0, 2.0, 1.0),
                ("sglang_default", 512, 0, 0.0, 2.0, 1.0)])
    assert prefer_clean(res) is res


def test_instrumented_cells_never_stand_in_for_plain_ones():
    # a profiled run (torch.profiler on: slower by design) of the same configuration is another measurement
    res = _res([("granikv", 512, 0, 0.5, 2.0, 1000.0), ("granikv", 512, 1, 0.0, 2.0, 300.0)])
    res.cells["profile_steps"] = [0, 20]
    assert prefer_clean(res) is res                       # the plain cell stays, though only it captured
    res.cells["profile_steps"] = [0, 0]
    assert len(prefer_clean(res).set_aside) == 1          # a plain clean twin does replace it


def test_a_rerun_sweep_supersedes_older_cells_of_the_same_configuration_only():
    from analysis.clean import prefer_rerun
    from runners.campaign import CampaignItem

    def cell(sweep, s, lp, rep, thr):
        return {"sweep": sweep, "cell_id": f"rep={rep},system={s},Lp={lp}", "path": f"{sweep}/{s}/{lp}/{rep}",
                "kind": "serving", "system.name": s, "workload.prefix_len": lp, "rep": rep,
                "cuda_graph_capture_s": 0.0, "duration_s": 2.0, "output_throughput_tok_s": thr}

    rows = [cell("headline_llama3_8b_tp1", "granikv", 512, 0, 900.0),       # old, rerun exists: set aside
            cell("headline_llama3_8b_tp1", "granikv", 512, 1, 950.0),       # old rep 1 too (rep is not identity)
            cell("headline_llama3_8b_tp1", "granikv", 1024, 0, 800.0),      # the rerun has not reached it: kept
            cell("sharegpt_matrix_llama3_8b_tp1", "granikv", 512, 0, 920.0),  # the other superseded sweep
            cell("other_sweep", "granikv", 512, 0, 700.0),                  # not superseded: kept
            cell("headline_onecommit_llama3_8b_tp1", "granikv", 512, 0, 1000.0),
            cell("headline_onecommit_llama3_8b_tp1", "granikv", 512, 1, 1010.0)]
    res = Results(root=Path("."), cells=pd.DataFrame(rows), failures=pd.DataFrame(), kernels=pd.DataFrame(),
                  config_columns=COLS)
    item = CampaignItem(id="onecommit", what="x", issue=28, sweep="headline_onecommit",
                        supersedes=["headline_llama3_8b_tp1", "sharegpt_matrix_llama3_8b_tp1"])
    out = prefer_rerun(res, [item])
    assert sorted(out.set_aside["path"]) == ["headline_llama3_8b_tp1/granikv/512/0",
                                             "headline_llama3_8b_tp1/granikv/512/1",
                                             "sharegpt_matrix_llama3_8b_tp1/granikv/512/0"]
    assert set(out.set_aside["superseded_by"]) == {"headline_onecommit_llama3_8b_tp1"}
    assert set(out.set_aside["set_aside_for"]) == {"headline_onecommit_llama3_8b_tp1/granikv/512/0"}
    kept = set(out.cells["path"])
    assert "headline_llama3_8b_tp1/granikv/1024/0" in kept and "other_sweep/granikv/512/0" in kept
    assert sorted(all_cells(out)["path"]) == sorted(res.cells["path"])
    assert list(all_cells(out).columns) == list(res.cells.columns)
    line = set_aside_line(out)
    assert "Cells superseded (3)" in line and "2 of headline_llama3_8b_tp1 by headline_onecommit_llama3_8b_tp1" in line
    assert "Repetitions set aside" not in line
    # nothing rerun yet: nothing set aside
    assert prefer_rerun(Results(root=Path("."), cells=pd.DataFrame(rows[:5]), failures=pd.DataFrame(),
                                kernels=pd.DataFrame(), config_columns=COLS), [item]).set_aside.empty
    with pytest.raises(ValueError, match="supersedes must be a list of sweep folder names"):
        CampaignItem(id="bad", what="x", issue=28, sweep="headline", supersedes="headline_llama3_8b_tp1")


def test_reruns_table_sets_each_superseded_configuration_beside_its_rerun():
    """tables/reruns: one row per configuration a rerun superseded, the older repetitions' mean and code
    version next to the rerun's; configurations the rerun has not reached, and unrelated sweeps, have no row."""
    from analysis.clean import prefer_rerun
    from analysis.exhibits.campaign.reruns import table
    from runners.campaign import CampaignItem

    def cell(sweep, s, lp, rep, thr, commit):
        return {"sweep": sweep, "cell_id": f"rep={rep},system={s},Lp={lp}", "path": f"{sweep}/{s}/{lp}/{rep}",
                "kind": "serving", "system.name": s, "workload.prefix_len": lp, "rep": rep,
                "cuda_graph_capture_s": 0.0, "duration_s": 2.0, "output_throughput_tok_s": thr,
                "provenance.git_commit": commit, "provenance.git_dirty": False}

    old, new = "multiprefix_uniform_a100_40gb", "multiprefix_uniform_a100_40gb_pool_eviction"
    rows = [cell(old, "granikv", 4, 0, 800.0, "a" * 40), cell(old, "granikv", 16, 0, 500.0, "b" * 40),
            cell(old, "granikv", 64, 0, 100.0, "b" * 40), cell(old, "sglang_default", 4, 0, 400.0, "a" * 40),
            cell(new, "granikv", 4, 0, 880.0, "c" * 40), cell(new, "granikv", 16, 0, 600.0, "c" * 40),
            cell(new, "granikv", 16, 1, 620.0, "d" * 40)]
    res = Results(root=Path("."), cells=pd.DataFrame(rows), failures=pd.DataFrame(), kernels=pd.DataFrame(),
                  config_columns=COLS)
    assert table(res).empty                                   # nothing superseded before prefer_rerun
    item = CampaignItem(id="evict", what="x", issue=28, sweep="multiprefix_uniform_pool_eviction",
                        overrides=["hardware=a100_40gb"], supersedes=[old])
    t = table(prefer_rerun(res, [item])).set_index("workload.prefix_len")
    assert sorted(t.index) == [4, 16] and set(t["system"]) == {"granikv"}
    assert (t.loc[4, "before"], t.loc[4, "after"], t.loc[4, "code_before"], t.loc[4, "code_after"]) == \
        (800.0, 880.0, "aaaaaaa", "ccccccc")
    assert (t.loc[16, "n_after"], t.loc[16, "after"], t.loc[16, "code_after"]) == (2, 610.0, "2 versions")
    assert t.loc[16, "after_over_before"] == pytest.approx(1.22)
    assert set(t["superseded_sweep"]) == {old} and set(t["rerun_sweep"]) == {new}
