"""Token-mask cost per decode step of three constrained-decoding libraries (docs/structured-output.md).

Each of R rows holds its own matcher over one JSON schema, at its own place in a valid token path
(rows at random offsets, so they are in different grammar states). A step advances every row by its
next token and fills every row's bitmask (int32 words, 32 tokens each), as a decode step would; the
figure is the median step time. Libraries are skipped when not importable (xgrammar needs torch).

    flock /tmp/mlxq-bench.lock python docs/bench/structured_mask_cost.py TOKENIZER_DIR... --rows 16 32 128 256
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any, Callable

import numpy as np

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 40},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                    "price": {"type": "number", "minimum": 0},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "tags", "price", "ok"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def instance(count: int) -> str:
    rng = random.Random(0)
    words = ["alpha", "beta queue", "worker node", "redis", "Batch job", "token"]
    items = [{"id": i, "name": rng.choice(words) + f" {i}", "tags": rng.sample(["red", "green", "blue"], 2),
              "price": round(rng.random() * 100, 2), "ok": i % 2 == 0} for i in range(count)]
    return json.dumps({"items": items}, separators=(",", ":"))


class Candidate:
    """One library: build a matcher per row, advance rows, fill a (rows, words) int32 bitmask."""

    name = ""

    def setup(self, tokenizer: Any, vocab: int, schema: str) -> None: ...
    def new_row(self) -> Any: ...
    def advance(self, rows: list[Any], tokens: list[int]) -> None: ...
    def fill(self, rows: list[Any], bitmask: np.ndarray) -> None: ...


class LLGuidance(Candidate):
    name = "llguidance"

    def setup(self, tokenizer: Any, vocab: int, schema: str) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np = llguidance, llguidance.numpy
        started = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        self.prototype = llguidance.LLMatcher(self.tok, self.grammar)
        assert not self.prototype.is_error(), self.prototype.get_error()
        self.compile_s = time.perf_counter() - started
        self.executor = llguidance.LLExecutor()

    def new_row(self) -> Any:
        return self.prototype.deep_copy()

    def advance(self, rows: list[Any], tokens: list[int]) -> None:
        for row, token in zip(rows, tokens):
            if not row.consume_token(token):
                raise RuntimeError(row.get_error())

    def fill(self, rows: list[Any], bitmask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(r, i) for i, r in enumerate(rows)], bitmask)


class LLGuidanceSerial(LLGuidance):
    name = "llguidance (one thread, row by row)"

    def fill(self, rows: list[Any], bitmask: np.ndarray) -> None:
        for i, row in enumerate(rows):
            self.np.fill_next_token_bitmask(row, bitmask, i)


class XGrammar(Candidate):
    name = "xgrammar"

    def setup(self, tokenizer: Any, vocab: int, schema: str) -> None:
        import torch
        import xgrammar

        self.xgr, self.torch = xgrammar, torch
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        self.compiled = xgrammar.GrammarCompiler(info).compile_json_schema(schema)
        self.compile_s = time.perf_counter() - started
        self.batch = xgrammar.BatchGrammarMatcher()

    def new_row(self) -> Any:
        return self.xgr.GrammarMatcher(self.compiled)

    def advance(self, rows: list[Any], tokens: list[int]) -> None:
        for row, token in zip(rows, tokens):
            if not row.accept_token(token):
                raise RuntimeError("xgrammar rejected a token")

    def fill(self, rows: list[Any], bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(rows, self.torch.from_numpy(bitmask))


class OutlinesCore(Candidate):
    name = "outlines-core"

    def setup(self, tokenizer: Any, vocab: int, schema: str) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        started = time.perf_counter()
        byte_decoder = _byte_decoder()
        special = set(tokenizer.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, token_id in tokenizer.get_vocab().items():
            if token_id in special or token_id >= vocab:
                continue
            try:
                key = bytes(byte_decoder[c] for c in text)
            except KeyError:  # an added token: its text is its bytes
                key = text.encode()
            tokens.setdefault(key, []).append(token_id)
        vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, tokens)
        self.tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        self.index = outlines_core.Index(build_regex_from_schema(schema), vocabulary)
        self.compile_s = time.perf_counter() - started

    def new_row(self) -> Any:
        return self.oc.Guide(self.index)

    def advance(self, rows: list[Any], tokens: list[int]) -> None:
        for row, token in zip(rows, tokens):
            row.advance(token, return_tokens=False)

    def fill(self, rows: list[Any], bitmask: np.ndarray) -> None:
        words = bitmask.shape[1]
        for i, row in enumerate(rows):
            view = bitmask[i]
            row.write_mask_into(view.ctypes.data, words, 4)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def measure(candidate: Candidate, path: list[int], rows: int, steps: int, warmup: int) -> dict[str, Any]:
    rng = random.Random(rows)
    offsets = [rng.randrange(0, len(path) - steps - warmup - 1) for _ in range(rows)]
    matchers = [candidate.new_row() for _ in range(rows)]
    for matcher, offset in zip(matchers, offsets):
        candidate.advance([matcher] * offset, path[:offset])
    bitmask = np.full((rows, (candidate_vocab + 31) // 32), -1, dtype=np.int32)
    times, fills = [], []
    for step in range(warmup + steps):
        started = time.perf_counter()
        candidate.advance(matchers, [path[o + step] for o in offsets])
        filled = time.perf_counter()
        candidate.fill(matchers, bitmask)
        done = time.perf_counter()
        if step >= warmup:
            times.append(done - started)
            fills.append(done - filled)
        allowed = (bitmask[0, path[offsets[0] + step + 1] // 32] >> (path[offsets[0] + step + 1] % 32)) & 1
        assert allowed, f"{candidate.name}: the path's next token is masked out"
    return {"median_ms": statistics.median(times) * 1e3, "fill_median_ms": statistics.median(fills) * 1e3,
            "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}


candidate_vocab = 0


def main() -> None:
    global candidate_vocab
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tokenizers", nargs="+")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 128, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    report: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "schema": SCHEMA, "runs": []}
    makers: list[Callable[[], Candidate]] = [LLGuidance, LLGuidanceSerial, XGrammar, OutlinesCore]
    for directory in args.tokenizers:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        candidate_vocab = len(tokenizer)
        path = tokenizer.encode(instance(400), add_special_tokens=False)
        schema = json.dumps(SCHEMA)
        for make in makers:
            candidate = make()
            try:
                candidate.setup(tokenizer, candidate_vocab, schema)
            except ImportError as exc:
                print(f"{candidate.name}: skipped ({exc})")
                continue
            run = {"library": candidate.name, "vocab": candidate_vocab, "tokenizer": directory,
                   "tokenizer_setup_s": round(candidate.tokenizer_s, 3), "compile_s": round(candidate.compile_s, 4),
                   "path_tokens": len(path), "by_rows": {}}
            for rows in args.rows:
                run["by_rows"][rows] = measure(candidate, path, rows, args.steps, args.warmup)
                print(f"{candidate.name:38s} vocab {candidate_vocab:6d} rows {rows:3d}: "
                      f"{run['by_rows'][rows]['median_ms']:8.3f} ms/step (fill {run['by_rows'][rows]['fill_median_ms']:.3f})",
                      flush=True)
            print(f"{candidate.name:38s} vocab {candidate_vocab:6d}: tokenizer {candidate.tokenizer_s:.2f} s, "
                  f"compile {candidate.compile_s * 1e3:.1f} ms", flush=True)
            report["runs"].append(run)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
