"""Record the real model's greedy answers to the speculative scenario's prompts (mlx-lm's generate_step
on the float32 copy a CPU worker serves), up to 128 tokens or EOS, for replay.py.

Run from the repository: .venv/bin/python docs/bench/cpu/speculative/graded-replay/record.py grounded 32 "$(.venv/bin/mlxq real-model)"
"""
import json, sys, time
from pathlib import Path
import worker  # BLAS trap: before mlx
from worker.settings import WorkerSettings
from worker.loading import load_model
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlxq.bench.spec_workloads import spec_prompts

kind, count, gguf = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, tokenizer = load_model(WorkerSettings(model=gguf))
answers = []
for prompt in spec_prompts(tokenizer, kind, count):
    started, ids = time.time(), []
    for token, _ in generate_step(mx.array(prompt.ids), model, max_tokens=128, sampler=lambda x: mx.argmax(x, axis=-1)):
        if int(token) in tokenizer.eos_token_ids:
            break
        ids.append(int(token))
    answers.append({"prompt": list(prompt.ids), "output": ids})
    print(len(answers), len(ids), round(time.time() - started, 1), repr(tokenizer.decode(ids)[:80]), flush=True)
(Path(__file__).parent / f"{kind}.json").write_text(json.dumps(answers))
