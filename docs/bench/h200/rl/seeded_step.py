"""Decode step time of the text engine at B rows: greedy, temperature (one shared sampler), seeded (per-row samplers)."""
import sys, time
import mlx.core as mx
from mlx_lm import load
from worker.engines.text import TextEngine
from worker.engines.base import SequenceSpec, SamplingParams
model, tok = load(sys.argv[1])
def run(B, temp, seeded, logprobs, warm=24, steps=40):
    eng = TextEngine(model, tok, max_num_seqs=B, prefill_batch_size=min(B, 64))
    specs = [SequenceSpec(uid=f"r{i}", prompt_token_ids=[5 + (i % 50), 7, 9] * 43, max_tokens=warm + steps + 20,
                          sampling=SamplingParams(temperature=temp, seed=(i if seeded else None)), logprobs=logprobs,
                          choice_index=0, request_id=f"q{i}") for i in range(B)]
    eng.add(specs)
    for _ in range(warm): eng.step()
    mx.synchronize()
    t = time.perf_counter()
    for _ in range(steps): eng.step()
    mx.synchronize()
    ms = (time.perf_counter() - t) / steps * 1000
    eng.reset()
    return ms
for B in [int(b) for b in sys.argv[2].split(",")]:
    for rep in range(2):
        for args in [(0.0, False, False), (1.0, False, False), (1.0, True, False), (1.0, True, True)]:
            print(f"B={B} temp={args[0]} seeded={args[1]} logprobs={args[2]}: {run(B, *args):.2f} ms/step", flush=True)
