"""The requests every arm runs, how they arrive, and what each arm records about them.

A workload is a fixed list of requests. Closed loop: `concurrency` clients, each sending its
requests one after the other (the next as soon as the previous finished); with one round that is
"N requests at once". Open loop: each request arrives at its own Poisson time, whatever happened
to the others. Every arm gets the same prompts (same token ids, same text) for the same workload.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

# Plain words, so that the text round-trips through any tokenizer (real or the random test ones).
WORDS = (
    "the queue carries jobs from web servers to workers and each worker batches many requests on one "
    "accelerator redis keeps results streams tokens are sampled one step at a time a batch of sequences "
    "shares each forward pass model prompt answer river mountain forest city ocean light shadow music "
    "number letter window garden kitchen paper engine signal harbor winter summer bridge market story"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: tuple[int, ...]


def make_prompts(tokenizer: Tokenizer, count: int, length: int, *, seed: int, salt: str) -> list[Prompt]:
    """`count` distinct prompts whose text encodes to exactly `length` tokens where the tokenizer
    allows it (text -> ids -> truncate -> text -> ids must round-trip; a few retries find one).
    Each starts with its own number, so no two share a prefix a prompt cache could reuse."""
    prompts = []
    for i in range(count):
        rng = random.Random(f"{seed}/{salt}/{i}")
        best: Optional[Prompt] = None
        for attempt in range(20):
            words = [f"{salt}-{i}-{attempt}:"] + [rng.choice(WORDS) for _ in range(length * 2 + 8)]
            ids = list(tokenizer.encode(" ".join(words)))[:length]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            again = tuple(tokenizer.encode(text))
            candidate = Prompt(text, again)
            if len(again) == length:
                best = candidate
                break
            if best is None or abs(len(again) - length) < abs(len(best.ids) - length):
                best = candidate
        assert best is not None
        prompts.append(best)
    return prompts


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: Prompt
    max_tokens: int
    client: int = 0  # closed loop: which client sends it (each client's requests go in index order)
    arrival_s: float = 0.0  # open loop: seconds after the start
    n: int = 1
    temperature: float = 0.0
    seed: Optional[int] = None

    @property
    def expected_tokens(self) -> int:
        return self.max_tokens * self.n


@dataclass
class Workload:
    kind: str  # "closed" | "open"
    label: str
    requests: list[BenchRequest]
    concurrency: Optional[int] = None
    rate: Optional[float] = None

    @property
    def expected_tokens(self) -> int:
        return sum(r.expected_tokens for r in self.requests)

    def describe(self) -> dict[str, Any]:
        prompt_lengths = sorted(len(r.prompt.ids) for r in self.requests)
        return {
            "kind": self.kind,
            "label": self.label,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": len(self.requests),
            "prompt_tokens": {"min": prompt_lengths[0], "max": prompt_lengths[-1]} if prompt_lengths else None,
            "max_tokens": max((r.max_tokens for r in self.requests), default=0),
            "n": max((r.n for r in self.requests), default=1),
            "expected_tokens": self.expected_tokens,
        }


def closed_loop(prompts: list[Prompt], concurrency: int, rounds: int, max_tokens: int, label: str = "") -> Workload:
    count = concurrency * rounds
    if len(prompts) < count:
        raise ValueError(f"closed loop needs {count} prompts, got {len(prompts)}")
    requests = [BenchRequest(i, prompts[i], max_tokens, client=i % concurrency) for i in range(count)]
    return Workload("closed", label or f"closed-{concurrency}", requests, concurrency=concurrency)


def spread_lengths(workload: Workload, spread: int, *, seed: int) -> Workload:
    """The same requests, each asking for `max_tokens` +- up to `spread` new tokens (uniform, seeded):
    sequences then end at different steps, as real outputs do, in every arm alike."""
    if spread <= 0:
        return workload
    rng = random.Random(f"{seed}/lengths/{workload.label}")
    requests = [replace(r, max_tokens=r.max_tokens + rng.randint(-spread, spread)) for r in workload.requests]
    return replace(workload, requests=requests)


def open_loop(prompts: list[Prompt], rate: float, max_tokens: int, *, seed: int, label: str = "") -> Workload:
    rng = random.Random(f"{seed}/poisson/{rate}")
    arrival, requests = 0.0, []
    for i, prompt in enumerate(prompts):
        requests.append(BenchRequest(i, prompt, max_tokens, client=i, arrival_s=arrival))
        arrival += rng.expovariate(rate)
    return Workload("open", label or f"open-{rate:g}", requests, rate=rate)


def all_at_once(requests: list[BenchRequest], label: str) -> Workload:
    """Closed loop with one client per request: every request is sent at the start."""
    placed = [BenchRequest(i, r.prompt, r.max_tokens, client=i, n=r.n, temperature=r.temperature, seed=r.seed)
              for i, r in enumerate(requests)]
    return Workload("closed", label, placed, concurrency=len(placed))


@dataclass
class RequestRecord:
    """What an arm saw of one request; times are seconds since the workload started."""

    index: int
    arrival: float
    started: Optional[float] = None  # left the queue (arm-specific; None where not observable)
    first_token: Optional[float] = None
    finished: Optional[float] = None
    tokens: int = 0
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "arrival": self.arrival, "started": self.started,
            "first_token": self.first_token, "finished": self.finished, "tokens": self.tokens,
            "error": self.error, **self.extra,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        known = {"index", "arrival", "started", "first_token", "finished", "tokens", "error"}
        return cls(int(data["index"]), float(data["arrival"]), started=data.get("started"),
                   first_token=data.get("first_token"), finished=data.get("finished"),
                   tokens=int(data.get("tokens") or 0), error=data.get("error"),
                   extra={k: v for k, v in data.items() if k not in known})


class Arrivals:
    """Releases a workload's requests to a single-threaded arm: open-loop ones at their times,
    closed-loop ones when the same client's previous request completes."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._open: deque[BenchRequest] = deque()
        self._clients: dict[int, deque[BenchRequest]] = {}
        self._ready: list[tuple[BenchRequest, float]] = []
        if workload.kind == "open":
            self._open = deque(sorted(workload.requests, key=lambda r: r.arrival_s))
        else:
            for request in workload.requests:
                self._clients.setdefault(request.client, deque()).append(request)
            for queue in self._clients.values():
                self._ready.append((queue.popleft(), 0.0))

    def due(self, now: float) -> list[tuple[BenchRequest, float]]:
        """Requests that have arrived by `now`, with their arrival times; each is returned once."""
        while self._open and self._open[0].arrival_s <= now:
            request = self._open.popleft()
            self._ready.append((request, request.arrival_s))
        ready, self._ready = self._ready, []
        return ready

    def completed(self, request: BenchRequest, now: float) -> None:
        queue = self._clients.get(request.client)
        if queue:
            self._ready.append((queue.popleft(), now))

    def next_arrival(self) -> Optional[float]:
        if self._ready:
            return 0.0
        return self._open[0].arrival_s if self._open else None

    @property
    def exhausted(self) -> bool:
        return not self._ready and not self._open and not any(self._clients.values())
