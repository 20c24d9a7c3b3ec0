"""Replies split into reasoning, answer and tool calls (worker/replies.py), as pure logic: every format,
failures kept as text with the flag, and the same split whatever pieces the text arrives in (a stream's
deltas add up to the result)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.replies import TOOL_CALL_FORMATS, ReplyFormat, ReplyParser, tool_call_format

THINK = ("<think>", "</think>")
NAMES = frozenset({"get_weather", "add"})
HERMES = ReplyFormat(think=THINK, tools=TOOL_CALL_FORMATS["hermes"], tool_names=NAMES)
LLAMA = ReplyFormat(tools=TOOL_CALL_FORMATS["llama3_json"], tool_names=NAMES)
MISTRAL = ReplyFormat(tools=TOOL_CALL_FORMATS["mistral"], tool_names=NAMES)


def whole(reply: ReplyFormat, text: str) -> ReplyParser:
    return ReplyParser(reply, lambda k: f"call_{k}").parse(text)


def in_pieces(reply: ReplyFormat, text: str, cuts: list[int]) -> tuple[str, str, list, ReplyParser]:
    """Feed `text` cut at `cuts`; what the deltas add up to, and the parser."""
    parser = ReplyParser(reply, lambda k: f"call_{k}")
    answer = reasoning = ""
    calls: list = []
    bounds = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    for delta in deltas:
        answer, reasoning, calls = answer + delta.answer, reasoning + delta.reasoning, calls + delta.calls
    return answer, reasoning, calls, parser


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLIES = [
    (HERMES, f"<think>\nLet me look.\n</think>\n\nChecking.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"),
    (HERMES, "No tools needed < here <tool but no call"),
    (HERMES, "<think>cut off while reasoning"),
    (HERMES, 'Before <tool_call>{"name": "get_weather", "arguments": {broken</tool_call> after'),
    (HERMES, '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>'),
    (HERMES, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'),  # unclosed at the reply's end
    (LLAMA, '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "X"}}'),
    (LLAMA, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'),
    (LLAMA, 'A plain answer {"name": "add"}'),
    (LLAMA, '{"not": "a call"}'),
    (MISTRAL, 'Sure [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]'),
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": '),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(REPLIES))), st.lists(st.integers(0, 400), max_size=12))
def test_any_pieces_give_the_whole_replys_split(case: int, cuts: list[int]) -> None:
    reply, text = REPLIES[case]
    expected = whole(reply, text)
    answer, reasoning, calls, parser = in_pieces(reply, text, cuts)
    assert (answer, reasoning, calls) == (expected.answer, expected.reasoning, expected.calls)
    assert (parser.answer, parser.reasoning, parser.calls, parser.error) == \
        (expected.answer, expected.reasoning, expected.calls, expected.error)


def test_hermes_reasoning_answer_and_calls() -> None:
    parsed = whole(*REPLIES[0])
    assert parsed.reasoning == "Let me look." and parsed.answer == "Checking." and parsed.error is None
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("call_0", "get_weather", {"city": "Paris"}), ("call_1", "get_weather", {"city": "Rome"})]
    assert whole(HERMES, "<think>cut off while reasoning").reasoning == "cut off while reasoning"
    unclosed = whole(*REPLIES[5])
    assert [c.function.name for c in unclosed.calls] == ["add"] and unclosed.answer == ""


def test_a_call_that_does_not_parse_stays_text_with_the_flag() -> None:
    broken = whole(*REPLIES[3])
    assert broken.calls == [] and broken.answer == REPLIES[3][1] and "JSONDecodeError" in (broken.error or "")
    unknown = whole(*REPLIES[4])
    assert unknown.calls == [] and unknown.answer == REPLIES[4][1] and "unknown_fn" in (unknown.error or "")
    plain = whole(*REPLIES[1])
    assert plain.answer == REPLIES[1][1] and plain.error is None


def test_llama3_and_mistral() -> None:
    two = whole(*REPLIES[6])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in two.calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "X"})] and two.answer == ""
    assert [c.function.name for c in whole(*REPLIES[7]).calls] == ["add"]
    assert whole(*REPLIES[8]).answer == REPLIES[8][1] and whole(*REPLIES[8]).error is None
    assert whole(*REPLIES[9]).error is not None and whole(*REPLIES[9]).answer == REPLIES[9][1]
    mistral = whole(*REPLIES[10])
    assert mistral.answer == "Sure" and [json.loads(c.function.arguments) for c in mistral.calls] == [{"a": 1}, {"a": 2}]
    assert whole(*REPLIES[11]).error is not None


def test_one_call_without_parallel_tool_calls() -> None:
    single = ReplyFormat(tools=TOOL_CALL_FORMATS["hermes"], tool_names=NAMES, parallel_tool_calls=False)
    assert len(whole(single, CALL + CALL).calls) == 1


def test_a_prompt_ending_inside_a_think_block_starts_reasoning() -> None:
    parsed = whole(ReplyFormat(think=THINK, starts_thinking=True), "thinking...\n</think>\n\nThe answer.")
    assert (parsed.reasoning, parsed.answer) == ("thinking...", "The answer.")


def test_formats_by_name() -> None:
    assert tool_call_format("json_tools") is TOOL_CALL_FORMATS["hermes"]  # mlx-lm's name for it
    qwen3_coder = tool_call_format("qwen3_coder")  # one of mlx-lm's own parsers: parsed, not forced
    assert qwen3_coder.start == "<tool_call>" and not qwen3_coder.forceable
    with pytest.raises(ValueError, match="unknown tool-call format"):
        tool_call_format("no_such_format")


def test_a_stream_cut_short_still_adds_up_to_its_result() -> None:
    """A streamed job cancelled while text is held back: its last delta hands that text out."""
    from schemas import GenerationRequest
    from worker.engines.base import TokenEvent
    from worker.output import JobOutput

    def decode(ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    reply = ReplyFormat(think=THINK, tools=TOOL_CALL_FORMATS["hermes"], tool_names=NAMES)
    output = JobOutput("j", GenerationRequest.validate_payload({"prompt": "x", "stream": True}), [1], frozenset({0}),
                       decode=decode, token_text=lambda t: chr(t), model=None, worker=None, enqueued_at=None,
                       started_at=0.0, reply=reply)
    deltas = []
    for ch in "<think>plan</thi":
        output.apply(TokenEvent(uid="j#0", token=ord(ch)), 0.0)
        deltas += output.stream_deltas()
    assert "".join(d.reasoning for d in deltas) == "plan"  # "</thi" is held: it might end the block
    output.end_live("cancelled")
    deltas += output.stream_deltas()
    choice = output.ended("cancelled").result().choices[0]
    assert "".join(d.reasoning for d in deltas) == choice.reasoning_content == "plan</thi"
    assert choice.finish_reason == "cancelled" and choice.text == ""
