#!/usr/bin/env bash
# Real SGLang 0.5.17 on the GPU host (system=sglang_server cells), from a carried wheel set.
#
# The host has python 3.12 and torch 2.11.0+cu130 but no SGLang and no internet. The wheel set
# (~118 MiB: sglang 0.5.17, the versions it pins, sglang-kernel 0.4.5 without its FA3 library;
# runners/gpu/sglang_wheels.txt) is built once on a machine with internet,
#   python runners/gpu/build_sgl_wheels.py      # -> .sgl_wheels/{whl/*.whl, whl/MANIFEST.txt, parts/}
# (git-ignored) and travels in parts of <= 40 MiB, one part per device call (a call carries at most
# 64 MiB with the checkout: send it with `bash runners/gpu/slim_tree.sh on`, ~12 MiB, the cells' metrics.json
# kept so that sweeps skip finished cells; `off` after), each with one part of the FlashInfer JIT cache:
#   bash runners/gpu/sglang.sh stage        # in each call: copy the carried part(s) to /tmp/sgl_parts
#   bash runners/gpu/sglang.sh install      # all parts there: check MANIFEST sha256, pip install --target /tmp/sgl_site,
#                                           # restore the JIT cache
#   bash runners/gpu/sglang.sh gate [overrides]   # start (or reuse) the server, serve 16 requests
#   bash runners/gpu/sglang.sh kernels      # the plugin's captured-step GPU tests under SGLang's FlashInfer
#   bash runners/gpu/sglang.sh stop         # stop every server this recipe started (by pid)
# and runners/gpu/sweep.sh measures with GRANIKV_ENGINE=sglang (it sources this file: install, gate,
# then the sweep). Consecutive calls on the same machine (it stays warm ~30 s after a call) reuse
# what /tmp holds: the parts, the site dir and the running server (started in its own session with
# GRANIKV_SGLANG_KEEP=1; the next call adopts it when its arguments are the same).
#
#   run(command="bash runners/gpu/sglang.sh stage", carry=[".sgl_wheels/parts/sgl_wheels.tar.part-aa", ".sgl_fi_cache/parts/sgl_fi_cache.tar.xz.part-aa"])
#   run(command="bash runners/gpu/sglang.sh stage", carry=[".sgl_wheels/parts/sgl_wheels.tar.part-ab", ".sgl_fi_cache/parts/sgl_fi_cache.tar.xz.part-ab"])
#   run(command="<provenance export line>; bash runners/gpu/sglang.sh stage && GRANIKV_ENGINE=sglang bash runners/gpu/sweep.sh headline -- system=sglang_server",
#       carry=[".sgl_wheels/parts/sgl_wheels.tar.part-ac", ".sgl_fi_cache/parts/sgl_fi_cache.tar.xz.part-ac", ".gpu_site/py"])
#
# The FlashInfer JIT cache. SGLang's FlashInfer (0.6.15) compiles its kernels at first use: the
# batch decode/prefill modules while the machine's first server starts (289 s against 72 s warm on
# the H200), the plugin's dense prefix module (single prefill) at its first decode step
# (a first warm-up of 90-114 s against 5-11 s). Every SGLang process this recipe starts (the sweeps'
# servers, the gate, runners.plugin_check) shares one workspace, FLASHINFER_WORKSPACE_BASE=
# .sgl_fi_cache (apart from the engine's .fi_cache: another FlashInfer version). sweep.sh packs it
# into $OUT as sgl_fi_cache.tar.xz.part-* (`bash runners/gpu/sglang.sh pack` does it by hand); put
# those in .sgl_fi_cache/parts/ here and carry one per call as above: the third call restores it.
# Installed sources get one fixed old mtime, so ninja does not take them for newer than the cache.
#
# Knobs: GRANIKV_SGLANG_PARTS (/tmp/sgl_parts), GRANIKV_SGLANG_SITE (/tmp/sgl_site),
# GRANIKV_SGLANG_STATE (/tmp/granikv-sglang: server state and logs), GRANIKV_SGLANG_GATE_ARGS
# (the gate's overrides, default: the headline's server at Lp=512, 16 requests).
SGL_PARTS=${GRANIKV_SGLANG_PARTS:-/tmp/sgl_parts}
SGL_SITE=${GRANIKV_SGLANG_SITE:-/tmp/sgl_site}
export GRANIKV_SGLANG_STATE=${GRANIKV_SGLANG_STATE:-/tmp/granikv-sglang}
SGL_JIT_PARTS=$SGL_PARTS/jit
export GRANIKV_SGLANG_KEEP=1 SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SGL_ROOT=${SGL_ROOT:-$PWD}
export FLASHINFER_WORKSPACE_BASE=$SGL_ROOT/.sgl_fi_cache   # one JIT cache for every SGLang process (above)
source "$(dirname "${BASH_SOURCE[0]}")/jit_cache.sh"
_slog() { echo "[sglang.sh +$(( $(date +%s) - ${T0:-$(date +%s)} ))s] $*"; }

sglang_stage() {   # copy the parts this call carried out of the checkout (the next call's checkout replaces it)
  mkdir -p "$SGL_PARTS"
  local n=0 p
  for p in "$SGL_ROOT"/.sgl_wheels/parts/sgl_wheels.tar.part-*; do
    [ -f "$p" ] || continue
    cp "$p" "$SGL_PARTS/" && n=$((n + 1))
  done
  mkdir -p "$SGL_JIT_PARTS"
  for p in "$FLASHINFER_WORKSPACE_BASE"/parts/sgl_fi_cache.tar.xz.part-*; do
    [ -f "$p" ] || continue
    cp "$p" "$SGL_JIT_PARTS/" && n=$((n + 1))
  done
  _slog "staged $n part(s); $SGL_PARTS holds: $(ls "$SGL_PARTS" "$SGL_JIT_PARTS" | grep part- | tr '\n' ' ')"
}

# The carried JIT cache -> $FLASHINFER_WORKSPACE_BASE/.cache (once; a missing part = a cold build). With no part
# carried: the seed committed with the code (runners/gpu/sgl_jit_seed/: SGLang's FlashInfer 0.6.15.post1 modules
# for sm90a that a flashinfer-backend server and the plugin's servers build), so that a fresh checkout's first
# server does not spend minutes of device time building them. Refresh it from a later call's parts with
# `cp .sgl_fi_cache/parts/sgl_fi_cache.tar.xz.part-* runners/gpu/sgl_jit_seed/` (remove the old parts first).
sglang_jit_restore() {
  fix_site_mtimes "$SGL_SITE"
  local P=$SGL_JIT_PARTS
  ls "$P"/sgl_fi_cache.tar.xz.part-* >/dev/null 2>&1 || P=$(dirname "${BASH_SOURCE[0]}")/sgl_jit_seed
  jit_cache_restore "$FLASHINFER_WORKSPACE_BASE" "$P" sgl_fi_cache
}

sglang_pack_jit() { jit_cache_pack "$FLASHINFER_WORKSPACE_BASE" sgl_fi_cache "${1:-3}"; }   # -> $OUT

sglang_install() {   # idempotent: the parts -> wheels (sha256 checked) -> $SGL_SITE
  if [ -f "$SGL_SITE/.installed" ]; then _slog "SGLang already installed in $SGL_SITE"; return 0; fi
  local W=/tmp/sgl_whl
  rm -rf "$W"; mkdir -p "$W"
  cat "$SGL_PARTS"/sgl_wheels.tar.part-* 2>/dev/null | tar -x -C "$W" 2>/dev/null \
    || { echo "ERROR: the wheel parts in $SGL_PARTS do not make a whole tar (a part missing? stage every part first)"; return 2; }
  [ -f "$W/whl/MANIFEST.txt" ] || { echo "ERROR: no MANIFEST.txt in the wheel set"; return 2; }
  (cd "$W/whl" && awk '{print $1"  "$3}' MANIFEST.txt | sha256sum -c --quiet) \
    || { echo "ERROR: wheel checksums do not match MANIFEST.txt (a part truncated?)"; return 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SGL_SITE" "$W"/whl/*.whl \
    || { echo "ERROR: pip install of the wheel set failed"; return 2; }
  cp "$W/whl/MANIFEST.txt" "$SGL_SITE/.manifest" && touch "$SGL_SITE/.installed"
  _slog "installed $(ls "$W"/whl/*.whl | wc -l) wheels into $SGL_SITE"
}

sglang_env_setup() {   # the runner's environment (hydra from .gpu_site/py) and the server's (SGLang first)
  sglang_install || return 2
  sglang_jit_restore
  export GRANIKV_SGLANG_PYTHONPATH=$SGL_SITE
  # a plugin server (system.server.uses_plugin) also gets the checkout and a dist-info naming the
  # granikv entry point of sglang.srt.plugins (what `pip install -e .` would write)
  local EP=/tmp/granikv_ep/granikv-0.0.0.dist-info
  mkdir -p "$EP"
  printf 'Metadata-Version: 2.1\nName: granikv\nVersion: 0.0.0\n' > "$EP/METADATA"
  printf '[sglang.srt.plugins]\ngranikv = granikv.sglang_plugin:load\n' > "$EP/entry_points.txt"
  export GRANIKV_PLUGIN_PYTHONPATH=$SGL_ROOT:/tmp/granikv_ep
  export PYTHONPATH=$SGL_ROOT:$SGL_ROOT/.gpu_site/py${PYTHONPATH:+:$PYTHONPATH}
  PY=${PYTHON:-python3}
  if [ -L "$SGL_ROOT/results/raw" ] && [ ! -e "$SGL_ROOT/results/raw" ]; then   # the checkout sent without raw cells
    rm "$SGL_ROOT/results/raw"; mkdir -p "$SGL_ROOT/results/raw"
  fi
  PYTHONPATH=$SGL_SITE $PY -c "import sglang, flashinfer; print('sglang', sglang.__version__, 'flashinfer', flashinfer.__version__)" \
    || { echo "ERROR: SGLang does not import from $SGL_SITE"; return 2; }
  $PY -c "import hydra, omegaconf, aiohttp, granikv.serving.session" \
    || { echo "ERROR: the runner's environment lacks hydra/omegaconf (.gpu_site/py carried?) or aiohttp"; return 2; }
}

sglang_gate() {   # start or reuse the server, serve a few requests through the measuring path, check them
  local G=/tmp/sglang_gate
  rm -rf "$G"
  # shellcheck disable=SC2086
  ${PY:-python3} -m runners.run sweep=headline system=sglang_server workload.prefix_len=512 workload.num_requests=16 \
      warmup_requests=0 sweep_name=sglang_gate results_dir="$G" ${GRANIKV_SGLANG_GATE_ARGS:-} > "${OUT:-/tmp}/sglang_gate.log" 2>&1
  local RC=$?
  tail -3 "${OUT:-/tmp}/sglang_gate.log"
  if [ "$RC" != 0 ] || ! ls "$G"/sglang_gate/*/metrics.json >/dev/null 2>&1; then
    _slog "SGLang gate FAILED (rc=$RC): nothing measured; see sglang_gate.log"
    tail -30 "$GRANIKV_SGLANG_STATE"/*/server.log 2>/dev/null | tail -30
    return 3
  fi
  _slog "SGLang gate passed: $(python3 -c "import json,glob; m=json.load(open(glob.glob('$G/sglang_gate/*/metrics.json')[0])); print(m['num_requests'], 'requests,', m['num_output_tokens'], 'tokens,', round(m['output_throughput_tok_s']), 'tok/s')")"
}

# The plugin's captured-step kernels under SGLang's own FlashInfer (0.6.15, not the engine's 0.7.2): the GPU
# tests of the captured step and the hot batch, in the server's environment (SGLang's site first), with the
# shared JIT cache. Log: $OUT/sglang_kernel_tests.log (commit it with the cells it gates). Selection: the
# arguments (default: both test files, without the fa2 cases, whose modules SGLang's servers never build).
sglang_kernels() {
  local SEL="${*:-tests/test_attention_graph_step_gpu.py tests/test_attention_hot_batch_gpu.py}"
  local LOG=${OUT:-/tmp}/sglang_kernel_tests.log
  _slog "pytest -m gpu $SEL, under SGLang's FlashInfer"
  # shellcheck disable=SC2086
  PYTHONPATH=$SGL_SITE:$PYTHONPATH $PY -m pytest -m gpu $SEL -k "not fa2" -q -p no:cacheprovider > "$LOG" 2>&1
  local RC=$?
  PYTHONPATH=$SGL_SITE $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$LOG" 2>&1
  tail -4 "$LOG"
  if [ "$RC" != 0 ] || grep -q "skipped" <(grep -E "passed|failed" "$LOG" | tail -1); then
    _slog "kernel tests rc=$RC (or skipped): see sglang_kernel_tests.log"
    return 3
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then   # run as a command (sweep.sh sources it for the functions)
  set -uo pipefail
  T0=$(date +%s)
  case "${1:-}" in
    stage) sglang_stage ;;
    install) sglang_install && sglang_jit_restore ;;
    pack) sglang_pack_jit "${2:-3}" ;;
    gate) shift; GRANIKV_SGLANG_GATE_ARGS="$*"; sglang_env_setup && sglang_gate ;;
    kernels) shift; sglang_env_setup && sglang_kernels "$@" ;;
    stop) PYTHONPATH=$SGL_ROOT:$SGL_ROOT/.gpu_site/py python3 -m granikv.serving.server stop ;;
    *) echo "usage: bash runners/gpu/sglang.sh stage|install|pack [MAX_PARTS]|gate [overrides]|kernels [tests]|stop" >&2; exit 2 ;;
  esac
fi
