"""Forced tool calls' grammars (worker/engines/tool_grammar.py) against llguidance and a tokenizer, without a
model: each format's own rendering of a call is accepted and parses back; a second call only with
parallel calls; another function's name never; a marker that is an added token (special or not, as
Qwen's `<tool_call>`) only as that token."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from schemas.agents import Tool
from worker.engines.tool_grammar import forced_call_constraint, special_token_of
from worker.replies import TOOL_CALL_FORMATS, ReplyFormat, ReplyParser

ADD = Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}})
ECHO = Tool.model_validate({"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}}})


@pytest.fixture(scope="module", params=["plain", "added-tokens"])
def tokenizer(tiny_model_dir: str, request: pytest.FixtureRequest) -> Any:
    """The tiny tokenizer; and the same with the tool markers as added tokens that are not special."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "added-tokens":
        loaded.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return loaded


def accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    import llguidance

    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tokenizer), eos_token=[eos]),
                                   llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_each_formats_call_is_accepted_and_parses_back(tokenizer: Any, name: str) -> None:
    call_format = TOOL_CALL_FORMATS[name]
    assert call_format.render is not None
    one = call_format.render([("add", {"a": 2, "b": 3})])
    two = call_format.render([("add", {"a": 2, "b": 3}), ("echo", {"text": "hi"})])
    lookup = special_token_of(tokenizer)
    parallel = forced_call_constraint(call_format, [ADD, ECHO], True, lookup).source
    single = forced_call_constraint(call_format, [ADD, ECHO], False, lookup).source
    named = forced_call_constraint(call_format, [ECHO], False, lookup).source
    assert accepts(tokenizer, parallel, one) and accepts(tokenizer, parallel, two)
    assert accepts(tokenizer, single, one) and not accepts(tokenizer, single, two)
    assert not accepts(tokenizer, named, one)
    assert not accepts(tokenizer, single, call_format.render([("add", {"a": "two", "b": 3})]))
    parsed = ReplyParser(ReplyFormat(tools=call_format, tool_names=frozenset({"add", "echo"})), str).parse(two)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("add", {"a": 2, "b": 3}), ("echo", {"text": "hi"})]
    if name == "hermes" and "<tool_call>" in tokenizer.get_added_vocab():  # named by id, never spelt out
        assert f"<[{tokenizer.convert_tokens_to_ids('<tool_call>')}]>" in single


def test_formats_mlxq_cannot_force_are_refused() -> None:
    from worker.replies import tool_call_format

    with pytest.raises(ValueError, match="tool_choice: a forced call cannot be made"):
        forced_call_constraint(tool_call_format("pythonic"), [ADD], False, lambda marker: None)
