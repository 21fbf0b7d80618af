"""The typed plan of one decode step: prefix classes, the path of each, the rest-of-request slots.

Every path rests on one exact decomposition (by the LSE merge):

    attention(q_i, prefix_i + rest_i) = merge(attention(q_i, prefix_i), attention(q_i, rest_i))

Requests with equal ``prefix_id`` form a prefix class; a policy (granikv.attention.policy) picks a
path per class. A class on a split-off path (cascade / dense / hydragen) has its prefix attended
apart; every request's remaining slots (all of them on the paged path) go to ONE batch decode.

``build_plan`` reads only a DecodeBatch (per-request KV slot ids, packed or as rows of a slot table,
prefix lengths, ids and HOT starts) and the policy: no KV cache object, no kernel. The plan is built
once per step and read by every layer's run().
"""
from __future__ import annotations

import bisect
import itertools
import operator
import time
from dataclasses import dataclass
from typing import Optional

import torch

from granikv.attention.batch import DecodeBatch, host_i64
from granikv.attention.policy import PATHS, PrefixPolicy


@dataclass(slots=True)
class ClassPlan:
    """One prefix class of a step: its rows (request indices), prefix and chosen prefix path."""

    prefix_id: int
    rows: list[int]
    prefix_len: int
    hot_start: int                        # first HOT row of the prefix, -1 if not one HOT run
    choice: str = "paged"                 # one of policy.PATHS
    meff: int = 0                         # B_class * Hq/Hkv (query rows per kv head)
    n_real: int = 0                       # rows that are requests (not CUDA-graph pad rows): decisions use it
    row_start: int = -1                   # rows == range(row_start, row_start + B_class), else -1 (gathered)
    slots: Optional[torch.Tensor] = None    # int64 [Lp] prefix slot ids on the device (a view of kv_indices or the slot table)


@dataclass(slots=True)
class StepPlan:
    """Everything run() needs, built once per step by ``build_plan``."""

    batch_size: int
    classes: list[ClassPlan]              # every prefix class, in order of first row
    split: list[ClassPlan]                # the classes off the paged path, same order
    rest_indptr: torch.Tensor             # int32 [B+1] (device)
    rest_indices: torch.Tensor            # int32 [nnz_rest] (device)
    rest_indptr_host: torch.Tensor        # int32 [B+1] (host copy, for FlashInfer's plan)
    choose_us: float = 0.0                # host time of the policy's choices (the dispatcher's cost)

    def structure(self) -> tuple:
        """Per split class (choice, B_class, Lp, hot_start, row_start): what a captured run() of
        this plan bakes in besides the batch size (the dense path reads the HOT slab at hot_start;
        a class of contiguous rows is read and merged as the slice at row_start)."""
        return tuple((c.choice, len(c.rows), c.prefix_len, c.hot_start, c.row_start) for c in self.split)

    def decisions(self, group: int) -> list[dict]:
        """The step trace: one dict per class (and one for the rows without a prefix)."""
        out = [{"prefix_id": c.prefix_id, "batch": len(c.rows), "meff": c.meff, "prefix_len": c.prefix_len,
                "hot": c.hot_start >= 0, "backend": c.choice} for c in self.classes]
        nopfx = self.batch_size - sum(len(c.rows) for c in self.classes)
        if nopfx:
            out.append({"prefix_id": -1, "batch": nopfx, "meff": nopfx * group, "prefix_len": 0, "hot": False,
                        "backend": "paged"})
        return out


def group_classes(batch: DecodeBatch) -> list[ClassPlan]:
    """The prefix classes of ``batch`` (:func:`group_prefix_classes` of its host lists)."""
    return group_prefix_classes(batch.prefix_ids, batch.prefix_lens, batch.hot_starts)


def group_prefix_classes(ids: list[int], lens: list[int], hots: list[int]) -> list[ClassPlan]:
    """Group rows by prefix id (>= 0 and prefix_len > 0); check members agree on the prefix.
    ``ids`` / ``lens`` / ``hots``: per row, DecodeBatch's prefix_ids / prefix_lens / hot_starts.

    Works per run of equal ids (the engine and SGLang order a decode batch by class, so a class is
    usually one run): each run is checked with one slice comparison, not row by row.
    """
    b = len(ids)
    # run boundaries, found in C (map / compress): [0, rows where the id changes..., B]
    cuts = [0, *itertools.compress(range(1, b), map(operator.ne, ids[1:], ids[:-1])), b] if b else [0]
    by_id: dict[int, ClassPlan] = {}
    for i, j in zip(cuts, cuts[1:]):
        pid, lp, hs = ids[i], lens[i], hots[i]
        if pid >= 0 and lp > 0:
            c = by_id.get(pid)
            first = i if c is None else c.rows[0]                  # the class's first row: its prefix
            if lens[i:j].count(lens[first]) != j - i or hots[i:j].count(hots[first]) != j - i:
                r = next(r for r in range(i, j) if lens[r] != lens[first] or hots[r] != hots[first])
                raise ValueError(f"DecodeBatch: requests {first} and {r} share prefix_id={pid} but have "
                                 f"prefix_len {lens[first]} vs {lens[r]} / hot_start {hots[first]} vs {hots[r]}; "
                                 "equal prefix_id must mean identical prefix slots")
            if c is None:
                by_id[pid] = ClassPlan(pid, list(range(i, j)), int(lp), int(hs))
            else:
                c.rows.extend(range(i, j))
    return list(by_id.values())


def build_plan(batch: DecodeBatch, policy: PrefixPolicy, group: int) -> StepPlan:
    """Group classes, let the policy choose each class's path, build the rest-of-request slot lists.

    ``group`` = Hq/Hkv (Meff = B_class * group). Pad rows (the last ``batch.num_pad``) do not count
    in the policy's decisions; in a class that goes ``paged`` they skip the prefix (1-token rows, as
    SGLang pads), their outputs being unused. Host work plus one async host->device copy.
    """
    name = policy.name
    b = batch.batch_size
    if batch.kv_indptr.numel() != b + 1:
        raise ValueError(f"{name}.plan: kv_indptr has {batch.kv_indptr.numel()} entries for {b} requests")
    if not (len(batch.prefix_ids) == len(batch.hot_starts) == b):
        raise ValueError(f"{name}.plan: prefix_lens/prefix_ids/hot_starts must all have {b} entries")
    if not 0 <= batch.num_pad <= b:
        raise ValueError(f"{name}.plan: num_pad={batch.num_pad} must be in [0, batch size {b}]")
    if batch.kv_indptr_host is not None:
        if batch.kv_indptr_host.device.type != "cpu" or batch.kv_indptr_host.numel() != b + 1:
            raise ValueError(f"{name}.plan: kv_indptr_host must be a host tensor of {b + 1} entries "
                             "(a copy of kv_indptr), or None")
        indptr_h = batch.kv_indptr_host.to(torch.int64)           # [B+1] host, no device sync
    else:
        indptr_h = batch.kv_indptr.to("cpu", torch.int64)         # [B+1] (a device->host copy: a sync on GPU)
    real = b - batch.num_pad                                      # rows >= real are padding
    classes = group_classes(batch)
    for c in classes:
        n = len(c.rows)
        c.meff = n * group
        c.n_real = bisect.bisect_left(c.rows, real)               # rows ascend; pad rows are the last
        # rows ascend (batch order): contiguous iff they span exactly B_class rows; the FlashInfer
        # path then reads q / writes o as slices instead of gathering and scattering
        c.row_start = c.rows[0] if c.rows[-1] - c.rows[0] + 1 == n else -1
    t_choose = time.perf_counter()
    policy.choose(classes, b)
    choose_us = (time.perf_counter() - t_choose) * 1e6            # the dispatcher's CPU time this step
    # host lists, one tensor at the end: per-class tensor ops cost ~5 us each (k=64 classes)
    skip_l: Optional[list[int]] = None                            # [B] prefix slots each row leaves out
    ip: Optional[list[int]] = None                                # indptr_h as a list, once a class splits
    split = []
    for c in classes:
        if c.choice not in PATHS:
            raise ValueError(f"{name}: unknown prefix path '{c.choice}' for prefix_id={c.prefix_id}")
        if c.choice == "dense" and c.hot_start < 0:
            raise ValueError(f"{name}: prefix_id={c.prefix_id} chose dense but has no HOT run (hot_start=-1)")
        if c.choice == "paged":
            if c.n_real < len(c.rows):                             # pad rows (last in the class): 1-token rows
                skip_l = skip_l or [0] * b
                for r in c.rows[c.n_real:]:
                    skip_l[r] = c.prefix_len
            continue
        skip_l = skip_l or [0] * b
        if c.row_start >= 0:                                       # one run of rows: one slice write
            skip_l[c.row_start:c.row_start + len(c.rows)] = [c.prefix_len] * len(c.rows)
        else:
            for r in c.rows:
                skip_l[r] = c.prefix_len
        if batch.kv_indices is not None:
            ip = ip or indptr_h.tolist()
        c.slots = batch.prefix_slots(c.rows[0], c.prefix_len, ip)
        split.append(c)
    if skip_l is None:                                             # every row attends its whole slot list
        skip, rest_indptr_h = None, indptr_h
    else:
        skip = host_i64(skip_l)                                   # [B]
        rest_lens = indptr_h.diff() - skip                        # [B] slots each row keeps
        if int(rest_lens.min()) < 0:
            raise ValueError(f"{name}.plan: a request has fewer KV slots than its prefix_len")
        rest_indptr_h = torch.zeros(b + 1, dtype=torch.int64)
        torch.cumsum(rest_lens, 0, out=rest_indptr_h[1:])
    # the kernel's slot lists: one async host->device copy and a few launches, no stream sync (the
    # overlap schedule plans while a step runs); from a slot table, one gather for every system
    rest_indptr, rest_indices = batch.slot_lists(skip, rest_indptr_h)
    return StepPlan(b, classes, split, rest_indptr, rest_indices, rest_indptr_h.int(), choose_us)
