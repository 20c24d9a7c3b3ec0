"""Agents through the gateway, with the official clients (`openai`, `anthropic`), against a real worker
process serving the tiny thinking tool model (tests/agent_models.py): tool calls blocking and streamed,
tool_choice required and named, a multi-turn tool loop, reasoning, calls that do not parse, prompt
logprobs (`echo`), errors in each API's shape, and the result in Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
import redis

from mlxq.redis_server import RedisServer
from schemas import GenerationResult, keys
from tests.agent_models import make_thinking_tool_model
from tests.gateway import key_entry, running_gateway, wait_live
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow  # a worker process and the gateway

KEY = "sk-agents-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@dataclass
class Stack:
    base: str  # .../v1
    conn: redis.Redis
    model_dir: str

    @property
    def root(self) -> str:
        return self.base.removesuffix("/v1")

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=KEY, max_retries=0, timeout=120)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.root, api_key=KEY, max_retries=0, timeout=120)

    def result(self, job_id: str) -> GenerationResult:
        raw = self.conn.get(keys.result_key(job_id))
        assert raw is not None
        return GenerationResult.model_validate_json(raw)

    def decode(self, token_ids: list[int]) -> str:
        from transformers import AutoTokenizer

        return str(AutoTokenizer.from_pretrained(self.model_dir).decode(token_ids))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import worker  # noqa: F401

    model_dir = str(make_thinking_tool_model(tmp_path_factory.mktemp("models") / "think"))
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        proc = start_worker(server.url, model_dir, "--alias", "think", "--max-num-seqs", "8", name="agents")
        try:
            wait_live(conn, "agents", timeout=180)
            with running_gateway(server.url, api_keys=key_entry("acme", KEY)) as base:
                yield Stack(base, conn, model_dir)
        finally:
            print(stop(proc)[-3000:])
            conn.close()


def _special(stack: Stack, token: str) -> str:
    from transformers import AutoTokenizer

    return f"<[{AutoTokenizer.from_pretrained(stack.model_dir).convert_tokens_to_ids(token)}]>"


def _validates(name: str, arguments: str | dict) -> None:
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


# ---------------------------------------------------------------- the openai SDK


def test_openai_tool_choice_required_and_named(stack: Stack) -> None:
    client = stack.openai()
    required = client.chat.completions.with_raw_response.create(
        model="think", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=128,
        seed=1)
    choice = required.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    _validates(call.function.name, call.function.arguments)
    stored = stack.result(required.headers["x-mlxq-job-id"]).choices[0]  # the result in Redis: parsed, all tokens
    assert [c.model_dump() for c in stored.tool_calls or []] == [call.model_dump()]
    assert call.function.name in stack.decode(stored.token_ids)
    named = client.chat.completions.create(model="think", messages=ASK, tools=TOOLS, max_tokens=128, seed=2,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    _validates("add", call.function.arguments)


def test_openai_streamed_tool_calls_add_up_to_the_blocking_answer(stack: Stack) -> None:
    client = stack.openai()
    ask = dict(model="think", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, seed=5,
               parallel_tool_calls=False)
    blocking = client.chat.completions.create(**ask).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                into = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                into["id"] = delta.id or into["id"]
                into["name"] += (delta.function.name or "") if delta.function else ""
                into["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == blocking.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in blocking.message.tool_calls or []]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # the SDK's own stream helper accumulates the same
    with client.chat.completions.stream(**ask) as helper:
        final = helper.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in blocking.message.tool_calls or []]


def test_openai_multi_turn_tool_loop(stack: Stack) -> None:
    """Call, answer the call, ask on: the SDK's own message object goes back as history."""
    client = stack.openai()
    messages: list[Any] = list(ASK)
    for turn in range(2):
        reply = client.chat.completions.create(model="think", messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=128, seed=turn)
        message = reply.choices[0].message
        messages.append(message)
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}"})
    final = client.chat.completions.create(model="think", messages=messages, tools=TOOLS, max_tokens=8, seed=9,
                                           extra_body={"return_token_ids": True})
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = stack.decode(final.model_extra["prompt_token_ids"])  # type: ignore[index]
    assert "<tool_response>\nresult 0\n</tool_response>" in prompt and "<tool_response>\nresult 1\n</tool_response>" in prompt
    assert prompt.count("<tool_call>\n{\"name\": ") == 2  # each earlier call, as the template writes it


def test_openai_reasoning_and_a_call_that_does_not_parse(stack: Stack) -> None:
    client = stack.openai()
    think, end = _special(stack, "<think>"), _special(stack, "</think>")
    open_, close = _special(stack, "<tool_call>"), _special(stack, "</tool_call>")
    grammar = f'start: {think} "Two and three." {end} "It is 5." {open_} "{{broken" {close}'
    ask = dict(model="think", messages=ASK, tools=TOOLS, max_tokens=64, extra_body={"guided_grammar": grammar})
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Two and three."  # type: ignore[index]
    assert choice.message.content == "It is 5.<tool_call>{broken</tool_call>" and choice.finish_reason == "stop"
    assert choice.message.tool_calls is None and "JSONDecodeError" in choice.model_extra["tool_call_error"]  # type: ignore[index]
    reasoning = content = ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        for delta in (c.delta for c in chunk.choices):
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == ("Two and three.", choice.message.content)


def test_openai_errors_keep_openais_shape(stack: Stack) -> None:
    client = stack.openai()
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
        (dict(tools=TOOLS, extra_body={"tool_call_format": "nope"}), "tool_call_format"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
              tool_choice="required"), "tool_choice"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="think", messages=ASK, max_tokens=4, **extra)
        assert info.value.status_code == 400 and info.value.body["param"] == param, (extra, info.value.body)
        assert info.value.body["type"] == "invalid_request_error"


def test_openai_completions_echo_prompt_logprobs(stack: Stack) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(stack.model_dir)
    client = stack.openai()
    ids = tokenizer.encode("The quick brown fox jumps")
    scored = client.completions.create(model="think", prompt=ids, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    rows = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None  # type: ignore[union-attr]
    assert max(abs(choice.logprobs.token_logprobs[i] - rows[i - 1][ids[i]]) for i in range(1, len(ids))) < 1e-3  # type: ignore
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs[1:])  # type: ignore[union-attr]
    assert choice.text == "".join(choice.logprobs.tokens) and scored.usage.completion_tokens == 0  # type: ignore
    text = client.completions.create(model="think", prompt="Hello there", echo=True, logprobs=1, max_tokens=1,
                                     temperature=0)
    got = text.choices[0]
    assert got.text.startswith("Hello there") and len(got.logprobs.tokens) == len(tokenizer.encode("Hello there")) + 1  # type: ignore
    several = client.completions.create(model="think", prompt=[ids, ids[:3]], echo=True, logprobs=0, max_tokens=0)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].logprobs.token_logprobs[1:] == pytest.approx(  # type: ignore[union-attr]
        choice.logprobs.token_logprobs[1:], abs=1e-4)  # (scored in one padded batch here: float sums differ)
    assert len(several.choices[1].logprobs.tokens) == 3  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="think", prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


# ---------------------------------------------------------------- the anthropic SDK

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_anthropic_tool_use_blocking_streamed_and_a_loop(stack: Stack) -> None:
    client = stack.anthropic()
    ask = dict(model="think", max_tokens=128, messages=ASK, tools=ANTHROPIC_TOOLS,
               tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"seed": 3})
    message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use" and message.role == "assistant" and message.usage.input_tokens > 0
    (use,) = [b for b in message.content if b.type == "tool_use"]
    _validates(use.name, use.input)
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in message.content]
    assert streamed.stop_reason == "tool_use"
    named = client.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    follow = client.messages.create(model="think", max_tokens=8, tools=ANTHROPIC_TOOLS, messages=[
        *ASK, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_anthropic_text_thinking_and_stop_sequences(stack: Stack) -> None:
    client = stack.anthropic()
    think, end = _special(stack, "<think>"), _special(stack, "</think>")
    grammar = f'start: {think} "Adding." {end} "It is 5. Done."'
    message = client.messages.create(model="think", max_tokens=64, system="Be brief.", messages=ASK,
                                     extra_body={"guided_grammar": grammar})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "Adding."), ("text", "It is 5. Done.")]
    assert message.stop_reason == "end_turn"
    stopped = client.messages.create(model="think", max_tokens=64, messages=ASK, stop_sequences=["Done"],
                                     extra_body={"guided_grammar": grammar})
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Done"
    assert stopped.content[-1].text == "It is 5. "  # type: ignore[union-attr]
    events = []
    with client.messages.stream(model="think", max_tokens=64, messages=ASK, extra_body={"guided_grammar": grammar}) as s:
        for event in s:
            events.append(event.type)
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "Adding."), ("text", "It is 5. Done.")]
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events


def test_anthropic_errors_in_anthropics_shape(stack: Stack) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        stack.anthropic().messages.create(model="think", max_tokens=8, messages=ASK,
                                          tool_choice={"type": "tool", "name": "nope"}, tools=ANTHROPIC_TOOLS)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "tool_choice" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=stack.root, api_key="wrong", max_retries=0).messages.create(
            model="think", max_tokens=8, messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"


def test_anthropic_structured_output(stack: Stack) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    message = stack.anthropic().messages.create(model="think", max_tokens=32, messages=ASK, extra_body={"seed": 1},
                                                output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]
