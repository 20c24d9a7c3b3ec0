#!/bin/bash
# H200: speculative decoding on the real model (SmolLM2-135M-Instruct, the bf16 copy), from the checkout's root.
#   bash docs/bench/h200/speculative/run.sh            # install, prepare, speculative, then pack
#   bash docs/bench/h200/speculative/run.sh speculative # the measurement alone (install and prepare done)
#   bash docs/bench/h200/speculative/run.sh probe       # the engine's probe of the float32 copy, TF32 on and off
#   bash docs/bench/h200/speculative/run.sh invariance  # greedy tokens alone and batched (batch_invariance.py)
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
DRAFT_MODEL=${DRAFT_MODEL:-}  # the `draft` drafter's model (--spec-draft-model), e.g. the model itself as a worker serves it
SAMPLING=${SAMPLING:-greedy,sampled}
WORKLOADS=${WORKLOADS:-grounded,chat}
IGNORE_EOS=${IGNORE_EOS:-}  # non-empty: every request makes NEW_TOKENS tokens (--spec-ignore-eos)
IN_PROCESS=${IN_PROCESS:-}  # non-empty: the arms as engines in the bench's process (--spec-in-process)
CPUS=${CPUS:-}  # e.g. 0-3: the bench and its workers on these cores alone (taskset), the same for every arm
BF16=/tmp/real-bf16  # made by real-model/run.sh prepare, as is /tmp/real-f32
MODEL=${MODEL:-$BF16}
RUN=/tmp/spec-run
HERE=$(dirname "$0")
mkdir -p "$OUT"

# Off, ngram and draft(self) workers side by side; grounded and open chat at $ROWS rows, greedy and sampled
# (temperature 0.7, seeded), $REPEATS interleaved repeats; a warm-up of each row count on every worker first.
speculative() {
  rm -rf $RUN
  (cd /tmp && timeout ${SPEC_TIMEOUT:-300} ${CPUS:+taskset -c $CPUS} $PYTHON -m mlxq bench --model "$MODEL" \
    --scenario speculative --spec-drafters "$DRAFTERS" --spec-workloads "$WORKLOADS" --spec-sampling "$SAMPLING" \
    --spec-rows "$ROWS" --spec-new-tokens "$NEW_TOKENS" ${DRAFT_MODEL:+--spec-draft-model "$DRAFT_MODEL"} ${IGNORE_EOS:+--spec-ignore-eos} ${IN_PROCESS:+--spec-in-process} --repeats "$REPEATS" \
    --warmup-tokens 32 --max-num-seqs 32 --out $RUN > "$OUT/speculative.log" 2>&1)
  echo "exit $?" >> "$OUT/speculative.log"
  cp $RUN/table.md "$OUT/speculative-table.md" 2>/dev/null
  cp "$OUT/speculative.log" $RUN/ 2>/dev/null
  tar -czf "$OUT/speculative.tar.gz" -C /tmp "$(basename $RUN)" 2>/dev/null
  grep -A40 "speculative decoding" "$OUT/speculative-table.md" 2>/dev/null || tail -20 "$OUT/speculative.log"
}

# The compiled engine's probe (worker/engines/decode_path.py) of the float32 copy, with MLX's TF32
# float32 matmuls (its default) and without (the worker's default, worker/platform.py).
probe() {
  for tf32 in 1 0; do
    MLX_ENABLE_TF32=$tf32 $PYTHON -c "
import logging, sys, worker
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')
from mlx_lm import load
from worker.engines.decode_path import compiled_unsupported_reason
print('MLX_ENABLE_TF32=$tf32:', compiled_unsupported_reason(load('/tmp/real-f32')[0]) or 'the compiled engine takes it')
" 2>&1 | grep -v Warning | tee -a "$OUT/probe.txt"
  done
}

# batch_invariance.py on the bf16 copy (off, prompt lookup; greedy) and the float32 copy (the model as its own draft
# too; greedy and seeded): each request's tokens alone against the same request in batches of 8 and 32.
invariance() {
  local model arms sampling
  for model in real-bf16 real-f32; do
    arms=off,ngram sampling=greedy; [ $model = real-f32 ] && arms=off,ngram,draft-self sampling=greedy,seeded
    timeout ${INV_TIMEOUT:-400} $PYTHON "$HERE/batch_invariance.py" --model /tmp/$model --arms $arms --sampling $sampling --rows 8,32 \
      --out "$OUT/invariance-$model" 2>&1 | grep -v -i warning | tee "$OUT/invariance-$model.log"
  done
}

case "${1:-all}" in
speculative) speculative ;;
probe) probe ;;
invariance) invariance ;;
all) bash "$HERE/../real-model/run.sh" install && bash "$HERE/../real-model/run.sh" prepare && speculative ;;
*) sed -n 2,7p "$0"; exit 2 ;;
esac
