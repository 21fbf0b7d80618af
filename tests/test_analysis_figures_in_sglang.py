"""in_sglang's figure: at most five series per panel (a system's other plugin settings in a panel of their
own), the systems in their own colours, tok/s panels on one y axis and ratio panels on another, the
heterogeneous k=4 bars labelled without overlap, legends at 8 pt below the panels."""
from __future__ import annotations

import pandas as pd
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
