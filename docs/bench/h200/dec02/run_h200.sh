#!/bin/bash
# The H200 runs of docs/bench/h200/dec02, from the checkout's root: the wheels under .whl (the second
# part of the mlx-cuda wheel among them), its first part copied to /tmp/w by an earlier call.
#   bash docs/bench/h200/dec02/run_h200.sh install | structured | structured-ab | lj LABEL [MLXQ_...=...] | gateway | cb
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=off HF_HUB_OFFLINE=1 MLX_PTX_CACHE_DIR=/tmp/ptx
OUT=${OUT:-/tmp/out}
BENCH="python3 -m mlxq bench --model /tmp/m --max-num-seqs 256 --rates ''"
case "$1" in
install)
  cat /tmp/w/cuda.part-aa .whl/cuda.part-ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/w/mlx_cuda_13-*.whl .whl/*.whl || exit 1
  SITE=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
  ln -sfn $SITE/nvidia /tmp/site/nvidia
  python3 -c "from worker.tiny_model import make_tiny_model; make_tiny_model('/tmp/m', shape='qwen2.5-0.5b', dtype='bfloat16')" || exit 1
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
  ;;
structured)  # half of 256 rows constrained against none, on the compiled engine
  (cd /tmp && timeout ${ST_TIMEOUT:-240} python3 -m mlxq.bench.structured --model /tmp/m --max-num-seqs 256 \
    --prompt-tokens 64 --new-tokens 64 --repeats ${ST_REPEATS:-3} --decode compiled --out $OUT/structured-256.json > $OUT/structured.log 2>&1)
  tail -8 $OUT/structured.log
  ;;
structured-ab)  # the masks started early (the engine's way) and late, alternating, one process each
  for round in 1 2; do for variant in early late; do
    timeout 150 python3 docs/bench/h200/dec02/structured_ab.py --model /tmp/m --variant $variant \
      --out $OUT/structured-$variant-$round.json 2>&1 | grep -v -i "tokenizer\|regex" | tail -1
  done; done
  ;;
lj)  # the late joiner end to end (one worker); $2: a label, the rest: settings for the worker
  label=$2; shift 2
  (cd /tmp && env "$@" MLXQ_DECODE_WARMUP_TOKENS=512 timeout ${LJ_TIMEOUT:-200} bash -c \
    "$BENCH --prompt-tokens 128 --new-tokens 128 --arms '' --scenario late-joiner --late-delay 0.5 --late-joins ${LJ_JOINS:-8} --out /tmp/lj-$label" \
    > /tmp/lj-$label.log 2>&1)
  grep -h "late joiner" /tmp/lj-$label/table.md || tail -5 /tmp/lj-$label.log
  cp /tmp/lj-$label/report.json $OUT/lj-$label-report.json 2>/dev/null
  ;;
gateway)  # 256 streaming chat clients through one gateway process against the producer
  (cd /tmp && timeout ${GW_TIMEOUT:-280} bash -c "$BENCH --prompt-tokens 64 --new-tokens 64 --arms '' \
    --scenario gateway-stream --repeats ${GW_REPEATS:-3} --out /tmp/gw" > /tmp/gw.log 2>&1)
  grep -h "gateway-stream #\|gateway streams" /tmp/gw.log | head -8 || tail -5 /tmp/gw.log
  cp /tmp/gw/report.json $OUT/gateway-stream-report.json 2>/dev/null
  ;;
cb)  # one worker (C1) against B at 256 in flight
  (cd /tmp && MLXQ_DECODE_WARMUP_TOKENS=256 timeout ${CB_TIMEOUT:-300} bash -c "$BENCH --prompt-tokens 128 \
    --new-tokens 128 --arms B,C --workers 1 --concurrency 256 --repeats 1 --headline-concurrency 256 \
    --scenario throughput --out /tmp/cb" > /tmp/cb.log 2>&1)
  grep -h "^| [BC]\|C/B" /tmp/cb/table.md || tail -5 /tmp/cb.log
  cp /tmp/cb/report.json $OUT/cb-report.json 2>/dev/null; cp /tmp/cb/table.md $OUT/cb-table.md 2>/dev/null
  ;;
esac
