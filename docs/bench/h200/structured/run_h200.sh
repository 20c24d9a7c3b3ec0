#!/bin/bash
# Call 2 of 2 on the H200: join the mlx_cuda_13 wheel (its first part came with call 1), install, run the scenario.
set -x
cat /tmp/w/mlxcuda.part-aa .dev-structured/w2/mlxcuda.part-ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
rm /tmp/w/mlxcuda.part-aa
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl || exit 1
SITE=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
ln -sfn $SITE/nvidia /tmp/site/nvidia
export PYTHONPATH=/tmp/site:$PWD/.dev-structured/src PYTHONUNBUFFERED=1 MLXQ_BLAS=none HF_HUB_OFFLINE=1
python3 -c 'import mlx.core as mx; print(mx.default_device()); a = mx.zeros((2, 8), dtype=mx.uint32); mx.eval(a); import numpy as np; v = np.array(a, copy=False); print("view", v.flags["WRITEABLE"]); v[0, 0] = 5; print((a + 1).tolist()[0][:2])'
time python3 -c "from worker.tiny_model import make_tiny_model; make_tiny_model('/tmp/m', shape='qwen2.5-0.5b', dtype='bfloat16')"
cd .dev-structured/src
time python3 -m mlxq.bench.structured --model /tmp/m --max-num-seqs 256 --prompt-tokens 64 --new-tokens 64 --repeats 3 --out $OUT/structured-256.json 2>&1 | tee $OUT/structured-256.log
time python3 -m mlxq.bench.structured --model /tmp/m --max-num-seqs 32 --prompt-tokens 64 --new-tokens 64 --repeats 3 --out $OUT/structured-32.json 2>&1 | tee $OUT/structured-32.log
