"""Seconds per `propose()` of the draft-model drafter (worker/engines/speculation/draft_model.py),
batched across rows, against the same proposals made one row at a time on mlx-lm's own caches
(the drafter before it was batched, written out here as `PerRowDrafter`), docs/speculative.md.

R rows of P-token prompts ask for k tokens each step. Both drafters see the same rows: after each
step every row keeps `(step + row) % (k + 1)` of the per-row drafter's proposal and then a token
of its own, as a verification would leave it (every row's proposals are partly rejected in turn).
The first call (every prompt run through) is reported apart from the steady steps that follow;
`mismatches` counts proposals that differ (floating-point ties aside, it should be 0).

    flock /tmp/mlxq-bench.lock python docs/bench/draft_batching.py MODEL --rows 8 32 --k 4 --float32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import worker  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from worker.engines.speculation.draft_model import DraftModelDrafter
from worker.engines.speculation.drafter import DraftRow


class PerRowDrafter:
    """One mlx-lm KV cache per row, trimmed to the prefix it shares with the row's tokens; every row's
    draft calls run one by one (their calls of one position evaluated together)."""

    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model, self.vocab = model, vocab_size
        self.rows: dict[str, tuple[list[Any], list[int]]] = {}

    def propose(self, rows: Sequence[DraftRow]) -> list[list[int]]:
        states, guesses = [], []
        for row in rows:
            cache, held = self.rows.setdefault(row.uid, (make_prompt_cache(self.model), []))
            tokens = list(row.tokens)
            shared = 0
            while shared < min(len(held), len(tokens) - 1) and held[shared] == tokens[shared]:
                shared += 1
            trim_prompt_cache(cache, len(held) - shared)
            held[:] = tokens
            logits = self.model(mx.array(tokens[shared:])[None], cache=cache)
            states.append((cache, held))
            guesses.append(mx.argmax(logits[0, -1, : self.vocab]))
        proposals: list[list[int]] = [[] for _ in rows]
        for step in range(max(row.k for row in rows)):
            mx.eval(guesses)
            for proposal, guess in zip(proposals, guesses):
                proposal.append(int(guess))
            if step + 1 == max(row.k for row in rows):
                break
            guesses = []
            for (cache, held), proposal in zip(states, proposals):
                held.append(proposal[-1])
                logits = self.model(mx.array([proposal[-1:]]), cache=cache)
                guesses.append(mx.argmax(logits[0, -1, : self.vocab]))
        return [p[: row.k] for p, row in zip(proposals, rows)]


def load_model(path: str, float32: bool) -> Any:
    if path.endswith(".gguf"):
        from worker.gguf import converted_directory

        path = str(converted_directory(Path(path)))
    model = load(path)[0]
    if float32:
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
    return model


def measure(model: Any, rows: int, k: int, prompt_tokens: int, steps: int) -> dict[str, Any]:
    vocab = model.args.vocab_size
    tokens = {f"r{i}": [(i * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(prompt_tokens + i % 5)]
              for i in range(rows)}
    per_row, batched = PerRowDrafter(model, vocab), DraftModelDrafter(model, vocab)
    times: dict[str, list[float]] = {"per_row": [], "batched": []}
    mismatches = 0
    for step in range(steps + 1):
        asking = [DraftRow(uid, list(t), k) for uid, t in tokens.items()]
        started = time.perf_counter()
        reference = per_row.propose(asking)
        times["per_row"].append(time.perf_counter() - started)
        started = time.perf_counter()
        proposals = batched.propose(asking)
        times["batched"].append(time.perf_counter() - started)
        mismatches += sum(a != b for a, b in zip(reference, proposals))
        for i, (uid, proposal) in enumerate(zip(tokens, reference)):
            kept = (step + i) % (k + 1)
            tokens[uid] += proposal[:kept] + [(sum(tokens[uid][-3:]) + step) % (vocab - 3) + 3]
    return {"rows": rows, "k": k, "prompt_tokens": prompt_tokens, "steps": steps, "mismatches": mismatches,
            **{f"{arm}_first_s": round(t[0], 4) for arm, t in times.items()},
            **{f"{arm}_step_s": round(statistics.median(t[1:]), 4) for arm, t in times.items()},
            "speedup": round(statistics.median(times["per_row"][1:]) / statistics.median(times["batched"][1:]), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the draft model: an mlx-lm directory or a .gguf file")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--float32", action="store_true", help="dequantize and compute in float32 (the CPU)")
    args = parser.parse_args()
    model = load_model(args.model, args.float32)
    for rows in args.rows:
        result = measure(model, rows, args.k, args.prompt_tokens, args.steps)
        print(json.dumps({"device": str(mx.default_device()), "machine": platform.machine(), **result}), flush=True)


if __name__ == "__main__":
    main()
