"""The reference a batched result is compared with: the same request run alone through mlx-lm."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step


def greedy_alone(model, prompt_ids: list[int], max_tokens: int, stop_ids: set[int]) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
    for token, lp in steps:
        token = int(token)
        tokens.append(token)
        logprobs.append(float(lp[token]))
        if token in stop_ids:
            break
    return tokens, logprobs
