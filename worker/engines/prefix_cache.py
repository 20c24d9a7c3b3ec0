"""PrefixCache: KV caches of earlier prompts, kept so that a later prompt that starts with the same
tokens (a shared system prompt, the previous turn of a chat) skips prefilling them.

Entries are mlx-lm per-layer cache lists keyed by the token ids they hold, least recently used
first out, bounded by the bytes of their arrays. A lookup hands out a copy trimmed to the longest
common prefix; entries themselves are never given to the batch. Only models whose caches are all
plain `KVCache` take part: a sliding-window or recurrent (SSM) cache cannot be cut back to a prefix.

Finding the longest match: every entry is indexed by chained hashes of its fixed-size token blocks
(hash k covers the first k blocks), so a lookup walks the prompt's blocks while some entry shares
them, then compares at most one block of tokens against each entry that got that far.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

Cache = list[Any]  # one mlx-lm cache object per layer

# Keeping a finished sequence's cache "in case" (a speculative store) copies its rows, which is pure
# cost where prompts share nothing (docs/design-notes.md, speculative stores). Once this many
# speculative stores were kept with no lookup hitting since, only one in SPECULATIVE_SAMPLE is kept
# (so a prefix that starts being shared still gets in), until a lookup hits again.
SPECULATIVE_PROBATION = 256
SPECULATIVE_SAMPLE = 16


def unsupported_reason(cache: Sequence[Any]) -> Optional[str]:
    """Why caches like `cache` (a fresh `make_prompt_cache(model)`) cannot be reused; None if they can."""
    if not cache:
        return "the model has no KV cache"
    others = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if others:
        return f"cache type {', '.join(others)} cannot be trimmed to a shared prefix"
    return None


@dataclass
class _Entry:
    key: int
    tokens: tuple[int, ...]
    cache: Cache
    nbytes: int
    chain: list[int]  # chain[k - 1]: the hash of the first k full blocks


class PrefixCache:
    def __init__(self, max_bytes: int, *, min_match: int = 16, block_size: int = 16,
                 disabled_reason: Optional[str] = None) -> None:
        if block_size < 1 or min_match < block_size:
            raise ValueError("PrefixCache: need 1 <= block_size <= min_match")
        self.max_bytes = max(0, max_bytes)
        self.min_match = min_match
        self.block_size = block_size
        self.disabled_reason = "size 0" if self.max_bytes == 0 else disabled_reason
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._through: dict[int, set[int]] = {}  # chain hash -> entries whose first k blocks it covers
        self._ending: dict[int, set[int]] = {}  # chain hash -> entries with exactly those k full blocks
        self._next_key = 0
        self.bytes = 0
        self.lookups = self.hits = self.prompt_tokens = self.reused_tokens = self.evictions = 0
        self.skipped_stores = 0
        self._kept_since_hit = 0  # speculative stores kept since the last lookup that hit
        self._offered_in_sampling = 0

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt_ids: Sequence[int]) -> Optional[tuple[Cache, int]]:
        """A copy of the cache of the longest prefix of `prompt_ids` held here, and its length:
        at least `min_match`, at most len(prompt_ids) - 1 (the last token must run to give logits).
        Counted in the stats."""
        self.lookups += 1
        self.prompt_tokens += len(prompt_ids)
        if not self.enabled:
            return None
        found = self._longest(prompt_ids, len(prompt_ids) - 1)
        if found is None or found[1] < self.min_match:
            return None
        entry, matched = found
        self._kept_since_hit = 0
        self._entries.move_to_end(entry.key)
        cache = copy.deepcopy(entry.cache)  # new cache objects; MLX arrays are values, shared until written
        if matched < len(entry.tokens):
            trim_prompt_cache(cache, len(entry.tokens) - matched)
        self.hits += 1
        self.reused_tokens += matched
        return cache, matched

    def store(self, tokens: Sequence[int], cache: Cache, speculative: bool = False) -> bool:
        """Keep `cache`, which must hold exactly `tokens`; the caller must not touch it afterwards.
        Returns whether it was kept (not when it is inconsistent, too big or already covered, nor a
        `speculative` one skipped while the cache goes unused: see SPECULATIVE_PROBATION)."""
        if not self.enabled or len(tokens) < self.min_match or unsupported_reason(cache) is not None:
            return False
        if speculative and self._kept_since_hit >= SPECULATIVE_PROBATION:
            self._offered_in_sampling += 1
            if self._offered_in_sampling % SPECULATIVE_SAMPLE:
                self.skipped_stores += 1
                return False
        if not can_trim_prompt_cache(cache) or any(c.size() != len(tokens) for c in cache):
            return False
        nbytes = sum(c.nbytes for c in cache)
        if nbytes > self.max_bytes:
            return False
        key_tokens = tuple(tokens)
        covering = self._longest(key_tokens, len(key_tokens))
        if covering is not None and covering[1] == len(key_tokens):  # held already, alone or inside a longer one
            self._entries.move_to_end(covering[0].key)
            return False
        chain = self._chain(key_tokens)
        for shorter in list(self._prefixes_of(key_tokens, chain)):  # the new entry serves all they served
            self._remove(shorter)
        # Materialize soon, so no pending graph keeps a whole batch's arrays alive; asynchronously,
        # so that the decode step already queued behind it is not waited for (a blocking eval here
        # makes every step that finishes a sequence wait for the GPU).
        mx.async_eval([c.state for c in cache])
        entry = _Entry(self._next_key, key_tokens, cache, nbytes, chain)
        self._next_key += 1
        self._entries[entry.key] = entry
        for h in chain:
            self._through.setdefault(h, set()).add(entry.key)
        if chain:
            self._ending.setdefault(chain[-1], set()).add(entry.key)
        self.bytes += nbytes
        if speculative:
            self._kept_since_hit += 1
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries.values())))
            self.evictions += 1
        return True

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._remove(entry)

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason or "",
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "min_match": self.min_match,
            "lookups": self.lookups,
            "hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "hit_rate": self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evictions": self.evictions,
            "skipped_stores": self.skipped_stores,
        }

    # --- the block index ---------------------------------------------------------------------
    def _blocks(self, tokens: Sequence[int]) -> Iterator[int]:
        h, size = 0, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            h = hash((h, tuple(tokens[start:start + size])))
            yield h

    def _chain(self, tokens: Sequence[int]) -> list[int]:
        return list(self._blocks(tokens))

    def _longest(self, tokens: Sequence[int], limit: int) -> Optional[tuple[_Entry, int]]:
        """The entry sharing the longest prefix with `tokens` (the shortest such entry on a tie:
        less to trim) and that prefix's length, capped at `limit`."""
        depth, candidates = 0, None
        for h in self._blocks(tokens):
            found = self._through.get(h)
            if not found:
                break
            depth, candidates = depth + 1, found
        if candidates is None:
            return None
        base = depth * self.block_size
        tail = tuple(tokens[base:base + self.block_size])
        best: Optional[tuple[_Entry, int]] = None
        for key in candidates:
            entry = self._entries[key]
            length = min(base + common_prefix_length(entry.tokens[base:base + self.block_size], tail), limit)
            if best is None or length > best[1] or (length == best[1] and len(entry.tokens) < len(best[0].tokens)):
                best = (entry, length)
        assert best is not None
        entry, length = best
        if entry.tokens[:length] != tuple(tokens[:length]):  # a hash collision, however unlikely
            return None
        return best

    def _prefixes_of(self, tokens: tuple[int, ...], chain: list[int]) -> Iterator[_Entry]:
        for h in chain:
            for key in self._ending.get(h, ()):
                entry = self._entries[key]
                if len(entry.tokens) <= len(tokens) and tokens[:len(entry.tokens)] == entry.tokens:
                    yield entry

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self.bytes -= entry.nbytes
        for h in entry.chain:
            _discard(self._through, h, entry.key)
        if entry.chain:
            _discard(self._ending, entry.chain[-1], entry.key)


# The cache a prompt starts from (None: empty), the tokens it holds, and whether it is the caller's
# own copy (else the prefix cache keeps it, and it must be copied before it is changed).
Start = tuple[Optional[Cache], int, bool]


def plan_starts(prefix: PrefixCache, copies: dict[tuple[int, ...], int],
                prefill: Callable[[list[int], Optional[Cache]], Cache]) -> dict[tuple[int, ...], Start]:
    """For each prompt of one admission round (to run `copies` times), the cache it starts from:
    the longest cached prefix, extended by `prefill(tokens, cache)` (in place; a fresh cache if
    None) to the whole prompt but its last token when it runs more than once, or to the longest
    prefix of at least `min_match` tokens it shares with another prompt of the round. Extended
    prefixes are stored, so the next prompt sharing one starts from it."""
    shared = shared_prefix_lengths(list(copies)) if prefix.enabled else {}
    starts: dict[tuple[int, ...], Start] = {}
    # Sorted: prompts sharing a prefix are neighbours, so the first one's prefill is the others' hit.
    for prompt in sorted(copies):
        if copies[prompt] > 1:
            want = len(prompt) - 1
        else:
            want = shared.get(prompt, 0)
            want = want if want >= prefix.min_match else 0
        found = prefix.lookup(prompt)  # a copy: ours
        cache, cached = found if found is not None else (None, 0)
        owned = True
        if want > cached:
            cache = prefill(list(prompt[cached:want]), cache)
            cached = want
            owned = not prefix.store(prompt[:want], cache)
        starts[prompt] = (cache, cached, owned)
    return starts


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_lengths(prompts: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """For each prompt, the longest prefix (but its last token) it shares with another of `prompts`.
    In sorted order the longest common prefix of a prompt with any other is with a neighbour."""
    ordered = sorted(prompts)
    shared = dict.fromkeys(ordered, 0)
    for a, b in zip(ordered, ordered[1:]):
        n = common_prefix_length(a, b)
        shared[a] = max(shared[a], min(n, len(a) - 1))
        shared[b] = max(shared[b], min(n, len(b) - 1))
    return shared


def _discard(index: dict[int, set[int]], h: int, key: int) -> None:
    keys = index.get(h)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[h]
