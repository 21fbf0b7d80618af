"""Slab grouping of a decode batch's KV index rows, vectorised, against a plain loop."""
from __future__ import annotations
import random

import torch

from granikv.sglang_plugin.hot_region import HotRegion
from granikv.sglang_plugin.slab_groups import group_by_slab
from test_sglang_plugin_model import ModelAllocator


def loop_reference(rows, seq_lens, starts, lens, ids):
    """The same answer, one request at a time."""
    sid, hot, off = [], [], []
    table = list(zip(starts.tolist(), lens.tolist(), ids.tolist()))
    for row, n in zip(rows.tolist(), seq_lens.tolist()):
        hit = None
        if n > 0:
            for s, ln, i in table:
                if s <= row[0] < s + ln:
                    hit = (s, ln, i)
        if hit is None:
            sid.append(-1), hot.append(0), off.append(-1)
            continue
        s, ln, i = hit
        run = 0
        while run < min(n, len(row)) and row[run] == row[0] + run and row[run] < s + ln:
            run += 1
        sid.append(i), hot.append(run), off.append(row[0] - s)
    order = sorted(range(len(sid)), key=lambda b: sid[b])  # Python's sort is stable
    groups = []
    for b in order:
        if groups and groups[-1][0] == sid[b]:
            groups[-1][1] += 1
        else:
            groups.append([sid[b], 1])
    return sid, hot, off, order, groups


def check_against_loop(rows, seq_lens, starts, lens, ids):
    g = group_by_slab(rows, seq_lens, starts, lens, ids)
    sid, hot, off, order, groups = loop_reference(rows, seq_lens, starts, lens, ids)
    assert g.slab_id.tolist() == sid
    assert g.hot_len.tolist() == hot
    assert g.offset.tolist() == off
    assert g.order.tolist() == order
    assert g.group_slab.tolist() == [s for s, _ in groups]
    assert g.group_size.tolist() == [n for _, n in groups]
    assert g.group_start.tolist() == [sum(n for _, n in groups[:i]) for i in range(len(groups))]
    return g


def test_a_hand_made_batch():
    # slabs: id 7 at [1, 11), id 3 at [11, 15) (adjacent: a run must stop at its slab's end), id 5 at [20, 26)
    starts, lens, ids = torch.tensor([20, 1, 11]), torch.tensor([6, 10, 4]), torch.tensor([5, 7, 3])
    rows = torch.tensor([
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],   # slab 7 whole, then contiguous into slab 3: run 10
        [1, 2, 3, 40, 41, 42, 0, 0, 0, 0, 0, 0],   # slab 7, 3 tokens, then COLD
        [30, 31, 32, 33, 0, 0, 0, 0, 0, 0, 0, 0],  # COLD: no slab
        [20, 21, 22, 23, 24, 25, 26, 27, 0, 0, 0, 0],  # slab 5 whole (26 is past its end)
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 51],   # slab 7, but its sequence is 4 long
        [13, 14, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0],   # inside slab 3 at offset 2
        [1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0],      # empty sequence
    ], dtype=torch.int32)
    seq = torch.tensor([12, 6, 4, 8, 4, 3, 0])
    g = check_against_loop(rows, seq, starts, lens, ids)
    assert g.slab_id.tolist() == [7, 7, -1, 5, 7, 3, -1]
    assert g.hot_len.tolist() == [10, 3, 0, 6, 4, 2, 0]
    assert g.offset.tolist() == [0, 0, -1, 0, 0, 2, -1]
    assert g.group_slab.tolist() == [-1, 3, 5, 7] and g.group_size.tolist() == [2, 1, 1, 3]
    assert g.order.tolist() == [2, 6, 5, 3, 0, 1, 4]  # stable within a group


def test_random_batches_match_the_loop():
    rnd = random.Random(0)
    for trial in range(40):
        a = ModelAllocator(400)
        region = HotRegion(a, rnd.choice([0, 50, 120]))
        for _ in range(rnd.randint(0, 8)):
            region.alloc(rnd.randint(1, 30))
        if region.pool.slabs and rnd.random() < 0.5:
            region.free(rnd.choice(region.pool.slabs))
        starts, lens, ids = region.table()
        B, W = rnd.randint(0, 12), rnd.randint(1, 40)
        rows = torch.randint(0, 401, (B, W), dtype=torch.int32)
        for b in range(B):  # most rows start with a (part of a) slab, some cross its end
            if region.pool.slabs and rnd.random() < 0.7:
                s = rnd.choice(region.pool.slabs)
                st = s.start + rnd.randint(0, s.length - 1) if rnd.random() < 0.3 else s.start
                n = rnd.randint(1, W)
                rows[b, :n] = torch.arange(st, st + n, dtype=torch.int32)
                if rnd.random() < 0.3 and n > 1:
                    rows[b, rnd.randint(1, n - 1)] = 0  # a break inside the run
        seq = torch.tensor([rnd.randint(0, W) for _ in range(B)], dtype=torch.int64)
        check_against_loop(rows, seq, starts, lens, ids)


def test_no_slabs_and_empty_batches():
    rows = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    empty = torch.empty(0, dtype=torch.int64)
    g = group_by_slab(rows, torch.tensor([3]), empty, empty, empty)
    assert g.slab_id.tolist() == [-1] and g.hot_len.tolist() == [0] and g.group_slab.tolist() == [-1]
    g = group_by_slab(torch.empty(0, 4, dtype=torch.int32), torch.empty(0), torch.tensor([1]), torch.tensor([4]),
                      torch.tensor([0]))
    assert g.slab_id.numel() == 0 and g.group_slab.numel() == 0


def test_width_bounds_the_run():
    rows = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)
    g = group_by_slab(rows[:, :3], torch.tensor([8]), torch.tensor([1]), torch.tensor([8]), torch.tensor([0]))
    assert g.hot_len.tolist() == [3]  # only the 3 columns given are looked at
