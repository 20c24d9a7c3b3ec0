#!/bin/bash
# The H200 runs of docs/bench/h200/joiner, from the checkout's root, the wheels under .dev-h200/b
# and the first part of the mlx-cuda wheel already copied to /tmp/w by an earlier call:
#   bash docs/bench/h200/joiner/run_h200.sh install|env|bench
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=off HF_HUB_OFFLINE=1 MLX_PTX_CACHE_DIR=/tmp/ptx
OUT=${OUT:-/tmp/out}
case "$1" in
install)
  cat /tmp/w/cuda.part-aa .dev-h200/b/cuda.part-ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  cp .dev-h200/b/*.whl /tmp/w/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl || exit 1
  SITE=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
  ln -sfn $SITE/nvidia /tmp/site/nvidia
  python3 -c "from worker.tiny_model import make_tiny_model; make_tiny_model('/tmp/m', shape='qwen2.5-0.5b', dtype='bfloat16')" || exit 1
  ;;
env)
  shift
  for variant in "$@"; do
    label=$(echo "$variant" | tr ' =' '_-')
    env ${variant/#default/} timeout 200 python3 docs/bench/h200/joiner/joiner_env.py --model /tmp/m --label "$label" \
      --out $OUT/env-$label.json ${ENGINE_FILE:+--engine-file $ENGINE_FILE} ${ROWS:+--rows $ROWS} 2>&1 | grep -v -i "tokenizer\|regex" | tail -8
  done
  ;;
lj)  # the late joiner end to end (one worker), then K against B at 32 rows; $2: extra MLX env, or "default"
  shift; variant=$1; label=$(echo "$variant" | tr ' =' '_-')
  BENCH="python3 -m mlxq bench --model /tmp/m --max-num-seqs 256 --rates '' --prompt-tokens 128 --new-tokens 128"
  (cd /tmp && env ${variant/#default/} MLXQ_DECODE_WARMUP_TOKENS=256 timeout ${LJ_TIMEOUT:-280} bash -c \
    "$BENCH --arms '' --scenario late-joiner --out /tmp/lj-$label" > /tmp/lj-$label.log 2>&1)
  grep -h "late joiner" /tmp/lj-$label/table.md || tail -5 /tmp/lj-$label.log
  cp /tmp/lj-$label/report.json $OUT/lj-$label-report.json 2>/dev/null
  ;;
kb)  # K against B; $2: extra MLX env, or "default"; $3: concurrency list
  shift; variant=$1; label=$(echo "$variant" | tr ' =' '_-')
  BENCH="python3 -m mlxq bench --model /tmp/m --max-num-seqs 256 --rates '' --prompt-tokens 128 --new-tokens 128"
  (cd /tmp && env ${variant/#default/} timeout ${KB_TIMEOUT:-280} bash -c \
    "$BENCH --arms B,K --concurrency $2 --repeats ${REPEATS:-3} --scenario throughput --out /tmp/kb-$label" \
    > /tmp/kb-$label.log 2>&1)
  grep -h "K/B\|^| [BK] " /tmp/kb-$label/table.md | head -12 || tail -5 /tmp/kb-$label.log
  cp /tmp/kb-$label/report.json $OUT/kb-$label-report.json 2>/dev/null; cp /tmp/kb-$label/table.md $OUT/kb-$label-table.md 2>/dev/null
  ;;
cb)  # one worker (C1) against B at 256 in flight, and the late joiner, as the worker runs by default
  BENCH="python3 -m mlxq bench --model /tmp/m --max-num-seqs 256 --rates '' --prompt-tokens 128 --new-tokens 128"
  (cd /tmp && MLXQ_DECODE_WARMUP_TOKENS=256 timeout ${CB_TIMEOUT:-400} bash -c "$BENCH --arms B,C --workers 1 \
    --concurrency 256 --repeats 1 --headline-concurrency 256 --scenario throughput,late-joiner --out /tmp/cb" \
    > /tmp/cb.log 2>&1)
  grep -h "^| [BC]\|C/B\|late joiner" /tmp/cb/table.md || tail -5 /tmp/cb.log
  grep -h "decode path\|warm-up\|CUDA" /tmp/cb/logs/*.log 2>/dev/null | head -5
  cp /tmp/cb/report.json $OUT/cb-report.json 2>/dev/null; cp /tmp/cb/table.md $OUT/cb-table.md 2>/dev/null
  ;;
structured)  # half of 256 rows constrained against none, on the engine a worker picks
  (cd /tmp && timeout ${ST_TIMEOUT:-300} python3 -m mlxq.bench.structured --model /tmp/m --max-num-seqs 256 \
    --prompt-tokens 64 --new-tokens 64 --repeats 3 --decode compiled --out $OUT/structured-256-compiled.json > /tmp/st.log 2>&1)
  tail -12 /tmp/st.log
  ;;
esac
