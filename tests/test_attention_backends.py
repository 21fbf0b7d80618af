"""Every prefix backend equals the reference decode over random batches (CPU torch paths)."""
import random
from types import SimpleNamespace
import pytest
import torch

from attn_util import make_step, rel_err
from granikv.attention import reference as R
from granikv.attention.decode import make_backend
from granikv.attention.dispatch import Dispatcher
from granikv.attention.policy import POLICIES
from granikv.config import SystemConfig

# mixed table: small Lp -> paged, mid Meff -> cascade, big Meff -> dense (exercises every path)
MIXED = [{"lp_max": 8, "choice": "paged"}, {"meff_min": 12, "choice": "dense"}, {"choice": "cascade"}]


def backend(name, hq, hkv, d, dtype=torch.float32, table=MIXED):
    disp = Dispatcher(hq, hkv, d, "test-gpu", table) if name == "granikv" else None
    return make_backend(SimpleNamespace(backend=name, dispatch="table", tensor_core_decode="auto"), hq, hkv, d, "cpu", dtype, dispatcher=disp)


def check(name, hq, hkv, d, k, v, batch, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch.batch_size, hq, d, generator=g).to(dtype)
    ref, _ = R.paged_decode_ref(q, k, v, batch.kv_indptr, batch.kv_indices)
    be = backend(name, hq, hkv, d, dtype)
    be.plan(batch)
    out = be.run(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out, ref) <= tol, (name, rel_err(out, ref))
    return be


NAMES = sorted(POLICIES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("group", [1, 4, 5, 8])
def test_backend_equals_reference_random(name, group):
    rnd = random.Random(group * 31 + len(name))
    for trial in range(3):
        hkv, d = rnd.choice([1, 2]), rnd.choice([8, 16])
        ncls = rnd.randint(1, 8)
        lps = [rnd.choice([1, 3, 17, 64, 200]) for _ in range(ncls)]
        sizes = [rnd.randint(1, 4) for _ in range(ncls)]
        hot = [rnd.random() < 0.7 for _ in range(ncls)]
        k, v, batch = make_step(trial + group, hkv, d, lps, sizes, hot, n_noprefix=rnd.randint(0, 2))
        check(name, group * hkv, hkv, d, k, v, batch, seed=trial)


@pytest.mark.parametrize("name", NAMES)
def test_long_prefix_4k_single_class(name):
    k, v, batch = make_step(5, 1, 8, [4096], [3], [True])
    be = check(name, 4, 1, 8, k, v, batch)
    if name in ("dense", "hydragen", "cascade"):
        assert be.last_decisions[0]["backend"] == {"dense": "dense", "hydragen": "hydragen", "cascade": "cascade"}[name]


@pytest.mark.parametrize("name", NAMES)
def test_bf16(name):
    k, v, batch = make_step(7, 2, 16, [300, 40], [5, 3], [True, False], dtype=torch.bfloat16)
    check(name, 8, 2, 16, k, v, batch, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", NAMES)
def test_no_common_prefix_and_singleton_class(name):
    k, v, batch = make_step(11, 2, 8, [50, 33], [1, 4], [True, True], n_noprefix=3)
    be = check(name, 8, 2, 8, k, v, batch)
    if name == "cascade":      # batch-global: no prefix common to every request -> paged
        assert all(d["backend"] == "paged" for d in be.last_decisions)
    k, v, batch = make_step(12, 2, 8, [], [], [], n_noprefix=4)      # nobody has a prefix
    check(name, 8, 2, 8, k, v, batch)


def test_granikv_uses_every_path_and_falls_back_without_hot():
    k, v, batch = make_step(3, 2, 8, [4, 100, 100, 60], [2, 1, 4, 5], [True, True, True, False])
    be = check("granikv", 8, 2, 8, k, v, batch)
    by = {(d["prefix_len"], d["batch"]): d["backend"] for d in be.last_decisions}
    assert by[(4, 2)] == "paged" and by[(100, 1)] == "cascade" and by[(100, 4)] == "dense"
    assert by[(60, 5)] == "cascade"          # dense wanted but not in HOT -> cascade (paged fallback)
    meff = {(d["prefix_len"], d["batch"]): d["meff"] for d in be.last_decisions}
    assert meff[(100, 4)] == 16 and meff[(4, 2)] == 8


def test_graph_key_changes_with_structure():
    k, v, batch = make_step(3, 2, 8, [100], [4], [True])
    be = backend("dense", 8, 2, 8)
    be.plan(batch)
    key1 = be.graph_key()
    be.plan(batch)
    assert be.graph_key() == key1 and hash(key1) is not None
    k, v, batch2 = make_step(4, 2, 8, [100, 30], [4, 2], [True, True])
    be.plan(batch2)
    assert be.graph_key() != key1


def test_bad_batches_are_rejected():
    k, v, batch = make_step(3, 2, 8, [10], [3], [True])
    be = backend("paged", 8, 2, 8)
    with pytest.raises(RuntimeError, match="before plan"):
        be.run(torch.randn(3, 8, 8), k, v)
    batch.prefix_lens[1] = 9                 # same prefix_id, different length
    with pytest.raises(ValueError, match="prefix_id"):
        be.plan(batch)
    with pytest.raises(ValueError, match="system.backend"):
        make_backend("nope", 8, 2, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_backend(SystemConfig(backend="paged"), 6, 4, 8)


def test_unknown_cascade_impl_names_the_field():
    from granikv.attention.decode import make_backend
    with pytest.raises(ValueError, match="cascade_impl must be one of"):
        make_backend("cascade", 8, 2, 16, cascade_impl="fast")
