#!/usr/bin/env bash
# Shared GPU-host environment for runners/gpu/*.sh (source it; do not run it).
#
# Sets up, from files the lead carries into the repository root (all git-ignored; the first, second and
# fourth are built by `python runners/gpu/build_gpu_site.py`, the third comes back from each call):
#   .gpu_site/flashinfer-0.7.2.post1.tar.xz   FlashInfer (python package tree), extracted into .gpu_site/site
#   .whl/apache_tvm_ffi-*.whl                  installed --no-deps into .gpu_site/site
#   .fi_cache/parts/fi_cache.tar.xz.part-*     the FlashInfer JIT cache (restored when present; else
#                                              the committed seed, runners/gpu/jit_seed/, see fi_cache_parts_dir)
#   .gpu_site/py/                              pure-Python wheels unpacked (hydra, omegaconf), put on PYTHONPATH
# and exports PY, PYTHONPATH, FLASHINFER_WORKSPACE_BASE, OUT, the NCCL settings of the host, and
# helpers: log, left (seconds left of BUDGET_S minus PACK_RESERVE_S), pack_fi_cache MAX_PARTS.
# Reads: GRANIKV_BUDGET_S (540), GRANIKV_PACK_RESERVE_S (60), GRANIKV_GIT_COMMIT / GRANIKV_GIT_DIRTY
# (the provenance the cells record: the device copy's .git may be stale; provenance_env.sh prints them),
# GRANIKV_ENV_CPU_TEST (the CPU test of this file), PYTHON, OUT ($PWD/.out when unset).
T0=${T0:-$(date +%s)}
BUDGET_S=${GRANIKV_BUDGET_S:-540}
PACK_RESERVE_S=${GRANIKV_PACK_RESERVE_S:-60}
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
ROOT=$PWD
GPU_LOG_TAG=${GPU_LOG_TAG:-gpu}
left() { echo $(( BUDGET_S - PACK_RESERVE_S - ($(date +%s) - T0) )); }
log() { echo "[$GPU_LOG_TAG +$(( $(date +%s) - T0 ))s] $*"; }

export GRANIKV_GIT_COMMIT=${GRANIKV_GIT_COMMIT:-unknown}
export GRANIKV_GIT_DIRTY=${GRANIKV_GIT_DIRTY:-unknown}
if [ "$GRANIKV_GIT_COMMIT" = unknown ]; then
  echo "[$GPU_LOG_TAG] WARNING: GRANIKV_GIT_COMMIT not set: results will name whatever commit this copy's .git reports" \
       "(possibly stale); prepend the line printed by runners/gpu/provenance_env.sh"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAX_JOBS=${MAX_JOBS:-16} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export FLASHINFER_USE_CUDA_NORM=1   # FlashInfer's CUDA norm kernels (sgl-kernel's), not its CuTe-DSL ones
export FLASHINFER_WORKSPACE_BASE=$ROOT/.fi_cache
SITE=$ROOT/.gpu_site/site
PY=${PYTHON:-python3}
source "$(dirname "${BASH_SOURCE[0]}")/jit_cache.sh"   # jit_cache_pack / _restore, fix_site_mtimes

# Where the JIT cache is restored from: the parts the last call brought back (.fi_cache/parts, put there
# by unpack.sh), else the seed committed with the code (runners/gpu/jit_seed/: FlashInfer 0.7.2.post1's
# modules for sm90a that the engine GPU gate and the serving cells build), so that a fresh checkout's
# first call does not spend ~5 min of device time building them. A cache is only a cache: FlashInfer
# rebuilds any module whose sources changed. Refresh the seed from a later call's parts with
# `cp .fi_cache/parts/fi_cache.tar.xz.part-* runners/gpu/jit_seed/` (remove the old parts first).
fi_cache_parts_dir() {
  if ls "$FLASHINFER_WORKSPACE_BASE/parts"/fi_cache.tar.xz.part-* >/dev/null 2>&1; then
    echo "$FLASHINFER_WORKSPACE_BASE/parts"
  else
    echo "$ROOT/runners/gpu/jit_seed"
  fi
}

gpu_env_setup() {
  if [ -n "${GRANIKV_ENV_CPU_TEST:-}" ]; then   # tests/test_gpu_scripts.py: the scripts' logic on CPU, no FlashInfer
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    log "CPU test environment (GRANIKV_ENV_CPU_TEST): no FlashInfer, no GPU"
    return 0
  fi
  mkdir -p "$SITE" "$FLASHINFER_WORKSPACE_BASE"
  if [ ! -d "$SITE/flashinfer" ]; then
    local FI_TAR
    FI_TAR=$(ls "$ROOT"/.gpu_site/flashinfer-*.tar.xz 2>/dev/null | head -1)
    [ -n "$FI_TAR" ] || { echo "ERROR: .gpu_site/flashinfer-0.7.2.post1.tar.xz not carried"; return 2; }
    tar -xJf "$FI_TAR" -C "$SITE" || { echo "ERROR: could not extract $FI_TAR"; return 2; }
  fi
  if [ ! -d "$SITE/tvm_ffi" ]; then
    local WHL
    WHL=$(ls "$ROOT"/.whl/apache_tvm_ffi-*.whl 2>/dev/null | head -1)
    [ -n "$WHL" ] || { echo "ERROR: .whl/apache_tvm_ffi-*.whl not carried"; return 2; }
    $PY -m pip install -q --no-deps --target "$SITE" "$WHL" || { echo "ERROR: pip install $WHL failed"; return 2; }
  fi
  fix_site_mtimes "$SITE"   # the tvm-ffi headers pip stamped would make every cached module rebuild
  jit_cache_restore "$FLASHINFER_WORKSPACE_BASE" "$(fi_cache_parts_dir)" fi_cache
  export PYTHONPATH=$ROOT:$SITE:$ROOT/.gpu_site/py${PYTHONPATH:+:$PYTHONPATH}
  $PY - <<'PYEOF' || { echo "ERROR: environment check failed (see above)"; return 2; }
import torch, yaml, hydra, omegaconf, flashinfer, granikv
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0))
print("flashinfer", flashinfer.__version__, flashinfer.__file__)
print("granikv", granikv.__file__)
PYEOF
  log "environment ready"
}

# Pack the JIT cache into $OUT as <= MAX_PARTS parts of 14 MB (none, with a warning, if larger).
pack_fi_cache() { jit_cache_pack "$FLASHINFER_WORKSPACE_BASE" fi_cache "${1:-5}"; }

# gpu_test_gate "TESTS" LOG: the GPU tests a script's measurements rest on (`pytest -m gpu TESTS`, log in
# $OUT/LOG); returns non-zero when one fails or the run ended in skips (then nothing may be measured).
gpu_test_gate() {
  log "pytest -m gpu $1 (gate for the measurements)"
  # shellcheck disable=SC2086
  timeout "$(left)" $PY -m pytest -m gpu $1 -q -p no:cacheprovider > "$OUT/$2" 2>&1
  local rc=$?
  tail -3 "$OUT/$2"
  if [ "$rc" != 0 ] || grep -q "skipped" <(tail -1 "$OUT/$2"); then
    log "GPU tests rc=$rc (or skipped): nothing measured (see $2)"
    return 1
  fi
}
