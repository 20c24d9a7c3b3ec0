"""Structured output on the wire: OpenAI's `response_format` shapes and the size limits of every
constraint a request may carry (`response_format`, `guided_regex`, `guided_grammar`).

The worker compiles a constraint into a token mask (worker/engines/constraints.py); whether the
library accepts it is only known there. What the schema checks is shape and size, and, without the
library (schemas/constraint_checks.py), that a JSON schema or grammar has a finite document and that
counted repetitions do not blow a regex up (`MAX_REGEX_REPEAT_EXPANSION`).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.constraint_checks import (MAX_REGEX_REPEAT_EXPANSION, json_schema_patterns, json_schema_problem,
                                       lark_grammar_checks, regex_repeat_expansion)

MAX_JSON_SCHEMA_CHARS = 32_768  # the schema as compact JSON
MAX_JSON_SCHEMA_DEPTH = 32  # objects and arrays nested in the schema document
MAX_GUIDED_REGEX_CHARS = 4_096
MAX_GUIDED_GRAMMAR_CHARS = 32_768

# OpenAI's json_object: any JSON object.
ANY_JSON_OBJECT = '{"type":"object"}'

ConstraintKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """A request's constraint as the worker compiles it: `source` is the JSON schema as compact
    JSON, the regex, or the Lark grammar; `field` is the request field it came from."""

    kind: ConstraintKind
    source: str
    field: str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, serialize_by_alias=True)


class JSONSchemaFormat(_Strict):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Optional[str] = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(..., alias="schema")
    # Accepted for OpenAI compatibility: the schema is always enforced as given.
    strict: Optional[bool] = None

    @field_validator("schema_")
    @classmethod
    def _check_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_schema_size(value)
        problem = _schema_problems.get(compact_json(value), value)
        if problem is not None:
            raise ValueError(problem)
        return value


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _check_shape(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required with type json_schema, and only there")
        return self


def _at_most(limit: int, name: str) -> AfterValidator:
    def check(value: str) -> str:
        if len(value) > limit:
            raise ValueError(f"{len(value)} characters, over the limit of {limit} ({name})")
        return value

    return AfterValidator(check)


# A request is validated more than once on its way (producer, worker intake, admission); the checks
# below cost up to tens of milliseconds for a hostile 32 KB constraint, so each text's answer is kept.
CHECKED_CACHE_SIZE = 256


def _repeats_problem(regexes: Any, what: str) -> Optional[str]:
    added = 0
    for regex in regexes:
        added += regex_repeat_expansion(regex, MAX_REGEX_REPEAT_EXPANSION - added)
        if added > MAX_REGEX_REPEAT_EXPANSION:
            return (f"{what} written out: counted repetitions (x{{n}}, nested ones multiply) add over "
                    f"{MAX_REGEX_REPEAT_EXPANSION} atoms, the limit (MAX_REGEX_REPEAT_EXPANSION)")
    return None


@functools.lru_cache(maxsize=CHECKED_CACHE_SIZE)
def _regex_problem(regex: str) -> Optional[str]:
    return _repeats_problem([regex], "the regex")


@functools.lru_cache(maxsize=CHECKED_CACHE_SIZE)
def _grammar_problem(grammar: str) -> Optional[str]:
    regexes, problem = lark_grammar_checks(grammar)
    return _repeats_problem(regexes, "its regexes") or problem


class _SchemaProblems:
    """What is wrong with a JSON schema (or None), kept by its compact JSON text."""

    def __init__(self) -> None:
        self._answers: OrderedDict[str, Optional[str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str, schema: dict[str, Any]) -> Optional[str]:
        with self._lock:
            if text in self._answers:
                self._answers.move_to_end(text)
                return self._answers[text]
        problem = _repeats_problem(json_schema_patterns(schema), "its patterns") or json_schema_problem(schema)
        with self._lock:
            self._answers[text] = problem
            if len(self._answers) > CHECKED_CACHE_SIZE:
                self._answers.popitem(last=False)
        return problem


_schema_problems = _SchemaProblems()


def _raising(problem_of: Any) -> AfterValidator:
    def check(value: str) -> str:
        problem = problem_of(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    return AfterValidator(check)


GuidedRegex = Annotated[str, Field(min_length=1), _at_most(MAX_GUIDED_REGEX_CHARS, "MAX_GUIDED_REGEX_CHARS"),
                        _raising(_regex_problem)]
GuidedGrammar = Annotated[str, Field(min_length=1), _at_most(MAX_GUIDED_GRAMMAR_CHARS, "MAX_GUIDED_GRAMMAR_CHARS"),
                          _raising(_grammar_problem)]


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def constraint_of(response_format: Optional[ResponseFormat], guided_regex: Optional[str],
                  guided_grammar: Optional[str]) -> Optional[Constraint]:
    """The one constraint these fields ask for, or None (no field, or `{"type": "text"}`)."""
    if guided_regex is not None:
        return Constraint("regex", guided_regex, "guided_regex")
    if guided_grammar is not None:
        return Constraint("grammar", guided_grammar, "guided_grammar")
    if response_format is None or response_format.type == "text":
        return None
    if response_format.json_schema is None:
        return Constraint("json_schema", ANY_JSON_OBJECT, "response_format")
    return Constraint("json_schema", compact_json(response_format.json_schema.schema_), "response_format.json_schema.schema")


def constraint_fields_given(response_format: Optional[ResponseFormat], guided_regex: Optional[str],
                            guided_grammar: Optional[str]) -> list[str]:
    given = [] if response_format is None or response_format.type == "text" else ["response_format"]
    return given + [name for name, value in (("guided_regex", guided_regex), ("guided_grammar", guided_grammar))
                    if value is not None]


def check_schema_size(schema: dict[str, Any]) -> None:
    """ValueError for a JSON schema nested deeper than MAX_JSON_SCHEMA_DEPTH or longer than
    MAX_JSON_SCHEMA_CHARS as JSON (a response format's, a tool's parameters)."""
    depth = _depth(schema)
    if depth > MAX_JSON_SCHEMA_DEPTH:
        raise ValueError(f"nested {depth} deep, over the limit of {MAX_JSON_SCHEMA_DEPTH} (MAX_JSON_SCHEMA_DEPTH)")
    size = len(compact_json(schema))
    if size > MAX_JSON_SCHEMA_CHARS:
        raise ValueError(f"{size} characters as JSON, over the limit of {MAX_JSON_SCHEMA_CHARS} (MAX_JSON_SCHEMA_CHARS)")


def _depth(value: Any) -> int:
    """How deep objects and arrays nest (iterative: a hostile document cannot exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
