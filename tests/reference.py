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


def fused_alone(model_dir: str, adapter_path, prompt_ids: list[int], max_tokens: int,
                stop_ids: set[int] = frozenset()) -> tuple[list[int], list[float]]:
    """The request alone through mlx-lm with a LoRA adapter: loaded by mlx-lm (`load(...,
    adapter_path=)`), then fused into the weights as `mlx_lm.fuse` does, then greedy."""
    from mlx.utils import tree_unflatten
    from mlx_lm import load

    model, _ = load(model_dir, adapter_path=str(adapter_path))
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    assert fused, "the adapter adapted no layer"
    model.update_modules(tree_unflatten(fused))
    return greedy_alone(model, prompt_ids, max_tokens, set(stop_ids))


def teacher_forced_logits(model, prompt_ids: list[int], generated: list[int]):
    """The model's raw logits at each generated position, from one full forward pass:
    row j is what `generated[j]` was drawn from, before any processing."""
    import numpy as np

    tokens = mx.array(prompt_ids + generated[:-1])[None]
    return np.array(model(tokens)[0, len(prompt_ids) - 1 :].astype(mx.float32))


def log_softmax(logits):
    import numpy as np

    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def teacher_forced_logprobs(model, prompt_ids: list[int], generated: list[int]):
    return log_softmax(teacher_forced_logits(model, prompt_ids, generated))


def run_all(scheduler, requests: dict[str, dict], max_steps: int = 10_000) -> dict:
    """Admit every request, step until all end, return {job_id: GenerationResult}."""
    results = {}
    for job_id, request in requests.items():
        failed = scheduler.admit(job_id, request)
        if failed is not None:
            results[job_id] = failed
    for _ in range(max_steps):
        if not len(scheduler):
            break
        for ended in scheduler.step():
            results[ended.id] = ended.result()
    assert not len(scheduler), "jobs did not end"
    return results


def vlm_alone(model, prompt, max_tokens: int, stop_ids: set[int] = frozenset(), sampler=None):
    """The same request alone through mlx-vlm's own generate_step, from the engine's `Prompt` (token
    ids, and the processor's pixels for an image request): its tokens and full log-distributions."""
    from mlx_vlm.generate.ar import generate_step as vlm_generate_step

    pixel_values, image_grid_thw = (None, None) if prompt.inputs is None else prompt.inputs.image_arrays()
    kwargs = {} if image_grid_thw is None else {"image_grid_thw": image_grid_thw}
    steps = vlm_generate_step(mx.array([prompt.token_ids]), model, pixel_values, None, max_tokens=max_tokens,
                              sampler=sampler or (lambda x: mx.argmax(x, axis=-1)), **kwargs)
    tokens, distributions = [], []
    for token, logprobs in steps:
        tokens.append(int(token))
        distributions.append(logprobs)
        if int(token) in stop_ids:
            break
    return tokens, distributions
