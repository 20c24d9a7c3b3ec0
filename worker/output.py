"""Output processing: what a job's user gets from the engine's token events, for any engine.

Per choice it keeps the tokens, logprobs and (where stop strings or streaming need it) the text as
it grows; it finds stop strings across token boundaries, cuts the stream deltas (holding back text
that could start a stop string), and builds the job's GenerationResult once the job has ended. It
knows the engine only through two callables: `decode` (token ids to text) and `token_text` (one
token's text, for top_logprobs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from schemas import Choice, ErrorInfo, GenerationRequest, GenerationResult, Speculation, TopLogprob, Usage
from schemas.agents import ToolCall
from schemas.result import PromptLogprobs, timings
from schemas.serializer import EncodedJSON
from worker.detokenize import IncrementalDetokenizer
from worker.engines.base import TokenEvent
from worker.replies import ReplyFormat, ReplyParser, tool_call_id

Decode = Callable[[list[int]], str]


@dataclass
class ChoiceState:
    index: int
    uid: str
    # Text as tokens arrive, only for requests that need it (stop strings, streaming); the others
    # decode once at the end, which spares every decode step a detokenizer call per sequence.
    detokenizer: Optional[IncrementalDetokenizer]
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    finish_reason: Optional[str] = None
    # Where `text` ends when a stop string cut it; None = the whole decoded text.
    text_end: Optional[int] = None
    # Stream bookkeeping: tokens and characters already handed out as deltas.
    streamed_tokens: int = 0
    streamed_chars: int = 0
    # For a constrained request: the engine's word, given with a sequence's last token, on whether
    # its text completes the constraint.
    engine_says_complete: Optional[bool] = None
    # [first_token_index, version] each time the weights that sampled its tokens changed.
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    # A streamed reply read for reasoning and tool calls, split as its text is handed out (worker/replies.py).
    reply: Optional[ReplyParser] = None
    stop_sequence: Optional[str] = None  # the stop string that ended it

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text so far, for choices decoded token by token (the others decode when the result is built)."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text if self.text_end is None else self.detokenizer.text[: self.text_end]


@dataclass
class EndedJob:
    """A job that ended. `result()` builds its GenerationResult, once, on whichever thread calls
    it: nothing of an ended job changes any more, so the worker builds results on its bookkeeping
    thread rather than in the step (docs/design-notes.md, "Results built off the step")."""

    id: str
    status: str
    build: Callable[[], GenerationResult] = field(repr=False)
    _result: Optional[GenerationResult] = field(default=None, repr=False)
    _encoded: Optional[EncodedJSON] = field(default=None, repr=False)

    @classmethod
    def built(cls, result: GenerationResult) -> "EndedJob":
        return cls(result.id, result.status, lambda: result, result)

    def result(self) -> GenerationResult:
        """Never raises: a result that cannot be built is a failed one, so the job still ends."""
        if self._result is None:
            try:
                self._result = self.build()
            except Exception as exc:
                self._result = GenerationResult(
                    id=self.id, status="failed",
                    error=ErrorInfo(type="ResultError", message=f"could not build the result: {exc!r}"))
        return self._result

    def encoded(self) -> EncodedJSON:
        """The result as JSON, encoded once: its result key and rq's return value are this text."""
        if self._encoded is None:
            self._encoded = EncodedJSON(self.result().model_dump_json())
        return self._encoded


@dataclass
class StreamDelta:
    """What one choice of a streaming job produced since the last delta."""

    job_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None
    # The logprobs of `token_ids`, for requests that asked for them (None otherwise).
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[list[TopLogprob]]] = None
    # A reply read for reasoning and tool calls: `text` is the answer's, these the rest (docs/tools.md).
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class JobOutput:
    """One job's choices as they grow, and the result they make."""

    def __init__(self, job_id: str, request: GenerationRequest, prompt_token_ids: list[int], stop_ids: frozenset[int],
                 *, decode: Decode, token_text: Callable[[int], str], model: Optional[str], worker: Optional[str],
                 enqueued_at: Optional[float], started_at: float, reply: Optional[ReplyFormat] = None) -> None:
        self.job_id = job_id
        self.request = request
        self.prompt_token_ids = prompt_token_ids
        self._reply = reply if reply is not None and reply.active else None
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self._decode, self._token_text = decode, token_text
        self._model, self._worker = model, worker
        self.enqueued_at, self.started_at = enqueued_at, started_at
        self.first_token_at: Optional[float] = None
        needs_text = bool(request.stop or request.stream)
        self.choices = [
            ChoiceState(index=index, uid=f"{job_id}#{index}",
                        detokenizer=IncrementalDetokenizer(decode) if needs_text else None, stop_ids=stop_ids,
                        logprobs=[] if request.wants_logprobs else None,
                        top_logprobs=[] if request.top_logprobs else None,
                        reply=self._reply_parser(index) if request.stream else None)
            for index in range(request.n)
        ]
        self.live = len(self.choices)  # choices not yet ended
        self.speculation: Optional[Speculation] = None  # summed over its choices' speculative steps

    def _reply_parser(self, index: int) -> Optional[ReplyParser]:
        if self._reply is None:
            return None
        return ReplyParser(self._reply, lambda call: tool_call_id(self.job_id, index, call))

    def apply(self, event: TokenEvent, now: float) -> Optional[ChoiceState]:
        """Add one token to its choice. Returns the choice if it ended with this token (EOS, a stop
        token, length, or a stop string: then its sequence is still in the engine), or with nothing
        generated (`event.empty`: max_tokens 0)."""
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = self._prompt_logprobs(*event.prompt_logprobs)
        choice = self.choices[event.index]
        if choice.done:
            return None
        if event.speculation is not None:
            drafter, proposed, accepted = event.speculation
            seen = self.speculation or Speculation(drafter=drafter, proposed=0, accepted=0)  # type: ignore[arg-type]
            self.speculation = Speculation(drafter=seen.drafter, proposed=seen.proposed + proposed,
                                           accepted=seen.accepted + accepted)
        if event.empty:
            choice.finish_reason = event.finish_reason or "length"
            self._choice_ended(choice)
            return choice
        if self.first_token_at is None:
            self.first_token_at = now
        choice.token_ids.append(event.token)
        choice.engine_says_complete = event.constraint_complete
        version = event.weight_version
        if version is not None and (not choice.weight_versions or choice.weight_versions[-1][1] != version):
            choice.weight_versions.append((len(choice.token_ids) - 1, version))
        if choice.logprobs is not None and event.logprob is not None:
            choice.logprobs.append(event.logprob)
        if choice.top_logprobs is not None and event.top_logprobs is not None:
            choice.top_logprobs.append(
                [TopLogprob(token_id=t, token=self._token_text(t), logprob=lp) for t, lp in event.top_logprobs])
        is_stop_token = event.finish_reason == "stop" and event.token in choice.stop_ids
        stop_at = None
        if choice.detokenizer is not None:
            new_text = "" if is_stop_token else choice.detokenizer.add(event.token)
            stop_at = _find_stop(choice.detokenizer.text, len(new_text), self.request.stop_strings)
        if stop_at is not None:
            choice.text_end = stop_at
            choice.finish_reason = "stop"
            choice.stop_sequence = next(s for s in self.request.stop_strings
                                        if choice.detokenizer.text.startswith(s, stop_at))  # type: ignore[union-attr]
        elif event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        if not choice.done:
            return None
        self._choice_ended(choice)
        return choice

    def end_live(self, finish_reason: str) -> list[ChoiceState]:
        """End every choice still running (a cancel, a timeout, an error); returns them."""
        live = [c for c in self.choices if not c.done]
        for choice in live:
            choice.finish_reason = finish_reason
            self._choice_ended(choice)
        return live

    def _choice_ended(self, choice: ChoiceState) -> None:
        if choice.detokenizer is not None and choice.text_end is None:
            choice.detokenizer.flush()  # the held-back text is final
        self.live -= 1

    def stream_deltas(self) -> list[StreamDelta]:
        """What each choice produced since the last call; text that could start a stop string is
        held back until decided."""
        if not self.request.stream:
            return []
        holdback = max((len(s) for s in self.request.stop_strings), default=1) - 1
        deltas = []
        for choice in self.choices:
            text = choice.text
            end = len(text) if choice.done else max(choice.streamed_chars, len(text) - holdback)
            unflushed = choice.done and choice.reply is not None and not choice.reply.finished
            if choice.streamed_tokens == len(choice.token_ids) and end == choice.streamed_chars and not unflushed:
                continue
            start = choice.streamed_tokens
            delta = StreamDelta(
                self.job_id, choice.index, choice.token_ids[start:], text[choice.streamed_chars:end],
                choice.finish_reason, logprobs=None if choice.logprobs is None else choice.logprobs[start:],
                top_logprobs=None if choice.top_logprobs is None else choice.top_logprobs[start:])
            if choice.reply is not None:
                parts = choice.reply.feed(delta.text)
                if choice.done:
                    ending = choice.reply.finish()
                    parts.answer, parts.reasoning = parts.answer + ending.answer, parts.reasoning + ending.reasoning
                    parts.calls += ending.calls
                delta.text, delta.reasoning, delta.tool_calls = parts.answer, parts.reasoning, parts.calls
            deltas.append(delta)
            choice.streamed_tokens, choice.streamed_chars = len(choice.token_ids), end
        return deltas

    def ended(self, status: str = "finished", error: Optional[ErrorInfo] = None) -> EndedJob:
        """The job is over: its result, to be built when someone asks for it."""
        finished_at = time.time()
        return EndedJob(self.job_id, status, lambda: self._result(status, error, finished_at))

    def _result(self, status: str, error: Optional[ErrorInfo], finished_at: float) -> GenerationResult:
        choices = [self._choice(c) for c in self.choices]
        versions = [c.weight_version for c in choices if c.weight_version is not None]
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = len(self.prompt_token_ids)
        request = self.request
        return GenerationResult(
            id=self.job_id, custom_id=request.custom_id, model=request.model or self._model,
            status=status,  # type: ignore[arg-type]
            choices=choices,
            prompt_token_ids=self.prompt_token_ids if request.return_prompt_token_ids else None,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            timings=timings(self.enqueued_at, self.started_at, finished_at, self.first_token_at),
            worker=self._worker, error=error, metadata=request.metadata,
            weight_version=min(versions) if versions else None, adapter=request.adapter,
            prompt_logprobs=self.prompt_logprobs, speculation=self.speculation)

    def _choice(self, choice: ChoiceState) -> Choice:
        text = self._final_text(choice)
        finish_reason = choice.finish_reason
        parsed: dict[str, object] = {}
        reply = choice.reply  # a stream's: what its deltas handed out
        if reply is None and self._reply is not None:
            reply = self._reply_parser(choice.index)
            assert reply is not None
            reply.parse(text)
        elif reply is not None and not reply.finished:
            reply.finish()
        if reply is not None:  # the reply read for reasoning and tool calls (docs/tools.md)
            text = reply.answer
            parsed = dict(reasoning_content=reply.reasoning or None, tool_calls=reply.calls or None,
                          tool_call_error=reply.error)
            if reply.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return Choice(index=choice.index, text=text, token_ids=choice.token_ids, logprobs=choice.logprobs,
                      top_logprobs=choice.top_logprobs, finish_reason=finish_reason,  # type: ignore[arg-type]
                      constraint_complete=self._constraint_complete(choice),
                      weight_version=choice.weight_versions[0][1] if choice.weight_versions else None,
                      weight_versions=choice.weight_versions if len(choice.weight_versions) > 1 else None,
                      stop_sequence=choice.stop_sequence, **parsed)

    def _prompt_logprobs(self, logprobs: list[Optional[float]], tops: Optional[list[list[tuple[int, float]]]]
                         ) -> PromptLogprobs:
        named = None if tops is None else [[TopLogprob(token_id=t, token=self._token_text(t), logprob=lp)
                                            for t, lp in row] for row in tops]
        return PromptLogprobs(token_ids=self.prompt_token_ids, tokens=[self._token_text(t) for t in self.prompt_token_ids],
                              logprobs=logprobs, top_logprobs=named)

    def _constraint_complete(self, choice: ChoiceState) -> Optional[bool]:
        """None unconstrained; else whether the text is a complete match: the engine's word on the
        last token, and False when a stop string cut the text or the choice ended without a last
        token of its own (cancelled, timed out)."""
        if self.request.constraint is None:
            return None
        return bool(choice.engine_says_complete) and choice.text_end is None

    def _final_text(self, choice: ChoiceState) -> str:
        """An ended choice's text (EOS and stop tokens are not text)."""
        if choice.detokenizer is not None:
            return choice.text
        tokens = choice.token_ids
        if choice.finish_reason == "stop" and tokens and tokens[-1] in choice.stop_ids:
            tokens = tokens[:-1]
        return self._decode(tokens)


def _find_stop(text: str, new_chars: int, stops: list[str]) -> Optional[int]:
    """Where the first stop string starts, looking only where the newest `new_chars` could have
    completed one (a stop string may straddle any number of tokens)."""
    if not stops or not new_chars:
        return None
    start = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    positions = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(positions) if positions else None
