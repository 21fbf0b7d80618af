#!/usr/bin/env bash
# GPU verification on the H200 host, the first part of ONE device `run` call:
#
#   run(command="<export line from runners/gpu/provenance_env.sh>; bash runners/gpu/verify.sh", timeout_s=600,
#       carry=[".gpu_site", ".whl", ".fi_cache"])
#
# (1) the GPU tests of the attention paths (tests/test_attention*.py -m gpu) and of the engine
#     (tests/test_engine_gpu.py -m gpu) run side by side (one compiles the fused-op JIT modules
#     on the CPUs while the other runs kernels; both are correctness tests, not timings);
# (2) then, alone on the machine, the host-side dispatch-cost cell of the kernel bench
#     (results/raw/kernel/dispatch_cost, rerun every call);
# (3) packs into $OUT:
#   verify_results.tar.gz   results/raw/{attention_gpu,engine_gpu_tests,kernel/dispatch_cost}
#   fi_cache.tar.xz.part-*  the JIT cache (with the fused-op modules; put them in .fi_cache/parts/)
# GRANIKV_VERIFY_THEN="bash runners/gpu/engine.sh" (with GRANIKV_SKIP_GPU_TESTS=1) chains the
# engine measurement in the same call; it then packs the cache itself. GRANIKV_VERIFY_TEST_LIMIT_S
# (default 330) limits each of the two test runs.
set -uo pipefail
T0=$(date +%s)
GPU_LOG_TAG=verify.sh
source "$(dirname "$0")/env.sh"
gpu_env_setup || exit 2
AT=$ROOT/results/raw/attention_gpu
ET=$ROOT/results/raw/engine_gpu_tests
mkdir -p "$AT" "$ET"
TLIM=${GRANIKV_VERIFY_TEST_LIMIT_S:-330}
log "GPU tests, attention and engine side by side (limit ${TLIM}s each)"
( timeout "$TLIM" $PY -m pytest -m gpu tests/test_attention*.py -q -p no:cacheprovider \
      --junitxml="$AT/junit.xml" > "$AT/pytest.log" 2>&1
  RC=$?
  echo "rc=$RC commit=$GRANIKV_GIT_COMMIT at=$(date -u +%FT%TZ)" > "$AT/last_rc"
  [ "$RC" = 0 ] && echo "commit=$GRANIKV_GIT_COMMIT at=$(date -u +%FT%TZ)" > "$AT/passed" ) &
APID=$!
PYTHONFAULTHANDLER=1 timeout "$TLIM" $PY -m pytest -m gpu tests/test_engine_gpu.py -v -p no:cacheprovider \
    --junitxml="$ET/junit.xml" > "$ET/pytest.log" 2>&1
ERC=$?
echo "rc=$ERC commit=$GRANIKV_GIT_COMMIT at=$(date -u +%FT%TZ)" > "$ET/last_rc"
wait $APID
log "attention GPU tests: $(cat "$AT/last_rc"); $(tail -1 "$AT/pytest.log")"
log "engine GPU tests: rc=$ERC; $(tail -1 "$ET/pytest.log")"
log "dispatch cost (host CPU, nothing else running; the cell is rerun)"
$PY -m runners.kernel_bench hardware=h200 'cells=[dispatch_cost]' force=true ncu=false 2>&1 | tail -8
cat results/raw/kernel/dispatch_cost/metrics.json 2>/dev/null
tar -czf "$OUT/verify_results.tar.gz" results/raw/attention_gpu results/raw/engine_gpu_tests \
    $(ls -d results/raw/kernel/dispatch_cost 2>/dev/null)
if [ -n "${GRANIKV_VERIFY_THEN:-}" ]; then
  log "then: $GRANIKV_VERIFY_THEN (budget $(( BUDGET_S - ($(date +%s) - T0) ))s)"
  GRANIKV_BUDGET_S=$(( BUDGET_S - ($(date +%s) - T0) )) bash -c "$GRANIKV_VERIFY_THEN"
else
  pack_fi_cache 4
fi
ls -la "$OUT"
log "done"
