"""Verification: which proposed tokens a row keeps, so that its output is the served model's own.

Every drafter here is deterministic: its proposal is a point mass q on one token x per position.
The rejection scheme that keeps the served model's distribution p (accept x with probability
min(1, p(x)/q(x)); on a rejection draw from norm(max(p - q, 0))) then reads: accept x with
probability p(x); on a rejection draw from p with x removed, renormalised. Drawing a token t from
p and accepting x exactly when t == x does both at once: P(accept) = p(x), and given t != x, t is
distributed as p without x. The token kept at a rejection is that t, and after a whole proposal
is accepted one more token (the bonus) is drawn from p at the next position.

So a row's token at each position is drawn exactly as a decode step would draw it: greedy rows
take the argmax, seeded rows draw token n with the key the seeded sampler gives token n
(worker/engines/sampling.py `mix_seed`), unseeded rows draw from their own settings. A greedy or
seeded row therefore gives the same tokens with or without speculation, alone or in any batch,
whatever was proposed; proposals only decide how many of them one forward pass makes.

Position 0 of every row is sampled by the engine's ordinary step sampling (worker/engines/
step_sampling.py), with every row of the batch; `ExtraPositions` samples positions 1..k of the
rows that proposed, which refuse the processing that depends on the tokens before each position
(speculator.py), with logit bias applied at each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from worker.engines.base import SamplingParams
from worker.engines.sampling import (LogprobGather, Namer, draw_with_keys, greedy, mix_seed, needs_raw_capture,
                                     reads_probabilities, requested_distribution)

Sampler = Any


@dataclass
class ExtraRow:
    """Position `offset` (1..k) of a row that proposed: where its logits are, and its sequence."""

    seq: Any  # the DecodingSequence
    slot: int
    offset: int
    key_index: int  # a seeded row's token number at this position (for its key)


@dataclass
class ExtraSample:
    tokens: mx.array  # (rows,)
    logprobs: Optional[LogprobGather]
    wanting: list[int]  # entries of the rows whose logprobs `logprobs` holds


class ExtraPositions:
    """Samples the proposed positions of a verification step, each as its row's decode step would."""

    def __init__(self) -> None:
        self._samplers: dict[SamplingParams, Sampler] = {}  # unseeded sampled rows, by settings

    def _sampler(self, params: SamplingParams) -> Sampler:
        key = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                             min_p=params.min_p)
        if key not in self._samplers:
            self._samplers[key] = make_sampler(temp=key.temperature, top_p=key.top_p if key.top_p < 1.0 else 0.0,
                                               min_p=key.min_p, top_k=key.top_k)
        return self._samplers[key]

    def sample(self, logits: mx.array, rows: Sequence[ExtraRow]) -> ExtraSample:
        """`logits` (slots, width, vocabulary) of the verification pass; one token per entry of `rows`."""
        slots = mx.array([r.slot for r in rows], dtype=mx.int32)
        offsets = mx.array([r.offset for r in rows], dtype=mx.int32)
        raw = logits[slots, offsets]  # (rows, vocabulary)
        processed = raw
        changed = [(i, r) for i, r in enumerate(rows) if any(not isinstance(p, Namer) for p in r.seq.processors)]
        if changed:
            parts = []
            for i, r in enumerate(rows):
                row = raw[i:i + 1]
                for processor in r.seq.processors:
                    if not isinstance(processor, Namer):  # a logit bias: it reads no tokens
                        row = processor(mx.array([], dtype=mx.int32), row)
                parts.append(row)
            processed = mx.concatenate(parts)
        logprobs = processed - mx.logsumexp(processed, axis=-1, keepdims=True)  # lazy: computed where read
        tokens = self._draw(processed, logprobs, rows)
        wanting = [i for i, r in enumerate(rows) if r.seq.spec.logprobs or r.seq.spec.top_logprobs]
        if not wanting:
            return ExtraSample(tokens, None, wanting)
        distributions = mx.stack([
            requested_distribution(rows[i].seq.spec, logprobs[i],
                                   raw[i] if needs_raw_capture(rows[i].seq.spec) else None) for i in wanting])
        index = mx.array(wanting, dtype=mx.int32)
        gather = LogprobGather(distributions, tokens[index], [rows[i].seq.spec.top_logprobs for i in wanting])
        return ExtraSample(tokens, gather, wanting)

    def _draw(self, processed: mx.array, logprobs: mx.array, rows: Sequence[ExtraRow]) -> mx.array:
        """Greedy rows' argmax, seeded rows' keyed draws and each unseeded setting's sampler, each
        group in one call, given what the step's would be given (step_sampling.py `_draw`)."""
        groups: dict[Any, list[int]] = {}
        for i, r in enumerate(rows):
            params = r.seq.spec.sampling
            kind = "greedy" if params.is_greedy else "seeded" if params.seed is not None else self._sampler(params)
            groups.setdefault(kind if isinstance(kind, str) else id(kind), []).append(i)
        tokens = mx.zeros((len(rows),), dtype=mx.uint32)
        for kind, members in groups.items():
            index = mx.array(members, dtype=mx.int32)
            params = rows[members[0]].seq.spec.sampling
            scores = (logprobs if reads_probabilities(params) else processed)[index]
            if kind == "greedy":
                drawn = greedy(scores)
            elif kind == "seeded":
                specs = [rows[i].seq.spec for i in members]
                keys = [mix_seed(s.sampling.seed, s.choice_index, rows[i].key_index) for s, i in zip(specs, members)]
                drawn = draw_with_keys(scores, [s.sampling for s in specs], keys)
            else:
                drawn = self._sampler(params)(scores)
            tokens = mx.put_along_axis(tokens, index, drawn.astype(mx.uint32), axis=0)
        return tokens


def accepted_count(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading proposed tokens the sampled ones confirm: `sampled[j]` is the served model's
    token at position j (after the row's input and draft[:j]); draft[j] is kept while it equals it."""
    count = 0
    while count < len(draft) and draft[count] == sampled[count]:
        count += 1
    return count
