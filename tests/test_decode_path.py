"""The compiled engine's probe (worker/engines/decode_path.py): what difference between batched and
alone next-token log-probabilities it accepts, in float32 and in half precision."""

import mlx.core as mx

from worker.engines.decode_path import probe_difference, rounds_below_float32


def _logprobs(logits: list[float], dtype=mx.float32) -> mx.array:
    x = mx.array(logits, dtype=mx.float32)
    return (x - mx.logsumexp(x)).astype(dtype)


def test_float32_takes_every_tokens_log_probability_within_1e_3():
    alone = [_logprobs([3.0, 1.0, -20.0])]
    close = [_logprobs([3.0, 1.0, -20.0005])]
    tail_moved = [_logprobs([3.0, 1.0, -20.01])]
    assert probe_difference(close, alone)[0] <= probe_difference(close, alone)[2]
    worst, measure, tolerance = probe_difference(tail_moved, alone)
    assert measure == "log-probabilities" and worst > tolerance


def test_half_precision_takes_a_moved_far_tail_but_not_a_moved_head():
    """bf16 kernels for another batch shape move log-probabilities near -30 by a few 0.25 steps (seen
    on the H200 with the real model); a wrong mask or position moves the probable tokens."""
    head = [4.0, 3.5, 1.0] + [-30.0] * 200
    alone = [_logprobs(head, mx.bfloat16)]
    tail_moved = [_logprobs(head[:3] + [-29.25] * 100 + [-30.75] * 100, mx.bfloat16)]
    worst, measure, tolerance = probe_difference(tail_moved, alone)
    assert measure.startswith("distribution") and worst <= tolerance
    assert float(mx.abs(tail_moved[0].astype(mx.float32) - alone[0].astype(mx.float32)).max()) >= 0.5
    head_moved = [_logprobs([3.5, 4.0, 1.0] + [-30.0] * 200, mx.bfloat16)]
    assert probe_difference(head_moved, alone)[0] > tolerance


def test_half_precision_takes_every_logit_rounded_another_way_but_not_a_wrong_position():
    """On the H200 the real model's bf16 copy measured 0.035 batched against alone (every logit rounded
    another way, the head too); a token dropped from the prompt, as a wrong position does, measured 0.87
    on the same model on the CPU."""
    head = [4.0, 3.5, 1.0, 0.5] + [-30.0] * 200
    alone = [_logprobs(head, mx.bfloat16)]
    rounded = [_logprobs([4.06, 3.44, 1.03, 0.47] + [-29.75] * 200, mx.bfloat16)]
    worst, _, tolerance = probe_difference(rounded, alone)
    assert 0.02 < worst <= tolerance
    wrong = [_logprobs([1.0, 3.5, 4.0, 0.5] + [-30.0] * 200, mx.bfloat16)]
    assert probe_difference(wrong, alone)[0] > tolerance


def test_a_half_precision_model_with_float32_logits_is_judged_as_half_precision():
    """A GGUF file dequantized to float16 keeps float32 norms, so its logits come out float32 though every
    matmul rounded: on the H200 its far tail moved by 0.0186 (seen), past float32's 1e-3."""
    alone = [_logprobs([4.0, 3.5, 1.0] + [-30.0] * 200)]
    tail_moved = [_logprobs([4.0, 3.5, 1.0] + [-30.02] * 200)]
    assert probe_difference(tail_moved, alone)[0] > probe_difference(tail_moved, alone)[2]
    worst, measure, tolerance = probe_difference(tail_moved, alone, half_precision=True)
    assert measure.startswith("distribution") and worst <= tolerance


def test_a_model_rounds_below_float32_in_half_precision_anywhere_and_in_float32_on_cuda_with_tf32(monkeypatch):
    """On the H200 the real model's float32 copy measured 0.038 batched against alone (its far tail)
    with MLX's default TF32 matmuls: CUDA's float32 then rounds below float32, unless the worker's
    MLX_ENABLE_TF32=0 holds; the CPU's and Metal's float32 do not."""
    import mlx.nn as nn

    full = nn.Linear(4, 4)
    half = nn.Linear(4, 4)
    half.set_dtype(mx.bfloat16)
    platforms = ("cpu", "metal", "cuda")
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    assert [rounds_below_float32(full, p) for p in platforms] == [False, False, True]
    assert [rounds_below_float32(half, p) for p in platforms] == [True, True, True]
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert [rounds_below_float32(full, p) for p in platforms] == [False, False, False]
    assert [rounds_below_float32(half, p) for p in platforms] == [True, True, True]
