"""Structured output: a request's constraint (JSON schema, regex, Lark grammar) as a per-row token
mask, with llguidance (docs/structured-output.md says why this library, with measurements).

- `ConstraintCompiler`, one per worker: builds llguidance's view of the tokenizer on a thread at
  start, compiles each constraint once (a cache keyed by its kind and text) under `PARSER_LIMITS`,
  computes its first mask there, and turns what the library cannot compile, or what fails or allows
  nothing at that first mask, into a ValueError that names the request field (`prepare` fails the
  job). The batch loop prepares a constrained request off its own thread (worker/scheduler.py).
- `RowConstraint`, one per sequence: a logits processor `(tokens, logits) -> logits` as mlx-lm's and
  mlx-vlm's BatchGenerators call them, once per sampled token, with the prompt and the tokens so far.
  It advances its matcher with the tokens it has not seen and masks every token the grammar does not
  allow next. EOS is allowed only where the grammar may end. A row whose matcher fails ends alone
  (its processor raises, or, deferred, `RowConstraint.error` is set for the engine to end it): a
  matcher's failure, or the library refusing a batch-wide call, never reaches another row.
- `MaskBatch`, one per engine: where the rows' masks live, and when they are filled. A row's
  processor only records that its mask is wanted and returns the masked logits as a lazy MLX graph
  over its row of a shared buffer; `fill()` (called before the batch is sampled: `fenced` wraps a
  sampler so) reads every waiting row's new token in one evaluation; then the batch's own thread
  advances the matchers and computes their masks (on llguidance's thread pool) while the calling
  thread hands the step's forward pass to the device. On MLX's CUDA and Metal backends handing it
  over is host work of the same order as the masks (kernel launches, with the GIL released), so
  the two overlap only on two threads. An engine that cannot call
  `fill()` before sampling builds its `MaskBatch(deferred=False)`: each row then fills its own mask
  in its call.

The buffer's rows are written only after the step that last read them has ended: a row writes its
slot once it has read the token sampled from its previous mask (which waits for that step), and a
slot given back is handed out again only two steps later.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from schemas.constraints import Constraint
from worker.engines.base import TokenEvent

log = logging.getLogger("mlxq.engine")

COMPILED_CACHE_SIZE = 128  # compiled constraints kept per worker, least recently used dropped first
# llguidance's bounds on one matcher's work (fuel: lexer work; items: Earley items), per mask and at
# its start, and on what it may build: a constraint over them fails (its job alone) instead of
# stalling the batch. Its defaults but for the lexer's states (each 1-2 kB): docs/structured-output.md.
PARSER_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                     max_lexer_states=50_000, max_grammar_size=500_000)
REUSE_AFTER_STEPS = 2
# JSON as json.dumps writes it: a model is not let to fill its output with whitespace. A schema's own
# "x-guidance" options come after these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint the library cannot compile; the message names the request field."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer: matchers for new rows are copies of `prototype`."""

    constraint: Constraint
    prototype: Any  # llguidance.LLMatcher at the start state

    def new_matcher(self) -> Any:
        return self.prototype.deep_copy()


class ConstraintCompiler:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = COMPILED_CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._cache_size = cache_size
        self._cache_lock = threading.Lock()  # the loop's preparing thread and the loop may both compile
        self._tokenizer: Any = None
        self._tokenizer_error: Optional[BaseException] = None
        # About a second for a 150k vocabulary (docs/structured-output.md): not on the first request's path.
        self._ready = threading.Event()
        threading.Thread(target=self._build_tokenizer, args=(hf_tokenizer,), name="llguidance-tokenizer",
                         daemon=True).start()

    def _build_tokenizer(self, hf_tokenizer: Any) -> None:
        try:
            import llguidance

            # As llguidance.hf.from_tokenizer does, through the attribute mlx-lm's TokenizerWrapper passes on.
            backend = copy.copy(hf_tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=sorted(self.eos_token_ids))
        except BaseException as exc:  # reported to each constrained request, never crashes the worker
            self._tokenizer_error = exc
        finally:
            self._ready.set()

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        key = (constraint.kind, constraint.source)
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = CompiledConstraint(constraint, self._matcher(constraint))
        with self._cache_lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, constraint: Constraint) -> Any:
        """A matcher at the start state with its first mask computed: the library builds its lexer
        there (the costly part of a hostile constraint), so a constraint that fails or allows nothing
        fails now, naming the field, and rows start from a matcher that has done that work."""
        import llguidance

        self._ready.wait()
        if self._tokenizer is None:
            raise ConstraintError(f"{constraint.field}: structured output is unavailable on this worker: "
                                  f"{self._tokenizer_error!r}")
        try:
            if constraint.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
            elif constraint.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(constraint.source)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(constraint.source)
        except ValueError as exc:
            raise ConstraintError(f"{constraint.field}: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**PARSER_LIMITS))
        if matcher.is_error():
            raise ConstraintError(f"{constraint.field}: cannot be compiled: {_first_lines(matcher.get_error())}")
        mask = np.zeros(math.ceil(self.vocab_size / 32), dtype=np.uint32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if not mask.any() or "NoExtension" in matcher.get_error():
            raise ConstraintError(f"{constraint.field}: allows no text at all")
        if matcher.is_error():
            raise ConstraintError(f"{constraint.field}: fails at its first token, within the limits on its work "
                                  f"(PARSER_LIMITS): {_first_lines(matcher.get_error(), 1)}")
        return matcher


class RowConstraint:
    """One sequence's matcher and its logits processor (see the module docstring)."""

    def __init__(self, compiled: CompiledConstraint, prompt_len: int, batch: "MaskBatch") -> None:
        self.constraint = compiled.constraint
        self._matcher = compiled.new_matcher()
        self._prompt_len = prompt_len
        self._batch = batch
        self._consumed = 0  # generated tokens the matcher has taken
        self._emitted: list[int] = []  # generated tokens the engine has returned
        self._accepting_before_last = False
        self.slot: Optional[int] = None
        # Set when a deferred fill could not advance the matcher: the engine ends the row with it.
        self.error: Optional[str] = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self._batch.launch(logits)
        return self._batch.masked(self, tokens, logits)

    @property
    def batched(self) -> bool:
        """Whether an engine may mask this row together with the others of its step
        (`MaskBatch.masked_rows`) instead of calling it as the row's processor."""
        return self._batch.deferred

    def unseen(self, tokens: mx.array) -> Optional[mx.array]:
        """The generated tokens in `tokens` (the prompt, then the output so far) not consumed yet: lazy."""
        count = tokens.shape[-1] - self._prompt_len - self._consumed
        return tokens.reshape(-1)[-count:] if count > 0 else None

    def advance(self, tokens: list[int]) -> None:
        """Consume `tokens`; raises RuntimeError naming the field if the matcher cannot go on."""
        self._consume(tokens)
        self.check()

    def check(self) -> None:
        """Raises RuntimeError naming the field if the matcher has failed (at a token, or at a mask:
        the library's limits on its work, a grammar with no way on)."""
        if self._matcher.is_error():
            raise RuntimeError(f"{self.constraint.field}: the constraint failed at generated token "
                               f"{self._consumed}: {_first_lines(self._matcher.get_error(), 1)}")

    def _consume(self, tokens: list[int]) -> None:
        for token in tokens:
            self._accepting_before_last = self._matcher.is_accepting()
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"{self.constraint.field}: the constraint failed at generated token "
                                   f"{self._consumed}: {_first_lines(self._matcher.get_error(), 1)}")
            self._consumed += 1

    def before_consuming_one(self) -> None:
        """The matcher is about to take one token in a batch call (`MaskBatch`'s parallel consume)."""
        self._accepting_before_last = self._matcher.is_accepting()

    def consumed_one(self, ok: bool) -> None:
        """The batch call's outcome for this row; raises RuntimeError naming the field if it failed."""
        if not ok:
            raise RuntimeError(f"{self.constraint.field}: the constraint failed at generated token "
                               f"{self._consumed}: {_first_lines(self._matcher.get_error(), 1)}")
        self._consumed += 1

    def fill_into(self, target: np.ndarray) -> None:
        """This row's next-token mask into `target` (uint32 words, 32 tokens each)."""
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    @property
    def matcher(self) -> Any:
        return self._matcher

    def observe(self, token: int) -> None:
        """The engine returned `token` for this row (the processor sees it one call later, if at all)."""
        self._emitted.append(token)

    def ended(self, stopped_by_token: bool) -> bool:
        """Whether the row's text is a complete match: with its last token, or without it when a
        stop token (not text) ended the row. Never raises: a matcher that refuses what the engine
        returned (a token its mask did not allow) sets `error`, and the engine ends the row with it."""
        try:
            self._consume(self._emitted[self._consumed:])
            self.check()
        except Exception as exc:
            self.error = self.error or str(exc)
            return False
        return self._accepting_before_last if stopped_by_token else bool(self._matcher.is_accepting())

    def release(self) -> None:
        self._batch.release(self)


class MaskBatch:
    """The masks of an engine's constrained rows: a buffer of uint32 words, one row per slot."""

    def __init__(self, vocab_size: int, capacity: int, *, deferred: bool = True,
                 threads: Optional[int] = None) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._words = math.ceil(vocab_size / 32)
        self._capacity = capacity
        self._buffer, self._view = _shared_buffer(capacity, self._words)
        # Without a view into MLX's memory (a backend that gives none), each row copies its own mask in.
        self.deferred = deferred and self._buffer is not None
        self._free = list(range(capacity - 1, -1, -1))
        self._released: list[tuple[int, int]] = []  # (slot, step it was given back)
        self._step = 0
        # Rows waiting for `fill`: a group's rows, where each row's new tokens are in the group's
        # tokens (a (start, stop) span), and those tokens (lazy).
        self._waiting: list[tuple[list[RowConstraint], list[tuple[int, int]], Optional[mx.array]]] = []
        self._forward: Optional[mx.array] = None  # the step's logits, handed to the device by `fill`
        self._executor = llguidance.LLExecutor(threads) if threads else llguidance.LLExecutor()
        # The one thread that advances matchers and writes masks (its threads exit with this object).
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxq-masks")
        self._filling: Optional[Future[None]] = None  # the batch thread's work since `start`
        self._filling_rows: list[RowConstraint] = []  # the rows that work is for
        self._apply = mx.compile(_apply_mask)

    def begin_step(self) -> None:
        """Before each batch step: a step that failed halfway leaves masks nobody will use."""
        self._waiting.clear()
        self._forward = None
        if self._filling is not None:
            with contextlib.suppress(Exception):
                self._join()
        self._step += 1

    def launch(self, logits: mx.array) -> None:
        """The step's forward pass: `fill` hands it to the device while the masks are computed."""
        if self._forward is None:
            self._forward = logits

    def masked(self, row: RowConstraint, tokens: mx.array, logits: mx.array) -> mx.array:
        if row.slot is None:
            row.slot = self._take_slot()
        if self.deferred:
            unseen = row.unseen(tokens)
            self._waiting.append(([row], [(0, 0 if unseen is None else unseen.size)], unseen))
            words = self._buffer[row.slot : row.slot + 1]
        else:
            unseen = row.unseen(tokens)
            row.advance(unseen.tolist() if unseen is not None else [])
            row.fill_into(self._view[row.slot])
            row.check()
            words = self._buffer[row.slot : row.slot + 1] if self._buffer is not None else mx.array(
                self._view[row.slot : row.slot + 1])
        return self._apply(words, logits.reshape(1, -1)).reshape(logits.shape)

    def expect(self, rows: list[tuple[RowConstraint, Optional[int]]], fed: mx.array) -> None:
        """A step's constrained rows, each with where in `fed` (the step's input tokens, lazy) the one
        token its matcher has not seen is, if it has one: their new tokens are read now (which waits
        for the step that sampled them) and their matchers advance and masks are computed on the
        batch's thread while the caller builds the step; `masked_rows` masks them, `fill` waits."""
        assert self.deferred and self._buffer is not None
        for row, _ in rows:
            if row.slot is None:
                row.slot = self._take_slot()
        spans = [(0, 0) if at is None else (at, at + 1) for _, at in rows]
        self._waiting.append(([row for row, _ in rows], spans, fed if any(at is not None for _, at in rows) else None))
        self.start()

    def masked_rows(self, rows: list[RowConstraint], logits: mx.array) -> mx.array:
        """`logits` (one row per row of `rows`, all `expect`ed this step) masked in one operation by
        the masks `fill` makes sure are written."""
        assert self._buffer is not None
        return _apply_mask(self._buffer[mx.array([row.slot for row in rows], dtype=mx.int32)], logits)

    def start(self) -> None:
        """The waiting rows' new tokens read (in one evaluation: each read waits on the device), their
        matchers set advancing and their masks computing on the batch's thread, unless that thread
        is still at an earlier start's work."""
        if not self._waiting or self._filling is not None:
            return
        waiting, self._waiting = self._waiting, []
        values = _read_tokens([tokens for _, _, tokens in waiting])
        self._filling = self._filler.submit(self._advance_and_compute, waiting, values)

    def fill(self) -> None:
        """Before sampling: every waiting row's matcher advanced by its new tokens and its mask
        written. The calling thread hands the forward pass to the device while the batch's thread
        works. Never raises: a row whose matcher cannot go on gets `error` set and an all-allowing mask."""
        forward, self._forward = self._forward, None
        self.start()
        try:
            if forward is not None and self._filling is not None:
                mx.async_eval(forward)
        finally:
            self._join()
        if self._waiting:  # rows that came while an earlier start's work ran
            self.start()
            self._join()

    def _join(self) -> None:
        filling, self._filling = self._filling, None
        if filling is None:
            return
        try:
            filling.result()
        except Exception as exc:  # `_advance_and_compute` fails rows one by one: this is a bug of ours
            log.exception("structured output: computing the masks failed")
            for row in self._filling_rows:
                if row.error is None:
                    self._fail(row, RuntimeError(f"{row.constraint.field}: the mask could not be computed: {exc!r}"))

    def _advance_and_compute(self, waiting: list[tuple[list[RowConstraint], list[tuple[int, int]], Any]],
                             values: list[list[int]]) -> None:
        """Advance each waiting row's matcher by its new tokens and compute its mask, in batch-wide
        calls; a row whose matcher fails (or that the library refuses) gets `error` and an
        all-allowing mask, and the others go on as if it were not there."""
        self._filling_rows = [row for group, _, _ in waiting for row in group]
        rows: list[RowConstraint] = []
        single: list[tuple[RowConstraint, int]] = []  # rows with one new token: advanced in one parallel call
        for (group, spans, _), tokens in zip(waiting, values):
            for row, (start, stop) in zip(group, spans):
                if row.error is not None:  # failed already: it is on its way out
                    self._fail(row, RuntimeError(row.error))
                    continue
                if stop - start == 1:
                    single.append((row, tokens[start]))
                    continue
                try:
                    row.advance(tokens[start:stop])
                    rows.append(row)
                except Exception as exc:
                    self._fail(row, exc)
        rows += self._consume_singles(single)
        self._compute_masks(rows)

    def _consume_singles(self, single: list[tuple[RowConstraint, int]]) -> list[RowConstraint]:
        """The rows of `single` that took their token, in one parallel call (one call per row if the
        library refuses the batch)."""
        if not single:
            return []
        for row, _ in single:
            row.before_consuming_one()
        try:
            taken = self._executor.consume_token_par([(row.matcher, token) for row, token in single])
        except Exception:
            taken = [_consume_alone(row, token) for row, token in single]
        went_on = []
        for (row, _), ok in zip(single, taken):
            try:
                row.consumed_one(ok)
                went_on.append(row)
            except Exception as exc:
                self._fail(row, exc)
        return went_on

    def _compute_masks(self, rows: list[RowConstraint]) -> None:
        """`rows`' masks in one call on llguidance's pool (each alone if the library refuses the
        batch); a row whose matcher failed at its mask fails alone."""
        if rows:
            try:
                self._executor.unsafe_compute_mask_ptr([(row.matcher, row.slot) for row in rows],
                                                       self._view.ctypes.data, self._words * 4, self._capacity)
            except Exception:
                for row in rows:
                    try:
                        row.fill_into(self._view[row.slot])
                    except Exception as exc:
                        self._fail(row, exc)
        for row in rows:
            if row.error is None:
                try:
                    row.check()
                except RuntimeError as exc:
                    self._fail(row, exc)

    def _fail(self, row: RowConstraint, exc: BaseException) -> None:
        """The row ends with its error (the engine reads it); meanwhile its mask hides nothing, so
        sampling its row stays well defined."""
        if row.error is None:  # the first failure is the reason
            row.error = (str(exc) if isinstance(exc, RuntimeError)
                         else f"{row.constraint.field}: {type(exc).__name__}: {exc}")
        if row.slot is not None:
            self._view[row.slot] = 0xFFFFFFFF

    def release(self, row: RowConstraint) -> None:
        if row.slot is not None:
            self._released.append((row.slot, self._step))
            row.slot = None

    def _take_slot(self) -> int:
        reusable = [r for r in self._released if self._step - r[1] >= REUSE_AFTER_STEPS]
        if reusable:
            self._released = [r for r in self._released if self._step - r[1] < REUSE_AFTER_STEPS]
            self._free.extend(slot for slot, _ in reusable)
        if not self._free:
            self._grow()
        return self._free.pop()

    def _grow(self) -> None:
        """More rows than slots (rows leaving and joining within two steps): a larger buffer. Rows
        keep their slots; graphs already built read the old buffer, so its waiting masks go there first."""
        self.fill()
        old = self._view
        self._buffer, self._view = _shared_buffer(self._capacity * 2, self._words)
        self._view[: self._capacity] = old
        self._free.extend(range(self._capacity * 2 - 1, self._capacity - 1, -1))
        self._capacity *= 2


def _consume_alone(row: RowConstraint, token: int) -> bool:
    try:
        return bool(row.matcher.consume_token(token))
    except Exception:
        return False


def finish_token(constraint: Optional[RowConstraint], event: TokenEvent) -> TokenEvent:
    """Tell a constrained row's matcher that the engine returned `event`'s token and, on the row's
    last token, whether its text is complete; where the matcher refuses what was returned, the
    row's error event instead (it ends alone, its job failing with the reason)."""
    if constraint is None:
        return event
    constraint.observe(event.token)
    if event.finish_reason is None:
        return event
    complete = constraint.ended(stopped_by_token=event.finish_reason == "stop")
    if constraint.error is not None:
        return TokenEvent(uid=event.uid, token=-1, index=event.index, error=constraint.error)
    event.constraint_complete = complete
    return event


def fenced(sampler: Callable[[mx.array], mx.array], before: Callable[[], None]) -> Callable[[mx.array], mx.array]:
    """`sampler`, calling `before` (a MaskBatch's fill) first. Marked shared, as the samplers it
    wraps are: one wrapper per sampler keeps a batch of rows that share a sampler sampled in one call."""

    def sample(logprobs: mx.array) -> mx.array:
        before()
        return sampler(logprobs)

    sample.shared = True  # type: ignore[attr-defined]
    return sample


def _shared_buffer(rows: int, words: int) -> tuple[Optional[mx.array], np.ndarray]:
    """An MLX array and a NumPy view of the same memory, so that masks written by the library
    reach graphs already built over it; (None, a NumPy array) where MLX gives no such view."""
    buffer = mx.zeros((rows, words), dtype=mx.uint32)
    mx.eval(buffer)
    try:
        view = np.array(buffer, copy=False)
    except (ValueError, TypeError, RuntimeError):
        return None, np.zeros((rows, words), dtype=np.uint32)
    if not (view.flags["C_CONTIGUOUS"] and view.flags["WRITEABLE"]):
        return None, np.zeros((rows, words), dtype=np.uint32)
    return buffer, view


_SHIFTS = mx.arange(32, dtype=mx.uint32)


def _apply_mask(words: mx.array, logits: mx.array) -> mx.array:
    """-inf where a token's bit in `words` (R, W) is clear; `logits` is (R, V)."""
    bits = (words[:, :, None] >> _SHIFTS) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-math.inf, dtype=logits.dtype))


def _read_tokens(arrays: list[Optional[mx.array]]) -> list[list[int]]:
    """Each array's values, in one evaluation: a single array is read as it is (it may be ready
    while the step's forward pass still runs), several are joined first (each read waits on the device)."""
    present = [a for a in arrays if a is not None]
    if len(present) == 1:
        values = [present[0].tolist()]
    else:
        joined = mx.concatenate([a.reshape(-1).astype(mx.int32) for a in present]).tolist() if present else []
        values, at = [], 0
        for a in present:
            values.append(joined[at : at + a.size])
            at += a.size
    it = iter(values)
    return [next(it) if a is not None else [] for a in arrays]


def _first_lines(message: str, lines: int = 3) -> str:
    return " ".join(message.strip().splitlines()[:lines])
