#!/usr/bin/env bash
# Measure at an earlier commit's code, with today's raw results: continue a sweep that must stay at
# one code version (conf/sweep/headline_onecommit.yaml) after later commits changed other files.
#
#   bash runners/gpu/pin_commit.sh on <commit>   # the working tree becomes <commit>'s code, plus every
#                                                # raw result of the branch (results/raw, staged)
#   bash runners/gpu/provenance_env.sh           # -> GRANIKV_GIT_COMMIT=<commit> GRANIKV_GIT_DIRTY=false
#   ... device calls, runners/gpu/unpack.sh after each (new cells land untracked in results/raw) ...
#   bash .git/granikv_pin_commit.sh off          # back on the branch, the new cells kept (untracked)
#   git add results/raw/... && git commit        # commit them on the branch
#
# `on` keeps a copy of this script at `git rev-parse --git-path granikv_pin_commit.sh` (.git/ in a plain
# clone) and prints the `off` command: <commit> may predate this script or hold an older one. While
# pinned, run this script through that copy, from the repository root.
# `on` needs a clean tree on a branch; it records the branch in .git/granikv_pin. The results are
# outside provenance_env.sh's dirty check, so cells measured while pinned record <commit>, clean:
# every file that runs (granikv/, runners/, conf/, tests/ for the GPU gate) is <commit>'s.
# `off` refuses while the slim tree (slim_tree.sh on) is on; it keeps every untracked file under
# results/raw, and `git status` outside results/raw must show nothing (a code change made while
# pinned would be lost: commit it on the branch instead).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
case "$HERE" in
  */runners/gpu) cd "$HERE/../.." ;;
  *) cd "$(git rev-parse --show-toplevel)" ;;   # the copy in the git dir: run from the repository root
esac
PIN="$(git rev-parse --git-path granikv_pin)"
SELF_COPY="$(git rev-parse --git-path granikv_pin_commit.sh)"
case "${1:-}" in
  on)
    [ -n "${2:-}" ] || { echo "usage: pin_commit.sh on <commit>"; exit 2; }
    [ ! -e "$PIN" ] || { echo "ERROR: already pinned ($(cat "$PIN")); run 'pin_commit.sh off' first"; exit 2; }
    BRANCH=$(git symbolic-ref --short -q HEAD) || { echo "ERROR: HEAD is detached: check out a branch first"; exit 2; }
    [ -z "$(git status --porcelain)" ] || { echo "ERROR: the tree has uncommitted changes: commit or stash them first"; exit 2; }
    C=$(git rev-parse --verify -q "$2^{commit}") || { echo "ERROR: '$2' is not a commit"; exit 2; }
    git merge-base --is-ancestor "$C" "$BRANCH" || { echo "ERROR: $C is not an ancestor of $BRANCH"; exit 2; }
    [ "$(cd "$(dirname "$0")" && pwd)/$(basename "$0")" = "$(cd "$(dirname "$SELF_COPY")" && pwd)/$(basename "$SELF_COPY")" ] \
      || cp "$0" "$SELF_COPY"   # before the checkout, which may remove or change this file
    git checkout -q --detach "$C"
    git checkout -q "$BRANCH" -- results/raw
    echo "$BRANCH $C" > "$PIN"
    echo "[pin_commit] on: code of $(git rev-parse --short "$C"), raw results of $BRANCH ($(git diff --cached --name-only | wc -l) files staged)"
    echo "[pin_commit] to return: bash $SELF_COPY off" ;;
  off)
    [ -e "$PIN" ] || { echo "ERROR: not pinned (no $PIN)"; exit 2; }
    if [ "$(git config --bool core.sparseCheckout || true)" = true ]; then
      echo "ERROR: the slim tree is on: run 'bash runners/gpu/slim_tree.sh off' first"; exit 2
    fi
    read -r BRANCH C < "$PIN"
    OTHER=$(git status --porcelain -- . ':(exclude)results/raw')
    [ -z "$OTHER" ] || { echo "ERROR: changes outside results/raw while pinned:"; echo "$OTHER"; exit 2; }
    N=$(git ls-files --others --exclude-standard results/raw | wc -l)
    git reset -q --hard        # the staged raw results go; untracked files (the new cells) stay
    git checkout -q "$BRANCH"  # refuses, changing nothing, if a new cell would overwrite a committed one
    rm -f "$PIN" "$SELF_COPY"
    echo "[pin_commit] off: on $BRANCH again, $N new file(s) under results/raw kept (untracked)" ;;
  *)
    echo "usage: pin_commit.sh on <commit> | off"; exit 2 ;;
esac
