"""Shared builders for the attention tests: random KV caches and DecodeBatches with prefix classes, a policy
with fixed paths, and the FlashInfer stand-in as a fixture."""
from __future__ import annotations

import sys

import pytest
import torch

from granikv.attention.batch import DecodeBatch
from granikv.attention.policy import PrefixPolicy


def make_step(seed: int, hkv: int, d: int, class_lps: list[int], class_sizes: list[int], hot: list[bool],
              n_noprefix: int = 0, max_suffix: int = 9, dtype=torch.float32, device="cpu", grouped: bool = False):
    """A random cache [C, Hkv, D] and a DecodeBatch: class c has class_sizes[c] requests sharing a
    class_lps[c]-token prefix, stored as one HOT run (hot[c]) or as scattered slots; every request
    then has 1..max_suffix own slots (ragged). ``n_noprefix`` requests have no prefix. Classes are
    interleaved in the batch, or, ``grouped``, each class's requests are consecutive rows (the
    order the engine gives backends that split classes)."""
    g = torch.Generator().manual_seed(seed)
    hot_total = sum(lp for lp, h in zip(class_lps, hot) if h) + 7
    n_req = sum(class_sizes) + n_noprefix
    cold_need = sum(lp for lp, h in zip(class_lps, hot) if not h) + n_req * (max_suffix + 20)
    cap = hot_total + cold_need
    k = torch.randn(cap, hkv, d, generator=g).to(dtype)
    v = torch.randn(cap, hkv, d, generator=g).to(dtype)
    cold = (hot_total + torch.randperm(cold_need, generator=g)).tolist()
    hot_pos = 3
    indptr, indices, plens, pids, hstarts = [0], [], [], [], []
    reqs = []
    for c, (lp, bc, h) in enumerate(zip(class_lps, class_sizes, hot)):
        if h:
            slots, hs = list(range(hot_pos, hot_pos + lp)), hot_pos
            hot_pos += lp
        else:
            slots, hs = [cold.pop() for _ in range(lp)], -1
        reqs += [(c, lp, hs, slots)] * bc
    reqs += [(-1, 0, -1, [])] * n_noprefix
    order = torch.randperm(len(reqs), generator=g).tolist()   # classes interleaved in the batch
    if grouped:
        order.sort(key=lambda i: reqs[i][0])
    for i in order:
        pid, lp, hs, slots = reqs[i]
        ns = int(torch.randint(1, max_suffix + 1, (1,), generator=g))
        own = [cold.pop() for _ in range(ns)]
        indices += slots + own
        indptr.append(len(indices))
        plens.append(lp)
        pids.append(pid)
        hstarts.append(hs)
    batch = DecodeBatch(torch.tensor(indptr, device=device), torch.tensor(indices, device=device), plens, pids, hstarts)
    return k.to(device), v.to(device), batch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def flashinfer_available() -> bool:
    """True on a CUDA machine where flashinfer imports (the GPU tests' skip condition)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any import failure means: not runnable here
        return False


class FixedPolicy(PrefixPolicy):
    """Chooses each class's path from ``paths`` (prefix id -> path); paged otherwise."""

    name = "fixed"

    def __init__(self, paths):
        self.paths = paths

    def choose(self, classes, batch_size):
        for c in classes:
            c.choice = self.paths.get(c.prefix_id, "paged")


@pytest.fixture(scope="module")
def fake_fi_module():
    """The FlashInfer stand-in (tests/fake_flashinfer.py) as ``flashinfer`` for one test module (module scope:
    hypothesis runs many examples per test function). Import it into a test module to use it."""
    import fake_flashinfer

    saved = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = fake_flashinfer.module()
    yield
    if saved is None:
        sys.modules.pop("flashinfer", None)
    else:
        sys.modules["flashinfer"] = saved
