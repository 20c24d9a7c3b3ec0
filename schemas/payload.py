"""A cheap look at a raw request before it is validated: its size, its nesting and its text.

Validating a request (pydantic, then the chat template) costs time and memory in proportion to its
size, on the producer's thread and on the worker's decode loop alike: 100,000 chat messages cost a
worker seconds per job before failing. So the counts are checked first, in one pass over the
decoded JSON that stops at the first limit crossed, and every string must be valid Unicode (a lone
surrogate, which JSON's `\\ud800` escapes allow, is not).
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64  # a JSON schema in response_format nests deepest; requests otherwise stay under 8
MAX_JSON_VALUES = 1_000_000
NOT_PROMPT_TEXT = frozenset({"role", "name", "type", "image_url", "url", "detail"})


class ShapeError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_shape(payload: dict[str, Any], max_messages: int, max_chars: int) -> None:
    """Raise ShapeError (naming the field and the limit) if `payload` is too big, too deep or not
    valid text; otherwise return at once. `max_chars` bounds the prompt's and messages' text."""
    messages = payload.get("messages")
    if isinstance(messages, list) and len(messages) > max_messages:
        raise ShapeError("messages", f"messages: {len(messages)} messages exceeds the limit of {max_messages}")
    values = 0
    prompt_chars = 0
    # (value, path, depth, counts toward the prompt's text)
    stack: list[tuple[Any, tuple[Any, ...], int, bool]] = [(payload, (), 0, False)]
    while stack:
        value, path, depth, is_prompt = stack.pop()
        if isinstance(value, str):
            if is_prompt:
                prompt_chars += len(value)
                if prompt_chars > max_chars:
                    field = _dotted(path[:1])
                    raise ShapeError(field, f"{field}: more than {max_chars} characters of prompt text, the limit")
            if not value.isascii():
                _check_text(value, path)
            continue
        values += len(value)
        if values > MAX_JSON_VALUES:
            raise ShapeError("request", f"request: more than {MAX_JSON_VALUES} JSON values")
        if depth >= MAX_JSON_DEPTH:
            field = _dotted(path[:1])
            raise ShapeError(field, f"{field}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not key.isascii():
                _check_text(key, path)
            # Scalars other than text need no look: only text and containers go on the stack.
            if isinstance(item, (str, dict, list)):
                in_prompt = is_prompt or (depth == 0 and key in ("prompt", "messages"))
                # Within messages only the content text is prompt text (not roles, names, image URLs).
                if in_prompt and key in NOT_PROMPT_TEXT:
                    in_prompt = False
                stack.append((item, (*path, key), depth + 1, in_prompt))


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = _dotted(path)
        code = ord(text[exc.start])
        raise ShapeError(field, f"{field}: contains a lone surrogate (U+{code:04X}), which is not valid Unicode "
                                "text") from None


def _dotted(path: tuple[Any, ...]) -> str:
    parts = []
    for part in path:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts) or "request"
