"""analysis.distance_to_limit on hand-written raw cells: the multiple of a hand-computed case, 'not measured'
wherever the GEMM floor (or a usable one) is missing, vendor peaks where the preset leaves them unset, and
the profiler breakdown of a small trace."""
from __future__ import annotations
import zlib
import json
from pathlib import Path
import pandas as pd
import pytest

from analysis.exhibits.kernel import distance_to_limit as D
from analysis import common
from analysis.measures import limit
from analysis.integrity import summary_of
from analysis.load import load_results
from granikv import rawio

GPU = "NVIDIA H200"
MODEL = {"name": "m", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}
# four requests behind one shared prefix of Lp=100: (prompt_len, output_len); suffix KV per decode step
# s_r = p_r - 100 + o_r / 2, weighted by o_r - 1 decode tokens: (4*12.5 + 2*21.5 + 0 + 8*8.5) / 14 = 11.5
REQUESTS = [(110, 5), (120, 3), (130, 1), (104, 9)]
SUFFIX = 11.5


def prov(gpu):
    return {**{k: None for k in rawio.PROVENANCE_KEYS}, "gpu_name": gpu, "git_commit": "abc"}


def serving_cell(root: Path, system="granikv", peaks=(1.0, 0.001), gpu=GPU, profile_steps=0, sweep="synthetic_grid_m_tp1",
                 trace: dict | None = None, cuda_graph_max_bs: int | None = None) -> Path:
    d = root / sweep / (f"system={system}" + ("" if cuda_graph_max_bs is None else f",graph_bs={cuda_graph_max_bs}"))
    wl = {"kind": "synthetic", "prefix_len": 100, "batch": 4, "num_prefixes": 1, "suffix_len": 10, "output_len": 5,
          "arrival": "burst"}
    hw = {"name": "h200", "dtype": "bfloat16", "peak_tflops": peaks[0], "peak_tbps": peaks[1],
          **({} if cuda_graph_max_bs is None else {"cuda_graph_max_bs": cuda_graph_max_bs})}
    rawio.write_json(d / "config.json", {"model": MODEL, "tp": 1, "system": {"name": system}, "workload": wl,
                                         "hardware": hw, "profile_steps": profile_steps, "rep": 0, "sweep_name": sweep,
                                         "provenance": prov(gpu)})
    reqs = [{"rid": i, "prompt_len": p, "shared_len": 100, "output_len": o} for i, (p, o) in enumerate(REQUESTS)]
    # each cell's own run: its finish times differ from every other cell's (analysis.integrity)
    done = [{**r, "arrival_s": 0.0, "finish_s": 1.0 + zlib.crc32(str(d.relative_to(root)).encode()) / 2**32}
            for r in reqs]
    rawio.write_json(d / "metrics.json", {**{k: ({} if k == "dispatch_counts" else 1.0) for k in rawio.SERVING_METRICS},
                                          **summary_of(done)})
    rawio.write_jsonl(d / "workload.jsonl", reqs)
    rawio.write_jsonl(d / "requests.jsonl", done)
    # full-batch decode steps (batch >= 0.9 * 4) of 10, 12, 11 ms -> p50 11 ms; a half-batch step and a
    # prefill step are not full-batch decode steps
    steps = [{"kind": "prefill", "batch_size": 4, "step_time_s": 0.5}] + \
        [{"kind": "decode", "batch_size": 4, "step_time_s": t} for t in (0.010, 0.012, 0.011)] + \
        [{"kind": "decode", "batch_size": 2, "step_time_s": 0.1}]
    rawio.write_jsonl(d / "steps.jsonl", steps)
    if trace is not None:
        (d / "trace.json").write_text(json.dumps(trace))
    return d


def floor_cell(root: Path, m=4, device="cuda", graph=True, gpu=GPU, time_ms=2.0, model="m", tp=1) -> Path:
    """A gemm_floor cell as runners.kernel_bench_gemm_floor writes it (the fields the analysis reads)."""
    cid = f"{model}-tp{tp}-m{m}"
    d = root / "gemm_floor" / cid
    rawio.write_json(d / "config.json", {"cell": {"cell_id": cid, "kind": "gemm_floor", "model": {"name": model}, "tp": tp,
                                                  "batch": m, "device": device, "shape": {"name": f"{model}_tp{tp}"}},
                                         # a CPU cell run on a GPU host names that GPU in its provenance too
                                         "provenance": prov(gpu)})
    rawio.write_jsonl(d / "kernel.jsonl", [{"backend": "step", "time_ms": time_ms, "graph": graph, "flops": 1, "bytes": 1}])
    rawio.write_json(d / "metrics.json", {"cell_id": cid, "step_ms": time_ms})
    return d


def table(root: Path, out: Path) -> pd.DataFrame:
    D.build(load_results(root), out, figures=False)
    t = pd.read_csv(out / "tables" / f"{D.NAME}.csv", dtype=str, keep_default_na=False)
    return t[(t["config"] == "m TP=1")].set_index("system")


def test_multiple_of_a_hand_computed_case(tmp_path):
    serving_cell(tmp_path / "raw")
    floor_cell(tmp_path / "raw")
    row = table(tmp_path / "raw", tmp_path / "out").loc["granikv"]
    # per layer: bytes_kv = 2 (K,V) * (100 + 4 * 11.5) * 2 KV heads * 8 * 2 B = 9344 B at 1 GB/s = 9.344 us;
    # flops = 4 * 4 * 8 * 4 * (100 + 11.5) = 57088 at 1 TFLOP/s = 0.057 us -> memory-bound; 2 layers: 0.018688 ms
    assert float(row["suffix_kv_mean"]) == pytest.approx(SUFFIX, abs=0.05)
    assert float(row["step_ms"]) == pytest.approx(11.0, abs=0.005)
    assert float(row["attn_roofline_ms"]) == pytest.approx(0.018688, abs=5e-4)
    assert row["attn_bound"] == "memory"
    assert float(row["gemm_floor_ms"]) == pytest.approx(2.0, abs=5e-4)
    assert float(row["limit_ms"]) == pytest.approx(2.018688, abs=5e-4)
    assert float(row["multiple"]) == pytest.approx(11.0 / 2.018688, abs=0.005)   # 5.45
    assert row["status"] == "measured" and row["gpu"] == GPU and row["n"] == "1"
    # the unrounded frame, exactly
    f = D.frame(load_results(tmp_path / "raw"))
    r = f[(f["config"] == "m TP=1") & (f["system"] == "granikv")].iloc[0]
    assert r["suffix_kv_mean"] == pytest.approx(SUFFIX)
    assert r["attn_roofline_ms"] == pytest.approx(2 * 9344 / 1e9 * 1e3)
    assert r["multiple"] == pytest.approx(11.0 / (2.0 + 2 * 9344 / 1e9 * 1e3))
    # the caption carries the formula
    md = (tmp_path / "out" / "tables" / f"{D.NAME}.md").read_text()
    assert "L x max(bytes_kv / BW, flops / PEAK)" in md and "(Lp + B x s)" in md


def test_compute_bound_roofline_and_vendor_peaks_when_unset():
    # Llama-3.1-8B shape at Lp=16K, B=256, s=96 on the H200 datasheet peaks: per layer
    # bytes = 2 * (16384 + 256*96) * 8 * 128 * 2 = 167772160 B -> 34.95 us at 4.8 TB/s;
    # flops = 4 * 32 * 128 * 256 * 16480 = 69122129920 -> 69.89 us at 989 TFLOP/s: compute-bound; x32 layers
    ms, bound = limit.attention_roofline_ms(16384, 256, 96, 32, 32, 8, 128, 1, 2, *common.VENDOR_PEAKS["NVIDIA H200"])
    assert bound == "compute" and ms == pytest.approx(32 * 69122129920 / 989e12 * 1e3)
    ms2, bound2 = limit.attention_roofline_ms(16384, 8, 96, 32, 32, 8, 128, 1, 2, 989.0, 4.8)
    assert bound2 == "memory" and ms2 == pytest.approx(32 * 2 * (16384 + 8 * 96) * 8 * 128 * 2 / 4.8e12 * 1e3)


def test_vendor_peaks_where_the_preset_leaves_them_unset(tmp_path):
    serving_cell(tmp_path / "raw", peaks=(0.0, 0.0))
    floor_cell(tmp_path / "raw")
    f = D.frame(load_results(tmp_path / "raw"))
    r = f[(f["config"] == "m TP=1") & (f["system"] == "granikv")].iloc[0]
    assert r["attn_roofline_ms"] == pytest.approx(2 * 9344 / 4.8e12 * 1e3)   # H200: 4.8 TB/s, memory-bound


@pytest.mark.parametrize("floor", [None, {"m": 8}, {"device": "cpu"}, {"graph": False}, {"gpu": "NVIDIA A100-SXM4-40GB"},
                                   {"tp": 2}])
def test_no_usable_gemm_floor_says_not_measured(tmp_path, floor):
    serving_cell(tmp_path / "raw")
    if floor is not None:            # a floor of another M, a CPU cell, an eager timing, another GPU, another shard
        floor_cell(tmp_path / "raw", **floor)
    row = table(tmp_path / "raw", tmp_path / "out").loc["granikv"]
    for col in ("gemm_floor_ms", "limit_ms", "multiple"):
        assert row[col] == "not measured", col
    assert row["status"].startswith("not measured") and "m-tp1-m4" in row["status"]
    assert float(row["step_ms"]) == pytest.approx(11.0, abs=0.005)       # what is measured is still shown
    assert float(row["attn_roofline_ms"]) > 0


def test_a_missing_floor_names_the_command_of_the_cells_own_gpu(tmp_path):
    """An H100 cell without its floor: the row says which command measures it there (hardware=h100), the H200's
    floor of the same shape not taken."""
    d = serving_cell(tmp_path / "raw", gpu="NVIDIA H100 80GB HBM3")
    cfg = rawio.read_json(d / "config.json")
    rawio.write_json(d / "config.json", {**cfg, "hardware": {**cfg["hardware"], "name": "h100"}})
    floor_cell(tmp_path / "raw")                      # the H200's
    row = table(tmp_path / "raw", tmp_path / "out").loc["granikv"]
    assert row["gemm_floor_ms"] == "not measured"
    assert "on NVIDIA H100 80GB HBM3 (python -m runners.kernel_bench_gemm_floor hardware=h100)" in row["status"]


def test_expected_rows_without_cells_say_not_measured(tmp_path):
    (tmp_path / "raw").mkdir()
    D.build(load_results(tmp_path / "raw"), tmp_path / "out", figures=False)
    t = pd.read_csv(tmp_path / "out" / "tables" / f"{D.NAME}.csv", dtype=str, keep_default_na=False)
    assert len(t) == 3 * 6 * 4 + 3 * 6 * 4 * 4      # headline + grid, paper configs x Lp (x B) x systems
    assert t["status"].eq("not measured").all()
    for col in ("step_ms", "gemm_floor_ms", "attn_roofline_ms", "multiple", "prof_gemm_ms"):
        assert t[col].eq("not measured").all(), col


def _trace(prefix_annotation: bool) -> dict:
    """Two decode steps 2.5 ms apart; in each a GEMM (1.0 ms), an attention kernel (0.5 ms), a FlashInfer
    norm (0.2 ms, not attention although its name holds 'flashinfer'); 1.7 ms busy -> 0.8 ms host gap."""
    ev = []
    for s in (0.0, 2500.0):
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "decode_step", "ts": s, "dur": 2000.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": s + 10, "dur": 1000.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "flashinfer::BatchDecodeWithPagedKVCacheKernel", "ts": s + 1010,
                   "dur": 500.0})
        ev.append({"ph": "X", "cat": "kernel", "name": "flashinfer::norm::FusedAddRMSNormKernel<8u>", "ts": s + 1510,
                   "dur": 200.0})
        if prefix_annotation:
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "prefix_attention", "ts": s + 1000, "dur": 300.0})
    ev.append({"ph": "X", "cat": "kernel", "name": "nvjet_outside", "ts": 9000.0, "dur": 999.0})   # outside every step
    return {"traceEvents": ev}


@pytest.mark.parametrize("prefix_annotation", [False, True])
def test_profiler_breakdown(tmp_path, prefix_annotation):
    serving_cell(tmp_path / "raw", system="sglang_default")
    serving_cell(tmp_path / "raw", system="sglang_default", profile_steps=2, sweep="profiler_m_tp1",
                 trace=_trace(prefix_annotation))
    row = table(tmp_path / "raw", tmp_path / "out").loc["sglang_default"]
    assert row["n"] == "1"                             # the instrumented cell is not a repetition of the step time
    assert float(row["prof_gemm_ms"]) == pytest.approx(1.0, abs=5e-4)
    assert float(row["prof_attention_ms"]) == pytest.approx(0.5, abs=5e-4)
    assert float(row["prof_other_ms"]) == pytest.approx(0.2, abs=5e-4)
    assert float(row["prof_host_gap_ms"]) == pytest.approx(0.8, abs=5e-4)
    assert float(row["prof_step_ms"]) == pytest.approx(2.5, abs=5e-4)
    if prefix_annotation:
        assert float(row["prof_prefix_attn_ms"]) == pytest.approx(0.5, abs=5e-4)
        assert float(row["prof_suffix_merge_ms"]) == pytest.approx(0.0, abs=5e-4)
    else:
        assert row["prof_prefix_attn_ms"] == "not measured" and row["prof_suffix_merge_ms"] == "not measured"
        assert "prefix / suffix split not measured" in row["prof_source"]


@pytest.mark.parametrize("name,attention", [
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", True),
    ("void PrefillWithKVCacheKernel<CollectiveMainloop<...>>", True),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", True),   # dense_kernel=fa2
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", True),  # cudnn
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", False)])
def test_attention_kernels_by_name(name, attention):
    from analysis.measures.limit import ATTENTION_KERNEL
    assert bool(ATTENTION_KERNEL.search(name)) == attention


def _scaled(trace: dict, gap_us: float) -> dict:
    """``trace`` with its second step moved ``gap_us`` later (a longer host gap, as eager steps have)."""
    ev = [dict(e) for e in trace["traceEvents"]]
    for e in ev:
        if 2500.0 <= e["ts"] < 9000.0:
            e["ts"] += gap_us
    return {"traceEvents": ev}


def test_graph_trace_gives_the_step_and_eager_trace_the_split(tmp_path):
    # CUDA-graph steps carry no prefix range; the eager run of the same configuration does, with a
    # host gap 3 ms longer: the step as served comes from the graph trace, the split from the eager one
    serving_cell(tmp_path / "raw", system="granikv")
    serving_cell(tmp_path / "raw", system="granikv", profile_steps=2, sweep="profiler_m_tp1", trace=_trace(False))
    serving_cell(tmp_path / "raw", system="granikv", profile_steps=2, sweep="profiler_m_tp1",
                 trace=_scaled(_trace(True), 3000.0), cuda_graph_max_bs=0)
    row = table(tmp_path / "raw", tmp_path / "out").loc["granikv"]
    assert float(row["prof_step_ms"]) == pytest.approx(2.5, abs=5e-4)
    assert float(row["prof_host_gap_ms"]) == pytest.approx(0.8, abs=5e-4)
    assert float(row["prof_prefix_attn_ms"]) == pytest.approx(0.5, abs=5e-4)
    assert float(row["prof_suffix_merge_ms"]) == pytest.approx(0.0, abs=5e-4)
    assert "split from 1 eager-step trace" in row["prof_source"]


def test_eager_trace_alone_says_so(tmp_path):
    serving_cell(tmp_path / "raw", system="granikv")
    serving_cell(tmp_path / "raw", system="granikv", profile_steps=2, sweep="profiler_m_tp1",
                 trace=_scaled(_trace(True), 3000.0), cuda_graph_max_bs=0)
    row = table(tmp_path / "raw", tmp_path / "out").loc["granikv"]
    assert float(row["prof_host_gap_ms"]) == pytest.approx(3.8, abs=5e-4)
    assert "eager: no CUDA-graph trace" in row["prof_source"]
    assert float(row["prof_prefix_attn_ms"]) == pytest.approx(0.5, abs=5e-4)


def test_report_lines_flag_a_floor_above_the_steps_own_gemms(tmp_path):
    # the trace's GEMMs take 1.0 ms per step, the floor timed alone 2.0 ms: not a lower bound there
    serving_cell(tmp_path / "raw", system="granikv")
    serving_cell(tmp_path / "raw", system="granikv", profile_steps=2, sweep="profiler_m_tp1", trace=_trace(True))
    floor_cell(tmp_path / "raw", time_ms=2.0)
    L = D.lines(D.frame(load_results(tmp_path / "raw")))
    row = next(x for x in L if x.startswith("| m TP=1 | 100 | 4 | granikv |"))
    assert "| 1.00 | 0.50 | 0.50 | 0.00 |" in row        # GEMMs, attention, prefix, suffix + merge
    assert "1 of these rows" in L[-1] and "1.00 ms against 2.00 ms" in L[-1]
    floor_cell(tmp_path / "raw2", time_ms=0.5)
    serving_cell(tmp_path / "raw2", system="granikv")
    serving_cell(tmp_path / "raw2", system="granikv", profile_steps=2, sweep="profiler_m_tp1", trace=_trace(True))
    assert not any("not a lower bound" in x for x in D.lines(D.frame(load_results(tmp_path / "raw2"))))
