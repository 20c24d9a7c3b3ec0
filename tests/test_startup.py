"""Start-up does not block serving: the compiled engine runs a step uncompiled while its shape's
kernels are being built by a background process (worker/engines/kernel_prebuild.py), with the
result the compiled step gives, and compiles the shape at its first step once they are built."""

from __future__ import annotations

import os
import time

import pytest
import redis

import worker  # noqa: F401  (BLAS before MLX)
import mlx.core as mx

from schemas import keys
from tests.workers import start_worker, stop, wait_for
from worker.engines.decode_step import DecodeStep
from worker.engines.slot_cache import KVLayout, SlotBuffers


def _steps(step: DecodeStep, layout: KVLayout, count: int = 3) -> list[mx.array]:
    """`count` steps of 4 slots at their own positions on fresh buffers: each step's logits."""
    buffers = SlotBuffers.allocate(layout, 4, 128)
    tokens = mx.array([3, 50, 7, 200], dtype=mx.uint32)
    positions = mx.array([0, 5, 9, 2], dtype=mx.int32)
    out = []
    for _ in range(count):
        logits = step(tokens, positions, buffers)
        mx.eval(logits, buffers.arrays())
        out.append(logits)
        tokens, positions = mx.argmax(logits, axis=-1).astype(mx.uint32), positions + 1
    return out


def test_a_step_runs_uncompiled_until_its_shape_may_compile_with_the_same_logits(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(tiny_model_dir)
    layout = KVLayout.of(model)
    ready: set[tuple[int, int]] = set()
    waiting = DecodeStep(model, layout.grouped_mask, may_compile=lambda shape: shape in ready)
    uncompiled = _steps(waiting, layout)
    assert waiting.uncompiled_steps == 3 and waiting.shapes == {}
    ready.add((4, 128))
    compiled = _steps(waiting, layout)
    assert waiting.uncompiled_steps == 3 and list(waiting.shapes) == [(4, 128)]
    assert not waiting.shapes[(4, 128)].at_start
    for a, b in zip(uncompiled, compiled):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5)
        assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1))


@pytest.mark.slow
def test_a_worker_takes_jobs_before_its_kernels_are_built(redis_url, tiny_model_dir, tmp_path, reference):
    """A fresh kernel cache (its own TMPDIR: nothing built yet, as on a new machine): the first job
    is answered while the background process still builds the kernels, exactly as mlx-lm answers it
    alone; once the kernels are built, a job's steps run compiled."""
    from producer import Client

    name = "startup"
    proc = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "2", name=name,
                        env={"TMPDIR": str(tmp_path), "MLXQ_DECODE_WARMUP_TOKENS": "128"})
    client = Client(redis_url)
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    prompt = list(range(10, 30))
    try:
        result = client.wait(client.submit({"prompt_token_ids": prompt, "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}), timeout=120)
        stats = conn.hgetall(keys.stats_key(name))
        built = list((tmp_path / "mlx").glob("*/cpu/*.so"))
        assert result.status == "finished", result
        assert result.choices[0].token_ids == reference(prompt, 12, ignore_eos=True)[0]
        assert int(stats["engine_uncompiled_steps"]) >= 11 and int(stats["engine_compiled_shapes"]) == 0, stats
        deadline = time.monotonic() + 240
        while int(conn.hget(keys.stats_key(name), "engine_compiled_shapes") or 0) == 0:
            assert time.monotonic() < deadline, "no shape compiled after the kernels were built"
            client.wait(client.submit({"prompt_token_ids": prompt, "max_tokens": 4, "temperature": 0}), timeout=60)
            time.sleep(0.5)
        assert len(list((tmp_path / "mlx").glob("*/cpu/*.so"))) > len(built)  # the process built them
        wait_for(lambda: not _prebuild_running(tmp_path), timeout=240, what="the prebuild process to end")
    finally:
        out = stop(proc)
        client.close()
    assert "kernels for 2 shapes (up to 2 slots x 128 tokens) are built in the background" in out, out
    assert "decode step kernels: 2 shapes prebuilt by a background process" in out, out


def _prebuild_running(tmp_path) -> bool:
    """Whether a kernel prebuild process of this test (its TMPDIR) is still alive."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"kernel_prebuild" in cmdline and f"TMPDIR={tmp_path}".encode() in environ:
            return True
    return False
