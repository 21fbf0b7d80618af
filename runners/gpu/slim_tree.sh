#!/usr/bin/env bash
# Keep the working tree that travels to the GPU host under its size limit (the device tool sends
# tracked files, 64 MiB in all with the carried FlashInfer files): `on` leaves the per-cell bulk
# (requests/steps/workload traces) out of this checkout through git's sparse checkout, keeping every
# config.json and metrics.json, which is all a resumable sweep needs to skip finished cells;
# `off` brings them back. Nothing is deleted from git. Run `off` before unpacking and committing
# new cells (git refuses to add paths outside a sparse checkout).
#
#   bash runners/gpu/slim_tree.sh on    # before a device call
#   bash runners/gpu/slim_tree.sh off   # after it
set -euo pipefail
case "${1:-}" in
  on)
    git sparse-checkout set --no-cone '/*' '!/results/raw/**/requests.jsonl.gz' '!/results/raw/**/steps.jsonl.gz' \
      '!/results/raw/**/workload.jsonl' '!/results/raw/**/workload.jsonl.gz' '!/results/raw/**/trace.json.gz'
    echo "[slim_tree] on: $(git ls-files -t results/raw | grep -c '^S') raw files left out of the working tree" ;;
  off)
    git sparse-checkout disable
    echo "[slim_tree] off: full working tree" ;;
  *)
    echo "usage: bash runners/gpu/slim_tree.sh on|off" >&2; exit 2 ;;
esac
