#!/usr/bin/env bash
# One round of the measurement campaign on the GPU host: ONE device `run` (<= 10 min), resumable.
#
#   run(command="<export line from runners/gpu/provenance_env.sh, run here>; bash runners/gpu/sweep.sh synthetic_grid [more presets] -- [overrides]",
#       timeout_s=600, carry=[".gpu_site", ".whl", ".fi_cache"])
#   (2 GPUs: GRANIKV_TP=2 ... sweep.sh headline_qwen25_14b, on the nvidia-h200-x2 kind)
#
# First the engine GPU gate (tests/test_engine_gpu.py: fused ops, engine vs the no-cache reference (also
# through evictions with synchronous free checks),
# memory rules; log in $OUT/fused_check.log): if it fails or skips, nothing is measured, and
# $OUT/.gate_failed stops any later sweep.sh of the same call. Then runs
# `python -m runners.run -m sweep=<preset> <overrides>` for each preset within the call's time
# budget: GRANIKV_BUDGET_S (default 540 s) less GRANIKV_PACK_RESERVE_S (default 60 s, kept for
# packing), measured from this script's start; a preset is not started with less than 60 s left.
# Cells already holding metrics.json are skipped (carried back in results/raw), and a cell cut off
# by the budget leaves no metrics.json, so the next round resumes where this one stopped.
# Packs into $OUT:
#   raw.tar.gz.part-*        every cell folder that got a metrics.json or failure.json in this call
#                            (<= 14 MB parts; raw2.tar.gz.part-*, ... when sweep.sh runs again in the
#                            same call)
#   sweep.log                the full log
#   fi_cache.tar.xz.part-*   the FlashInfer JIT cache for the next call (put in .fi_cache/parts/);
#                            with GRANIKV_ENGINE=sglang: sgl_fi_cache.tar.xz.part-* (SGLang's, .sgl_fi_cache/parts/)
#
# Knobs (environment): GRANIKV_TP (ranks, torchrun above 1), GRANIKV_BUDGET_S, GRANIKV_PACK_RESERVE_S,
# GRANIKV_GPU_SPLIT (below), GRANIKV_SKIP_FUSED_CHECK=1 (skip the gate: only on a warm machine that
# passed it at the same commit), GRANIKV_NO_FI_PACK=1 (a later script of the call packs the JIT cache),
# GRANIKV_NGPU (the GPU count, for the CPU tests of this script only).
# Here: `bash runners/gpu/unpack.sh <files_at>` in the repo root (it refuses to overwrite a committed
# cell, and puts the JIT cache parts in place), then commit results/raw. Each call sends this checkout
# again, which drops the cells the last call wrote there: on a warm machine (a chained call) the cells
# an earlier call finished are skipped all the same (their metrics.json kept in /tmp/granikv-done,
# GRANIKV_DONE_DIR); on a bare one, cells not unpacked and sent back are run again. Send the checkout with
# `bash runners/gpu/slim_tree.sh on` (the cells' metrics.json travel, so finished cells are skipped).
# A sweep that must stay at one code version continues at its commit: runners/gpu/pin_commit.sh.
#
# Two TP=1 sweeps at once on the 2-GPU kind (twice the cells per device-second):
#   GRANIKV_GPU_SPLIT="system=sglang_default,granikv|system=sglang_cascade,hydragen" bash runners/gpu/sweep.sh ...
# runs one sweep per '|'-separated part, part i on GPU i (CUDA_VISIBLE_DEVICES=i), each with the
# common overrides plus its part; logs sweep.gpu<i>.log. Each cell's provenance records
# cuda_visible_devices and concurrent_sweeps (the number of parts), so the analysis can tell them apart.
#
# GRANIKV_ENGINE=sglang: cells of a real SGLang server (system=sglang_server): runners/gpu/sglang.sh
# installs the staged wheel set, and its gate (a server started or reused, 16 requests served through
# the measuring path) replaces the engine GPU gate; no FlashInfer bundle is needed, and SGLang's
# FlashInfer JIT cache is its own (.sgl_fi_cache, see sglang.sh).
set -uo pipefail
T0=$(date +%s)
GPU_LOG_TAG=sweep.sh
source "$(dirname "$0")/env.sh"
ENGINE=${GRANIKV_ENGINE:-granikv}
if [ "$ENGINE" = sglang ]; then
  source "$(dirname "$0")/sglang.sh"
  [ -n "${GRANIKV_ENV_CPU_TEST:-}" ] || sglang_env_setup || exit 2
  GRANIKV_SKIP_FUSED_CHECK=1
  PACK_JIT=sglang_pack_jit     # SGLang's FlashInfer JIT cache (.sgl_fi_cache), see sglang.sh
else
  gpu_env_setup || exit 2
  PACK_JIT=pack_fi_cache
  # A real-SGLang server that an earlier call kept on this warm machine (sglang.sh sets GRANIKV_SGLANG_KEEP=1,
  # runners.plugin_check included) holds most of the GPU's memory: the engine's gate and cells need it back
  # (a gate after a kept plugin_check server ran out of memory in its memory tests).
  if [ -z "${GRANIKV_ENV_CPU_TEST:-}" ] && [ -d "${GRANIKV_SGLANG_STATE:-/tmp/granikv-sglang}" ]; then
    log "$($PY -m granikv.serving.server stop 2>&1 | tail -1) (an engine sweep needs the GPU's memory)"
  fi
fi
PRESETS=(); EXTRA=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; EXTRA=("$@"); break; fi
  PRESETS+=("$1"); shift
done
[ ${#PRESETS[@]} -gt 0 ] || { echo "usage: sweep.sh PRESET [PRESET ...] [-- overrides]"; exit 2; }
TP=${GRANIKV_TP:-1}
SPLIT=()
if [ -n "${GRANIKV_GPU_SPLIT:-}" ]; then
  IFS='|' read -r -a SPLIT <<< "$GRANIKV_GPU_SPLIT"
  NGPU=${GRANIKV_NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}   # GRANIKV_NGPU: CPU tests only
  if [ "$TP" -gt 1 ] || [ "${#SPLIT[@]}" -gt "$NGPU" ]; then
    log "ERROR: GRANIKV_GPU_SPLIT has ${#SPLIT[@]} parts for $NGPU GPUs at TP=$TP: it runs TP=1 sweeps, one per GPU"
    exit 2
  fi
fi
# The engine's fused layer ops (FlashInfer norm / RoPE / SiLU-mul) must match the torch math, and
# granikv's engine (overlap schedule, CUDA graphs vs eager) the no-cache reference, and the engine's
# GPU memory rules (graph cap, KV budget after a cached segment) must hold, at this commit
# before anything is measured (a cold JIT build of the fused ops takes a few minutes, once).
# A failed gate stops every later sweep.sh of the same device call too, GRANIKV_SKIP_FUSED_CHECK or
# not (stop 15 chained a second sweep after a failed gate and measured 13 cells that were discarded).
# The commit every cell will name must be the code that runs (granikv.rawio.code_check: a commit said clean
# whose code differs is refused): checked before anything is measured, so a wrong export costs seconds.
if [ -z "${GRANIKV_ENV_CPU_TEST:-}" ] && [ ! -e "$OUT/.gate_failed" ]; then
  $PY -c "import granikv.rawio as r; p = r.provenance(cuda_probe=False); print('provenance:', p['git_commit'][:12], 'dirty' if p['git_dirty'] else 'clean', p['git_code_check'])" \
    || { echo "provenance refused" > "$OUT/.gate_failed"; log "ERROR: provenance refused (above): nothing measured"; exit 3; }
fi
if [ -e "$OUT/.gate_failed" ]; then
  log "ERROR: an earlier sweep.sh of this call failed the engine GPU gate ($(cat "$OUT/.gate_failed")): nothing measured"
  exit 3
fi
if [ -z "${GRANIKV_SKIP_FUSED_CHECK:-}" ]; then
  log "pytest -m gpu tests/test_engine_gpu.py -k 'fused or (matches_reference and granikv) or memory or free_checks' (gate for the measurements)"
  timeout "$(left)" $PY -m pytest -m gpu tests/test_engine_gpu.py -q -p no:cacheprovider \
      -k "fused or (matches_reference and granikv) or memory or free_checks" > "$OUT/fused_check.log" 2>&1
  RC=$?                                  # pytest's own status: 0 only when every selected test passed
  tail -3 "$OUT/fused_check.log"
  if [ "$RC" != 0 ] || grep -q "skipped" <(tail -1 "$OUT/fused_check.log"); then
    echo "rc=$RC, see fused_check.log" > "$OUT/.gate_failed"
    log "engine GPU check rc=$RC (or skipped): nothing measured (see fused_check.log)"; pack_fi_cache 3; exit 3
  fi
fi
if [ "$ENGINE" = sglang ] && [ -z "${GRANIKV_ENV_CPU_TEST:-}" ] && [ -z "${GRANIKV_SKIP_SGLANG_GATE:-}" ]; then
  sglang_gate || { echo "sglang gate" > "$OUT/.gate_failed"; exit 3; }
fi
# Cells an earlier call on this warm machine finished: each call sends the checkout again, without them unless
# they were unpacked and sent back, so their metrics.json (kept in $DONE, outside the checkout) is put back where
# a cell is missing: the sweep skips it instead of measuring it twice. Never packed again (older than $MARK).
DONE=${GRANIKV_DONE_DIR:-/tmp/granikv-done}
if [ -d "$DONE" ]; then
  n=0
  while IFS= read -r f; do
    [ -e "results/raw/$f" ] && continue
    mkdir -p "results/raw/$(dirname "$f")" && cp -p "$DONE/$f" "results/raw/$f" && n=$((n + 1))
  done < <(cd "$DONE" && find . -name metrics.json -not -path '*/.*/*' | sed 's|^\./||')
  [ "$n" -eq 0 ] || log "$n cell(s) finished by an earlier call on this machine: skipped ($DONE)"
fi
MARK=$(mktemp); touch "$MARK"; sleep 1
LAUNCH="$PY -m runners.run"
[ "$TP" -gt 1 ] && LAUNCH="$PY -m torch.distributed.run --standalone --nproc_per_node=$TP -m runners.run"
for P in "${PRESETS[@]}"; do
  T=$(left)
  if [ "$T" -lt 60 ]; then log "budget spent: $P not started (the next round runs it)"; continue; fi
  if [ ${#SPLIT[@]} -eq 0 ]; then
    log "sweep=$P ${EXTRA[*]} (limit ${T}s)"
    timeout "$T" $LAUNCH -m "sweep=$P" "${EXTRA[@]}" 2>&1 | tee -a "$OUT/sweep.log" | grep -E "^\[runners.run\]|Error|error|FAILED" | tail -40
    log "sweep=$P rc=${PIPESTATUS[0]} (124 = cut by the budget; resumable; 1 = a cell failed: failure.json)"
    continue
  fi
  PIDS=()
  for i in "${!SPLIT[@]}"; do
    read -r -a PART <<< "${SPLIT[$i]}"
    log "sweep=$P ${EXTRA[*]} ${PART[*]} on GPU $i (limit ${T}s)"
    ( CUDA_VISIBLE_DEVICES=$i GRANIKV_CONCURRENT_SWEEPS=${#SPLIT[@]} \
        timeout "$T" $LAUNCH -m "sweep=$P" "${EXTRA[@]}" "${PART[@]}" >> "$OUT/sweep.gpu$i.log" 2>&1
      echo "$?" > "$OUT/.rc.gpu$i" ) &
    PIDS+=($!)
  done
  wait "${PIDS[@]}"
  for i in "${!SPLIT[@]}"; do
    grep -E "^\[runners.run\]|Error|error|FAILED" "$OUT/sweep.gpu$i.log" | tail -20
    log "sweep=$P on GPU $i rc=$(cat "$OUT/.rc.gpu$i") (124 = cut by the budget; resumable; 1 = a cell failed: failure.json)"
  done
done
# finished (metrics.json) or failed (failure.json) cells only: a cell cut off mid-run is rerun next round
CHANGED=$(find results/raw -newer "$MARK" \( -name metrics.json -o -name failure.json \) 2>/dev/null \
          | grep -v '/\.' | sed 's|/[^/]*$||' | sort -u)
if [ -n "$CHANGED" ]; then
  RAW=raw; N=1                           # a second sweep.sh in the same call packs raw2.tar.gz.part-*, ...
  while ls "$OUT/$RAW.tar.gz.part-"* >/dev/null 2>&1; do N=$((N + 1)); RAW=raw$N; done
  tar -czf - $CHANGED | split -b 14m - "$OUT/$RAW.tar.gz.part-"
  log "packed $(echo "$CHANGED" | wc -l) cell folders"
  for c in $CHANGED; do   # remembered for a later call on this machine (above); a failed cell is not
    [ -f "$c/metrics.json" ] || continue
    mkdir -p "$DONE/${c#results/raw/}" && cp -p "$c/metrics.json" "$DONE/${c#results/raw/}/"
  done
else
  log "no cell written"
fi
[ -n "${GRANIKV_NO_FI_PACK:-}" ] || $PACK_JIT 3   # GRANIKV_NO_FI_PACK=1: a later script in the call packs it
ls -la "$OUT"
CHANGED="$CHANGED" $PY - <<'PYEOF'
import json, os, pathlib
print("\n== cells finished in this call ==")   # the cells carried in are not listed again
for cell in sorted(filter(None, os.environ["CHANGED"].split("\n"))):
    m = pathlib.Path(cell) / "metrics.json"
    if not m.exists():
        print(f"{cell}: failed (failure.json)")
        continue
    d = json.loads(m.read_text())
    if "output_throughput_tok_s" in d:
        print(f"{m.parent.parent.name}/{m.parent.name[:110]}: {d['output_throughput_tok_s']:.0f} tok/s, "
              f"TPOT p50 {d.get('tpot_p50_ms') or float('nan'):.1f} ms")
PYEOF
log "done"
