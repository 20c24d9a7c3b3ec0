"""The served text model and its tokenizer as the text engines read them: a request's prompt as
token ids, the vocabulary size, the context length, the KV-cache bytes one token takes."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from schemas import GenerationRequest
from worker.engines.base import Prompt
from worker.engines.chat_template import ChatFormat, RequestRejected
from worker.engines.constraints import ConstraintCompiler

__all__ = ["ChatFormat", "RequestRejected", "measure_kv_bytes_per_token", "model_context_length", "model_vocab_size",
           "prepare_prompt"]


def prepare_prompt(chat: ChatFormat, request: GenerationRequest, constraints: ConstraintCompiler) -> Prompt:
    """The prompt's token ids, how its reply reads (reasoning, tool calls: worker/replies.py) and,
    for a constrained request or a forced tool call, its compiled constraint (cached per worker:
    docs/structured-output.md has the compile times)."""
    token_ids = chat.prompt_ids(request)
    reply = chat.reply_format(request, token_ids)
    constraint = request.constraint or chat.forced_call(request)
    if constraint is None:
        return Prompt(token_ids, reply=reply)
    if request.ignore_eos:
        raise RequestRejected(f"ignore_eos: cannot be combined with {constraint.field.split('.')[0]}, "
                              "which ends the text where the constraint allows EOS")
    return Prompt(token_ids, inputs=constraints.compile(constraint), reply=reply)


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
