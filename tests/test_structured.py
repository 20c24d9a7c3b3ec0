"""Structured output on the tiny random-weight model: constrained rows beside free rows in one batch.

Random weights emit EOS at random; under a constraint EOS may only come where the grammar can end,
so every result that ended with `stop` must be a complete match."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import jsonschema
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.serializers import JSONSerializer

from producer import Client
from schemas import GenerationRequest, GenerationResult, keys
from schemas.constraints import MAX_JSON_SCHEMA_CHARS
from tests.workers import start_worker, stop


@pytest.fixture(scope="module", params=["batch-generator", "compiled", "compiled-first-token-from-the-prefill"])
def engine(tiny_model_dir, request):
    """Both text engines: mlx-lm's BatchGenerator and mlxq's compiled decode path (its first
    tokens sampled by a decode step, the CPU's way, and from the prefill, a GPU's way)."""
    import worker  # noqa: F401
    from mlx_lm import load

    from worker.engines.compiled import CompiledEngine
    from worker.engines.text import TextEngine

    model, tokenizer = load(tiny_model_dir)
    if request.param == "batch-generator":
        return TextEngine(model, tokenizer, max_num_seqs=16)
    return CompiledEngine(model, tokenizer, max_num_seqs=16,
                          first_token_from_prefill=request.param == "compiled-first-token-from-the-prefill")


class _Recording:
    """The engine as the scheduler sees it, keeping each sequence's last TokenEvent."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.last: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[Any]:
        events = self._engine.step()
        for event in events:
            self.last[event.uid] = event
        return events


def run(engine: Any, requests: dict[str, dict], joining: Optional[dict[str, dict]] = None, join_after: int = 3
        ) -> tuple[dict[str, GenerationResult], _Recording]:
    """Run requests through a BatchScheduler over `engine`; `joining` ones are admitted after
    `join_after` steps, while the first ones decode."""
    from worker.scheduler import BatchScheduler

    recording = _Recording(engine)
    scheduler = BatchScheduler(recording, max_num_seqs=16, default_max_tokens=32)  # type: ignore[arg-type]
    results: dict[str, GenerationResult] = {}
    for job_id, payload in requests.items():
        failed = scheduler.admit(job_id, payload)
        if failed is not None:
            results[job_id] = failed
    steps = 0
    while len(scheduler) or joining:
        if joining and steps >= join_after:
            for job_id, payload in joining.items():
                failed = scheduler.admit(job_id, payload)
                if failed is not None:
                    results[job_id] = failed
            joining = None
        for ended in scheduler.step():
            results[ended.id] = ended.result()
        steps += 1
    return results, recording


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


# --- random JSON schemas ------------------------------------------------------------------------

_names = st.sampled_from(["a", "b", "id", "name", "x_1", "tags"])


def _integer() -> st.SearchStrategy[dict]:
    return st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})


def _number() -> st.SearchStrategy[dict]:
    return st.tuples(st.integers(-10, 10), st.integers(1, 20)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})


_leaf = st.one_of(
    _integer(),
    _number(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.sampled_from(["red", "green", "x y"]), st.integers(0, 9)), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)


def _object(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.tuples(children, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
    ),
    max_leaves=5,
).map(lambda schema: schema if schema.get("type") == "object" else
      {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(schemas, st.integers(0, 2**31)), min_size=3, max_size=3))
def test_every_finished_json_result_validates(engine, cases):
    requests = {f"j{i}": {"prompt": "Reply in JSON.", "max_tokens": 48, "temperature": 1.0, "seed": seed,
                          "response_format": json_format(schema)} for i, (schema, seed) in enumerate(cases)}
    results, recording = run(engine, requests)
    for i, (schema, _) in enumerate(cases):
        choice = results[f"j{i}"].choices[0]
        complete = recording.last[f"j{i}#0"].constraint_complete
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), schema)
            assert complete is True
        else:
            assert choice.finish_reason == "length" and len(choice.token_ids) == 48
            assert complete is _parses_and_validates(choice.text, schema)


def _parses_and_validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# --- random regexes -----------------------------------------------------------------------------

_atoms = st.sampled_from(["a", "b", "z", "0", "7", "-", "_", "[a-c]", "[0-9]", "[xyz]", "(ab|c)", "(0|12)"])
_quantifiers = st.sampled_from(["", "", "?", "+", "{2}", "{1,3}", "{0,2}"])
regexes = st.lists(st.tuples(_atoms, _quantifiers).map("".join), min_size=1, max_size=5).map("".join)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(regexes, st.integers(0, 2**31)), min_size=3, max_size=3))
def test_every_finished_regex_result_matches(engine, cases):
    requests = {f"r{i}": {"prompt": "code:", "max_tokens": 24, "temperature": 1.0, "seed": seed,
                          "guided_regex": regex} for i, (regex, seed) in enumerate(cases)}
    results, recording = run(engine, requests)
    for i, (regex, _) in enumerate(cases):
        choice = results[f"r{i}"].choices[0]
        complete = recording.last[f"r{i}#0"].constraint_complete
        if choice.finish_reason == "stop":
            assert re.fullmatch(regex, choice.text), (regex, choice.text)
            assert complete is True
        else:
            assert complete is bool(re.fullmatch(regex, choice.text)), (regex, choice.text)


def test_lark_grammar_and_json_object(engine):
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"'
    requests = {f"g{seed}": {"prompt": "list:", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                             "guided_grammar": grammar} for seed in range(4)}
    requests.update({f"o{seed}": {"prompt": "obj:", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                                  "response_format": {"type": "json_object"}} for seed in range(4)})
    results, _ = run(engine, requests)
    finished = [r.choices[0] for r in results.values() if r.choices[0].finish_reason == "stop"]
    assert finished, "no constrained request finished within max_tokens"
    for job_id, result in results.items():
        text = result.choices[0].text
        if result.choices[0].finish_reason != "stop":
            continue
        if job_id.startswith("g"):
            assert re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x))*\)", text), text
        else:
            assert isinstance(json.loads(text), dict), text


# --- mixed batches ------------------------------------------------------------------------------

SCHEMA_A = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
SCHEMA_B = {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 4}


def _mixed() -> tuple[dict[str, dict], dict[str, dict]]:
    first = {
        "free-greedy": {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 20, "temperature": 0, "logprobs": True},
        "free-seeded": {"prompt": "tell me", "max_tokens": 20, "temperature": 0.9, "seed": 7, "n": 2},
        "schema-a": {"prompt": "tell me", "max_tokens": 30, "temperature": 0, "logprobs": True,
                     "logprobs_mode": "processed", "response_format": json_format(SCHEMA_A)},
        "regex": {"prompt": "id:", "max_tokens": 12, "temperature": 1.0, "seed": 3, "guided_regex": "[a-f0-9]{4,8}"},
    }
    joining = {
        "free-late": {"prompt_token_ids": [9, 10, 11], "max_tokens": 16, "temperature": 0},
        "schema-b": {"prompt": "colours", "max_tokens": 30, "temperature": 1.0, "seed": 11, "n": 2,
                     "response_format": json_format(SCHEMA_B)},
        "schema-a-late": {"prompt": "again", "max_tokens": 30, "temperature": 0.7, "seed": 5, "stop": "}",
                          "response_format": json_format(SCHEMA_A)},
        # Other processors before the mask (the compiled engine masks its constrained rows together).
        "regex-penalised": {"prompt": "id:", "max_tokens": 10, "temperature": 0, "repetition_penalty": 1.3,
                            "logit_bias": {"40": 3.0}, "guided_regex": "[a-f0-9]{4,8}"},
    }
    return first, joining


def test_mixed_batch_rows_equal_the_same_requests_run_alone(engine):
    first, joining = _mixed()
    alone = {job_id: run(engine, {job_id: payload})[0][job_id] for job_id, payload in {**first, **joining}.items()}
    batched, _ = run(engine, first, joining, join_after=3)
    for job_id, result in alone.items():
        assert result.status == "finished", result.error
        for a, b in zip(result.choices, batched[job_id].choices, strict=True):
            assert a.token_ids == b.token_ids, job_id
            assert a.finish_reason == b.finish_reason, job_id
            if a.logprobs is not None:
                assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), job_id
    # The constraints held in the batch, each on its own rows.
    for choice in batched["schema-b"].choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), SCHEMA_B)
    late = batched["schema-a-late"].choices[0]
    assert "}" not in late.text  # the stop string still cuts constrained text


def test_processed_logprobs_are_after_the_mask(engine):
    regex = "[ab]+"
    results, _ = run(engine, {"p": {"prompt": "x", "max_tokens": 6, "temperature": 0, "guided_regex": regex,
                                    "top_logprobs": 5, "logprobs_mode": "processed"},
                              "r": {"prompt": "x", "max_tokens": 6, "temperature": 0, "guided_regex": regex,
                                    "top_logprobs": 5, "logprobs_mode": "raw"}})
    processed, raw = results["p"].choices[0], results["r"].choices[0]
    assert processed.token_ids == raw.token_ids
    tokens = {top.token_id for step in processed.top_logprobs[:-1] for top in step if top.logprob is not None}
    allowed = {tok for tok in tokens if tok in engine.eos_token_ids or set(engine.token_text(tok)) <= {"a", "b"}}
    assert tokens == allowed  # only what the grammar allowed (EOS once it may end) has probability
    assert any(engine.token_text(tok) for tok in tokens)
    assert all(p >= r - 1e-5 for p, r in zip(processed.logprobs, raw.logprobs))


def test_max_tokens_ends_length_and_incomplete(engine):
    results, recording = run(engine, {"long": {"prompt": "x", "max_tokens": 3, "temperature": 0,
                                               "guided_regex": "q{10}"}})
    choice = results["long"].choices[0]
    assert choice.finish_reason == "length" and choice.text == "qqq"
    assert recording.last["long#0"].constraint_complete is False


@pytest.mark.parametrize("payload, field", [
    ({"response_format": json_format({"type": "frob"})}, "response_format.json_schema.schema"),
    ({"response_format": json_format({"allOf": [{"type": "string"}, {"type": "integer"}]})},
     "response_format.json_schema.schema"),
    ({"response_format": json_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
])
def test_uncompilable_constraints_fail_before_decoding(engine, payload, field):
    results, recording = run(engine, {"bad": {"prompt": "x", **payload}, "good": {"prompt": "x", "max_tokens": 5}})
    assert results["bad"].status == "failed" and results["bad"].choices == []
    assert results["bad"].error.message.startswith(f"{field}:"), results["bad"].error.message
    assert "bad#0" not in recording.last
    assert results["good"].status == "finished"


def test_compiled_constraints_are_cached_per_worker(engine):
    request = GenerationRequest.validate_payload({"prompt": "x", "response_format": json_format(SCHEMA_A)})
    assert engine.prepare(request).inputs is engine.prepare(request).inputs


# --- a real worker process ----------------------------------------------------------------------

RECURSIVE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "next": {"$ref": "#/$defs/node"}}, "required": ["v"],
    "additionalProperties": False}}}
# No finite document matches: refused when validated (schemas/constraint_checks.py).
ENDLESS = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}
# Passes validation and compiles, but llguidance's parser runs out of its item limit on the first
# token (the required property goes through patternProperties): the sequence fails alone.
FAILS_MIDWAY = {"type": "object", "patternProperties": {"^x$": {"$ref": "#"}}, "required": ["x"],
                "additionalProperties": False}


@pytest.mark.slow
def test_bad_huge_and_recursive_schemas_fail_alone_and_the_worker_lives(redis_url, tiny_model_dir):
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    client = Client(redis_url)
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(MAX_JSON_SCHEMA_CHARS // 100)}}
    raw = {  # enqueued past the producer's own validation: the worker must refuse them itself
        "huge": ({"prompt": "x", "response_format": json_format(huge)}, "MAX_JSON_SCHEMA_CHARS"),
        "two": ({"prompt": "x", "guided_regex": "a", "guided_grammar": "start: \"a\""}, "at most one constraint"),
        "endless": ({"prompt": "x", "response_format": json_format(ENDLESS)},
                    "response_format.json_schema.schema: has no finite document"),
    }
    compiled_bad = {
        "unsatisfiable": ({"prompt": "x", "response_format": json_format({"allOf": [{"type": "string"},
                                                                                    {"type": "null"}]})},
                          "response_format.json_schema.schema"),
        "regex": ({"prompt": "x", "guided_regex": "(("}, "guided_regex"),
    }
    free = {"prompt_token_ids": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    proc = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "8", name="structured")
    try:
        ids = {name: queue.enqueue(keys.JOB_FUNCTION, request=payload).id for name, (payload, _) in raw.items()}
        ids.update({name: client.submit(payload) for name, (payload, _) in compiled_bad.items()})
        ids["recursive"] = client.submit({"prompt": "tree", "max_tokens": 40, "temperature": 1.0, "seed": 1,
                                          "response_format": json_format(RECURSIVE)})
        ids["midway"] = client.submit({"prompt": "tree", "max_tokens": 20, "temperature": 0,
                                       "response_format": json_format(FAILS_MIDWAY)})
        ids["free"] = client.submit(free)
        results = client.wait_many(list(ids.values()), timeout=300)
        assert proc.poll() is None, "the worker died"
        late = client.wait(client.submit(free), timeout=120)
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    for name, (_, needle) in {**raw, **compiled_bad}.items():
        result = results[ids[name]]
        assert result.status == "failed" and result.choices == [], name
        assert needle in result.error.message, (name, result.error.message)
    recursive = results[ids["recursive"]].choices[0]
    if recursive.finish_reason == "stop":
        jsonschema.validate(json.loads(recursive.text), RECURSIVE)
    midway = results[ids["midway"]]
    assert midway.status == "failed" and midway.choices[0].finish_reason == "error"
    assert "response_format.json_schema.schema: the constraint failed" in midway.error.message
    assert results[ids["free"]].choices[0].token_ids == late.choices[0].token_ids


def test_results_say_whether_a_constrained_text_is_complete(engine):
    requests = {
        "whole": {"prompt": "pick", "guided_regex": "[ab]", "max_tokens": 8, "temperature": 0},
        "cut": {"prompt": "count", "guided_regex": "[0-9]{40}", "max_tokens": 3, "temperature": 0},
        "stopped": {"prompt": "count", "guided_regex": "1[0-9]{30}", "stop": "1", "max_tokens": 8, "temperature": 0},
        "free": {"prompt": "free", "max_tokens": 3, "temperature": 0},
    }
    results, _ = run(engine, requests)
    whole, cut, stopped = (results[name].choices[0] for name in ("whole", "cut", "stopped"))
    assert whole.finish_reason == "stop" and whole.constraint_complete is True and re.fullmatch("[ab]", whole.text)
    assert cut.finish_reason == "length" and cut.constraint_complete is False
    assert stopped.finish_reason == "stop" and stopped.constraint_complete is False  # the stop string cut it
    assert results["free"].choices[0].constraint_complete is None


@pytest.mark.slow
def test_the_gateway_passes_constraints_through_to_the_openai_client(redis_url, tiny_model_dir):
    import openai

    from tests.gateway import running_gateway, wait_live

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    worker = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="gw-structured")
    try:
        wait_live(redis.Redis.from_url(redis_url), "gw-structured")
        with running_gateway(redis_url, insecure=True) as base:
            client = openai.OpenAI(base_url=base, api_key="unused")
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
            regex = client.completions.create(model="tiny", prompt="code:", max_tokens=20, temperature=0,
                                              extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    finally:
        stop(worker)
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:  # it ran out of tokens: still a prefix of a valid answer
        assert choice.message.content.startswith("{")
    # six characters, then only EOS is allowed: it must end there
    assert regex.choices[0].finish_reason == "stop" and re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)


def test_a_constrained_row_keeps_its_other_processors(engine):
    """logit_bias runs before the mask: among the letters the grammar allows, the biased one wins."""
    letters = {engine.token_text(tok): tok for tok in range(engine.vocab_size) if engine.token_text(tok) in ("a", "b")}
    assert set(letters) == {"a", "b"}
    for wanted in ("a", "b"):
        payload = {"prompt": "x", "max_tokens": 6, "temperature": 0, "guided_regex": "[ab]{6}",
                   "logit_bias": {str(letters[wanted]): 50.0}, "repetition_penalty": 1.1}
        results, _ = run(engine, {"row": payload, "free": {"prompt": "y", "max_tokens": 4, "temperature": 0}})
        assert results["row"].choices[0].text == wanted * 6


def test_masks_are_computed_on_their_own_thread_while_the_forward_pass_is_handed_over(engine, monkeypatch):
    """`MaskBatch.fill` hands the step's logits to the device on the calling thread while the
    matchers advance on the batch's thread; the results are those of the batch run before."""
    import threading

    import mlx.core as mx

    from worker.engines import constraints

    requests = {f"r{i}": {"prompt": "digits:", "max_tokens": 8, "temperature": 1.0, "seed": 5 + i,
                          "guided_regex": "[0-9]{2,8}"} for i in range(3)}
    requests["free"] = {"prompt": "y", "max_tokens": 8, "temperature": 0}
    before, _ = run(engine, requests)
    advanced_on: set[str] = set()
    handed_over_in_fill: list[str] = []
    filling = threading.local()
    advance, async_eval, fill = constraints.RowConstraint.advance, mx.async_eval, constraints.MaskBatch.fill

    def recording_advance(self: Any, tokens: list[int]) -> None:
        advanced_on.add(threading.current_thread().name)
        advance(self, tokens)

    def recording_async_eval(*arrays: Any) -> None:
        if getattr(filling, "active", False):
            handed_over_in_fill.append(threading.current_thread().name)
        async_eval(*arrays)

    def recording_fill(self: Any) -> None:
        filling.active = True
        try:
            fill(self)
        finally:
            filling.active = False

    monkeypatch.setattr(constraints.RowConstraint, "advance", recording_advance)
    monkeypatch.setattr(constraints.mx, "async_eval", recording_async_eval)
    monkeypatch.setattr(constraints.MaskBatch, "fill", recording_fill)
    after, _ = run(engine, requests)
    assert advanced_on and all(name.startswith("mlxq-masks") for name in advanced_on)
    assert handed_over_in_fill and set(handed_over_in_fill) == {threading.current_thread().name}
    for job_id in requests:
        assert after[job_id].choices[0].token_ids == before[job_id].choices[0].token_ids


def test_constraints_still_hold_after_an_engine_reset(engine):
    """The loop resets the engine after a failed step; constrained rows sampled afterwards are
    masked exactly as before (the same seeded request gives the same matching text)."""
    requests = {f"d{i}": {"prompt": "digits:", "max_tokens": 12, "temperature": 1.0, "seed": 11 + i,
                          "guided_regex": "[0-9]{3,8}"} for i in range(3)}
    before, _ = run(engine, requests)
    engine.reset()
    after, _ = run(engine, requests)
    for job_id in requests:
        assert re.fullmatch("[0-9]{0,8}", after[job_id].choices[0].text), after[job_id].choices[0].text
        assert after[job_id].choices[0].token_ids == before[job_id].choices[0].token_ids
