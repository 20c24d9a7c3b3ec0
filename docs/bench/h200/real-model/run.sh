#!/bin/bash
# H200 runs of the real model (SmolLM2-135M-Instruct) and of a 7B shape's weight formats, from the
# checkout's root (README.md here says what each phase measures). Every phase writes under $OUT.
#   bash docs/bench/h200/real-model/run.sh install | prepare | real-bf16 | real-4bit | weights-7b | all
#   bash docs/bench/h200/real-model/run.sh real-4bit-worker    # extra: the GGUF as a worker serves it (fp16)
# `install` needs the bundle unpacked in $PACK (whl/*.whl, mlx_cuda_13's wheel among them, and
# SmolLM2-135M-Instruct.Q4_1.gguf), or its parts (bundle.part-*) in $PARTS, unpacked there.
# `all` takes about 8 minutes: install ~1, prepare ~0.5, real-bf16 and real-4bit ~2 each, weights-7b ~3.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLXQ_BLAS=${MLXQ_BLAS:-off} HF_HUB_OFFLINE=1 MLX_PTX_CACHE_DIR=/tmp/ptx \
  MLXQ_CACHE_DIR=/tmp/mlxq-cache MLXQ_DECODE_WARMUP_TOKENS=256
OUT=${OUT:-/tmp/out}
PACK=${PACK:-/tmp/pack}
PARTS=${PARTS:-/tmp/parts}
PYTHON=${PYTHON:-python3}
REPEATS=${REPEATS:-2}
CONCURRENCY=${CONCURRENCY:-8,32,256}
TOKENS=${TOKENS:-128}  # prompt tokens and new tokens
SHAPE7B=${SHAPE7B:-qwen2.5-7b}
GGUF=$PACK/SmolLM2-135M-Instruct.Q4_1.gguf
BF16=/tmp/real-bf16
M7=/tmp/m7-bf16
M7Q=/tmp/m7-4bit
mkdir -p "$OUT"

install() {
  if [ ! -d "$PACK/whl" ]; then
    mkdir -p "$PACK" && cat "$PARTS"/bundle.part-* | tar -x -C "$PACK" || return 1
  fi
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$PACK"/whl/*.whl || return 1
  SITE=$($PYTHON -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')
  ln -sfn "$SITE/nvidia" /tmp/site/nvidia
  $PYTHON -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())" | tee "$OUT/install.txt"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/install.txt" 2>&1
}

# The GGUF converted once (worker/gguf.py), and a bf16 copy: dequantized in float32 by mlx-lm, then cast
# (one rounding, to bf16, instead of rounding the float16 scales to bf16 first).
prepare() {
  local converted
  converted=$($PYTHON -c "from pathlib import Path; from worker.gguf import converted_directory; \
print(converted_directory(Path('$GGUF')))") || return 1
  if [ ! -f $BF16/config.json ]; then
    timeout 120 $PYTHON -m mlx_lm convert --hf-path "$converted" --mlx-path /tmp/real-f32 -d --dtype float32 \
      > "$OUT/prepare.log" 2>&1 || return 1
    timeout 120 $PYTHON -m mlx_lm convert --hf-path /tmp/real-f32 --mlx-path $BF16 --dtype bfloat16 \
      >> "$OUT/prepare.log" 2>&1 || return 1
    $PYTHON -c "import json; p='$BF16/config.json'; c=json.load(open(p)); c['torch_dtype']='bfloat16'; \
json.dump(c, open(p, 'w'), indent=2)"
  fi
  $PYTHON -c "from mlx_lm import load, generate; m, t = load('$BF16'); \
print('bf16 copy:', generate(m, t, t.apply_chat_template([{'role': 'user', 'content': 'What is the capital of France?'}], \
add_generation_prompt=True, tokenize=False), max_tokens=12))" 2>&1 | tail -1 | tee "$OUT/prepare.txt"
}

# K/B and C1/B at each N, side by side in one run, $REPEATS interleaved repeats; the greedy-text check
# of every arm is in the report (text_identity).
throughput() {
  local label=$1 model=$2 weights=$3
  (cd /tmp && timeout ${TP_TIMEOUT:-200} $PYTHON -m mlxq bench --model "$model" --weights "$weights" \
    --arms B,K,C --workers 1 --concurrency "$CONCURRENCY" --rates '' --max-num-seqs 256 \
    --prompt-tokens "$TOKENS" --new-tokens "$TOKENS" --repeats "$REPEATS" --headline-concurrency 256 \
    --scenario throughput --out /tmp/$label > "$OUT/$label.log" 2>&1)
  cp /tmp/$label/report.json "$OUT/$label-report.json" 2>/dev/null
  cp /tmp/$label/table.md "$OUT/$label-table.md" 2>/dev/null
  cp /tmp/$label/plot.png "$OUT/$label-plot.png" 2>/dev/null
  ratios "$OUT/$label-report.json" | tee "$OUT/$label-ratios.txt" || tail -5 "$OUT/$label.log"
}

ratios() {
  $PYTHON - "$1" <<'EOF'
import json, sys
from mlxq.bench.report import find, paired_ratios
report = json.load(open(sys.argv[1]))
labels = sorted({e["workload"]["label"] for e in report["results"]}, key=lambda l: int(l.split("-")[1]))
for label in labels:
    tps = {arm: (find(report, arm, label) or {}).get("tokens_per_s") for arm in ("B", "K", "C1")}
    each = {key: paired_ratios(report, label, top, "B") for key, top in (("K/B", "K"), ("C1/B", "C1"))}
    print(label, "tok/s (median run):", {k: round(v) if v else v for k, v in tps.items()},
          "|", "; ".join(f"{k} {', '.join(f'{x:.2f}' for x in v)}" for k, v in each.items()))
same = report.get("text_identity", {})
print("greedy text = mlx-lm alone in every arm and repeat:", same.get("all_same_as_reference"))
EOF
}

real_bf16() { throughput real-bf16 $BF16 worker; }
real_4bit() { throughput real-4bit "$GGUF" as-loaded; }  # 4-bit, float16 scales, as the file has them
real_4bit_worker() { throughput real-4bit-worker "$GGUF" worker; }  # dequantized to float16 at load

# The 7B shape: random bf16 weights, quantized to 4 bits (group 64) by mlx_lm convert, then its decode
# step at 8 and 64 rows and a 128-token prefill, as loaded (4-bit) against dequantized (bf16).
weights_7b() {
  if [ ! -f $M7Q/config.json ]; then
    timeout 200 $PYTHON -c "from worker.tiny_model import make_tiny_model; \
make_tiny_model('$M7', shape='$SHAPE7B', dtype='bfloat16')" > "$OUT/weights-7b-make.log" 2>&1 || return 1
    timeout 200 $PYTHON -m mlx_lm convert --hf-path $M7 --mlx-path $M7Q -q --q-bits 4 \
      >> "$OUT/weights-7b-make.log" 2>&1 || return 1
  fi
  (cd /tmp && timeout ${W_TIMEOUT:-200} $PYTHON -m mlxq bench --model $M7Q --arms '' --scenario weights \
    --weights-variants as-loaded,dequantized --weights-rows 8,64 --weights-steps 8 --weights-prefill 128 \
    --out /tmp/weights-7b > "$OUT/weights-7b.log" 2>&1)
  cp /tmp/weights-7b/report.json "$OUT/weights-7b-report.json" 2>/dev/null
  grep -h "weight formats" /tmp/weights-7b/table.md || tail -5 "$OUT/weights-7b.log"
}

case "${1:-}" in
install) install ;;
prepare) prepare ;;
real-bf16) real_bf16 ;;
real-4bit) real_4bit ;;
real-4bit-worker) real_4bit_worker ;;
weights-7b) weights_7b ;;
all) install && prepare && real_bf16 && real_4bit && weights_7b ;;
*) sed -n 2,8p "$0"; exit 2 ;;
esac
