#!/usr/bin/env bash
# A FlashInfer JIT cache that travels between GPU-host machines (source it; do not run it).
# env.sh uses it for the engine's FlashInfer (.fi_cache, fi_cache.tar.xz.part-*), sglang.sh for
# SGLang's (.sgl_fi_cache, sgl_fi_cache.tar.xz.part-*). The whole cache travels (object files too):
# emptying them left ninja linking modules whose instantiations were missing (undefined symbol at
# load). Logs through `log` where the caller defines one.
_jlog() { if declare -F log >/dev/null; then log "$@"; else echo "[jit_cache] $*"; fi; }

# jit_cache_pack WORKSPACE NAME MAX_PARTS: WORKSPACE/.cache -> $OUT/NAME.tar.xz.part-* of
# GRANIKV_JIT_PART_MIB (14) MiB; none when it needs more than MAX_PARTS (one per carrying call).
jit_cache_pack() {
  local WS=$1 NAME=$2 MAX_PARTS=${3:-5} MIB=${GRANIKV_JIT_PART_MIB:-14} D=${OUT:-/tmp/out} STAGE NP
  [ -d "$WS/.cache" ] || { _jlog "no JIT cache to pack"; return 0; }
  mkdir -p "$D"; STAGE=$(mktemp -d)
  cp -a "$WS/.cache" "$STAGE/" && find "$STAGE/.cache" -name '*.lock' -delete
  tar --format=posix -C "$STAGE" -cf - .cache | xz -T0 -6 > "$STAGE/c.tar.xz"
  rm -f "$D/$NAME".tar.xz.part-*
  split -b "${MIB}m" "$STAGE/c.tar.xz" "$D/$NAME.tar.xz.part-"
  NP=$(ls "$D/$NAME".tar.xz.part-* | wc -l)
  if [ "$NP" -gt "$MAX_PARTS" ]; then
    _jlog "WARNING: the JIT cache needs $NP parts (> $MAX_PARTS allowed); not packed"
    rm -f "$D/$NAME".tar.xz.part-*
  else
    _jlog "packed the JIT cache: $NP part(s), $(du -h "$STAGE/c.tar.xz" | cut -f1)"
  fi
  rm -rf "$STAGE"
}

# jit_cache_restore WORKSPACE PARTS_DIR NAME: PARTS_DIR/NAME.tar.xz.part-* -> WORKSPACE/.cache,
# once; parts that do not make a whole archive leave no half cache (a cold build then).
jit_cache_restore() {
  local WS=$1 P=$2 NAME=$3
  mkdir -p "$WS"
  [ -d "$WS/.cache" ] && return 0
  ls "$P/$NAME".tar.xz.part-* >/dev/null 2>&1 || { _jlog "no JIT cache carried: cold FlashInfer builds"; return 0; }
  if cat "$P/$NAME".tar.xz.part-* | tar -xJ -C "$WS" 2>/dev/null; then
    _jlog "restored the FlashInfer JIT cache ($(du -sh "$WS/.cache" | cut -f1))"
  else
    rm -rf "$WS/.cache"
    _jlog "WARNING: the JIT cache parts do not make a whole archive (one not carried?): cold FlashInfer builds"
  fi
}

# fix_site_mtimes SITE: one fixed old mtime for installed sources, once. pip stamps the install time,
# and ninja then takes every cached module for older than its sources and rebuilds it (~4 min).
fix_site_mtimes() {
  [ -f "$1/.mtime_fixed" ] && return 0
  find "$1" -exec touch -h -d '2020-01-01 00:00:00' {} + && touch "$1/.mtime_fixed"
}
