#!/usr/bin/env bash
# Prefill steps in isolation on the GPU host (runners/prefill_bench.py): one device `run`, ~2-4 min.
#
#   run(command="<export line of runners/gpu/provenance_env.sh>; bash runners/gpu/prefill.sh [MODEL:TP ...]",
#       carry=[".gpu_site", ".whl", ".fi_cache"], kind="nvidia-h200-x2")
#
# MODEL:TP[:ALLREDUCE]. Default: llama3_8b:1 qwen25_14b:1 qwen25_14b:2 qwen25_14b:2:symm_one_shot
# (TP=2 needs 2 GPUs; skipped, with a note, on one).
# Packs results/raw/prefill_host into $OUT/prefill_host.tar.gz (untar in the repo root, commit), and
# writes $OUT/prefill.log and the FlashInfer JIT cache parts ($OUT/fi_cache.tar.xz.part-*; not with
# GRANIKV_NO_FI_PACK=1, when a later script of the call packs it).
set -uo pipefail
T0=$(date +%s)
GPU_LOG_TAG=prefill.sh
source "$(dirname "$0")/env.sh"
gpu_env_setup || exit 2
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
RUNS=("$@"); [ ${#RUNS[@]} -gt 0 ] || RUNS=(llama3_8b:1 qwen25_14b:1 qwen25_14b:2 qwen25_14b:2:symm_one_shot)
for R in "${RUNS[@]}"; do
  IFS=: read -r M TP AR <<< "$R"; AR=${AR:-nccl}
  if [ "$TP" -gt "$NGPU" ]; then log "$M TP=$TP: not run (this host has $NGPU GPU)"; continue; fi
  if [ "$(left)" -lt 60 ]; then log "$M TP=$TP: not run (budget spent)"; continue; fi
  log "$M TP=$TP all-reduce $AR"
  if [ "$TP" -gt 1 ]; then
    timeout "$(left)" $PY -m torch.distributed.run --standalone --nproc_per_node="$TP" -m runners.prefill_bench \
      --model "$M" --hardware h200 --allreduce "$AR" 2>&1 | tee -a "$OUT/prefill.log" | grep -E "^\[prefill_bench\]|Error"
  else
    timeout "$(left)" $PY -m runners.prefill_bench --model "$M" --hardware h200 --allreduce "$AR" 2>&1 | tee -a "$OUT/prefill.log" \
      | grep -E "^\[prefill_bench\]|Error"
  fi
done
[ -d results/raw/prefill_host ] && tar -czf "$OUT/prefill_host.tar.gz" results/raw/prefill_host
[ -n "${GRANIKV_NO_FI_PACK:-}" ] || pack_fi_cache 3
log "done"
