#!/usr/bin/env bash
# Engine measurement on the H200 host, ONE call of the device `run` (< 9 min including FlashInfer JIT).
#
#   run(command="<export line from runners/gpu/provenance_env.sh, run here>; bash runners/gpu/engine.sh", timeout_s=600,
#       carry=[".gpu_site", ".whl", ".fi_cache"])
#
# Llama-3.1-8B shape (random bf16 weights), synthetic burst: one 8K-token shared prefix, B=256
# requests with 32-token unique suffixes, 128 output tokens, TP=1, hardware=h200 (mem_fraction
# 0.88, CUDA graphs up to batch 256, chunked prefill 8192; granikv's dispatcher uses
# conf/hardware/h200.yaml's decision_table when the calibration has written one, else the
# paper's rule, and says so in the log). For each of sglang_default, sglang_cascade, hydragen,
# granikv: a warm-up pass (JIT, graph capture, logit probe), a measured pass (TPOT p50, output
# throughput, TTFT, the dispatch trace), a profiled pass (torch.profiler: share of each decode
# step outside GPU kernels), and token agreement + max logit difference vs sglang_default.
#
# Writes into $OUT (<= 8 files, each < 15 MB):
#   engine_summary.json        the table above per system (also printed at the end)
#   engine_results.tar.gz      results/raw/engine_bench/<system>/{config,metrics}.json, requests.jsonl.gz,
#                              steps.jsonl.gz (+ failure.json for a system that failed), summary.json
#   engine_bench.log           the full log
#   engine_gpu_tests.log       pytest -m gpu tests/test_engine_gpu.py (small model: every system's decode
#                              logits vs the no-cache reference, CUDA-graph replay vs eager)
#   fi_cache.tar.xz.part-*     the FlashInfer JIT cache (<= 4 parts; put them in .fi_cache/parts/)
#
# Knobs (environment): GRANIKV_ENGINE_OUT (default results/raw/engine_bench), GRANIKV_TP=2 runs under torchrun with 2 ranks (the nvidia-h200-x2 kind),
# GRANIKV_ENGINE_MODEL=qwen25_14b (default llama3_8b), GRANIKV_ENGINE_BENCH_ARGS="..." adds
# arguments (e.g. "--systems sglang_default,granikv --cuda-graph-max-bs 0"), GRANIKV_SKIP_GPU_TESTS=1 skips
# the engine GPU tests, GRANIKV_BUDGET_S / GRANIKV_PACK_RESERVE_S the time budget (runners/gpu/env.sh).
set -uo pipefail
T0=$(date +%s)
GPU_LOG_TAG=engine.sh
source "$(dirname "$0")/env.sh"
gpu_env_setup || exit 2
if [ -z "${GRANIKV_SKIP_GPU_TESTS:-}" ]; then
log "pytest -m gpu tests/test_engine_gpu.py (limit 300s: a cold JIT build of the fused layer ops takes minutes)"
PYTHONFAULTHANDLER=1 timeout 300 $PY -m pytest -m gpu tests/test_engine_gpu.py -v -p no:cacheprovider -x 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -15
log "engine gpu tests rc=${PIPESTATUS[0]}"
else
  log "GPU tests skipped (GRANIKV_SKIP_GPU_TESTS set)"
fi
RES=${GRANIKV_ENGINE_OUT:-results/raw/engine_bench}   # e.g. results/raw/engine_bench_qwen25_14b_tp2
rm -rf "$RES"
T=$(left); [ "$T" -gt 60 ] || T=60
log "engine_bench (limit ${T}s)"
TP=${GRANIKV_TP:-1}
LAUNCH="$PY -m runners.engine_bench"
[ "$TP" -gt 1 ] && LAUNCH="$PY -m torch.distributed.run --standalone --nproc_per_node=$TP -m runners.engine_bench"
timeout "$T" $LAUNCH --model "${GRANIKV_ENGINE_MODEL:-llama3_8b}" --hardware h200 --prefix-len 8192 --batch 256 \
    --suffix-len 32 --output-len 128 --out "$RES" ${GRANIKV_ENGINE_BENCH_ARGS:-} 2>&1 | tee "$OUT/engine_bench.log"
RC=${PIPESTATUS[0]}
log "engine_bench rc=$RC"
[ -f "$RES/summary.json" ] && cp "$RES/summary.json" "$OUT/engine_summary.json"
[ -d "$RES" ] && tar -czf "$OUT/engine_results.tar.gz" "$RES"
pack_fi_cache 4
ls -la "$OUT"
log "done"
exit $RC
