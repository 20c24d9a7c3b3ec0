"""One request's constraint cannot hurt the others in its batch: a constraint with no finite document
or of unbounded size is refused when validated (naming the field), one the library fails on at its
first mask is refused when compiled, one whose matcher fails mid-way fails that row alone while its
neighbours decode exactly as alone, and a constraint not compiled yet is compiled off the loop."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from rq import Queue
from rq.serializers import JSONSerializer

from producer import Client
from producer.errors import InvalidRequest
from schemas import GenerationRequest, InvalidRequestError, keys
from schemas.constraint_checks import (MAX_REGEX_REPEAT_EXPANSION, json_schema_problem, lark_grammar_problem,
                                       regex_repeat_expansion)
from tests.test_structured import engine, json_format, run  # noqa: F401  (the engines' fixture)
from tests.workers import start_worker, stop

# --- finite documents: the analysis against a naive fixed point ---------------------------------

QUANTIFIERS = ["", "", "*", "+", "?", "{2}", "{0,2}", "{1,}", " ~ 2", " ~ 0..3", "[]"]


@st.composite
def items(draw: Any, rules: int, depth: int = 0) -> tuple:
    kind = draw(st.sampled_from(["lit", "ref", "ref", "group"] if depth < 2 else ["lit", "ref"]))
    quantifier = draw(st.sampled_from(QUANTIFIERS))
    if kind == "lit":
        return ("lit", draw(st.sampled_from(['"a"', '/[0-9]+/', '"b"'])), quantifier)
    if kind == "ref":
        return ("ref", draw(st.integers(0, rules - 1)), quantifier)
    return ("group", draw(alternatives(rules, depth + 1)), quantifier)


def alternatives(rules: int, depth: int = 0) -> st.SearchStrategy[list[list[tuple]]]:
    return st.lists(st.lists(items(rules, depth), min_size=0, max_size=3), min_size=1, max_size=3)


def rule_name(index: int) -> str:
    return "start" if index == 0 else f"r{index}"


def render(alts: list[list[tuple]]) -> str:
    def item(node: tuple) -> str:
        kind, value, quantifier = node
        text = value if kind == "lit" else rule_name(value) if kind == "ref" else f"({render(value)})"
        return f"[{text}]" if quantifier == "[]" else text + quantifier
    return " | ".join(" ".join(item(node) for node in seq) or '""' for seq in alts)


def naive_finite(rules: list[list[list[tuple]]]) -> list[bool]:
    finite = [False] * len(rules)

    def alts_finite(alts: list[list[tuple]]) -> bool:
        return any(all(item_finite(node) for node in seq) for seq in alts)

    def item_finite(node: tuple) -> bool:
        kind, value, quantifier = node
        if quantifier in ("*", "?", "{0,2}", " ~ 0..3", "[]"):
            return True
        return True if kind == "lit" else finite[value] if kind == "ref" else alts_finite(value)

    changed = True
    while changed:
        changed = False
        for i, alts in enumerate(rules):
            if not finite[i] and alts_finite(alts):
                finite[i] = changed = True
    return finite


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(alternatives(n), min_size=n, max_size=n)))
def test_a_grammar_is_refused_exactly_when_no_derivation_of_start_ends(rules: list[list[list[tuple]]]) -> None:
    text = "\n".join(f"{rule_name(i)}: {render(alts)}" for i, alts in enumerate(rules))
    problem = lark_grammar_problem(text)
    assert (problem is None) == naive_finite(rules)[0], (text, problem)


@pytest.mark.parametrize("grammar, finite", [
    ('start: "a" start', False),
    ('start: a\na: "x" b\nb: "y" a', False),
    ('start: "a" start | "b"', True),
    ('?start: x\nx[lazy]: "a" x', False),
    ('start: a -> b\na: a "x"', False),
    ('start: x ~ 0..2\nx: x', True),
    ('start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"  // a comment\n# another', True),
    ('start: %json {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}', False),
    ('start: %json {"type": "object", "x": "|)("}', True),
    ('start: TEXT | fun\nTEXT: /[^{](.|\\n)*/\nfun: <|python_tag|> @call', True),
    ('start: A\nA: "a" & /b/', True),  # an intersection of terminals: the library's to judge
    ('%import common.WS\nstart: WS start', True),  # not read: counted as finite
    ('start: ' + '(' * 500 + '"a"' + ')' * 500, True),  # nested too deep to read: counted as finite
])
def test_grammars_the_analysis_reads_and_those_it_leaves_to_the_library(grammar: str, finite: bool) -> None:
    assert (lark_grammar_problem(grammar) is None) == finite, lark_grammar_problem(grammar)


@pytest.mark.parametrize("grammar", [
    'start: /(a{1000}){1000}/',
    'start: %json {"type": "string", "pattern": "^(a{100}){101}$"}',
    'start: \u00e9 /a{20000}/',  # what the reader cannot read does not hide a regex from the count
    'start: A B\nA: /a{6000}/\nB: /b{6000}/',  # counted over the whole grammar
])
def test_a_grammars_regexes_are_counted_written_out(grammar: str) -> None:
    with pytest.raises(InvalidRequestError, match="^invalid request: guided_grammar: its regexes written out"):
        GenerationRequest.validate_payload({"prompt": "x", "guided_grammar": grammar})


RECURSIVE_WITH_BASE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}}}
ENDLESS = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}


@pytest.mark.parametrize("schema, finite", [
    (ENDLESS, False),
    (RECURSIVE_WITH_BASE, True),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": "array", "items": {"$ref": "#"}}, True),  # [] ends it
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, True),
    ({"oneOf": [{"$ref": "#"}]}, False),
    ({"allOf": [{"type": "object"}, ENDLESS["$defs"]["node"]], "$defs": ENDLESS["$defs"]}, False),
    ({"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}}, False),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # no type: any value is one
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}, True),  # not ours to judge
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"], "enum": [{"a": 1}]}, True),
])
def test_a_json_schema_is_refused_when_no_instance_ends(schema: Any, finite: bool) -> None:
    assert (json_schema_problem(schema) is None) == finite


@pytest.mark.parametrize("regex, added", [
    ("a{3}", 2), ("(ab){3}", 4), ("(a|b){3}", 4), ("[a-z]{10}", 9), (r"\p{L}{5}", 4), ("[{]{3}", 2),
    ("(?P<x>ab){2}", 2), ("(?i)a{4}", 3), (r"\d{1,2}-\d{3}", 3), ("a{2}{3}", 5), ("abc", 0), ("a{2,}", 1),
    ("(a{1000}){1000}", MAX_REGEX_REPEAT_EXPANSION + 1), ("a{100000}", MAX_REGEX_REPEAT_EXPANSION + 1),
    ("(" * 2000 + "a" + ")" * 2000 + "{3}", 2),
])
def test_counted_repetitions_are_counted_written_out(regex: str, added: int) -> None:
    assert regex_repeat_expansion(regex) == added


HOSTILE = {
    "guided_grammar": ({"guided_grammar": 'start: "a" start'}, "has no finite document"),
    "guided_regex": ({"guided_regex": "(a{1000}){1000}"}, "MAX_REGEX_REPEAT_EXPANSION"),
    "response_format.json_schema.schema": ({"response_format": json_format(ENDLESS)}, "has no finite document"),
}


@pytest.mark.parametrize("field", list(HOSTILE))
def test_producers_refuse_them_naming_the_field(field: str, redis_url: str) -> None:
    extra, needle = HOSTILE[field]
    with pytest.raises(InvalidRequestError) as raised:
        GenerationRequest.validate_payload({"prompt": "x", **extra})
    assert raised.value.field == field and needle in str(raised.value), str(raised.value)
    with pytest.raises(InvalidRequest) as refused:
        Client(redis_url).submit({"prompt": "x", **extra})
    assert f"{field}:" in str(refused.value)
    assert not redis.Redis.from_url(redis_url).keys("rq:job:*")


# --- the engines -----------------------------------------------------------------------------

# Passes every check (its required property goes through patternProperties, which the analysis
# leaves to the library) and its first mask; llguidance's parser then runs out of items on the
# first token: a matcher that fails mid-way.
FAILS_MIDWAY = {"type": "object", "patternProperties": {"^x$": {"$ref": "#"}}, "required": ["x"],
                "additionalProperties": False}
NEIGHBOURS = {
    "free-greedy": {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "logprobs": True},
    "free-seeded": {"prompt": "tell me", "max_tokens": 12, "temperature": 0.9, "seed": 7, "n": 2},
    "regex": {"prompt": "id:", "max_tokens": 12, "temperature": 1.0, "seed": 3, "guided_regex": "[a-f0-9]{4,8}"},
    "schema": {"prompt": "obj", "max_tokens": 16, "temperature": 0, "response_format": json_format(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})},
}


def test_a_row_whose_matcher_fails_ends_alone_and_its_neighbours_decode_as_alone(engine: Any) -> None:  # noqa: F811
    hostile = {"prompt": "x", "max_tokens": 20, "temperature": 0, "response_format": json_format(FAILS_MIDWAY)}
    alone = {name: run(engine, {name: payload})[0][name] for name, payload in NEIGHBOURS.items()}
    # The failing row alone (the library's batch call then had no other row), first, and joining.
    for first, joining in (({"hostile": hostile}, NEIGHBOURS), (NEIGHBOURS, {"hostile": hostile}),
                           ({"hostile": hostile, **NEIGHBOURS}, None)):
        results, recording = run(engine, first, joining, join_after=2)
        failed = results["hostile"]
        assert failed.status == "failed" and [c.finish_reason for c in failed.choices] == ["error"], failed
        assert failed.error.message.startswith(
            "RuntimeError: response_format.json_schema.schema: the constraint failed"), failed.error
        for name, result in alone.items():
            batched = results[name]
            assert batched.status == "finished", (name, batched.error)
            assert [c.token_ids for c in batched.choices] == [c.token_ids for c in result.choices], name
            assert [c.finish_reason for c in batched.choices] == [c.finish_reason for c in result.choices], name
            if result.choices[0].logprobs is not None:
                assert batched.choices[0].logprobs == pytest.approx(result.choices[0].logprobs, abs=1e-4), name


def test_what_fails_or_allows_nothing_at_the_first_mask_is_refused_when_compiled(engine: Any) -> None:  # noqa: F811
    from worker.engines.constraints import ConstraintError

    nothing = GenerationRequest.validate_payload({"prompt": "x", "guided_grammar": 'start: A\nA: "a" & /b/'})
    with pytest.raises(ConstraintError, match="^guided_grammar: allows no text at all"):
        engine.prepare(nothing)
    results, _ = run(engine, {"nothing": nothing.to_payload(), "free": NEIGHBOURS["free-greedy"]})
    assert results["nothing"].status == "failed" and results["nothing"].choices == []
    assert results["nothing"].error.message.startswith("guided_grammar: allows no text"), results["nothing"].error
    assert results["free"].status == "finished"


def test_a_constrained_request_is_checked_and_compiled_off_the_loops_thread(engine: Any) -> None:  # noqa: F811
    """The loop hands `slow_prepare`'s work to its preparing thread, then admits with what it made."""
    from worker.engines.constraints import ConstraintCompiler
    from worker.scheduler import BatchScheduler

    scheduler = BatchScheduler(engine, max_num_seqs=16, default_max_tokens=8)
    assert scheduler.slow_prepare({"prompt": "x"}) is None  # nothing slow: admitted at once
    compiled_on: list[str] = []
    compile = ConstraintCompiler.compile

    def recording(self: Any, constraint: Any) -> Any:
        compiled_on.append(threading.current_thread().name)
        return compile(self, constraint)

    ConstraintCompiler.compile = recording  # type: ignore[method-assign]
    try:
        made: dict[str, Any] = {}
        for name, payload in (("good", {"prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]{3}-[a-z]{2,7}-q"}),
                              ("bad", {"prompt": "x", "guided_regex": "a{99999}"})):
            work = scheduler.slow_prepare(payload)
            assert work is not None
            thread = threading.Thread(target=lambda: made.update({name: _outcome(work)}), name="preparer")
            thread.start()
            thread.join(timeout=60)
        assert scheduler.admit("good", {"prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]{3}-[a-z]{2,7}-q"},
                               prepared=made["good"]) is None
    finally:
        ConstraintCompiler.compile = compile  # type: ignore[method-assign]
    assert compiled_on == ["preparer"]
    assert isinstance(made["bad"], InvalidRequestError) and made["bad"].field == "guided_regex"
    ended = []
    while len(scheduler):
        ended += [job.result() for job in scheduler.step()]
    (good,) = ended
    assert good.status == "finished" and re.fullmatch("[0-9]{0,3}(-[a-z]{0,7}(-q?)?)?", good.choices[0].text), good


def _outcome(work: Any) -> Any:
    """What the preparing thread makes of `slow_prepare`'s work (nothing to read: a constraint alone)."""
    try:
        assert not work.reads
        return work.prepare({})
    except Exception as exc:
        return exc


# --- a real worker: hostile constraints beside good traffic ------------------------------------

GOOD = {
    "free": {"prompt_token_ids": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True},
    "free-sampled": {"prompt": "a story", "max_tokens": 24, "temperature": 0.8, "seed": 4, "stream": True},
    "regex": {"prompt": "code:", "max_tokens": 16, "temperature": 1.0, "seed": 9, "guided_regex": "[A-Z]{3}-[0-9]{2,6}",
              "stream": True},
}


@pytest.mark.slow
def test_hostile_constraints_beside_good_streams_on_a_real_worker(redis_url: str, tiny_model_dir: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    queue = Queue("mlxq", connection=conn, serializer=JSONSerializer)
    client = Client(redis_url)
    hostile = {  # enqueued past the producer's own validation: the worker must refuse them itself
        "endless-grammar": ({"prompt": "x", "guided_grammar": 'start: "a" start'},
                            "guided_grammar: has no finite document"),
        "huge-regex": ({"prompt": "x", "guided_regex": "(a{1000}){1000}"},
                       "guided_regex: the regex written out"),
        "endless-schema": ({"prompt": "x", "response_format": json_format(ENDLESS)},
                           "response_format.json_schema.schema: has no finite document"),
        "allows-nothing": ({"prompt": "x", "guided_grammar": 'start: A\nA: "a" & /b/'},
                           "guided_grammar: allows no text"),
        "fails-midway": ({"prompt": "x", "max_tokens": 20, "temperature": 0, "response_format": json_format(FAILS_MIDWAY)},
                         "response_format.json_schema.schema: the constraint failed"),
    }
    proc = start_worker(redis_url, tiny_model_dir, "--max-num-seqs", "8", name="hostile-constraints")
    try:
        alone = {name: client.wait(client.submit(payload), timeout=120) for name, payload in GOOD.items()}
        good_ids = {name: client.submit(payload) for name, payload in GOOD.items()}
        bad_ids = {name: queue.enqueue(keys.JOB_FUNCTION, request=payload).id for name, (payload, _) in hostile.items()}
        good_ids.update({f"{name}-again": client.submit(payload) for name, payload in GOOD.items()})
        streams = {name: list(client.stream(job_id, timeout=120)) for name, job_id in good_ids.items()}
        results = client.wait_many([*good_ids.values(), *bad_ids.values()], timeout=180)
        assert proc.poll() is None, "the worker died"
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert "engine step failed" not in out, out  # no step failed, so nothing was reset or run again
    for name, job_id in bad_ids.items():
        result, needle = results[job_id], hostile[name][1]
        assert result.status == "failed" and needle in result.error.message, (name, result.error, out[-3000:])
        assert all(c.finish_reason == "error" for c in result.choices), (name, result.choices)
    for name, job_id in good_ids.items():
        expected = alone[name.removesuffix("-again")]
        result = results[job_id]
        assert result.status == "finished", (name, result.error, out[-3000:])
        assert [c.token_ids for c in result.choices] == [c.token_ids for c in expected.choices], name
        events = streams[name]
        assert not [e for e in events if e["event"] == "restart"], (name, events)  # never re-run
        assert events[-1]["event"] == "end" and events[-1]["status"] == "finished", events[-1]
        streamed = [t for e in events if e["event"] == "token" for t in e["token_ids"]]
        assert streamed == result.choices[0].token_ids, name
        choice = result.choices[0]
        if "guided_regex" in GOOD[name.removesuffix("-again")] and choice.finish_reason == "stop":
            assert choice.constraint_complete is True, choice


def test_the_gateway_answers_400_naming_the_field(redis_url: str) -> None:
    import httpx

    from tests.gateway import announce, running_gateway

    announce(redis.Redis.from_url(redis_url), "nobody", "tiny")
    with running_gateway(redis_url, insecure=True) as base:
        for field, (extra, needle) in HOSTILE.items():
            answer = httpx.post(f"{base}/completions", json={"model": "tiny", "prompt": "x", **extra}, timeout=30)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == field and needle in error["message"], error
    assert not redis.Redis.from_url(redis_url).keys("rq:job:*")


lark_text = st.text(alphabet=st.sampled_from(list('start:|()[]*+?~&{},.0123456789"/\\ab%json@<>-=!\n #')), max_size=200)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(["type", "$ref", "required", "properties", "items",
                                                              "minItems", "anyOf", "allOf", "oneOf", "pattern",
                                                              "patternProperties", "$defs", "a"]), inner, max_size=5),
                           max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(lark_text, st.text(max_size=100), json_values)
def test_the_checks_read_anything_a_producer_can_write_without_failing(grammar: str, regex: str, schema: Any) -> None:
    """Whatever the text, validation answers: accepted, or refused naming the field, never a crash."""
    for extra in ({"guided_grammar": grammar}, {"guided_regex": regex},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"x": schema}}}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                      "type": "object", "properties": {"p": schema}, "required": ["p"], "$defs": {"d": schema}}}}}):
        if not next(iter(extra.values())):
            continue
        try:
            GenerationRequest.validate_payload({"prompt": "x", **extra})
        except InvalidRequestError as exc:
            assert exc.field in ("guided_grammar", "guided_regex", "response_format.json_schema.schema",
                                 "response_format.json_schema", "response_format"), (exc.field, str(exc))
