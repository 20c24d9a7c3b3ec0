#!/bin/bash
# The H200 runs of docs/bench/h200/compiled (README.md there), from the root of a checkout with the
# packages under .dev-engine/code and the wheels under .dev-engine/ (the mlx-cuda wheel in two parts):
#   bash .dev-engine/code/docs/bench/h200/compiled/h200.sh install|step|variants|kb|k0|cb
set -uo pipefail
export PYTHONUNBUFFERED=1
CODE=$PWD/.dev-engine/code
OUT=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site:$CODE
MODEL=/tmp/m
BENCH="python3 -m mlxq bench --model $MODEL --max-num-seqs 256 --rates '' --prompt-tokens 128 --new-tokens 128"
case "$1" in
install)
  cat /tmp/cuda-part-aa .dev-engine/cuda-part-ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .dev-engine/whl/*.whl /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 1
  ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" /tmp/site/nvidia
  python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" || exit 1
  (cd /tmp && python3 -m mlxq make-tiny-model $MODEL --shape qwen2.5-0.5b --dtype bfloat16) || exit 1
  nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
  ;;
step)
  (cd /tmp && python3 $CODE/docs/bench/h200/compiled/step_floor.py --model $MODEL --rows 256 --also-rows 32 \
    --cache 200 --out $OUT/step_floor.json) 2>&1 | grep -v regex
  ;;
variants)
  (cd /tmp && python3 $CODE/docs/bench/h200/compiled/step_variants.py --model $MODEL --rows 256,32 --cache 200 \
    --out $OUT/step_variants.json)
  ;;
kb)
  (cd /tmp && eval $BENCH --arms B,K --concurrency 32,256 --repeats 1 --scenario throughput --out /tmp/kb \
    > /tmp/kb.log 2>&1)
  grep -A12 "^### Closed" /tmp/kb/table.md; grep "K/B" /tmp/kb/table.md
  cp /tmp/kb/report.json $OUT/kb-report.json; cp /tmp/kb/plot.png $OUT/kb-plot.png
  ;;
k0)
  (cd /tmp && MLXQ_BENCH_K_OVERLAP=0 eval $BENCH --arms K --concurrency 32,256 --repeats 1 --scenario throughput \
    --out /tmp/k0 > /tmp/k0.log 2>&1)
  grep "^| K" /tmp/k0/table.md; cp /tmp/k0/report.json $OUT/k0-report.json
  ;;
cb)
  (cd /tmp && MLXQ_DECODE_WARMUP_TOKENS=256 eval $BENCH --arms B,C --workers 1 --concurrency 256 --repeats 1 \
    --headline-concurrency 256 --scenario throughput,late-joiner --out /tmp/cb > /tmp/cb.log 2>&1)
  grep -A8 "^### Closed" /tmp/cb/table.md; grep -A3 "^### Scen" /tmp/cb/table.md; grep "C/B" /tmp/cb/table.md
  grep -h "decode path\|warm-up\|compiled" /tmp/cb/logs/*.log | head -20 > $OUT/cb-worker-log.txt
  cp /tmp/cb/report.json $OUT/cb-report.json; cp /tmp/cb/table.md $OUT/cb-table.md
  ;;
esac
