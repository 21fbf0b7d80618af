"""The headline figures (and every lines_vs figure) as a reviewer reads them: one y axis for every panel,
one row of panels per GPU model with each GPU's ratios over its own SGLang default, legends at 8 pt below
the panels, and each panel naming what it lacks (systems, Lp) and where the paper has no value."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import plots
from analysis.exhibits.headline import headline
from analysis.load import Results
from figure_rules import catch, check_all, shared_y

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
LPS = (512, 1024, 2048, 4096, 8192, 16384)


def _cells(gpu: str, configs=(("llama3_8b", 1), ("qwen25_14b", 2)), systems=("sglang_default", "granikv"),
           speed: float = 1.0) -> list[dict]:
    rows = []
    for model, tp in configs:
        for lp in LPS:
            for s in systems:
                tok = 1000.0 * speed * (1.0 + (lp / 16384) * (s != "sglang_default"))
                rows.append({"model.name": model, "tp": tp, "workload.kind": "sharegpt", "workload.batch": 256,
                             "workload.num_prefixes": 1, "workload.prefix_len": lp, "system.name": s, "rep": 0,
                             "output_throughput_tok_s": tok, "tpot_p50_ms": 10.0, "ttft_p50_ms": 100.0,
                             "provenance.gpu_name": gpu})
    return rows


def _res(rows: list[dict]) -> Results:
    cells = pd.DataFrame(rows)
    conf = ["model.name", "tp", "workload.kind", "workload.batch", "workload.num_prefixes", "workload.prefix_len",
            "system.name", "rep"]
    return Results(root=Path("."), cells=cells, failures=pd.DataFrame(), kernels=pd.DataFrame(), config_columns=conf)


def test_headline_ratio_puts_each_gpu_beside_the_other_on_one_y_axis(tmp_path, monkeypatch):
    # the H100 runs at half the H200's speed, both systems alike: its ratios are the H200's, its tok/s half
    res = _res(_cells(H200) + _cells(H100, speed=0.5))
    caught = catch(monkeypatch, plots)
    t = headline.build(res, tmp_path)
    fig = caught.figs["headline_ratio"]
    axes = [ax for ax in fig.axes if ax.axison]
    assert len(axes) == 4                                     # 2 GPUs x 2 configurations
    assert shared_y(axes)
    titles = [ax.get_title() for ax in axes]
    assert sum(H100 in x for x in titles) == 2 and sum(H200 in x for x in titles) == 2
    assert all(H200 in x for x in titles[:2])                 # the primary GPU model's row first, the H100's below
    data = caught.data["headline_ratio"]
    h100 = data[data["panel"].str.startswith(H100)]
    assert len(h100) == 2 * len(LPS) and h100["ratio_vs_sglang_default"].max() == 2.0   # over the H100's own default
    assert H100 in fig._suptitle.get_text() and H200 in fig._suptitle.get_text()
    check_all(fig)
    thr = caught.figs["headline_throughput"]
    assert shared_y([ax for ax in thr.axes if ax.axison])
    check_all(thr)
    assert len(t) > 0                                         # the written table is still built


def test_one_gpu_is_one_row_of_panels_named_in_the_title(tmp_path, monkeypatch):
    caught = catch(monkeypatch, plots)
    headline.build(_res(_cells(H200)), tmp_path)
    fig = caught.figs["headline_ratio"]
    axes = [ax for ax in fig.axes if ax.axison]
    assert len(axes) == 2 and shared_y(axes)
    assert all(H200 not in ax.get_title() for ax in axes) and H200 in fig._suptitle.get_text()
    check_all(fig)


def test_a_gpu_without_a_measured_row_is_neither_drawn_nor_named(tmp_path, monkeypatch):
    # the H100's cells are of a system the headline table does not hold (real SGLang): no H100 row is built
    other = [{**r, "system.name": "sglang_server"} for r in _cells(H100, systems=("sglang_default",))]
    caught = catch(monkeypatch, plots)
    headline.build(_res(_cells(H200) + other), tmp_path)
    fig = caught.figs["headline_ratio"]
    assert len([ax for ax in fig.axes if ax.axison]) == 2
    assert H200 in fig._suptitle.get_text() and H100 not in fig._suptitle.get_text()
    check_all(fig)


def test_a_panel_names_the_systems_and_lp_it_lacks_and_a_missing_paper_value(tmp_path, monkeypatch):
    rows = _cells(H200, configs=(("llama3_8b", 1),), systems=("sglang_default", "sglang_cascade", "hydragen",
                                                              "granikv"))
    # qwen25_32b TP=2 (no paper value): granikv and the default at 8K and 16K only; no cascade, no hydragen
    rows += [r for r in _cells(H200, configs=(("qwen25_32b", 2),)) if r["workload.prefix_len"] >= 8192]
    caught = catch(monkeypatch, plots)
    headline.build(_res(rows), tmp_path)
    fig = caught.figs["headline_ratio"]
    title = {ax.get_title().split("\n")[0]: ax.get_title().replace("\n", " ") for ax in fig.axes if ax.axison}
    lone = title["qwen25_32b TP=2"]
    assert "Lp 512-4K: not measured" in lone and "sglang_cascade, hydragen: not measured" in lone
    assert "no paper value for qwen25_32b TP=2" in lone
    assert "not measured" not in title["llama3_8b TP=1"] and "no paper value" not in title["llama3_8b TP=1"]
    check_all(fig)


def test_missing_note_names_runs_of_lp():
    xs = [512, 1024, 2048, 4096, 8192, 16384]
    note = plots.missing_note({"granikv": {8192.0, 16384.0, 512.0}, "hydragen": {8192.0}}, xs, "workload.prefix_len",
                              ["hydragen", "granikv", "sglang_cascade"])
    assert note == ("Lp 1K-4K: not measured; sglang_cascade: not measured; "
                    "hydragen: not measured at Lp 512, 16K")
