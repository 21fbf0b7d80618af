#!/usr/bin/env bash
# The dispatcher's calibration on the H200 host, alone: ONE device `run` (<= 10 min), resumable.
#
#   run(command="<export line from runners/gpu/provenance_env.sh, run here>; bash runners/gpu/calibrate.sh [overrides]",
#       timeout_s=600, carry=[".gpu_site", ".whl", ".fi_cache"])
#
# First the attention GPU tests of the paths it times (GRANIKV_CAL_TESTS, default the classes-of-adjacent-rows
# test of tests/test_attention_gpu.py, the Llama shape; log in $OUT/cal_tests.log): if they fail or skip,
# nothing is measured. Then runs
# `python -m runners.calibrate hardware=h200 time_budget_s=<left> <overrides>` (graph-replayed and
# eager step times of every option, the fit with the no-regression guard, the table written into
# conf/hardware/h200.yaml) and packs into $OUT:
#   cal.tar.gz   results/raw/<sweep_name> (default calibration_eager) + conf/hardware/h200.yaml (its table)
# Then here: `tar -xzf <files_at>/cal.tar.gz` in the repo root, and commit both. Cells already measured
# are skipped (they travel in results/raw), so a call cut off by its budget resumes in the next one.
# Can be followed in the same call by runners/gpu/sweep.sh, whose cells then dispatch with the new table
# (each cell's config.json records the table it ran with).
# Knobs: GRANIKV_BUDGET_S / GRANIKV_PACK_RESERVE_S (runners/gpu/env.sh), GRANIKV_CAL_SWEEP (the sweep_name),
# GRANIKV_CAL_TESTS (the gate's tests; empty: no gate),
# GRANIKV_CAL_HARDWARE (default h200; cpu for the CPU test of this script, with GRANIKV_ENV_CPU_TEST).
set -uo pipefail
T0=${T0:-$(date +%s)}
GPU_LOG_TAG=calibrate.sh
source "$(dirname "$0")/env.sh"
gpu_env_setup || exit 2
SWEEP=${GRANIKV_CAL_SWEEP:-calibration_eager}
HW=${GRANIKV_CAL_HARDWARE:-h200}
TESTS=${GRANIKV_CAL_TESTS-tests/test_attention_gpu.py::test_grouped_classes_match_reference}
if [ -n "$TESTS" ]; then
  gpu_test_gate "$TESTS" cal_tests.log || exit 3
fi
T=$(left)
if [ "$T" -le 30 ]; then log "no time left to calibrate (${T}s)"; exit 3; fi
log "calibrate hardware=$HW sweep_name=$SWEEP (budget ${T}s) $*"
$PY -m runners.calibrate hardware="$HW" sweep_name="$SWEEP" time_budget_s="$T" "$@" 2>&1 | tail -60
RC=${PIPESTATUS[0]}
mkdir -p "$OUT"
tar -czf "$OUT/cal.tar.gz" "results/raw/$SWEEP" "conf/hardware/$HW.yaml" 2>/dev/null
ls -la "$OUT/cal.tar.gz"
log "calibrate rc=$RC"
exit "$RC"
