"""Tool calls and reasoning on both text engines (mlx-lm's BatchGenerator and mlxq's compiled one), through
the scheduler, on tiny random-weight models: one whose chat template (written in tests/agent_models.py)
takes tools and thinks, with its tags as special tokens, and the plain ChatML one, which takes no tools
(they reach it in the system message). Random weights say anything: forced calls must still parse
against their schemas; the text a parse is checked on is forced by a grammar."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from schemas import GenerationRequest, GenerationResult
from tests.agent_models import make_thinking_tool_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import worker  # noqa: F401  (points MLX at OpenBLAS before it loads)

    return str(make_thinking_tool_model(tmp_path_factory.mktemp("models") / "think"))


def _engine(kind: str, path: str, **options: Any) -> Any:
    import worker  # noqa: F401
    from mlx_lm import load

    from worker.engines.compiled import CompiledEngine
    from worker.engines.text import TextEngine

    model, tokenizer = load(path)
    if kind == "batch-generator":
        return TextEngine(model, tokenizer, max_num_seqs=16, **options)
    return CompiledEngine(model, tokenizer, max_num_seqs=16, **options)


@pytest.fixture(scope="module", params=["batch-generator", "compiled"])
def engine(think_model_dir: str, request: pytest.FixtureRequest) -> Any:
    return _engine(request.param, think_model_dir)


@pytest.fixture(scope="module", params=["batch-generator", "compiled"])
def chatml_engine(tiny_model_dir: str, request: pytest.FixtureRequest) -> Any:
    """The tiny model whose ChatML template takes no tools."""
    return _engine(request.param, tiny_model_dir)


def run(engine: Any, requests: dict[str, dict[str, Any]], *, stream: bool = False
        ) -> tuple[dict[str, GenerationResult], list[Any]]:
    """Every request through one BatchScheduler, together; results, and the stream deltas."""
    from worker.scheduler import BatchScheduler

    scheduler = BatchScheduler(engine, max_num_seqs=16, default_max_tokens=64)
    results: dict[str, GenerationResult] = {}
    for job_id, payload in requests.items():
        failed = scheduler.admit(job_id, {**payload, **({"stream": True} if stream else {})})
        if failed is not None:
            results[job_id] = failed
    deltas = []
    while len(scheduler):
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        deltas += scheduler.take_stream_deltas()
    return results, deltas


def check_calls(result: GenerationResult, engine: Any, allowed: set[str], at_most: int = 99) -> None:
    """A forced call: finished with its calls, each to an allowed function with arguments that validate;
    the markup is in the token ids, not in the text."""
    assert result.status == "finished", result.error
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, engine.decode(choice.token_ids))
    assert choice.tool_calls and len(choice.tool_calls) <= at_most and choice.tool_call_error is None
    for call in choice.tool_calls:
        assert call.function.name in allowed and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.function.name in engine.decode(choice.token_ids)
    assert choice.text == ""


def test_forced_calls_parse_against_their_schemas(engine: Any) -> None:
    """tool_choice required and named, on sampled (temperature 1) random-weight output: every reply is
    a call that validates, in the template's format (special-token tags)."""
    requests = {}
    for seed in range(3):
        requests[f"required-{seed}"] = {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                        "parallel_tool_calls": False, "seed": seed, "max_tokens": 128}
        requests[f"named-{seed}"] = {"messages": ASK, "tools": TOOLS, "seed": seed, "max_tokens": 128,
                                     "tool_choice": {"type": "function", "function": {"name": "add"}}}
    results, _ = run(engine, requests)
    for seed in range(3):
        check_calls(results[f"required-{seed}"], engine, {"get_weather", "add"}, at_most=1)
        check_calls(results[f"named-{seed}"], engine, {"add"}, at_most=1)


@pytest.mark.parametrize("call_format", ["hermes", "llama3_json", "mistral"])
def test_forced_calls_in_each_format_on_a_template_without_tools(chatml_engine: Any, call_format: str) -> None:
    """A template that takes no tools gets them described in the system message; each format's call
    (plain-text markers here) is forced and parsed back."""
    requests = {f"{call_format}-{seed}": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": seed,
                                          "max_tokens": 160, "tool_call_format": call_format,
                                          "parallel_tool_calls": False}
                for seed in range(2)}
    results, _ = run(chatml_engine, requests)
    for result in results.values():
        check_calls(result, chatml_engine, {"get_weather", "add"}, at_most=1)
    prompt = chatml_engine.decode(chatml_engine.prepare(GenerationRequest.validate_payload(
        {"messages": ASK, "tools": TOOLS, "tool_call_format": call_format})).token_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt


def _special(engine: Any, token: str) -> str:
    return f"<[{engine.tokenizer.convert_tokens_to_ids(token)}]>"


def test_auto_parses_a_call_and_keeps_one_that_does_not_parse_as_text(engine: Any) -> None:
    """With tool_choice auto the reply is read for calls (its text forced here by a grammar)."""
    open_, close = _special(engine, "<tool_call>"), _special(engine, "</tool_call>")
    good = f'start: "On it." {open_} "\\n{{\\"name\\": \\"add\\", \\"arguments\\": {{\\"a\\": 2, \\"b\\": 3}}}}\\n" {close}'
    bad = f'start: "On it." {open_} "{{\\"name\\": \\"add\\", \\"arguments\\": {{oops" {close}'
    results, _ = run(engine, {
        "good": {"messages": ASK, "tools": TOOLS, "guided_grammar": good, "max_tokens": 64},
        "bad": {"messages": ASK, "tools": TOOLS, "guided_grammar": bad, "max_tokens": 64},
        "none": {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "guided_grammar": good, "max_tokens": 64}})
    choice = results["good"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.text == "On it."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.tool_calls or []] == [("add", {"a": 2, "b": 3})]
    broken = results["bad"].choices[0]
    assert broken.finish_reason == "stop" and broken.tool_calls is None
    assert broken.text == 'On it.<tool_call>{"name": "add", "arguments": {oops</tool_call>'
    assert "JSONDecodeError" in (broken.tool_call_error or "")
    untouched = results["none"].choices[0]  # tool_choice none: nothing is parsed
    assert untouched.tool_calls is None and untouched.text == engine.decode(untouched.token_ids[:-1])


def test_reasoning_is_split_from_the_answer(engine: Any) -> None:
    think, end = _special(engine, "<think>"), _special(engine, "</think>")
    results, _ = run(engine, {
        "thinks": {"messages": ASK, "guided_grammar": f'start: {think} "\\nPlan it.\\n" {end} "\\n\\nSunny."',
                   "max_tokens": 32},
        # the prompt leaves a think block open (a template variable only chat_template_kwargs set)
        "open": {"messages": ASK, "chat_template_kwargs": {"open_think": True}, "max_tokens": 32,
                 "guided_grammar": f'start: "Plan it." {end} "Sunny."'},
        # enable_thinking false: the prompt holds an empty think block, the reply is all answer
        "off": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 32,
                "guided_grammar": 'start: "Sunny."'},
        # no template, no split: a raw prompt's text is the text
        "raw": {"prompt": "x", "guided_grammar": f'start: {think} "a" {end} "b"', "max_tokens": 32}})
    for name in ("thinks", "open"):
        choice = results[name].choices[0]
        assert (choice.reasoning_content, choice.text, choice.finish_reason) == ("Plan it.", "Sunny.", "stop"), name
    off = results["off"].choices[0]
    assert (off.reasoning_content, off.text) == (None, "Sunny.")
    assert results["raw"].choices[0].text == "<think>a</think>b"  # nothing lost from the token ids
    thinks = results["thinks"].choices[0]
    assert engine.decode(thinks.token_ids[:-1]) == "<think>\nPlan it.\n</think>\n\nSunny."


def test_streamed_deltas_add_up_to_the_result(engine: Any) -> None:
    think, end = _special(engine, "<think>"), _special(engine, "</think>")
    open_, close = _special(engine, "<tool_call>"), _special(engine, "</tool_call>")
    call = f'{open_} "\\n{{\\"name\\": \\"add\\", \\"arguments\\": {{\\"a\\": 1, \\"b\\": 2}}}}\\n" {close}'
    requests = {
        "auto": {"messages": ASK, "tools": TOOLS, "max_tokens": 160,
                 "guided_grammar": f'start: {think} "hmm" {end} "Adding." {call} "\\n" {call}'},
        "forced": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "seed": 4, "max_tokens": 128},
    }
    results, deltas = run(engine, requests, stream=True)
    for job_id, result in results.items():
        mine = [d for d in deltas if d.job_id == job_id]
        choice = result.choices[0]
        assert "".join(d.text for d in mine) == choice.text
        assert "".join(d.reasoning for d in mine) == (choice.reasoning_content or "")
        assert [c for d in mine for c in d.tool_calls] == (choice.tool_calls or [])
        assert [t for d in mine for t in d.token_ids] == choice.token_ids
    auto = results["auto"].choices[0]
    assert (auto.reasoning_content, auto.text, len(auto.tool_calls or [])) == ("hmm", "Adding.", 2)
    assert auto.tool_calls[0].id != auto.tool_calls[1].id  # type: ignore[index]


def test_requests_the_worker_cannot_serve_fail_naming_the_field(engine: Any) -> None:
    uncompilable = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
    results, _ = run(engine, {
        "schema": {"messages": ASK, "tools": [uncompilable], "tool_choice": "required"},
        "format": {"messages": ASK, "tools": TOOLS, "tool_call_format": "no_such_format"},
        "unforceable": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "tool_call_format": "qwen3_coder"},
        "template": {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}}})
    assert all(r.status == "failed" and r.error is not None for r in results.values())
    assert "tool_choice:" in results["schema"].error.message  # type: ignore[union-attr]
    assert "tool_call_format:" in results["format"].error.message  # type: ignore[union-attr]
    assert "tool_choice:" in results["unforceable"].error.message  # type: ignore[union-attr]
    assert "chat_template_kwargs:" in results["template"].error.message  # type: ignore[union-attr]


def test_history_with_calls_and_answers_reaches_the_template(engine: Any, chatml_engine: Any) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    request = GenerationRequest.validate_payload({"messages": history, "tools": TOOLS})
    for model in (engine, chatml_engine):  # the template's own rendering, and the fallback's
        prompt = model.decode(model.prepare(request).token_ids)
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
        assert "<tool_response>\n21 degrees\n</tool_response>" in prompt
