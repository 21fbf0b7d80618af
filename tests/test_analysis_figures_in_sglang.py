"""in_sglang's figure: at most five series per panel (a system's other plugin settings in a panel of their
own), the systems in their own colours, tok/s panels on one y axis and ratio panels on another, the
heterogeneous k=4 bars labelled without overlap, legends at 8 pt below the panels."""
from __future__ import annotations

import pandas as pd
import pytest
from matplotlib.colors import to_rgb

from analysis.exhibits.sglang import in_sglang
from figure_rules import catch, check_all, series, shared_y


def _table() -> pd.DataFrame:
    runs = [("sglang_default", "", ""), ("sglang_cascade", "composed", "fast"),
            ("sglang_cascade", "multilevel", "flashinfer"), ("hydragen", "", "flashinfer"), ("granikv", "", "fast"),
            ("granikv", "", "flashinfer")]
    rows = []
    for st, lps in (("headline", (512, 2048, 8192, 16384)), ("hetero k=4", (8192,))):
        for lp in lps:
            for i, (s, impl, plan) in enumerate(runs):
                x = 1.0 if s == "sglang_default" else 0.8 + 0.1 * i + lp / 16384
                rows.append({"set": st, "workload.prefix_len": lp, "system": s, "cascade_impl": impl,
                             "decode_plan": plan, "sglang_tok_s": 5000 * x, "sglang_x": x, "engine_tok_s": 6000 * x,
                             "engine_x": x * 1.1, "status": "measured"})
    return pd.DataFrame(rows, columns=in_sglang.COLS)


def test_in_sglang_figure_keeps_the_rules(tmp_path, monkeypatch):
    caught = catch(monkeypatch, in_sglang)
    in_sglang.draw(_table(), tmp_path)
    fig = caught.figs["in_sglang"]
    check_all(fig)
    by = {ax.get_title(): ax for ax in fig.axes}
    assert shared_y([by["output tok/s in SGLang"], by["output tok/s in the engine"]])
    ratio = [ax for t, ax in by.items() if "over" in t or "other plugin settings" in t]
    assert len(ratio) == 3 and shared_y(ratio)
    other = series(by["in SGLang, other plugin settings (in the table)"])
    assert other == ["sglang_cascade (multilevel, flashinfer)", "granikv (flashinfer)"]
    # hydragen ran with one setting only (not today's): its main series, named with the setting
    assert "hydragen (flashinfer)" in series(by["in SGLang, over real SGLang default"])
    for ax in fig.axes:                   # within a panel, no two series share a colour
        cols = [to_rgb(line.get_color()) for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert len(cols) == len(set(cols)), ax.get_title()


def test_a_second_gpu_gets_its_own_column_never_a_shared_panel(tmp_path, monkeypatch):
    h200 = _table().assign(gpu="NVIDIA H200")
    today = h200[(h200["set"] == "headline") & h200["decode_plan"].isin(["fast", ""])
                 & h200["cascade_impl"].isin(["composed", ""])]
    h100 = today.assign(gpu="NVIDIA H100 80GB HBM3", sglang_x=today["sglang_x"] * 1.2,
                        sglang_tok_s=today["sglang_tok_s"] * 0.9)
    caught = catch(monkeypatch, in_sglang)
    in_sglang.draw(pd.concat([h200, h100], ignore_index=True), tmp_path)
    fig = caught.figs["in_sglang"]
    check_all(fig)
    by = {ax.get_title(): ax for ax in fig.axes}
    right = [ax for t, ax in by.items() if t.startswith("NVIDIA H100 80GB HBM3: ")]
    assert len(right) == 2
    ratio = by["NVIDIA H100 80GB HBM3: in SGLang, over its real SGLang default"]
    assert shared_y([ratio, by["in SGLang, over real SGLang default"]])
    assert shared_y([by["NVIDIA H100 80GB HBM3: output tok/s in SGLang"], by["output tok/s in SGLang"]])
    # today's settings only (hydragen's is not today's), and the engine's GraniKV on that GPU model beside them
    assert series(ratio) == ["sglang_cascade", "granikv", "granikv in the engine, H100"]
    h200 = by["in SGLang, over real SGLang default"]
    assert {line.get_marker() for line in h200.get_lines() if not line.get_label().startswith("_")} == {"o"}
    assert [line.get_marker() for line in ratio.get_lines() if not line.get_label().startswith("_")] == ["D", "D", "s"]
    engine = [line for line in ratio.get_lines() if line.get_label() == "granikv in the engine, H100"][0]
    want = h100[h100["system"] == "granikv"].sort_values("workload.prefix_len")["engine_x"]
    assert list(engine.get_ydata()) == pytest.approx(list(want)) and engine.get_linestyle() == "--"
    assert "right column: today's plugin on NVIDIA H100 80GB HBM3" in fig._suptitle.get_text()


def test_the_second_gpus_heterogeneous_rows_are_bars_named_with_it(tmp_path, monkeypatch):
    """The right column's GPU model's heterogeneous k=4 rows at today's settings join the bar panel, over its own
    SGLang default, each label ending with the GPU; its rows of earlier settings do not; labels never overlap."""
    h200 = _table().assign(gpu="NVIDIA H200")
    today = h200[h200["decode_plan"].isin(["fast", ""]) & h200["cascade_impl"].isin(["composed", ""])]
    h100 = today.assign(gpu="NVIDIA H100 80GB HBM3", sglang_x=today["sglang_x"] * 1.2, engine_x=float("nan"))
    old = h200[(h200["set"] == "hetero k=4") & (h200["decode_plan"] == "flashinfer")].assign(gpu="NVIDIA H100 80GB HBM3")
    caught = catch(monkeypatch, in_sglang)
    in_sglang.draw(pd.concat([h200, h100, old], ignore_index=True), tmp_path)
    fig = caught.figs["in_sglang"]
    check_all(fig)
    bars = {ax.get_title(): ax for ax in fig.axes}["heterogeneous k=4, A100-40GB KV budget"]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    named = [x for x in labels if x.endswith(", H100")]
    assert sorted(x.split("\n")[0] for x in named) == ["granikv", "sglang_cascade"]   # hydragen: not today's plan
    assert all("flashinfer" not in x for x in named)
    assert len(labels) - len(named) == 5                  # the first GPU's five rows, every setting
