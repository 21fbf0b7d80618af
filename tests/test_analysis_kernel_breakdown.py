"""analysis.kernel_breakdown on a real CPU kernel-bench run with profile_kernels=true: one row per
(backend, kernel) for the longest kernels, the rest lumped, a (busy) row per backend; shares sum to 1;
a malformed profile names the fix; no profiled row -> one 'not measured' row."""
import os
import subprocess
import sys
from pathlib import Path
import pytest

from analysis.exhibits.kernel import kernel_breakdown as KB
from analysis.measures import kernels
from analysis.load import load_results

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    raw = tmp_path_factory.mktemp("raw")
    args = ["hardware=cpu", f"results_dir={raw}", "sweep_name=kb", "prefix_lens=[40]", "batches=[4]",
            "num_prefixes=[1]", "layout=false", "dispatch_cost=false", "backends=[paged,dense]",
            "shapes=[{name:t,hq:8,hkv:2,d:16}]", "profile_kernels=true"]
    p = subprocess.run([sys.executable, "-m", "runners.kernel_bench", *args], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return raw


def test_rows_per_backend_and_kernel(profiled, tmp_path):
    t = KB.build(load_results(profiled), tmp_path)
    assert (tmp_path / "tables" / "kernel_breakdown.md").exists()
    assert set(t["backend"]) == {"paged", "dense"} and set(t["status"]) == {"measured"}
    for be, g in t.groupby("backend"):
        busy = g[g["kernel"] == "(busy)"]
        parts = g[g["kernel"] != "(busy)"]
        assert len(busy) == 1 and busy["timed_us"].iloc[0] > 0
        assert len(parts) <= KB.TOP + 1 and parts["share"].sum() == pytest.approx(1.0)
        assert parts["us_per_call"].sum() == pytest.approx(busy["us_per_call"].iloc[0])
        assert (g["Lp"] == 40).all() and (g["B"] == 4).all() and (g["sweep"] == "kb").all()


def test_short_kernel_names():
    assert KB.short_name("void flashinfer::PrefillWithKVCacheKernel<CollectiveMainloop<A, B>>(Params)") == \
        "flashinfer::PrefillWithKVCacheKernel"
    assert KB.short_name("aten::mm") == "aten::mm"
    assert len(KB.short_name("x" * 200)) == 70


def test_a_malformed_profile_names_the_fix():
    with pytest.raises(ValueError, match="profile_kernels=true"):
        kernels.row_kernels('[{"name": "k"}]', "cell")


def test_no_profile_is_reported_not_measured(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    t = KB.build(load_results(raw), tmp_path)
    assert len(t) == 1 and t["status"].iloc[0].startswith("not measured")


def test_split_layout_row_reads_the_slab_once_like_its_plain_sibling():
    import pandas as pd
    from analysis.measures.kernels import slab_once
    k = pd.DataFrame({"cell.kind": ["layout", "layout", "layout", "layout", "decode"],
                      "k.backend": ["contiguous_dense", "contiguous_dense_split", "paged_unique_decode",
                                    "contiguous_dense_split", "dense"],
                      "path": ["a", "a", "a", "c", "b"]})
    # cell c has no plain row to take the count from: its own count stays
    got = slab_once(k, pd.Series([10.0, 999.0, 500.0, 42.0, 7.0])).tolist()
    assert got == [10.0, 10.0, 500.0, 42.0, 7.0]
