"""COLD pool free checks: "sync" (raise in the faulty free, the CPU default), "deferred" (the CUDA
default: no host read per free, the next call or check() raises) and "off". The deferred mode runs
the same code on CPU, so its logic is tested here; tests/test_kv_cold_gpu.py runs it on CUDA."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from granikv.kv import ColdPool
from granikv.kv.cold_pool import default_checks


def test_modes_and_defaults():
    assert ColdPool(4).checks == "sync" and ColdPool(4).validate is True
    assert default_checks("cpu") == "sync" and default_checks("cuda") == "deferred"
    assert ColdPool(4, validate=True).checks == "sync" and ColdPool(4, validate=False).checks == "off"
    d = ColdPool(4, validate="deferred")
    assert d.checks == "deferred" and d.validate is True
    with pytest.raises(ValueError, match="validate must be"):
        ColdPool(4, validate="eager")


def test_deferred_double_free_raises_at_the_next_call_and_stays_raised():
    pool = ColdPool(8, offset=100, validate="deferred")
    ids = pool.alloc(4)
    pool.free(ids[:2])
    pool.free(ids[:1])  # double free of slot 100: no host read, no raise here
    with pytest.raises(ValueError, match=r"double free.*\[100\].*deferred"):
        pool.alloc(1)
    with pytest.raises(ValueError, match="double free"):
        pool.check()
    with pytest.raises(ValueError, match="double free"):  # the free list may hold 100 twice: unusable
        pool.free(ids[2:])


@pytest.mark.parametrize("bad,outside", [("never", False), ("repeated", False), ("below", True), ("above", True)])
def test_deferred_flags_each_kind_of_bad_free(bad, outside):
    pool = ColdPool(8, offset=100, validate="deferred")
    ids = pool.alloc(4)  # 100..103 allocated, 104..107 free
    arg = {"never": torch.tensor([105]), "repeated": torch.tensor([101, 102, 101]),
           "below": torch.tensor([99]), "above": torch.tensor([102, 108])}[bad]
    pool.free(arg)
    with pytest.raises(ValueError, match="outside" if outside else "not allocated") as e:
        pool.check()
    assert ("outside" in str(e.value)) == outside
    assert ids.numel() == 4


def test_deferred_valid_use_never_flags():
    pool = ColdPool(16, offset=7, validate="deferred")
    live = []
    g = torch.Generator().manual_seed(0)
    for step in range(200):  # the ring wraps many times; frees in a shuffled order
        n = int(torch.randint(1, 6, (1,), generator=g))
        got = pool.alloc(n)
        if got is not None:
            live.extend(got.tolist())
        if live and (got is None or step % 3 == 0):
            perm = torch.randperm(len(live), generator=g).tolist()
            k = max(1, len(live) // 2)
            back = [live[i] for i in perm[:k]]
            live = [live[i] for i in perm[k:]]
            pool.free(torch.tensor(back))
        assert pool.free_tokens + len(live) == 16
        assert sorted((pool.owned_mask().nonzero().flatten() + 7).tolist()) == sorted(live)
    pool.check()


def test_off_checks_nothing():
    pool = ColdPool(4, validate="off")
    ids = pool.alloc(2)
    pool.free(ids)
    pool.free(ids[:1])
    pool.check()  # nothing was recorded to look at
    assert pool.free_tokens == 5


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "free", "free", "free", "dup", "bad"]),
                         st.integers(1, 5), st.integers(0, 10 ** 6)), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_deferred_flags_exactly_when_sync_raises(ops):
    """Differential: the same calls on a "sync" and a "deferred" pool. Until the sync pool raises,
    both hand out the same ids and the deferred one stays quiet; the call that makes the sync pool
    raise makes the deferred one raise at check()."""
    sync, lazy = ColdPool(12, offset=3, validate="sync"), ColdPool(12, offset=3, validate="deferred")
    live: list[int] = []
    for op, n, r in ops:
        if op == "alloc":
            a, b = sync.alloc(n), lazy.alloc(n)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.tolist() == b.tolist()
                live.extend(a.tolist())
            continue
        if op == "free":  # a valid free of some live ids
            if not live:
                continue
            k = 1 + r % len(live)
            ids, live = live[:k], live[k:]
        elif op == "dup":  # a live id twice in one free
            if not live:
                continue
            ids = [live[r % len(live)]] * 2
        else:  # an arbitrary list of ids: maybe valid, maybe not
            ids = [(r >> (4 * j)) % 17 for j in range(n)]  # 0..16: below, inside and above [3, 15)
        t = torch.tensor(ids, dtype=torch.int64)
        try:
            sync.free(t)
        except ValueError:
            lazy.free(t)
            with pytest.raises(ValueError):
                lazy.check()
            return
        lazy.free(t)
        lazy.check()
        if op != "free":
            live = [x for x in live if x not in ids]
        assert sync.free_tokens == lazy.free_tokens
        assert torch.equal(sync.owned_mask(), lazy.owned_mask())
