#!/usr/bin/env bash
# Unpack what a device call brought back into this checkout (run here, in the repo root):
#
#   bash runners/gpu/unpack.sh <files_at>
#
# - every raw*.tar.gz.part-* set: cell folders into results/raw. A folder that already holds a
#   committed metrics.json is not overwritten (a call sent without results/raw, or run with the
#   same overrides, measures that cell again): the script names each such folder and stops before
#   touching anything. GRANIKV_UNPACK_REPLACE=1 replaces them; then say so in
#   results/raw/PROVENANCE_ERRATA.md, since the older cell survives only in git history.
# - sgl_fi_cache.tar.xz.part-* into .sgl_fi_cache/parts/ and fi_cache.tar.xz.part-* into
#   .fi_cache/parts/, replacing the older parts (the JIT cache for the next call to carry).
set -euo pipefail
FROM=${1:?usage: bash runners/gpu/unpack.sh <files_at of the device call>}
[ -d "$FROM" ] || { echo "ERROR: $FROM is not a folder (pass the call's files_at)" >&2; exit 2; }
TMP=$(mktemp -d -t granikv-unpack.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

n=0
for first in "$FROM"/raw*.tar.gz.part-aa; do
  [ -f "$first" ] || continue
  cat "${first%aa}"* | tar -xz -C "$TMP" \
    || { echo "ERROR: ${first%aa}* do not make a whole tar.gz (a part missing?)" >&2; exit 2; }
  n=$((n + 1))
done
[ "$n" -gt 0 ] || echo "[unpack] no raw*.tar.gz parts in $FROM"

mapfile -t cells < <(cd "$TMP" && find . \( -name metrics.json -o -name failure.json \) -printf '%h\n' | sed 's|^\./||' | sort -u)
clash=()
for cell in "${cells[@]}"; do   # every cell folder brought back (it holds metrics.json or failure.json)
  if git ls-files --error-unmatch "$cell/metrics.json" >/dev/null 2>&1; then clash+=("$cell"); fi
done
if [ "${#clash[@]}" -gt 0 ] && [ "${GRANIKV_UNPACK_REPLACE:-0}" != 1 ]; then
  echo "ERROR: ${#clash[@]} cell(s) brought back already have a committed metrics.json; nothing unpacked:" >&2
  printf '  %s\n' "${clash[@]}" >&2
  echo "  (GRANIKV_UNPACK_REPLACE=1 replaces them: record that in results/raw/PROVENANCE_ERRATA.md)" >&2
  exit 3
fi
for cell in "${cells[@]}"; do
  rm -rf "$cell"; mkdir -p "$(dirname "$cell")"
  cp -r "$TMP/$cell" "$cell"
done
echo "[unpack] ${#cells[@]} cell folder(s) into results/raw (${#clash[@]} replaced a committed cell)"

for kind in sgl_fi_cache fi_cache; do
  ls "$FROM/$kind".tar.xz.part-* >/dev/null 2>&1 || continue
  mkdir -p ".$kind/parts"; rm -f ".$kind/parts/$kind".tar.xz.part-*
  cp "$FROM/$kind".tar.xz.part-* ".$kind/parts/"
  echo "[unpack] JIT cache parts -> .$kind/parts/: $(ls ".$kind/parts" | tr '\n' ' ')"
done
