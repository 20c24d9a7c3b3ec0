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
    env $variant timeout 200 python3 docs/bench/h200/joiner/joiner_env.py --model /tmp/m --label "$label" \
      --out $OUT/env-$label.json ${ENGINE_FILE:+--engine-file $ENGINE_FILE} ${ROWS:+--rows $ROWS} 2>&1 | grep -v -i "tokenizer\|regex" | tail -8
  done
  ;;
esac
