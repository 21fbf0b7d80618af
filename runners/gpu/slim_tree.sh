#!/usr/bin/env bash
# Keep the working tree that travels to the GPU host under its size limit (the device tool sends
# tracked files, 64 MiB in all with the carried FlashInfer files): `on` leaves the per-cell bulk
# (requests/steps/workload traces, profiler trace.json.gz, NVML samples) and the generated tables and
# figures out of this checkout through git's sparse checkout, keeping every config.json and
# metrics.json, which is all a resumable sweep needs to skip finished cells.
# The same traces of cells not yet committed (unpacked between two device calls) are listed in
# .git/info/exclude while `on` holds, so they stay here but do not travel either.
# `off` brings everything back. Nothing is deleted from git or from disk. Run `off` before
# committing new cells (git refuses to add paths outside a sparse checkout).
#
#   bash runners/gpu/slim_tree.sh on    # before a device call
#   bash runners/gpu/slim_tree.sh bare  # before a call that reads no cell (SGLang wheel staging)
#   bash runners/gpu/slim_tree.sh off   # after it
set -euo pipefail
BULK=(requests.jsonl.gz steps.jsonl.gz workload.jsonl workload.jsonl.gz trace.json.gz nvml.csv)
GENERATED=(results/figures results/tables)   # what `make reproduce` writes: no device command reads it
EXCLUDE="$(git rev-parse --git-path info/exclude)"
BEGIN="# >>> slim_tree.sh: untracked per-cell traces" END="# <<< slim_tree.sh"
drop_exclude() {  # remove our block from .git/info/exclude, leave the user's lines alone
  [ -f "$EXCLUDE" ] && sed -i "/^$BEGIN\$/,/^$END\$/d" "$EXCLUDE" || true
}
case "${1:-}" in
  on)
    sparse=('/*'); for f in "${BULK[@]}"; do sparse+=("!/results/raw/**/$f"); done
    for d in "${GENERATED[@]}"; do sparse+=("!/$d/"); done
    git sparse-checkout set --no-cone "${sparse[@]}"
    drop_exclude; mkdir -p "$(dirname "$EXCLUDE")"
    { echo "$BEGIN"; for f in "${BULK[@]}"; do echo "/results/raw/**/$f"; done; echo "$END"; } >> "$EXCLUDE"
    echo "[slim_tree] on: $(git ls-files -t results/raw | grep -c '^S') raw files left out of the working tree," \
      "$(git ls-files --others --ignored --exclude-standard results/raw | wc -l) untracked ones kept from travelling" ;;
  bare)   # a command that reads no cell (staging a wheel part, a new sweep of its own): results/ stays behind
    git sparse-checkout set --no-cone '/*' '!/results/'
    drop_exclude
    echo "[slim_tree] bare: results/ left out of the working tree" ;;
  off)
    git sparse-checkout disable
    drop_exclude
    echo "[slim_tree] off: full working tree" ;;
  *)
    echo "usage: bash runners/gpu/slim_tree.sh on|bare|off" >&2; exit 2 ;;
esac
