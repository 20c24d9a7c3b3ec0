#!/bin/bash
# H200: speculative decoding on the real model (SmolLM2-135M-Instruct, the bf16 copy), from the checkout's root.
#   bash docs/bench/h200/speculative/run.sh            # install, prepare, speculative, then pack
#   bash docs/bench/h200/speculative/run.sh speculative # the measurement alone (install and prepare done)
# install and prepare are docs/bench/h200/real-model/run.sh's (the bundle from $PACK or $PARTS, see its README).
# Everything lands in $OUT/speculative.tar.gz (report.json, table.md, speculative.png, the log, the worker logs)
# plus $OUT/speculative-table.md and $OUT/speculative.log to read at once. About 5 minutes in all.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=${MLXQ_BLAS:-off} HF_HUB_OFFLINE=1 MLX_PTX_CACHE_DIR=/tmp/ptx \
  MLXQ_CACHE_DIR=/tmp/mlxq-cache MLXQ_DECODE_WARMUP_TOKENS=${MLXQ_DECODE_WARMUP_TOKENS:-512}
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
REPEATS=${REPEATS:-2}
ROWS=${ROWS:-1,8,32}
NEW_TOKENS=${NEW_TOKENS:-128}
DRAFTERS=${DRAFTERS:-ngram,draft-self}
SAMPLING=${SAMPLING:-greedy,sampled}
BF16=/tmp/real-bf16  # made by real-model/run.sh prepare, as is /tmp/real-f32
MODEL=${MODEL:-$BF16}
RUN=/tmp/spec-run
HERE=$(dirname "$0")
mkdir -p "$OUT"

# Off, ngram and draft(self) workers side by side; grounded and open chat at $ROWS rows, greedy and sampled
# (temperature 0.7, seeded), $REPEATS interleaved repeats; a warm-up of each row count on every worker first.
speculative() {
  rm -rf $RUN
  (cd /tmp && timeout ${SPEC_TIMEOUT:-300} $PYTHON -m mlxq bench --model "$MODEL" --scenario speculative \
    --spec-drafters "$DRAFTERS" --spec-workloads grounded,chat --spec-sampling "$SAMPLING" --spec-rows "$ROWS" \
    --spec-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --warmup-tokens 32 --max-num-seqs 32 --out $RUN \
    > "$OUT/speculative.log" 2>&1)
  echo "exit $?" >> "$OUT/speculative.log"
  cp $RUN/table.md "$OUT/speculative-table.md" 2>/dev/null
  cp "$OUT/speculative.log" $RUN/ 2>/dev/null
  tar -czf "$OUT/speculative.tar.gz" -C /tmp "$(basename $RUN)" 2>/dev/null
  grep -A40 "speculative decoding" "$OUT/speculative-table.md" 2>/dev/null || tail -20 "$OUT/speculative.log"
}

case "${1:-all}" in
speculative) speculative ;;
all) bash "$HERE/../real-model/run.sh" install && bash "$HERE/../real-model/run.sh" prepare && speculative ;;
*) sed -n 2,7p "$0"; exit 2 ;;
esac
