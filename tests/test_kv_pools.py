"""Unit tests of the HOT slab pool, the COLD token pool and the KV buffers."""
import pytest
import torch

from granikv.kv import ColdPool, HotPool, KVCache, Slab


def test_hot_first_fit_and_coalesce():
    pool = HotPool(100)
    a, b, c = pool.alloc(30), pool.alloc(30), pool.alloc(30)
    assert (a.start, b.start, c.start) == (0, 30, 60)
    assert pool.free_tokens == 10 and pool.largest_free_extent == 10
    assert pool.alloc(11) is None
    pool.free(b)
    assert pool.largest_free_extent == 30
    d = pool.alloc(20)  # first fit: the hole at 30, not the tail at 90
    assert d.start == 30
    pool.free(a)
    pool.free(d)  # coalesces [0,30) + [30,50) + [50,60)
    assert pool.free_extents() == [(0, 60), (90, 10)]
    pool.free(c)
    assert pool.free_extents() == [(0, 100)] and pool.free_tokens == 100


def test_hot_aligned_slabs_start_on_multiples_and_leave_the_skipped_slots_free():
    pool = HotPool(40, offset=1, align=8)                  # slots 1..40, as a plugin region after SGLang's slot 0
    a = pool.alloc(5)
    assert a.start == 8                                   # slots 1..7 skipped, still free
    assert pool.free_extents() == [(1, 7), (13, 28)]
    b = pool.alloc(7)                                     # 1..7 holds 7 slots but from no aligned start
    assert b.start == 16 and not pool.fits(18) and pool.fits(17)
    assert pool.alloc(18) is None and pool.eviction_window(18, {}) is None
    pool.free(a)
    pool.free(b)
    assert pool.free_extents() == [(1, 40)] and pool.free_tokens == 40


def test_hot_aligned_eviction_window_asks_room_for_an_aligned_start():
    pool = HotPool(32, offset=0, align=8)
    s = [pool.alloc(8) for _ in range(4)]                 # 0, 8, 16, 24: full
    assert [x.start for x in s] == [0, 8, 16, 24]
    # one slab alone would do at align 1; aligned, 16 slots need room 23: three slabs
    window = pool.eviction_window(16, {x.start: (i, 8) for i, x in enumerate(s)})
    assert window == [0, 8, 16]
    assert HotPool(32, align=1).eviction_window(8, {}) == []


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_hot_pool_rejects_a_bad_align(bad):
    with pytest.raises(ValueError, match="align must be an int >= 1"):
        HotPool(10, align=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_hot_alloc_rejects_bad_size(bad):
    with pytest.raises(ValueError, match="positive int"):
        HotPool(10).alloc(bad)


def test_hot_free_errors_name_the_problem():
    pool = HotPool(10)
    s = pool.alloc(4)
    with pytest.raises(ValueError, match="only whole"):
        pool.free(Slab(s.start, 2))
    pool.free(s)
    with pytest.raises(ValueError, match="double free"):
        pool.free(s)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(Slab(7, 1))


def test_cold_alloc_distinct_and_exhaustion():
    pool = ColdPool(10, offset=100)
    a = pool.alloc(6)
    assert a.dtype == torch.int64 and len(set(a.tolist())) == 6
    assert all(100 <= x < 110 for x in a.tolist())
    assert pool.alloc(5) is None and pool.free_tokens == 4
    b = pool.alloc(4)
    assert set(a.tolist()).isdisjoint(b.tolist())
    pool.free(a[:3])
    c = pool.alloc(3)  # wraps around the ring
    assert sorted(c.tolist()) == sorted(a[:3].tolist())
    assert pool.free_tokens == 0


def test_cold_free_errors():
    pool = ColdPool(8)
    ids = pool.alloc(4)
    with pytest.raises(ValueError, match="twice"):
        pool.free(torch.tensor([ids[0].item(), ids[0].item()]))
    assert pool.free_tokens == 4  # the failed free changed nothing
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="outside"):
        pool.free(torch.tensor([99]))
    with pytest.raises(ValueError, match="int64"):
        pool.free([1, 2])
    with pytest.raises(ValueError, match="positive int"):
        pool.alloc(0)


def test_kvcache_layout_hot_first_and_views():
    kv = KVCache(num_layers=2, capacity_tokens=50, kv_heads=2, head_dim=4, hot_fraction=0.2)
    assert kv.hot_tokens == 10 and kv.hot_pool.capacity == 10 and kv.cold_pool.capacity == 40
    slab = kv.hot_pool.alloc(6)
    ids = kv.cold_pool.alloc(3)
    assert ids.min() >= 10
    k = torch.randn(6, 2, 4)
    kv.write(1, torch.arange(slab.start, slab.end), k, -k)
    hk, hv = kv.slab_view(1, slab)
    assert hk.shape == (6, 2, 4) and hk.is_contiguous()
    assert torch.equal(hk, k) and torch.equal(hv, -k)
    assert hk.data_ptr() == kv.k(1).data_ptr()  # a view, no copy
    assert torch.equal(kv.k(1)[slab.start:slab.end], k)  # the same rows by global index


def test_kvcache_paged_baseline_is_same_path():
    kv = KVCache(1, 16, 1, 2, hot_fraction=0.0)
    assert kv.hot_tokens == 0 and kv.hot_pool.alloc(1) is None
    assert kv.cold_pool.alloc(16).tolist() != []


@pytest.mark.parametrize("frac", [-0.1, 1.0, 1.5])
def test_kvcache_rejects_bad_hot_fraction(frac):
    with pytest.raises(ValueError, match="hot_fraction"):
        KVCache(1, 16, 1, 2, hot_fraction=frac)


def test_cold_validation_is_on_for_cpu_pools_and_can_be_turned_off():
    """CPU pools check each free() at once ("sync"); validate=False turns the checks off. (CUDA pools
    check too, deferred so as not to sync the stream: tests/test_kv_cold_checks.py, test_kv_cold_gpu.py.)"""
    assert ColdPool(4).validate is True
    pool = ColdPool(4, validate=False)
    ids = pool.alloc(2)
    pool.free(ids)
    pool.free(ids[:1])                 # a double free goes unchecked here: the engine never does one
    assert pool.free_tokens == 5       # (which is why the CPU tests keep the checks on)
