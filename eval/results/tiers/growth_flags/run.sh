#!/usr/bin/env bash
# Before/after decayed-head flags, interleaved per document-set size, one core, one torch thread.
# BEFORE: an export of main at 847a178 (format /2, no flags) in $BEFORE, with this branch's
# hypic/evaluation/tiers.py copied over it (the harness only: --configs, --pool-bytes, pool records);
# AFTER: this worktree. Each side runs from its own folder: python puts the working directory
# first on sys.path, so running from elsewhere would import the other side's hypic.
set -euo pipefail
AFTER=$(cd "$(dirname "$0")/../../../.." && pwd)
BEFORE=${BEFORE:-/tmp/tiers_before}
OUT=${OUT:-$AFTER/eval/results/tiers/growth_flags}
POOL_BYTES=${POOL_BYTES:-16141926}   # 8 mean documents' entries as the shapes size them (all heads): same both sides
MEMORY_DOCS=${MEMORY_DOCS:-8}        # sizes are multiples of this many documents
CONFIGS=${CONFIGS:-memory/lru +disk/lru}
ORDER=${ORDER:-before after}         # which side runs first at each size
ROUND=${ROUND:-1}
mkdir -p "$OUT/before" "$OUT/after"
for fraction in ${FRACTIONS:-1 2 5 10 20}; do
  for side in $ORDER; do
    root=$([ $side = before ] && echo "$BEFORE" || echo "$AFTER")
    out="$OUT/$side/round$ROUND-x$fraction"
    echo "$(date -Is) $side x$fraction -> $out"
    (cd "$root" && PYTHONPATH="$root:$root/datasets" taskset -c 1 /tmp/venv/bin/python -m hypic.cli eval tiers \
       --parts capacity --configs $CONFIGS --fractions "$fraction" --pool-bytes "$POOL_BYTES" \
       --memory-docs "$MEMORY_DOCS" --threads 1 --out "$out" > "$out.log" 2>&1 || { echo "failed: $out.log"; exit 1; })
  done
done
