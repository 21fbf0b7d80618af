"""Small analysis helpers: the decision table a cell could use, markdown digests of long JSON values,
and the report's note on headline pairs measured at different code versions."""
from __future__ import annotations
import json

import pandas as pd

from analysis.common import json_digest
from granikv.rawio import applicable_table
from analysis.report.steps import split_pairs_line


def _rule(hq, hkv, choice, gpu="NVIDIA H200"):
    return {"gpu": gpu, "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": 128, "lp_min": 0, "meff_min": 0,
            "choice": choice}


def test_applicable_table_keeps_the_rules_of_the_cells_gpu_and_per_rank_shape():
    table = [_rule(32, 8, "dense"), _rule(10, 2, "paged"), _rule(10, 2, "cascade", gpu="A100"),
             {"choice": "cascade", "lp_min": 0}]                      # no gpu / shape: applies everywhere
    cfg = {"tp": 4, "model": {"num_heads": 40, "num_kv_heads": 8, "head_dim": 128},
           "hardware": {"gpu_name": "NVIDIA H200", "decision_table": table}}
    got = applicable_table(cfg)["hardware"]["decision_table"]
    assert got == [_rule(10, 2, "paged"), {"choice": "cascade", "lp_min": 0}]
    assert cfg["hardware"]["decision_table"] == table                  # the input is not changed
    tp1 = applicable_table({**cfg, "tp": 1, "model": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}})
    assert tp1["hardware"]["decision_table"][0] == _rule(32, 8, "dense")
    assert applicable_table({"hardware": {"decision_table": table}}) == {"hardware": {"decision_table": table}}


def test_the_plugin_table_belongs_to_the_plugins_granikv_only():
    plug = [{**_rule(32, 8, "dense"), "graph": True}, {**_rule(10, 2, "paged"), "graph": True}]
    cfg = {"tp": 1, "model": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
           "hardware": {"gpu_name": "NVIDIA H200", "decision_table": [], "plugin_graph_table": plug}}
    for name in ("granikv", "sglang_server", "sglang_server_hydragen"):   # they never read it
        assert "plugin_graph_table" not in applicable_table({**cfg, "system": {"name": name}})["hardware"]
    got = applicable_table({**cfg, "system": {"name": "sglang_server_granikv"}})["hardware"]["plugin_graph_table"]
    assert got == [plug[0]]                                           # its GPU and per-rank shape only


def test_json_digest_tells_tables_apart_and_leaves_other_values():
    a, b = json.dumps([_rule(32, 8, "dense")]), json.dumps([_rule(32, 8, "paged")])
    assert json_digest(a).startswith("1 rules #") and json_digest(a) != json_digest(b)
    assert json_digest(a) == json_digest(a) and json_digest(0.88) == 0.88 and json_digest("h200") == "h200"


def test_split_pairs_line_names_pairs_measured_at_different_commits():
    t = pd.DataFrame([
        {"config": "m TP=4", "workload.prefix_len": 512, "system.name": "granikv", "commit": "aaa", "prefill_p50_ms": 30.0},
        {"config": "m TP=4", "workload.prefix_len": 512, "system.name": "sglang_default", "commit": "aaa", "prefill_p50_ms": 31.0},
        {"config": "m TP=4", "workload.prefix_len": 4096, "system.name": "granikv", "commit": "bbb", "prefill_p50_ms": 65.9},
        {"config": "m TP=4", "workload.prefix_len": 4096, "system.name": "sglang_default", "commit": "aaa", "prefill_p50_ms": 37.5},
        {"config": "other", "workload.prefix_len": 512, "system.name": "granikv", "commit": "ccc", "prefill_p50_ms": 1.0},
    ])
    line = split_pairs_line(t, "m TP=4")
    assert "Lp=4096 (GraniKV at 1 code version, sglang_default at 1; p50 prefill step 65.9 vs 37.5 ms)" in line
    assert "bbb" not in line                                      # commits belong in the table, not the prose
    assert "Lp=512" not in line
    assert split_pairs_line(t[t["workload.prefix_len"] == 512], "m TP=4") == ""
    assert split_pairs_line(t, "m TP=4", lps=[512.0]) == ""
    casc = pd.concat([t, pd.DataFrame([{"config": "m TP=4", "workload.prefix_len": 512, "system.name": "sglang_cascade",
                                        "commit": "ddd", "prefill_p50_ms": 50.0}])])
    assert "Lp=512 (GraniKV at 1 code version, sglang_cascade at 1;" in split_pairs_line(casc, "m TP=4", "sglang_cascade",
                                                                          lps=[512.0])


def test_a_system_keeps_its_colour_in_every_figure():
    from analysis.plots import system_colors, system_order
    full = system_colors(["granikv", "hydragen", "sglang_cascade", "sglang_default"])
    part = system_colors(["granikv", "sglang_default"])                # a panel without two of the systems
    assert part["granikv"] == full["granikv"] and part["sglang_default"] == full["sglang_default"]
    assert len({full[s] for s in full}) == len(full)                    # distinct colours
    assert system_order(["granikv", "zz_new", "sglang_default"]) == ["sglang_default", "granikv", "zz_new"]


def test_a_figure_draws_one_configuration_per_point():
    """Two configurations at one (Lp, B) (the grid's cell and the engine bench's, other warm-up): the
    figure takes the configuration with the most rows in the panel, never a mean of the two."""
    from analysis.plots import one_per_point
    t = pd.DataFrame({"workload.prefix_len": [512, 1024, 8192, 8192, 16384],
                      "workload.batch": [256] * 5,
                      "warmup_requests": [256, 256, 0, 256, 256],
                      "system": ["sglang_cascade"] * 5, "status": ["measured"] * 5,
                      "mean": [1.0, 2.0, 10.0, 30.0, 4.0], "ratio_vs_sglang_default": [1.1, 1.2, 1.8, 2.3, 2.9]})
    kept, n = one_per_point(t, ["workload.prefix_len", "workload.batch"])
    assert n == 1 and list(kept["mean"]) == [1.0, 2.0, 30.0, 4.0]
    alone = t[t["warmup_requests"] == 0]                 # a point of its own is drawn whatever its configuration
    k, n = one_per_point(alone, ["workload.prefix_len"])
    assert n == 0 and k is alone
