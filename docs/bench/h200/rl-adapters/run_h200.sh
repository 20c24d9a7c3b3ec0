#!/bin/bash
cat /tmp/w/cuda.part-aa .dev-h200/b/cuda.part-ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
cp .dev-h200/b/*.whl /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl || exit 1
SITE=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
ln -sfn $SITE/nvidia /tmp/site/nvidia
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=off HF_HUB_OFFLINE=1
python3 -c "from worker.tiny_model import make_tiny_model; make_tiny_model('/tmp/m', shape='qwen2.5-0.5b', dtype='bfloat16')"
timeout 400 python3 docs/bench/h200/rl-adapters/adapter_step.py --model /tmp/m --rows 64 256 --repeats 3 --out $OUT/adapter-step.json 2>&1 | grep -v tokenizer | tee $OUT/adapter-step.log
