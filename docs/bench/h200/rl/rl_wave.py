"""The RL bench's grouped run in process: 32 prompts x n=8 seeded, 64 new tokens, whole run; engine counters."""
import sys, time
import mlx.core as mx
from mlx_lm import load
from worker.engines.text import TextEngine
from worker.scheduler import BatchScheduler
model, tok = load(sys.argv[1])
eng = TextEngine(model, tok, max_num_seqs=256, prefill_batch_size=int(sys.argv[2]), prefix_cache_bytes=1024 << 20)
sch = BatchScheduler(eng, max_num_seqs=256)
for run in range(3):
    before = eng.time_stats()
    for p in range(32):
        req = {"prompt_token_ids": [5 + p + 40 * run, 7, 9] * 85, "max_tokens": 64, "temperature": 1.0,
               "ignore_eos": True, "n": 8, "seed": p}
        assert sch.admit(f"j{run}-{p}", req) is None
    t = time.perf_counter(); steps = 0; lens = []
    while len(sch):
        sch.step(); steps += 1
    wall = time.perf_counter() - t
    after = eng.time_stats()
    d = {k: after[k] - before[k] for k in ("decode_s", "decode_steps", "prefill_s", "prefill_calls")}
    print(f"run {run}: wall {wall:.2f} s, loop turns {steps}, decode {d['decode_s']:.2f} s / {d['decode_steps']} steps = "
          f"{1000 * d['decode_s'] / d['decode_steps']:.1f} ms, prefill {d['prefill_s']:.2f} s / {d['prefill_calls']}", flush=True)
