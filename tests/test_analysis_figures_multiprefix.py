"""multiprefix's figure: tok/s as lines on log axes (no bars there), ratios as bars on a linear axis, one y
axis per row; a configuration with SGLang default alone gets no (empty) ratio panel but a line below the
figure; two configurations of one mode and budget are told apart in their titles."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.exhibits.multiprefix import multiprefix
from analysis.load import Results
from figure_rules import catch, check_all, shared_y

KEYS = ["mode", "config", "hardware.name", "system", "hardware.decision_table", "workload.prefix_lens"]


def _rows(mode, budget, table, systems, ks, scale=1.0):
    return [{"mode": mode, "config": "llama3_8b TP=1", "hardware.name": budget, "system": s,
             "hardware.decision_table": table, "workload.prefix_lens": None, "workload.num_prefixes": k,
             "mean": scale * 1e4 / k * (1 + j), "ratio_vs_sglang_default": 1 + j, "vs_own_k1": 1.0 / k, "n": 1,
             "status": "measured"} for j, s in enumerate(systems) for k in ks]


def test_multiprefix_figure_keeps_the_rules(tmp_path, monkeypatch):
    allsys = ["sglang_default", "sglang_cascade", "hydragen", "granikv"]
    m = pd.DataFrame(_rows("uniform", "h200", "[1 rule]", allsys, (1, 4, 16, 64))
                     + _rows("heterogeneous", "a100_40gb", "[1 rule]", allsys, (4, 8), scale=0.5)
                     + _rows("heterogeneous", "a100_40gb", "[2 rules]", ["sglang_default"], (4, 8))
                     + _rows("heterogeneous", "h200", "[1 rule]", allsys, (4, 8)))
    caught = catch(monkeypatch, multiprefix)
    res = Results(root=Path("."), cells=pd.DataFrame(), failures=pd.DataFrame(), kernels=pd.DataFrame())
    multiprefix.draw(res, m, KEYS, tmp_path)
    fig = caught.figs["multiprefix"]
    check_all(fig)
    top = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    bot = [ax for ax in fig.axes if ax.containers]
    assert len(top) == len(bot) == 3                        # the SGLang-default-alone configuration: no panel
    assert shared_y(top) and shared_y(bot)
    assert all(not ax.containers for ax in top)
    titles = [ax.get_title().replace("\n", " ") for ax in top]
    assert len(set(titles)) == 3
    notes = " ".join(t.get_text().replace("\n", " ") for t in fig.texts)
    assert "SGLang default alone" in notes and "heterogeneous, llama3_8b TP=1, KV budget a100_40gb" in notes
