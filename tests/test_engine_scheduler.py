"""Scheduler admission: the shared prefix is matched once per admission; prefix ids, HOT starts and
in-batch waits come from that one match and the placement's locked index node."""
from __future__ import annotations
import random

import pytest
import torch

from granikv.config import HardwareConfig
from granikv.engine.scheduler import Scheduler, Seq, Storage
from granikv.kv import KVCache
from granikv.request import Request


def make(hot_fraction=0.5, cap=4096):
    st = Storage(KVCache(1, cap, 1, 1, hot_fraction, torch.float32, "cpu"), enable_hot=hot_fraction > 0)
    return st, Scheduler(st, HardwareConfig(kv_budget_tokens=cap, max_running_requests=64), max_rows=64)


def reqs():
    rng = random.Random(0)
    p, q, r = ([rng.randrange(1000) for _ in range(n)] for n in (40, 20, 30))
    pre = [p, p, p + q, p[:20], r, p, r]  # same, extension, strict prefix (splits p's node), other, again
    return [Request(i, x + [1000 + i, 2000 + i], 3, 0.0, shared_len=len(x), prefix_class=0) for i, x in enumerate(pre)]


@pytest.mark.parametrize("hot_fraction", [0.5, 0.0])
def test_one_match_per_admission_and_ids_from_the_node(hot_fraction):
    st, sch = make(hot_fraction)
    calls = []
    real = st.index.match
    st.index.match = lambda tokens: calls.append(len(tokens)) or real(tokens)
    rs = reqs()
    sch.add([Seq(r, i) for i, r in enumerate(rs)])
    seqs = sch.admit_arrived(0.0)
    assert len(seqs) == len(rs)
    assert calls == [r.shared_len for r in rs]  # one match of the shared prefix per request, nothing else
    st.index.match = real
    for a in seqs:
        pre_a = tuple(a.req.prompt_ids[:a.req.shared_len])
        runs = real(list(pre_a)).hot_runs
        assert a.placement.hot_runs == runs  # what a fresh match says now
        whole = len(runs) == 1 and runs[0][0] == 0 and runs[0][2] == a.req.shared_len
        assert a.hot_start == (runs[0][1] if whole else -1)
        assert (a.hot_start >= 0) == (hot_fraction > 0)
        assert torch.equal(a.slots[:a.req.shared_len], real(list(pre_a)).slots)
        for b in seqs:  # equal id <=> identical prefix (hence identical slots) among live requests
            assert (a.prefix_id == b.prefix_id) == (pre_a == tuple(b.req.prompt_ids[:b.req.shared_len]))


def test_waits_on_the_writers_of_the_kv_it_reads():
    _, sch = make()
    rs = reqs()
    sch.add([Seq(r, i) for i, r in enumerate(rs)])
    s = sch.admit_arrived(0.0)
    assert [x.where for x in s] == ["hot", "hit", "hot", "hit", "hot", "hit", "hit"]
    assert [x.cached_len for x in s] == [0, 40, 40, 20, 0, 40, 30]
    assert s[0].waits_on == [] and s[4].waits_on == []
    assert s[1].waits_on == [s[0]] and s[3].waits_on == [s[0]] and s[6].waits_on == [s[4]]
    assert s[2].waits_on == [s[0]]  # reads p (written by 0); writes q itself
    assert s[5].waits_on == [s[0]]  # p + q's writer (2) writes beyond what 5 reads
    assert [w.req.rid for w in sch.writers] == [0, 2, 4]
