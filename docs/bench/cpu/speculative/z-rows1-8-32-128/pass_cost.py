"""A verification pass's model call (VerifyStep) at widths 2..5 over a decode step's (DecodeStep), compiled,
at 1, 8 and 32 slots of 256 positions, the served real model (float32 on the CPU); medians of 7.

Run from the repository: .venv/bin/python docs/bench/cpu/speculative/z-rows1-8-32-128/pass_cost.py "$(mlxq real-model)"
"""
import sys, time, statistics
import worker  # BLAS trap
import mlx.core as mx
from worker.loading import load_model
from worker.settings import WorkerSettings
from worker.engines.decode_step import DecodeStep
from worker.engines.speculation.verify_step import VerifyStep
from worker.engines.slot_cache import KVLayout, SlotBuffers

model, tok = load_model(WorkerSettings.from_env({}, model=sys.argv[1]))
layout = KVLayout.of(model)
for slots in (1, 8, 32):
    length = 256
    dec = DecodeStep(model, layout.grouped_mask)
    ver = VerifyStep(model, layout.grouped_mask)
    buf = SlotBuffers.allocate(layout, slots, length)
    pos = mx.array([150] * slots, dtype=mx.int32)
    def run_dec():
        logits = dec(mx.zeros((slots,), mx.uint32), pos, buf); mx.eval(logits, buf.arrays())
    def run_ver(w):
        logits = ver(mx.zeros((slots, w), mx.uint32), pos, buf); mx.eval(logits, buf.arrays())
    for f in [run_dec] + [lambda w=w: run_ver(w) for w in range(2, 6)]:
        f(); f()
    res = {}
    for rep in range(7):
        for name, f in [("1", run_dec)] + [(str(w), lambda w=w: run_ver(w)) for w in range(2, 6)]:
            t = time.perf_counter(); f(); res.setdefault(name, []).append(time.perf_counter() - t)
    base = statistics.median(res["1"])
    print(f"slots {slots}: step {base*1000:.1f} ms; verify widths 2..5: " +
          " ".join(f"{statistics.median(res[str(w)])/base:.2f}" for w in range(2, 6)), flush=True)
