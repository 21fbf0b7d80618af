"""analysis.prefix_kernel: a dense call's kernels sorted into prefix / suffix / merge / glue, the prefix
kernel's share of the bf16 peak and the target verdict on hand-computed rows, Nsight Compute's numbers
taken from the layout cell of the same point, and a table that says not measured without profiles."""
from __future__ import annotations
import json
from types import SimpleNamespace
import pandas as pd
import pytest

from analysis.exhibits.kernel import prefix_kernel as P
from analysis.common import NOT_MEASURED

LLAMA = {"cell.shape.name": "llama3_8b", "cell.shape.hq": 32, "cell.shape.hkv": 8, "cell.shape.d": 128}
FI_PREFIX = "void flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<...>>(...)"
FI_SUFFIX = "void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>(...)"


def _row(prefix_us, lp=16384, b=256, backend="dense", time_ms=0.190, path="kernel_x/decode", prefix_name=FI_PREFIX):
    ks = [{"name": prefix_name, "us_per_call": prefix_us, "launches_per_call": 1.0},
          {"name": FI_SUFFIX, "us_per_call": 65.0, "launches_per_call": 1.0},
          {"name": "void flashinfer::MergeStatesKernel<8>(...)", "us_per_call": 2.0, "launches_per_call": 1.0},
          {"name": "void flashinfer::MergeStateInPlaceKernel<8>(...)", "us_per_call": 2.0, "launches_per_call": 1.0},
          {"name": "void at::native::elementwise_kernel<128, 4>(...)", "us_per_call": 7.0, "launches_per_call": 1.0}]
    return {"cell.kind": "decode", "provenance.gpu_name": "NVIDIA H200", **LLAMA, "cell.prefix_len": lp, "cell.batch": b,
            "cell.suffix_len": 128, "k.backend": backend, "k.time_ms": time_ms, "k.kernels": json.dumps(ks),
            "peaks.peak_tflops": 800.0, "sweep": "kernel_x", "path": path, "provenance.git_commit": "abcdef0"}


def _frame(rows, root="."):
    return P.frame(SimpleNamespace(kernels=pd.DataFrame(rows), root=root))


@pytest.mark.parametrize("name,kind", [
    (FI_PREFIX, "prefix"), (FI_SUFFIX, "suffix"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_128x128x128", "prefix"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "prefix"),
    ("void flashinfer::MergeStatesKernel<8u, __nv_bfloat16>", "merge"),
    ("void at::native::elementwise_kernel<128, 4>", "glue")])
def test_kernels_are_sorted_by_name(name, kind):
    assert P.classify(name) == kind


def test_hand_computed_row_meets_the_target():
    r = _frame([_row(100.0)]).iloc[0]
    # 4 x 256 x 32 x 16384 x 128 = 68.72 GFLOP in 100 us = 687.2 TFLOP/s = 69.5% of 989
    assert r["prefix_tflops"] == pytest.approx(687.19, abs=0.01)
    assert r["prefix_pct_peak"] == pytest.approx(687.19 / 989.0, abs=1e-4)
    assert r["prefix_pct_measured"] == pytest.approx(687.19 / 800.0, abs=1e-4)
    # suffix: 2 x 256 x 128 x 8 x 128 x 2 B = 134.2 MB in 65 us
    assert r["suffix_tbps"] == pytest.approx(134217728 / 65e-6 / 1e12, rel=1e-9)
    assert (r["merge_us"], r["glue_us"]) == (4.0, 7.0)
    assert r["gaps_us"] == pytest.approx(190.0 - 176.0)
    # roofline: flops 4 x 256 x 32 x (16384 + 128) x 128 at 989 TFLOP/s (compute-bound here)
    assert r["roofline_us"] == pytest.approx(4 * 256 * 32 * 16512 * 128 / 989e12 * 1e6, rel=1e-9)
    assert r["meets_target"] == "yes"


def test_slow_prefix_misses_and_other_points_have_no_target():
    t = _frame([_row(140.0), _row(90.0, prefix_name="cudnn_generated_fort_native_sdpa_sm90"),
                _row(20.0, lp=2048)])
    by = {(r.Lp, r.prefix_us): r.meets_target for r in t.itertuples()}
    assert by[(16384, 140.0)] == "no"        # above 135 us
    assert by[(16384, 90.0)] == "yes"        # cuDNN's kernel counts as the prefix kernel too
    assert by[(2048, 20.0)] == "-"


def test_ncu_comes_from_the_layout_cell_of_the_same_point(tmp_path):
    lay = tmp_path / "kernel_x" / "layout"
    lay.mkdir(parents=True)
    (lay / "metrics.json").write_text(json.dumps({"ncu": {"contiguous_dense_split": {"sm_pct": 74.4, "dram_pct": 14.8}}}))
    layout_row = {**_row(100.0), "cell.kind": "layout", "k.backend": "contiguous_dense_split", "path": "kernel_x/layout"}
    t = _frame([_row(100.0), _row(110.0, backend="dense_cudnn"), layout_row], root=tmp_path)
    assert len(t) == 2                                   # the layout row is not a dense call
    dense = t[t["backend"] == "dense"].iloc[0]
    assert (dense["ncu_sm_pct"], dense["ncu_dram_pct"]) == (74.4, 14.8)
    assert pd.isna(t[t["backend"] == "dense_cudnn"].iloc[0]["ncu_sm_pct"])


def test_without_profiles_the_table_says_not_measured(tmp_path):
    row = {**_row(100.0), "k.kernels": None}
    t = P.build(SimpleNamespace(kernels=pd.DataFrame([row]), root=tmp_path), tmp_path)
    assert t.empty
    text = (tmp_path / "tables" / "prefix_kernel.md").read_text()
    assert NOT_MEASURED in text and "profile_kernels=true" in text
    assert P.lines(t) == []


def test_a_malformed_kernel_list_names_the_fix():
    with pytest.raises(ValueError, match="rerun the cell"):
        _frame([{**_row(100.0), "k.kernels": json.dumps([{"name": "x"}])}])
