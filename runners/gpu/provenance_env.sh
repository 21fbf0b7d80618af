#!/usr/bin/env bash
# Print the provenance exports for a GPU-host command, from THIS checkout. Run it here and paste its
# output at the start of the device command (the command string is executed there, not here):
#   $ bash runners/gpu/provenance_env.sh
#   export GRANIKV_GIT_COMMIT=<sha> GRANIKV_GIT_DIRTY=false
#   run(command="export GRANIKV_GIT_COMMIT=<sha> GRANIKV_GIT_DIRTY=false; bash runners/gpu/sweep.sh headline", ...)
# The GPU host gets a copy of the working tree whose .git, if any, may be stale; granikv.rawio's
# provenance() takes these variables over git when they are set.
cd "$(dirname "$0")/../.." || exit 2
C=$(git rev-parse HEAD) || exit 2
CHANGED=$(git status --porcelain -- . ':(exclude)results' | awk '{print $NF}' | sort | tr '\n' ',' | sed 's/,$//')
if [ -z "$CHANGED" ]; then D=false; else D=true; fi
# GRANIKV_GIT_DIRTY_FILES: which paths differ from the commit (recorded in each cell's provenance)
echo "export GRANIKV_GIT_COMMIT=$C GRANIKV_GIT_DIRTY=$D${CHANGED:+ GRANIKV_GIT_DIRTY_FILES=$CHANGED}"
