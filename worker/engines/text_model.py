"""The served text model and its tokenizer as the text engines read them: a request's prompt as
token ids, the vocabulary size, the context length, the KV-cache bytes one token takes."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from schemas import GenerationRequest
from worker.engines.base import Prompt
from worker.engines.constraints import ConstraintCompiler


class RequestRejected(ValueError):
    """The request cannot run on this model; the message names the field."""


def prompt_token_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The request's input as token ids: ids as given, a raw prompt, or chat messages through the
    tokenizer's chat template."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.prompt is not None:
        return list(tokenizer.encode(request.prompt))
    assert request.messages is not None
    if not getattr(tokenizer, "has_chat_template", False):
        raise RequestRejected("messages: this model has no chat template; send `prompt` or `prompt_token_ids`")
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if not isinstance(content, str):
            if any(part.type != "text" for part in content):
                raise RequestRejected(
                    f"messages[{i}].content: image parts need a vision model; this worker serves a text model"
                )
        messages.append(message.model_dump(exclude_none=True))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prepare_prompt(tokenizer: Any, request: GenerationRequest, constraints: ConstraintCompiler) -> Prompt:
    """The prompt's token ids and, for a constrained request, its compiled constraint (cached per
    worker: docs/structured-output.md has the compile times)."""
    token_ids = prompt_token_ids(tokenizer, request)
    constraint = request.constraint
    if constraint is None:
        return Prompt(token_ids)
    if request.ignore_eos:
        raise RequestRejected(f"ignore_eos: cannot be combined with {constraint.field.split('.')[0]}, "
                              "which ends the text where the constraint allows EOS")
    return Prompt(token_ids, inputs=constraints.compile(constraint))


def measure_kv_bytes_per_token(model: Any) -> int:
    """Run one token through a fresh cache and weigh its (batch, heads, time, dim) arrays per
    time step: right for GQA and quantized caches alike. 0 when nothing grows per token."""
    try:
        cache = make_prompt_cache(model)
        model(mx.array([[0]]), cache=cache)
        arrays = [a for c in cache for a in _flatten(c.state) if isinstance(a, mx.array) and a.ndim == 4]
        mx.eval(arrays)
        return int(sum(a.nbytes // a.shape[2] for a in arrays))
    except Exception:
        return 0


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def model_vocab_size(model: Any, tokenizer: Any) -> int:
    args = getattr(model, "args", None)
    size: Optional[int] = getattr(args, "vocab_size", None)
    return int(size) if size else len(tokenizer)


def model_context_length(model: Any) -> Optional[int]:
    length = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return int(length) if isinstance(length, int) and length > 0 else None
