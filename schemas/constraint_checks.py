"""Checks of a constraint that need no grammar library, so producers, the gateway and workers make
them alike when a request is validated (schemas/constraints.py calls them):

- a finite document: a JSON schema or Lark grammar one of whose required parts only recurses (a rule
  `start: "a" start`, an object whose required property is the object again) has no finite text to
  end with. Whether some derivation of the start can end is the least fixed point of an AND/OR graph
  (`_Finite`): a rule is finite if one alternative has every part finite; an object if every required
  property is. The analysis errs one way only: what it does not understand counts as finite, so it
  never refuses a constraint that has a document; the worker's library check is the binding one.
- a bounded size: counted repetitions (`x{n}`, `x{n,m}`) multiply what a regex holds written out:
  `(a{1000}){1000}` is a million atoms in 15 characters, and each costs the library's lexer work
  (docs/structured-output.md has the measurements). What they add is capped per constraint.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional
from urllib.parse import unquote

# Atoms that counted repetitions may add to a constraint's regexes written out (guided_regex, a Lark
# grammar's /regex/ terminals, a JSON schema's `pattern`s and `patternProperties`): as many as a
# regex of MAX_GUIDED_REGEX_CHARS holds. What a mask costs at the cap: docs/structured-output.md.
MAX_REGEX_REPEAT_EXPANSION = 4_096

_AND, _OR = 0, 1


class _Finite:
    """An AND/OR graph: a node is finite when all (AND) or one (OR) of its children are; an AND with
    no children is finite, an OR with none never is. `solve` finds the least fixed point in time
    linear in the edges (no recursion: a hostile nesting cannot exhaust the stack)."""

    def __init__(self) -> None:
        self.kinds: list[int] = []
        self.children: list[list[int]] = []

    def node(self, kind: int = _AND, children: Optional[list[int]] = None) -> int:
        self.kinds.append(kind)
        self.children.append(list(children or []))
        return len(self.kinds) - 1

    def always(self) -> int:
        return self.node(_AND)

    def never(self) -> int:
        return self.node(_OR)

    def solve(self) -> list[bool]:
        parents: list[list[int]] = [[] for _ in self.kinds]
        need = []
        for n, (kind, children) in enumerate(zip(self.kinds, self.children)):
            need.append(len(children) if kind == _AND else 1)
            for child in children:
                parents[child].append(n)
        finite = [False] * len(self.kinds)
        ready = [n for n, count in enumerate(need) if count == 0]
        while ready:
            n = ready.pop()
            if finite[n]:
                continue
            finite[n] = True
            for parent in parents[n]:
                if not finite[parent]:
                    need[parent] -= 1
                    if need[parent] <= 0:
                        ready.append(parent)
        return finite


# --- JSON schema --------------------------------------------------------------------------------

def json_schema_problem(schema: Any) -> Optional[str]:
    """Why `schema` has no finite document, or None (also where the analysis cannot tell)."""
    graph = _JsonSchemaGraph(schema)
    root = graph.build()
    finite = graph.finite.solve()
    if finite[root]:
        return None
    looping = sorted({ref for ref, node in graph.refs if not finite[node]})
    where = f" (through {', '.join(looping[:3])})" if looping else ""
    return ("has no finite document: every instance needs a required property or array item that can never "
            f"be completed{where}")


class _JsonSchemaGraph:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.finite = _Finite()
        self.refs: list[tuple[str, int]] = []  # each `$ref` followed, and its target's node
        self._nodes: dict[int, int] = {}
        self._todo: list[tuple[Any, int]] = []

    def build(self) -> int:
        root = self._node_of(self.root)
        while self._todo:
            schema, node = self._todo.pop()
            self._fill(schema, node)
        return root

    def _node_of(self, schema: Any) -> int:
        key = id(schema)
        if key not in self._nodes:
            self._nodes[key] = self.finite.always()
            self._todo.append((schema, self._nodes[key]))
        return self._nodes[key]

    def _fill(self, schema: Any, node: int) -> None:
        if schema is False:
            self.finite.kinds[node] = _OR  # no instance at all
            return
        if not isinstance(schema, dict):
            return
        parts = self.finite.children[node]
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = _resolve(self.root, ref)
            if target is not _MISSING:
                parts.append(self._node_of(target))
                self.refs.append((ref, parts[-1]))
        every = schema.get("allOf")
        for sub in every if isinstance(every, list) else ():
            parts.append(self._node_of(sub))
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                parts.append(self.finite.node(_OR, [self._node_of(sub) for sub in options]))
        if "enum" in schema or "const" in schema:
            return  # a literal value is an instance
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds) or not kinds:
            return  # any type: a number will do
        options = [self._object(schema) if kind == "object" else self._array(schema) if kind == "array"
                   else self.finite.always() for kind in kinds]
        parts.append(self.finite.node(_OR, options))

    def _object(self, schema: dict[str, Any]) -> int:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        extra = schema.get("additionalProperties", True)
        parts = []
        for name in required:
            if not isinstance(name, str):
                continue
            if name in properties:
                parts.append(self._node_of(properties[name]))
            elif schema.get("patternProperties"):
                continue  # a pattern may take it: counted as finite
            elif isinstance(extra, (bool, dict)):
                parts.append(self._node_of(extra))
        return self.finite.node(_AND, parts)

    def _array(self, schema: dict[str, Any]) -> int:
        least = schema.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        if isinstance(items, list):  # the older spelling of prefixItems
            prefix, items = items, schema.get("additionalItems")
        prefix = prefix if isinstance(prefix, list) else []
        parts = [self._node_of(sub) for sub in prefix[:least]]
        if least > len(prefix) and isinstance(items, (bool, dict)):
            parts.append(self._node_of(items))
        contains, at_least = schema.get("contains"), schema.get("minContains", 1)
        if isinstance(contains, (bool, dict)) and not (isinstance(at_least, int) and at_least == 0):
            parts.append(self._node_of(contains))
        return self.finite.node(_AND, parts)


_MISSING = object()


def _resolve(root: Any, ref: str) -> Any:
    """A local `$ref` ("#" or a JSON pointer "#/a/b") in `root`; _MISSING for any other."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def json_schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex a JSON schema holds: `pattern` values and `patternProperties` keys (iterative)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            if isinstance(node.get("patternProperties"), dict):
                yield from (key for key in node["patternProperties"] if isinstance(key, str))
            stack.extend(node.values())


# --- Lark grammars (llguidance's dialect) -------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\f]+) | (?P<newline>\n) | (?P<comment>(?://|\#)[^\n]*)
  | (?P<dots>\.\.) | (?P<arrow>->)
  | (?P<punct>[:|()\[\]*+?~&,.{}=!^])
  | (?P<name>[A-Za-z_][\w-]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-zA-Z]*)
  | (?P<special><[^<>\s]+>)
  | (?P<directive>%[a-z_]+)
  | (?P<grammar>@[\w-]+)
  | (?P<number>[0-9]+)
""", re.VERBOSE)

_MAX_NESTING = 100  # parentheses deeper than this: not analysed (counted as finite)


class _Unsure(Exception):
    """The analysis cannot read this grammar: nothing is concluded."""


def lark_grammar_problem(grammar: str) -> Optional[str]:
    """Why the Lark grammar's `start` has no finite document, or None (also where the analysis cannot tell)."""
    return lark_grammar_checks(grammar)[1]


def lark_grammar_checks(grammar: str) -> tuple[list[str], Optional[str]]:
    """The grammar's regexes (its /regex/ literals and its `%json` blocks' patterns), and why its
    `start` has no finite document (None: it has one, or the analysis cannot tell), from one reading."""
    patterns: list[str] = []
    tokens = list(_tokens(grammar, patterns))
    regexes = [_regex_body(text) for kind, text in tokens if kind == "regex"] + patterns
    return regexes, _start_problem(tokens)


def _start_problem(tokens: list[tuple[str, str]]) -> Optional[str]:
    try:
        rules = _rules(tokens)
        if "start" not in rules:
            return None  # the library says what is wrong with it
        graph, nodes = _Finite(), {name: 0 for name in rules}
        for name in rules:
            nodes[name] = graph.node(_OR)
        for name, body in rules.items():
            graph.children[nodes[name]].extend(_Alternatives(body, graph, nodes).parse())
    except (_Unsure, RecursionError):
        return None
    finite = graph.solve()
    if finite[nodes["start"]]:
        return None
    stuck = [name for name in rules if not finite[nodes[name]]]
    shown = ", ".join(stuck[:5]) + (", ..." if len(stuck) > 5 else "")
    return f"has no finite document: no derivation of `start` ever ends (rules that only recurse: {shown})"


def _regex_body(literal: str) -> str:
    return literal[1:literal.rindex("/")]


def _tokens(grammar: str, patterns: Optional[list[str]] = None) -> Iterator[tuple[str, str]]:
    """(kind, text) of each token, comments and spaces left out; a `%json`/`%regex`/`%llguidance`
    block is one token ("block", or "endless" for a `%json` schema with no finite document, whose
    patterns go to `patterns`). What it cannot read is an "unknown" token of one character."""
    at, end = 0, len(grammar)
    decoder = json.JSONDecoder()
    while at < end:
        match = _TOKEN.match(grammar, at)
        if match is None:
            yield "unknown", grammar[at]
            at += 1
            continue
        kind, text = match.lastgroup or "", match.group()
        at = match.end()
        if kind in ("space", "comment"):
            continue
        if kind == "directive" and text in ("%json", "%regex", "%llguidance"):
            start = at
            while at < end and grammar[at] in " \t\r\n":
                at += 1
            try:
                value, at = decoder.raw_decode(grammar, at)
            except (ValueError, RecursionError):
                yield "unknown", text
                at = start
                continue
            if text == "%json":
                if patterns is not None:
                    patterns.extend(json_schema_patterns(value))
                yield ("endless" if json_schema_problem(value) else "block"), text
            else:
                yield "block", text
            continue
        yield kind, text


def _rules(tokens: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Each rule's (or terminal's) body tokens: a definition starts a line with `name:` (after an
    optional `?` or `!`, a `.priority` and `[options]`); `%ignore` lines are left out."""
    rules: dict[str, list[tuple[str, str]]] = {}
    current: Optional[list[tuple[str, str]]] = None
    i, line_start = 0, True
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "newline":
            line_start, i = True, i + 1
            continue
        if line_start:
            line_start = False
            head = _definition(tokens, i)
            if head is not None:
                name, i = head
                if rules.get(name):  # defined again: one more alternative
                    rules[name].append(("punct", "|"))
                current = rules.setdefault(name, [])
                continue
            if kind == "directive":
                if text != "%ignore":
                    raise _Unsure(f"directive {text}")
                while i < len(tokens) and tokens[i][0] != "newline":
                    i += 1
                current = None
                continue
        if kind == "block" and text == "%llguidance":
            i += 1
            continue
        if current is None:
            raise _Unsure("a body outside any rule")
        current.append((kind, text))
        i += 1
    return rules


def _definition(tokens: list[tuple[str, str]], i: int) -> Optional[tuple[str, int]]:
    """(name, index after the colon) if a definition starts at `i`."""
    if tokens[i] in (("punct", "?"), ("punct", "!")):
        i += 1
    if i >= len(tokens) or tokens[i][0] != "name":
        return None
    name, i = tokens[i][1], i + 1
    if i + 1 < len(tokens) and tokens[i] == ("punct", ".") and tokens[i + 1][0] == "number":
        i += 2
    if i < len(tokens) and tokens[i] == ("punct", "["):
        depth = 0
        while i < len(tokens):
            if tokens[i] == ("punct", "["):
                depth += 1
            elif tokens[i] == ("punct", "]"):
                depth -= 1
                if depth == 0:
                    break
            elif tokens[i][0] == "newline":
                return None
            i += 1
        i += 1
    if i < len(tokens) and tokens[i] == ("punct", ":"):
        if i + 1 < len(tokens) and tokens[i + 1] == ("punct", ":"):
            raise _Unsure("a parametric rule")
        return name, i + 1
    return None


class _Alternatives:
    """A rule body read into the graph: alternatives (OR) of sequences (AND) of items; an optional
    or starred item needs nothing; anything the reader does not know stops the analysis."""

    def __init__(self, body: list[tuple[str, str]], graph: _Finite, rules: dict[str, int]) -> None:
        self._tokens = [t for t in body if t[0] != "newline"]
        self._at = 0
        self._graph, self._rules = graph, rules

    def parse(self) -> list[int]:
        options = self._alternatives(0)
        if self._at != len(self._tokens):
            raise _Unsure(f"unexpected {self._tokens[self._at][1]!r}")
        return options

    def _peek(self) -> tuple[str, str]:
        return self._tokens[self._at] if self._at < len(self._tokens) else ("end", "")

    def _alternatives(self, depth: int) -> list[int]:
        if depth > _MAX_NESTING:
            raise _Unsure("nested too deep")
        options = [self._sequence(depth)]
        while self._peek() == ("punct", "|"):
            self._at += 1
            options.append(self._sequence(depth))
        return options

    def _sequence(self, depth: int) -> int:
        parts: list[int] = []
        intersected = False
        while True:
            kind, text = self._peek()
            if kind == "end" or (kind == "punct" and text in "|)]"):
                break
            if (kind, text) == ("punct", "&"):
                intersected, self._at = True, self._at + 1
                continue
            if kind == "arrow":  # an alias: `-> name`
                self._at += 1
                if self._peek()[0] != "name":
                    raise _Unsure("an alias without a name")
                self._at += 1
                continue
            parts.append(self._item(depth))
        # An intersection of terminals may be empty or not: counted as finite.
        return self._graph.always() if intersected else self._graph.node(_AND, parts)

    def _item(self, depth: int) -> int:
        node, optional = self._atom(depth)
        while True:
            kind, text = self._peek()
            if (kind, text) in (("punct", "*"), ("punct", "?")):
                optional, self._at = True, self._at + 1
            elif (kind, text) == ("punct", "+"):
                self._at += 1
            elif (kind, text) == ("punct", "{"):
                optional = self._counted_braces() == 0 or optional
            elif (kind, text) == ("punct", "~") and self._tokens[self._at + 1:self._at + 2] and \
                    self._tokens[self._at + 1][0] == "number":
                optional = self._counted_tilde() == 0 or optional
            else:
                break
        return self._graph.always() if optional else node

    def _atom(self, depth: int) -> tuple[int, bool]:
        kind, text = self._peek()
        self._at += 1
        if kind in ("string", "regex", "special", "grammar", "block"):
            return self._graph.always(), False
        if kind == "endless":
            return self._graph.never(), False
        if kind == "name":
            if text not in self._rules:
                raise _Unsure(f"an undefined name {text!r}")
            return self._rules[text], False
        if (kind, text) == ("punct", "~"):  # a negated terminal: counted as finite
            if depth > _MAX_NESTING:
                raise _Unsure("nested too deep")
            self._atom(depth + 1)
            return self._graph.always(), False
        if (kind, text) in (("punct", "("), ("punct", "[")):
            closing = ")" if text == "(" else "]"
            options = self._alternatives(depth + 1)
            if self._peek() != ("punct", closing):
                raise _Unsure(f"no closing {closing}")
            self._at += 1
            return self._graph.node(_OR, options), text == "["
        raise _Unsure(f"unexpected {text!r}")

    def _counted_braces(self) -> int:
        """`{n}`, `{n,}`, `{,m}`, `{n,m}`: the least count."""
        self._at += 1
        least = 0
        if self._peek()[0] == "number":
            least = int(self._peek()[1])
            self._at += 1
        if self._peek() == ("punct", ","):
            self._at += 1
            if self._peek()[0] == "number":
                self._at += 1
        if self._peek() != ("punct", "}"):
            raise _Unsure("a malformed count")
        self._at += 1
        return least

    def _counted_tilde(self) -> int:
        """`~ n` or `~ n..m`: the least count."""
        self._at += 1
        least = int(self._peek()[1])
        self._at += 1
        if self._peek()[0] == "dots":
            self._at += 1
            if self._peek()[0] != "number":
                raise _Unsure("a malformed range")
            self._at += 1
        return least


# --- regex sizes --------------------------------------------------------------------------------

_COUNT = re.compile(r"\{([0-9]{0,12})(?:(,)([0-9]{0,12}))?\}")


def regex_repeat_expansion(regex: str, cap: int = MAX_REGEX_REPEAT_EXPANSION) -> int:
    """How many atoms counted repetitions add to `regex` written out (x{3} adds 2 x's; nested counts
    multiply), stopping early above `cap`. Rust regex syntax, read leniently: what it cannot read
    counts as one atom. Iterative: a hostile nesting cannot exhaust the stack."""
    # Each open group: (atoms of its finished alternatives, of the current one, of the last item).
    # A size past `ceiling` is over the cap whatever follows (sizes only grow): it is held there.
    frames: list[list[int]] = [[0, 0, 0]]
    written = 0
    ceiling = cap + len(regex) + 1
    at, end = 0, len(regex)
    while at < end:
        char = regex[at]
        frame = frames[-1]
        if char == "(":
            frames.append([0, 0, 0])
            at += 1
            if regex.startswith(("?P<", "?<"), at):  # a named group
                close = regex.find(">", at)
                at = close + 1 if close >= 0 else end
            elif regex.startswith("?", at):  # (?:...), (?flags:...) or (?flags)
                at += 1
                while at < end and (regex[at].isalpha() or regex[at] == "-"):
                    at += 1
                if regex.startswith(":", at):
                    at += 1
            continue
        if char == ")":
            if len(frames) > 1:
                done, current, _ = frames.pop()
                group = min(done + current, ceiling)
                frames[-1][1] = min(frames[-1][1] + group, ceiling)
                frames[-1][2] = group
            at += 1
            continue
        if char == "|":
            frame[0] = min(frame[0] + frame[1], ceiling)
            frame[1] = frame[2] = 0
            at += 1
            continue
        if char in "*+?":
            at += 1
            continue
        if char == "{":
            count = _COUNT.match(regex, at)
            if count is not None:
                low, comma, high = count.groups()
                times = int(high) if comma and high else int(low or 0)
                grown = min(frame[2] * max(times, 1), ceiling)
                frame[1] = min(frame[1] + grown - frame[2], ceiling)
                frame[2] = grown
                at = count.end()
                continue
        at = _skip_atom(regex, at)
        frame[1] += 1
        frame[2] = 1
        written += 1
    while len(frames) > 1:
        done, current, _ = frames.pop()
        frames[-1][1] = min(frames[-1][1] + done + current, ceiling)
    total = min(frames[0][0] + frames[0][1], ceiling)
    return max(0, min(total - written, cap + 1))


def _skip_atom(regex: str, at: int) -> int:
    """The index after the atom at `at`: an escape (with its braces), a class, or one character."""
    char = regex[at]
    if char == "\\":
        if at + 2 < len(regex) and regex[at + 1] in "pPxu" and regex[at + 2] == "{":
            close = regex.find("}", at + 2)
            return close + 1 if close >= 0 else len(regex)
        return min(at + 2, len(regex))
    if char == "[":
        depth, at = 1, at + 1
        if regex.startswith("^", at):
            at += 1
        if regex.startswith("]", at):
            at += 1
        while at < len(regex) and depth:
            if regex[at] == "\\":
                at += 2
                continue
            if regex[at] == "[":
                depth += 1
            elif regex[at] == "]":
                depth -= 1
            at += 1
        return at
    return at + 1
