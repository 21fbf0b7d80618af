"""analysis.in_sglang on a cells frame shaped as the loader writes it: each in-SGLang system over real
SGLang default and each engine system over the engine's default at the same point, the plugin's
counters as shares and per-step host time, a window with no counted step as not recorded, and
planned points without a cell as not measured rows."""
from __future__ import annotations
from pathlib import Path
import numpy as np
import pandas as pd
import pytest

from analysis.exhibits.sglang import in_sglang
from analysis.measures import sglang as sglang_measures
from analysis.report import sglang as sglang_lines
from analysis.load import Results

BASE = {"model.name": "llama3_8b", "tp": 1, "workload.batch": 256, "profile_steps": 0, "nsys": False}
HEAD = {**BASE, "workload.kind": "sharegpt", "workload.num_prefixes": 1, "hardware.name": "h200",
        "workload.prefix_lens": None}
HET = {**BASE, "workload.kind": "multiprefix", "workload.num_prefixes": 4, "hardware.name": "a100_40gb",
       "workload.prefix_lens": "[2048, 4096, 8192, 16384]"}


def cell(where, system, lp, tok, rep=0, **plugin):
    return {**where, "system.name": system, "workload.prefix_len": lp, "rep": rep, "output_throughput_tok_s": tok,
            "itl_p50_ms": 1e4 / tok, "ttft_p50_ms": 100.0, **{f"plugin.{k}": v for k, v in plugin.items()}}


# the config columns of the graph-form tests' cells
GRAPH_COLS = ["model.name", "tp", "workload.batch", "workload.kind", "workload.num_prefixes", "hardware.name",
              "workload.prefix_lens", "system.name", "workload.prefix_len", "rep", "system.decode_plan",
              "system.server.extra_args"]


def results(rows):
    return Results(root=Path("."), cells=pd.DataFrame(rows), failures=pd.DataFrame(), kernels=pd.DataFrame())


def test_ratios_counters_and_not_measured_rows(tmp_path):
    counters = {"steps": 10, "split_steps": 8, "rows.dense": 300, "rows.paged": 100, "rows.cascade": 0,
                "rows.hydragen": 0, "plan_us": 8000.0, "prefix_us": 800.0, "index_us": 1600.0, "make_us": 2400.0,
                "load_us": 3200.0, "dispatch_us": 80.0}
    rows = [cell(HEAD, "sglang_server", 16384, 2000, rep=0), cell(HEAD, "sglang_server", 16384, 3000, rep=1),
            cell(HEAD, "sglang_server_granikv", 16384, 5000, **counters),
            cell(HEAD, "sglang_default", 16384, 2400), cell(HEAD, "granikv", 16384, 6000),
            cell(HET, "sglang_server", 8192, 4000), {**cell(HET, "sglang_server_cascade", 8192, 3900, steps=0, split_steps=0, plan_us=0.0),
                                              "system.cascade_impl": "multilevel"}]
    t = in_sglang.in_sglang_table(results(rows)).set_index(["set", "workload.prefix_len", "system"])
    g = t.loc[("headline", 16384, "granikv")]
    assert g["sglang_x"] == pytest.approx(5000 / 2500) and g["engine_x"] == pytest.approx(6000 / 2400)
    assert (g["n_sglang"], g["n_engine"]) == (1, 1) and g["status"] == "measured"
    assert g["rows_dense"] == pytest.approx(0.75) and g["rows_paged"] == pytest.approx(0.25)
    assert g["plan_us"] == pytest.approx(1000.0) and g["load_us"] == pytest.approx(400.0)
    assert t.loc[("headline", 16384, "sglang_default"), "n_sglang"] == 2
    # every planned headline Lp has all four systems, measured or not
    assert t.loc[("headline", 512, "hydragen"), "status"] == "not measured"
    assert {lp for s, lp, _ in t.index if s == "headline"} == set(in_sglang.HEADLINE_LPS)
    # a counter window that counted no step recorded nothing: NaN, never 0
    c = t.loc[("hetero k=4", 8192, "sglang_cascade")]
    assert c["sglang_x"] == pytest.approx(3900 / 4000) and np.isnan(c["plan_us"]) and np.isnan(c["rows_paged"])
    assert c["cascade_impl"] == "multilevel" and g["cascade_impl"] == ""
    assert np.isnan(c["engine_x"]) and c["n_engine"] == 0
    assert t.loc[("hetero k=4", 8192, "granikv"), "status"] == "not measured"
    # a rerun on another GPU path is a row of its own, never pooled with the old one
    rows.append({**cell(HET, "sglang_server_cascade", 8192, 4400), "system.cascade_impl": "composed"})
    t2 = in_sglang.in_sglang_table(results(rows))
    cas = t2[(t2["set"] == "hetero k=4") & (t2["system"] == "sglang_cascade")].set_index("cascade_impl")
    assert cas.loc["composed", "sglang_x"] == pytest.approx(4400 / 4000) and cas.loc["multilevel", "n_sglang"] == 1
    in_sglang.build(results(rows), tmp_path)
    assert (tmp_path / "tables" / "in_sglang.md").exists() and (tmp_path / "figures" / "in_sglang.csv").exists()


def test_decode_plan_splits_rows_todays_setting_first(tmp_path):
    """Cells of one system and point that ran different plugin decode plans are separate rows (never
    pooled), today's (fast) first; SGLang default has no variant; a cell from before the key existed
    is its loader default (flashinfer)."""
    rows = [cell(HEAD, "sglang_server", 512, 10000),
            {**cell(HEAD, "sglang_server_granikv", 512, 7000), "system.decode_plan": "flashinfer"},
            {**cell(HEAD, "sglang_server_granikv", 512, 9000), "system.decode_plan": "fast"},
            {**cell(HEAD, "sglang_server_cascade", 512, 8000), "system.decode_plan": "fast",
             "system.cascade_impl": "composed"},
            {**cell(HEAD, "sglang_server_cascade", 512, 5000), "system.decode_plan": "flashinfer",
             "system.cascade_impl": "multilevel"}]
    t = in_sglang.in_sglang_table(results(rows))
    at = t[(t["set"] == "headline") & (t["workload.prefix_len"] == 512)]
    g = at[at["system"] == "granikv"]
    assert list(g["decode_plan"]) == ["fast", "flashinfer"] and list(g["cascade_impl"]) == ["", ""]
    assert list(g["sglang_x"]) == pytest.approx([0.9, 0.7]) and list(g["n_sglang"]) == [1, 1]
    c = at[at["system"] == "sglang_cascade"]
    assert list(zip(c["cascade_impl"], c["decode_plan"])) == [("composed", "fast"), ("multilevel", "flashinfer")]
    assert [in_sglang.is_current(r) for _, r in c.iterrows()] == [True, False]
    base = at[at["system"] == "sglang_default"]
    assert len(base) == 1 and base["decode_plan"].iloc[0] == ""
    in_sglang.build(results(rows), tmp_path)
    assert (tmp_path / "figures" / "in_sglang.png").exists()


def test_claims_use_todays_plugin_settings_where_a_configuration_has_them():
    cols = ["model.name", "tp", "workload.batch", "workload.kind", "workload.num_prefixes", "hardware.name",
            "workload.prefix_lens", "system.name", "workload.prefix_len", "rep", "system.decode_plan",
            "system.cascade_impl"]
    rows = [cell(HEAD, "sglang_server", 16384, 2500),
            {**cell(HEAD, "sglang_server_granikv", 16384, 5000), "system.decode_plan": "flashinfer"},
            {**cell(HEAD, "sglang_server_granikv", 16384, 4000), "system.decode_plan": "fast"},
            {**cell(HEAD, "sglang_server_granikv", 8192, 4600), "system.decode_plan": "flashinfer"},
            {**cell(HEAD, "sglang_server_cascade", 16384, 3500), "system.decode_plan": "flashinfer",
             "system.cascade_impl": "multilevel"},
            {**cell(HEAD, "sglang_server_cascade", 16384, 4200), "system.decode_plan": "fast",
             "system.cascade_impl": "composed"},
            {**cell(HEAD, "sglang_server_hydragen", 16384, 4100), "system.decode_plan": "flashinfer",
             "system.cascade_impl": "multilevel"}]
    df = pd.DataFrame(rows)
    kept = sglang_measures.prefer_current(df, cols)
    tok = kept.groupby(["system.name", "workload.prefix_len"])["output_throughput_tok_s"].apply(list).to_dict()
    assert tok[("sglang_server_granikv", 16384)] == [4000]          # today's (fast) only: never pooled
    assert tok[("sglang_server_granikv", 8192)] == [4600]           # only older settings measured: kept
    assert tok[("sglang_server_cascade", 16384)] == [4200]
    assert tok[("sglang_server_hydragen", 16384)] == [4100] and tok[("sglang_server", 16384)] == [2500]
    # the claims' cells frame goes through it
    from analysis.verdict.context import Context
    res = Results(root=Path("."), cells=df.assign(kind="serving"), failures=pd.DataFrame(), kernels=pd.DataFrame(),
                  config_columns=cols)
    got = Context(res).frame("cells")
    assert sorted(got.loc[got["system.name"] == "sglang_server_granikv", "output_throughput_tok_s"]) == [4000, 4600]


def test_todays_variants_are_the_plugin_systems_configs():
    import yaml
    conf = Path(__file__).resolve().parents[1] / "conf" / "system"
    for name in ("cascade", "hydragen", "granikv"):
        y = yaml.safe_load((conf / f"sglang_server_{name}.yaml").read_text())
        assert y["decode_plan"] == sglang_measures.VARIANTS["decode_plan"]
    assert yaml.safe_load((conf / "sglang_server_cascade.yaml").read_text())["cascade_impl"] == \
        sglang_measures.VARIANTS["cascade_impl"]


def test_no_cells_is_every_point_not_measured(tmp_path):
    t = in_sglang.build(results([]), tmp_path)
    assert set(t["status"]) == {"not measured"}
    assert (tmp_path / "figures" / "in_sglang.png").exists()


def test_the_claim_line_names_both_systems_and_the_plugin_counters():
    counters = {"steps": 4, "split_steps": 4, "rows.dense": 40, "rows.paged": 0, "rows.cascade": 0, "rows.hydragen": 0,
                "plan_us": 4000.0}
    rows = [cell(HET, "sglang_server", 8192, 4000), cell(HET, "sglang_server_granikv", 8192, 5000, **counters)]
    claim = pd.Series({"selectors": "workload.kind=multiprefix;workload.num_prefixes=4;hardware.name=a100_40gb;"
                                    "system.name=sglang_server_granikv", "baseline": "system.name=sglang_server"})
    line = sglang_lines.claim_line(results(rows), claim)
    assert "sglang_server_granikv against sglang_server" in line and "ITL p50 2.0 vs 2.5 ms" in line
    assert "100.0% dense" in line and "host plan 1000 us" in line and "not logged" in line
    assert "host time per replayed step" not in line                        # no histogram recorded
    assert sglang_lines.claim_line(results(rows[:1]), claim) == ""          # no cell of the claim's system
    from granikv.sglang_plugin.path_stats import host_bin
    hist = {f"replay_hist.own.{host_bin(50.0)}": 8, f"replay_hist.own.{host_bin(900.0)}": 2,
            f"replay_hist.total.{host_bin(700.0)}": 10}
    rows[1] = cell(HET, "sglang_server_granikv", 8192, 5000, **counters, **hist)
    line = sglang_lines.claim_line(results(rows), claim)
    assert "the plugin's own 54 us median, 939 us p90; 724 us median with the rest decode's plan" in line


def test_the_claim_line_names_the_cells_with_earlier_settings_it_leaves_out():
    rows = [cell(HEAD, "sglang_server", 16384, 2500),
            {**cell(HEAD, "sglang_server_granikv", 16384, 4000), "system.decode_plan": "fast"},
            {**cell(HEAD, "sglang_server_granikv", 16384, 5000), "system.decode_plan": "flashinfer"}]
    cols = list(pd.DataFrame(rows).columns)
    res = Results(root=Path("."), cells=pd.DataFrame(rows), failures=pd.DataFrame(), kernels=pd.DataFrame(),
                  config_columns=[c for c in cols if c.startswith(("system.", "workload.", "model.", "hardware.", "tp"))])
    claim = pd.Series({"selectors": "workload.kind=sharegpt;workload.prefix_len=16384;system.name=sglang_server_granikv",
                       "baseline": "system.name=sglang_server"})
    line = sglang_lines.claim_line(res, claim)
    assert "ITL p50 2.5 vs 4.0 ms" in line                                  # today's cell (4000 tok/s) only
    assert "not used, measured with earlier plugin settings: decode_plan=flashinfer: 5000 tok/s (2.00x)" in line
    assert "cascade_impl" not in line


def test_the_decode_graph_form_splits_rows_and_the_claims_take_full_graphs():
    """A plugin cell's server flag names its graph form: breakable and full cells of one configuration are
    two rows, and the claims keep the full-graph cells where a configuration has them."""
    brk = "['--cuda-graph-backend-decode', 'breakable']"
    rows = [{**cell(HEAD, "sglang_server", 16384, 2500), "system.server.extra_args": "[]"},
            {**cell(HEAD, "sglang_server_granikv", 16384, 4000), "system.decode_plan": "fast",
             "system.server.extra_args": brk},
            {**cell(HEAD, "sglang_server_granikv", 16384, 5500), "system.decode_plan": "fast",
             "system.server.extra_args": "[]"},
            {**cell(HEAD, "sglang_server_granikv", 8192, 4600), "system.decode_plan": "fast",
             "system.server.extra_args": brk}]
    t = in_sglang.in_sglang_table(results(rows))
    g = t[(t["system"] == "granikv") & (t["workload.prefix_len"] == 16384)]
    assert list(g["decode_graphs"]) == ["full", "breakable"] and list(g["n_sglang"]) == [1, 1]
    assert list(g["sglang_x"]) == [5500 / 2500, 4000 / 2500]
    assert t.loc[t["system"] == "sglang_default", "decode_graphs"].fillna("").eq("").all()
    kept = sglang_measures.prefer_current(pd.DataFrame(rows), GRAPH_COLS)
    tok = kept.groupby(["system.name", "workload.prefix_len"])["output_throughput_tok_s"].apply(list).to_dict()
    assert tok[("sglang_server_granikv", 16384)] == [5500] and tok[("sglang_server_granikv", 8192)] == [4600]


def test_a_configuration_without_todays_settings_keeps_one_combination_never_two():
    """Two older combinations and no cell with today's: the claims keep the closer one (the graph form
    deciding first, then the decode plan), never both pooled."""
    brk = "['--cuda-graph-backend-decode', 'breakable']"
    rows = [{**cell(HEAD, "sglang_server_granikv", 16384, 4000), "system.decode_plan": "fast",
             "system.server.extra_args": brk},
            {**cell(HEAD, "sglang_server_granikv", 16384, 5000), "system.decode_plan": "flashinfer",
             "system.server.extra_args": brk},
            {**cell(HEAD, "sglang_server_granikv", 8192, 3000), "system.decode_plan": "flashinfer",
             "system.server.extra_args": "[]"},
            {**cell(HEAD, "sglang_server_granikv", 8192, 3900), "system.decode_plan": "fast",
             "system.server.extra_args": brk}]
    kept = sglang_measures.prefer_current(pd.DataFrame(rows), GRAPH_COLS)
    tok = kept.groupby("workload.prefix_len")["output_throughput_tok_s"].apply(list).to_dict()
    assert tok == {16384: [4000], 8192: [3000]}
    assert list(kept.columns) == list(pd.DataFrame(rows).columns)      # no derived column leaks out


def test_a_forced_path_is_an_ablation_left_out_of_the_table():
    """A plugin (or engine) cell whose dispatcher was forced (system.dispatch=*_only) is not GraniKV: it never
    enters the GraniKV row, in SGLang or in the engine; a cell from before the key counts as the table's."""
    rows = [cell(HEAD, "sglang_server", 512, 10000), cell(HEAD, "sglang_default", 512, 10000),
            {**cell(HEAD, "sglang_server_granikv", 512, 9000), "system.dispatch": "table"},
            {**cell(HEAD, "sglang_server_granikv", 512, 6000), "system.dispatch": "cascade_only"},
            cell(HEAD, "granikv", 512, 11000),
            {**cell(HEAD, "granikv", 512, 3000), "system.dispatch": "dense_only"}]
    t = in_sglang.in_sglang_table(results(rows)).set_index(["set", "workload.prefix_len", "system"])
    g = t.loc[("headline", 512, "granikv")]
    assert (g["n_sglang"], g["sglang_x"]) == (1, pytest.approx(0.9))
    assert (g["n_engine"], g["engine_x"]) == (1, pytest.approx(1.1))


def test_a_plugin_row_holds_one_code_version_the_last_measured():
    """Repetitions of a plugin system at two code versions are never pooled: the row (and the claims) keep the
    version its point was measured at last, and the table counts the cells left out; the ratio is over real
    SGLang's cells of that version's run (the same commit), the SGLang-default row itself pools every run."""
    def at(row, commit, started):
        return {**row, "provenance.git_commit": commit, "provenance.started_at": started}
    rows = [at(cell(HEAD, "sglang_server", 16384, 2000), "a" * 40, "2026-12-01T10:00:00+00:00"),
            at(cell(HEAD, "sglang_server", 16384, 3000, rep=1), "b" * 40, "2026-12-02T10:00:00+00:00"),
            at(cell(HEAD, "sglang_server_granikv", 16384, 4000), "a" * 40, "2026-12-01T10:05:00+00:00"),
            at(cell(HEAD, "sglang_server_granikv", 16384, 5000, rep=1), "b" * 40, "2026-12-02T10:05:00+00:00"),
            at(cell(HEAD, "sglang_server_granikv", 16384, 5500, rep=2), "b" * 40, "2026-12-02T11:05:00+00:00")]
    t = in_sglang.in_sglang_table(results(rows)).set_index(["set", "workload.prefix_len", "system"])
    g = t.loc[("headline", 16384, "granikv")]
    assert g["n_sglang"] == 2 and g["sglang_tok_s"] == pytest.approx(5250) and g["older_versions"] == 1
    assert g["sglang_x"] == pytest.approx(5250 / 3000) and g["base_run"] == "same" and g["n_base"] == 1
    assert t.loc[("headline", 16384, "sglang_default"), "sglang_tok_s"] == pytest.approx(2500)   # every run
    kept = sglang_measures.prefer_current(pd.DataFrame(rows), GRAPH_COLS)
    ours = kept[kept["system.name"] == "sglang_server_granikv"]
    assert sorted(ours["output_throughput_tok_s"]) == [5000, 5500] and len(kept) == 3
    assert list(kept.loc[kept["system.name"] == "sglang_server", "output_throughput_tok_s"]) == [3000]


def test_host_quantiles_pool_the_cells_histograms_and_need_every_cell_to_have_one():
    """The replayed steps' host-time quantiles of a row come from its cells' histograms summed bin by bin (never an
    average of per-cell quantiles); a row with a cell that recorded no histogram (an older plugin) gets NaN."""
    import numpy as np
    import pandas as pd

    from analysis.measures.sglang import plugin_counters
    from granikv.sglang_plugin.path_stats import host_bin

    lo, hi = str(host_bin(100.0)), str(host_bin(1000.0))
    cells = pd.DataFrame([{"plugin.steps": 10, "plugin.split_steps": 5, f"plugin.replay_hist.total.{lo}": 7,
                           f"plugin.replay_hist.own.{lo}": 7},
                          {"plugin.steps": 10, "plugin.split_steps": 5, f"plugin.replay_hist.total.{hi}": 8,
                           f"plugin.replay_hist.own.{lo}": 8}])
    out = plugin_counters(cells)
    assert 1000 <= out["host_p50_us"] < 1100             # 8 of 15 steps took 1000 us: the pooled median
    assert 100 <= out["own_p50_us"] < 110 and 100 <= out["own_p90_us"] < 110
    older = pd.concat([cells, pd.DataFrame([{"plugin.steps": 10, "plugin.split_steps": 5}])], ignore_index=True)
    assert np.isnan(plugin_counters(older)["host_p50_us"])
