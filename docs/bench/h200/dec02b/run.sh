#!/bin/bash
# The H200 runs of docs/bench/h200/dec02b, from the checkout's root, after
# `bash docs/bench/h200/dec02/run_h200.sh install`. TREE is `.` (this tree) or a directory holding
# another tree's packages (`git archive REV worker mlxq schemas producer | tar -x -C DIR`).
#   bash docs/bench/h200/dec02b/run.sh parts | profile TREE LABEL | lj TREE LABEL
set -uo pipefail
export MLXQ_BLAS=off HF_HUB_OFFLINE=1 MLX_PTX_CACHE_DIR=/tmp/ptx PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
HERE=$PWD/docs/bench/h200/dec02b
filter() { grep -v -i "tokenizer\|regex"; }
case "$1" in
parts)
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 $HERE/prefill_parts.py --model /tmp/m 2>&1 | filter | tail -6
  ;;
profile)
  tree=$(cd $2 && pwd); label=$3
  (cd /tmp && PYTHONPATH=/tmp/site:$tree timeout 240 python3 $HERE/profile_join.py --model /tmp/m --joins ${JOINS:-16} \
    --out $OUT/profile-$label.json 2>&1 | filter | tail -4)
  ;;
lj)
  tree=$(cd $2 && pwd); label=$3
  (cd /tmp && PYTHONPATH=/tmp/site:$tree MLXQ_DECODE_WARMUP_TOKENS=512 timeout ${LJ_TIMEOUT:-240} python3 -m mlxq bench \
    --model /tmp/m --max-num-seqs 256 --rates '' --prompt-tokens 128 --new-tokens 128 --arms '' --scenario late-joiner \
    --late-delay 0.5 --late-joins ${LJ_JOINS:-16} --out /tmp/lj-$label > /tmp/lj-$label.log 2>&1)
  grep -h "late joiner" /tmp/lj-$label/table.md || tail -5 /tmp/lj-$label.log
  cp /tmp/lj-$label/report.json $OUT/lj-$label-report.json 2>/dev/null
  ;;
esac
