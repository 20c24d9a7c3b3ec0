"""Incremental detokenization: text grows as tokens arrive, without splitting a multi-byte
character across two chunks (the decoded tail is held back while it ends in U+FFFD)."""

from __future__ import annotations

from typing import Callable


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self.text = ""
        # tokens[_prefix:_read] were decoded already; re-decoding from _prefix keeps the
        # tokenizer's context for spaces and merges at the boundary.
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        """Append a token; return the text it completed (may be empty)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        new = after[len(before) :]
        self.text += new
        self._prefix = self._read
        self._read = len(self.tokens)
        return new

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the end)."""
        tail = self._decode(self.tokens[self._prefix :])[len(self._decode(self.tokens[self._prefix : self._read])) :]
        self.text += tail
        self._prefix = self._read = len(self.tokens)
        return tail
