#!/usr/bin/env bash
# One kernel-bench measurement on the GPU host, ONE device `run` (<= 10 min), resumable:
#
#   run(command="<export line from runners/gpu/provenance_env.sh, run here>; bash runners/gpu/kernel.sh
#                sweep_name=kernel_dense_kernels 'backends=[dense,dense_cudnn]' 'cells=[...]' profile_kernels=true",
#       timeout_s=600, carry=[".gpu_site", ".whl", ".fi_cache"])
#
# Arguments: Hydra overrides of `python -m runners.kernel_bench hardware=h200` (give sweep_name=, so the
# cells land in a sweep of their own; GRANIKV_KERNEL_HARDWARE picks another hardware option;
# GRANIKV_KERNEL_TOOL=graph_step_bench runs runners.graph_step_bench instead, the same way, and
# GRANIKV_KERNEL_TOOL=kernel_bench_gemm_floor the GEMM floor, e.g. GRANIKV_KERNEL_HARDWARE=h100 with sweep_name=gemm_floor_h100
# 'models=[{model: llama3_8b, tp: 1}]' 'batches=[256]'). First the attention GPU tests of the kernels it may run
# (GRANIKV_KERNEL_TESTS, default tests/test_attention_sdpa.py and the dense split test; log in
# $OUT/kernel_tests.log): if they fail or skip, nothing is measured. Then kernel_bench with the
# call's time budget (GRANIKV_BUDGET_S less GRANIKV_PACK_RESERVE_S, as sweep.sh); cells already
# holding metrics.json are skipped. Packs into $OUT what sweep.sh packs (raw.tar.gz.part-* of the cell
# folders this call finished or failed, the FlashInfer JIT cache, kernel.log), so that
# `bash runners/gpu/unpack.sh <files_at>` takes it back here the same way.
set -uo pipefail
T0=$(date +%s)
GPU_LOG_TAG=kernel.sh
source "$(dirname "$0")/env.sh"
gpu_env_setup || exit 2
grep -q "sweep_name=" <<< "$*" || { log "ERROR: give sweep_name=<name> (a sweep of its own under results/raw)"; exit 2; }
TESTS=${GRANIKV_KERNEL_TESTS:-tests/test_attention_sdpa.py tests/test_attention_gpu.py::test_dense_kv_split_matches_reference}
if [ -n "$TESTS" ]; then
  gpu_test_gate "$TESTS" kernel_tests.log || { pack_fi_cache 3; exit 3; }
fi
MARK=$(mktemp); touch "$MARK"; sleep 1
T=$(left)
HW=${GRANIKV_KERNEL_HARDWARE:-h200}
TOOL=${GRANIKV_KERNEL_TOOL:-kernel_bench}
case "$TOOL" in kernel_bench|graph_step_bench|kernel_bench_gemm_floor) ;;
  *) log "ERROR: GRANIKV_KERNEL_TOOL=$TOOL: kernel_bench | graph_step_bench | kernel_bench_gemm_floor"; exit 2;; esac
log "$TOOL hardware=$HW $* (budget ${T}s)"
timeout "$T" $PY -m "runners.$TOOL" "hardware=$HW" time_budget_s=$((T - 30 > 30 ? T - 30 : 30)) "$@" \
  > "$OUT/kernel.log" 2>&1
log "$TOOL rc=$? (124 = cut by the budget; resumable)"
tail -25 "$OUT/kernel.log"
CHANGED=$(find results/raw -newer "$MARK" \( -name metrics.json -o -name failure.json \) 2>/dev/null \
          | grep -v '/\.' | sed 's|/[^/]*$||' | sort -u)
if [ -n "$CHANGED" ]; then
  RAW=raw; N=1
  while ls "$OUT/$RAW.tar.gz.part-"* >/dev/null 2>&1; do N=$((N + 1)); RAW=raw$N; done
  # shellcheck disable=SC2086
  tar -czf - $CHANGED | split -b 14m - "$OUT/$RAW.tar.gz.part-"
  log "packed $(echo "$CHANGED" | wc -l) cell folders: $(echo $CHANGED)"
else
  log "no cell written"
fi
[ -n "${GRANIKV_NO_FI_PACK:-}" ] || pack_fi_cache 3
log "done"
