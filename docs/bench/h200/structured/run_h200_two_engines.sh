#!/bin/bash
# H200 call 2 of 2: join the mlx_cuda_13 wheel (part aa came with call 1), install, run the structured scenario.
cat /tmp/w/cuda.part-aa .dev-h200/b/cuda.part-ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
cp .dev-h200/b/*.whl /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl || exit 1
SITE=$(python3 -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
ln -sfn $SITE/nvidia /tmp/site/nvidia
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=off HF_HUB_OFFLINE=1
python3 -c "import worker, mlxq.bench.structured, worker.engines.compiled; print('imports ok')" || exit 1
python3 -c "from worker.tiny_model import make_tiny_model; make_tiny_model('/tmp/m', shape='qwen2.5-0.5b', dtype='bfloat16')"
for d in ${DECODES:-compiled batch-generator}; do
  timeout 200 python3 -m mlxq.bench.structured --model /tmp/m --max-num-seqs 256 --prompt-tokens 64 --new-tokens 64 --repeats 3 --decode $d --out $OUT/structured-256-$d.json 2>&1 | grep -v tokenizer | tee $OUT/structured-256-$d.log
done
