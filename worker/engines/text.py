"""Text engine: mlx-lm's BatchGenerator (continuous batching) behind the Engine protocol.

Uses only mlx-lm's public API: `BatchGenerator.insert/next/remove`, `StopSequences`,
`sample_utils.make_sampler/make_logits_processors`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from schemas import GenerationRequest
from worker.engines.base import SamplingParams, SequenceSpec, TokenEvent


class RequestRejected(ValueError):
    """The request cannot run on this model; the message names the field."""


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class TextEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_num_seqs: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._vocab_size = _model_vocab_size(model, tokenizer)
        self._eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
        self._generator = BatchGenerator(
            model,
            sampler=_greedy,
            completion_batch_size=max_num_seqs,
            prefill_batch_size=min(prefill_batch_size, max_num_seqs),
            prefill_step_size=prefill_step_size,
        )
        self._by_engine_uid: dict[int, SequenceSpec] = {}
        self._engine_uid: dict[str, int] = {}
        # Rows with equal settings share one sampler object so mlx-lm samples them in one call.
        self._samplers: dict[SamplingParams, Callable[[mx.array], mx.array]] = {}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def num_active(self) -> int:
        return len(self._by_engine_uid)

    def prompt_token_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return list(self.tokenizer.encode(request.prompt))
        assert request.messages is not None
        if not getattr(self.tokenizer, "has_chat_template", False):
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
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add(self, specs: list[SequenceSpec]) -> None:
        if not specs:
            return
        uids = self._generator.insert(
            [spec.prompt_token_ids for spec in specs],
            max_tokens=[spec.max_tokens for spec in specs],
            samplers=[self._sampler(spec.sampling) for spec in specs],
            logits_processors=[_logits_processors(spec.sampling) for spec in specs],
            stop_sequences=[StopSequences([[t] for t in sorted(spec.stop_token_ids)]) for spec in specs],
        )
        for engine_uid, spec in zip(uids, specs):
            self._by_engine_uid[engine_uid] = spec
            self._engine_uid[spec.uid] = engine_uid

    def step(self) -> list[TokenEvent]:
        if not self._by_engine_uid:
            return []
        _, responses = self._generator.next()
        events: list[TokenEvent] = []
        wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]] = []
        for response in responses:
            spec = self._by_engine_uid.get(response.uid)
            if spec is None:  # removed while its step was in flight
                continue
            event = TokenEvent(uid=spec.uid, token=int(response.token), finish_reason=response.finish_reason)
            events.append(event)
            if spec.logprobs or spec.top_logprobs:
                wanted.append((event, spec, response.logprobs))
            if response.finish_reason is not None:
                self._forget(spec.uid)
        if wanted:
            _attach_logprobs(wanted)
        return events

    def remove(self, uids: list[str]) -> None:
        engine_uids = [self._engine_uid[u] for u in uids if u in self._engine_uid]
        if engine_uids:
            self._generator.remove(engine_uids)
        for uid in uids:
            self._forget(uid)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _forget(self, uid: str) -> None:
        engine_uid = self._engine_uid.pop(uid, None)
        if engine_uid is not None:
            self._by_engine_uid.pop(engine_uid, None)

    def _sampler(self, params: SamplingParams) -> Callable[[mx.array], mx.array]:
        key = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
        )
        if key.is_greedy:
            return _greedy
        if key not in self._samplers:
            self._samplers[key] = make_sampler(
                temp=key.temperature,
                top_p=key.top_p if key.top_p < 1.0 else 0.0,
                min_p=key.min_p,
                top_k=key.top_k,
            )
        return self._samplers[key]


def _logits_processors(params: SamplingParams) -> list[Callable[[mx.array, mx.array], mx.array]]:
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )


def _attach_logprobs(wanted: list[tuple[TokenEvent, SequenceSpec, mx.array]]) -> None:
    """Gather the chosen token's logprob (and the top-k) for every row that asked, in one eval."""
    rows = mx.stack([logprobs for _, _, logprobs in wanted])
    tokens = mx.array([event.token for event, _, _ in wanted])
    chosen = mx.take_along_axis(rows, tokens[:, None], axis=-1)[:, 0]
    k = max(spec.top_logprobs for _, spec, _ in wanted)
    if k:
        candidates = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
        candidate_vals = mx.take_along_axis(rows, candidates, axis=-1)
        order = mx.argsort(-candidate_vals, axis=-1)
        top_ids = mx.take_along_axis(candidates, order, axis=-1)
        top_vals = mx.take_along_axis(candidate_vals, order, axis=-1)
        mx.eval(chosen, top_ids, top_vals)
        top_ids_list, top_vals_list = top_ids.tolist(), top_vals.tolist()
    else:
        mx.eval(chosen)
    chosen_list = chosen.tolist()
    for i, (event, spec, _) in enumerate(wanted):
        event.logprob = float(chosen_list[i])
        if spec.top_logprobs:
            event.top_logprobs = list(zip(top_ids_list[i][: spec.top_logprobs], top_vals_list[i][: spec.top_logprobs]))


def _model_vocab_size(model: Any, tokenizer: Any) -> int:
    args = getattr(model, "args", None)
    size: Optional[int] = getattr(args, "vocab_size", None)
    return int(size) if size else len(tokenizer)
