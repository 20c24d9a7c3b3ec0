"""What one constraint costs llguidance on a tokenizer: the matcher's construction, its first mask and
the worst of the next masks along a token path, under mlxq's PARSER_LIMITS or the library's defaults.
docs/structured-output.md quotes its output for hostile constraints.

    python docs/bench/constraint_probe.py --tokenizer DIR [--defaults] [--steps 8]

DIR holds a Hugging Face tokenizer (tokenizer.json). Each case is a constraint kind and its text; the
path takes the middle allowed token at each step.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import llguidance
import numpy as np
from transformers import AutoTokenizer

from worker.engines.constraints import JSON_OPTIONS, PARSER_LIMITS

CASES = [
    ("regex", "(a{1000}){1000}"),
    ("regex", "a{100000}"),
    ("json", json.dumps({"type": "string", "pattern": "^(a{1000}){1000}$"})),
    ("lark", 'start: "a" start'),
    ("regex", "a{10000}"),
    ("regex", "(ab){5000}"),
    ("regex", "[a-z]{10000}"),
    ("regex", "[0-9]{3}-[a-z]{2,8}"),
    ("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                                                          "l": {"type": "array", "items": {"type": "number"}}},
                         "required": ["n", "s", "l"]})),
]


def grammar(kind: str, text: str) -> str:
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--defaults", action="store_true", help="llguidance's own limits, not PARSER_LIMITS")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    backend = copy.copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    vocab = len(hf)
    tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=[hf.eos_token_id])
    limits = None if args.defaults else llguidance.LLParserLimits(**PARSER_LIMITS)
    print(f"vocabulary {vocab}; limits: {'llguidance defaults' if args.defaults else PARSER_LIMITS}")
    for kind, text in CASES:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar(kind, text), log_level=0, limits=limits)
        built = time.perf_counter()
        mask = np.zeros((vocab + 31) // 32, dtype=np.uint32)
        first = worst = 0.0
        for step in range(args.steps):
            at = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            took = time.perf_counter() - at
            first, worst = (took, worst) if step == 0 else (first, max(worst, took))
            allowed = [t for t in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
                       if t != hf.eos_token_id]
            if matcher.is_error() or not allowed:
                break
            matcher.consume_token(int(allowed[len(allowed) // 2]))
        error = matcher.get_error().splitlines()[0] if matcher.is_error() else ""
        print(f"{kind:5} {text[:44]!r:48} construct {1e3 * (built - started):6.1f} ms  first mask "
              f"{1e3 * first:8.1f} ms  worst later {1e3 * worst:6.1f} ms  {error[:70]}")


if __name__ == "__main__":
    main()
