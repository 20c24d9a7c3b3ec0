"""The draft-model drafter (`--speculative draft --draft-model PATH`): a smaller model of the same
tokenizer proposes each row's next k tokens, greedily (its argmax: a deterministic proposal, which
verification treats as a point mass, worker/engines/speculation/verify.py).

Each row keeps its own mlx-lm KV cache in the draft model and the tokens that cache holds. At a
proposal the cache is trimmed back to the longest prefix it shares with the row's tokens now (the
proposed tokens that were rejected go), the rest of the row's tokens are run through (the whole
prompt the first time), then k - 1 proposed tokens are fed one by one. The rows' draft calls of one
position are evaluated together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from worker.engines.speculation.drafter import DraftRow

# Prompt tokens run through the draft model per call (as the served model's prefill step).
PREFILL_STEP = 2048


class VocabularyMismatch(ValueError):
    """The draft model's tokenizer is not the served model's."""


def check_same_vocabulary(tokenizer: Any, draft_tokenizer: Any) -> None:
    """Refuse a draft model whose token ids mean other text than the served model's: its proposals
    would be ids of other tokens, and would be rejected."""
    ours, theirs = dict(tokenizer.get_vocab()), dict(draft_tokenizer.get_vocab())
    if ours == theirs:
        return
    differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
    raise VocabularyMismatch(
        f"MLXQ_DRAFT_MODEL: its tokenizer differs from the served model's ({len(theirs)} tokens against "
        f"{len(ours)}; e.g. {', '.join(f'{token!r}={index}' for token, index in differing)}): a draft model must "
        "share the served model's tokenizer")


@dataclass
class _DraftRow:
    cache: list[Any]
    held: list[int] = field(default_factory=list)  # the tokens the cache holds, in order
    confirmed: int = 0  # how many of them are the row's own (not proposed) tokens


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model: Any, vocab_size: int, prefill_step: int = PREFILL_STEP) -> None:
        """`vocab_size`: the served model's; the draft model proposes no id at or past it."""
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise ValueError("MLXQ_DRAFT_MODEL: its KV caches cannot be trimmed (a sliding window or recurrent "
                             "state), so rejected proposals could not be rolled back: use a model with plain KV caches")
        self.model = model
        self._vocab_size = vocab_size
        self._prefill_step = prefill_step
        self._rows: dict[str, _DraftRow] = {}

    def _catch_up(self, row: DraftRow) -> mx.array:
        """Bring the row's draft cache to its tokens; the draft model's logits after the last one (lazy)."""
        state = self._rows.get(row.uid)
        if state is None:
            state = self._rows[row.uid] = _DraftRow(make_prompt_cache(self.model))
        tokens = list(row.tokens)
        limit = min(len(state.held), len(tokens) - 1)  # at least the last token is run again
        shared = min(state.confirmed, limit)  # a row's own tokens never change: compare only past them
        while shared < limit and state.held[shared] == tokens[shared]:
            shared += 1
        if len(state.held) > shared:
            trim_prompt_cache(state.cache, len(state.held) - shared)
        rest = tokens[shared:]
        logits = None
        for start in range(0, len(rest), self._prefill_step):
            if start:
                mx.eval([c.state for c in state.cache])
            logits = self.model(mx.array(rest[start:start + self._prefill_step])[None], cache=state.cache)
        assert logits is not None
        state.held, state.confirmed = tokens, len(tokens)
        return logits[0, -1, : self._vocab_size]

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in rows]
        live = [i for i, row in enumerate(rows) if row.k > 0]
        if not live:
            return proposals
        guesses = [mx.argmax(self._catch_up(rows[i])) for i in live]
        for step in range(max(rows[i].k for i in live)):
            mx.eval(guesses)
            tokens = [int(g) for g in guesses]
            for i, token in zip(live, tokens):
                proposals[i].append(token)
            live, guesses = [i for i in live if len(proposals[i]) < rows[i].k], []
            for i in live:
                state = self._rows[rows[i].uid]
                token = proposals[i][-1]
                state.held.append(token)
                logits = self.model(mx.array([[token]]), cache=state.cache)
                guesses.append(mx.argmax(logits[0, -1, : self._vocab_size]))
            if not live:
                break
        return proposals

    @property
    def rows(self) -> list[str]:
        """The rows whose draft caches it keeps."""
        return list(self._rows)

    def accepted(self, uid: str, proposed: int, accepted: int) -> None:
        pass  # the next proposal trims the cache to what the row's tokens confirm

    def forget(self, uid: str) -> None:
        self._rows.pop(uid, None)

    def reset(self) -> None:
        self._rows.clear()
