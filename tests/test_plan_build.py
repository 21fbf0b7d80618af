"""granikv.attention.plan on CPU: class grouping by runs matches a row-by-row grouping on any order of
rows; inconsistent classes and short slot lists are refused with the rows named; the rest-of-request
lists are exactly each request's slots after the prefix its class attends apart."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from granikv.attention.batch import DecodeBatch, host_i64
from granikv.attention.plan import build_plan, group_classes
from granikv.attention.policy import DenseHotPolicy, PagedPolicy, PrefixPolicy

LENS = {0: 3, 1: 5, 2: 2, 3: 4}          # prefix_id -> prefix_len (-1: no prefix)


def _batch(ids: list[int], suffix: int = 2, num_pad: int = 0) -> DecodeBatch:
    lp = [LENS.get(i, 0) for i in ids]
    hs = [10 * i if i >= 0 else -1 for i in ids]
    idx, ptr = [], [0]
    for r, (i, n) in enumerate(zip(ids, lp)):
        idx += list(range(10 * i, 10 * i + n)) + [1000 + 10 * r + t for t in range(suffix)]
        ptr.append(len(idx))
    return DecodeBatch(torch.tensor(ptr), torch.tensor(idx), lp, ids, hs, kv_indptr_host=torch.tensor(ptr),
                       num_pad=num_pad)


def _rowwise(ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, i in enumerate(ids):
        if i >= 0 and LENS[i] > 0:
            out.setdefault(i, []).append(r)
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=0, max_size=40))
def test_grouping_by_runs_matches_row_by_row(ids):
    classes = group_classes(_batch(ids))
    assert {c.prefix_id: c.rows for c in classes} == _rowwise(ids)
    assert [c.prefix_id for c in classes] == list(_rowwise(ids))            # in order of first row
    for c in classes:
        assert c.prefix_len == LENS[c.prefix_id] and c.hot_start == 10 * c.prefix_id


class _Split(PrefixPolicy):
    name = "split"

    def choose(self, classes, batch_size):
        for c in classes:
            c.choice = "cascade" if c.prefix_id % 2 == 0 else "paged"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=1, max_size=30), st.integers(0, 3))
def test_rest_lists_leave_out_exactly_the_split_prefixes(ids, npad):
    npad = min(npad, len(ids))
    b = _batch(ids, num_pad=npad)
    p = build_plan(b, _Split(), group=4)
    ptr, idx = b.kv_indptr.tolist(), b.kv_indices.tolist()
    rptr, ridx = p.rest_indptr.tolist(), p.rest_indices.tolist()
    assert p.rest_indptr_host.tolist() == rptr
    split_rows = {r for c in p.split for r in c.rows}
    for r, i in enumerate(ids):
        lp = LENS.get(i, 0)
        pad_paged = r >= len(ids) - npad and i >= 0 and i % 2 == 1      # pad rows of a paged class skip it too
        skip = lp if (r in split_rows or pad_paged) else 0
        assert ridx[rptr[r]:rptr[r + 1]] == idx[ptr[r] + skip:ptr[r + 1]]
    for c in p.split:
        assert c.slots.tolist() == list(range(10 * c.prefix_id, 10 * c.prefix_id + c.prefix_len))


def test_paged_plan_is_the_batch_itself():
    b = _batch([0, 0, 1, -1, 2])
    p = build_plan(b, PagedPolicy(), group=4)
    assert not p.split and torch.equal(p.rest_indices, b.kv_indices.int()) and torch.equal(p.rest_indptr, b.kv_indptr.int())


def test_a_class_with_two_prefixes_is_refused():
    b = _batch([0, 0, 0])
    b.prefix_lens[2] = 4                                                  # same id, another length, same run
    with pytest.raises(ValueError, match=r"requests 0 and 2 share prefix_id=0"):
        group_classes(b)
    b = _batch([1, 0, 1])
    b.hot_starts[2] = 99                                                  # same id, another HOT start, later run
    with pytest.raises(ValueError, match=r"requests 0 and 2 share prefix_id=1"):
        group_classes(b)


def test_a_request_shorter_than_its_prefix_is_refused():
    b = _batch([0, 0], suffix=0)
    b.prefix_lens[:] = [4, 4]
    b.hot_starts[:] = [0, 0]
    with pytest.raises(ValueError, match="fewer KV slots than its prefix_len"):
        build_plan(b, DenseHotPolicy(), group=4)


def test_host_i64():
    assert host_i64([3, -1, 2**40]).tolist() == [3, -1, 2**40] and host_i64([]).numel() == 0
    assert host_i64([1, 2]).dtype == torch.int64


def _as_table(b: DecodeBatch, rows_order: list[int], width_pad: int = 3) -> DecodeBatch:
    """The same batch with its slot lists as rows of a slot table (SGLang's req_to_token form): request i
    sits on table row ``rows_order[i]`` (any rows, in any order), rows wider than the lists, the unused
    cells and rows filled with junk the plan must never read."""
    ptr, idx = b.kv_indptr.tolist(), b.kv_indices.tolist()
    n = len(ptr) - 1
    width = max([ptr[i + 1] - ptr[i] for i in range(n)], default=0) + width_pad
    table = torch.full((max(rows_order, default=0) + 2, width), -7, dtype=torch.int64)
    for i, r in enumerate(rows_order):
        table[r, :ptr[i + 1] - ptr[i]] = torch.tensor(idx[ptr[i]:ptr[i + 1]])
    return DecodeBatch(b.kv_indptr, None, list(b.prefix_lens), list(b.prefix_ids), list(b.hot_starts),
                       kv_indptr_host=b.kv_indptr_host.clone(), num_pad=b.num_pad, slot_table=table,
                       slot_rows=host_i64(rows_order))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=1, max_size=30), st.integers(0, 3), st.randoms())
def test_a_slot_table_plans_exactly_as_the_packed_lists(ids, npad, rnd):
    npad = min(npad, len(ids))
    b = _batch(ids, num_pad=npad)
    rows = rnd.sample(range(2 * len(ids)), len(ids))                      # table rows: scattered, any order
    t = _as_table(b, rows)
    for policy in (_Split(), PagedPolicy(), DenseHotPolicy()):
        p, q = build_plan(b, policy, group=4), build_plan(t, policy, group=4)
        assert torch.equal(p.rest_indptr, q.rest_indptr) and torch.equal(p.rest_indices, q.rest_indices)
        assert p.rest_indices.dtype == q.rest_indices.dtype == torch.int32
        assert torch.equal(p.rest_indptr_host, q.rest_indptr_host)
        assert [(c.prefix_id, c.choice, c.slots.tolist()) for c in p.split] == \
               [(c.prefix_id, c.choice, c.slots.tolist()) for c in q.split]
        assert -7 not in q.rest_indices.tolist()


@pytest.mark.parametrize("bad, field", [
    (dict(kv_indices=torch.arange(4)), "exactly one of kv_indices"),
    (dict(kv_indices=None, slot_table=None), "exactly one of kv_indices"),
    (dict(slot_rows=None), "DecodeBatch.slot_rows"),
    (dict(slot_rows=host_i64([0])), "DecodeBatch.slot_rows"),
    (dict(slot_table=torch.zeros(4, 6, dtype=torch.int64).t()), "DecodeBatch.slot_table"),
    (dict(kv_indptr_host=None), "DecodeBatch.kv_indptr_host"),
])
def test_a_malformed_slot_table_batch_names_its_field(bad, field):
    args = dict(kv_indptr=torch.tensor([0, 2, 4]), kv_indices=None, prefix_lens=[1, 1], prefix_ids=[0, 0],
                hot_starts=[0, 0], kv_indptr_host=torch.tensor([0, 2, 4]), slot_table=torch.zeros(3, 4, dtype=torch.int64),
                slot_rows=host_i64([0, 1]))
    args.update(bad)
    with pytest.raises(ValueError, match=field):
        DecodeBatch(**args)
