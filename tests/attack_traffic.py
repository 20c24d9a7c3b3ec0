"""The tenant-attack suite's good traffic and its ledger: tenant acme's streamed and blocking chats and
`/v1/jobs`, a producer's jobs and streams, each request's tokens compared with the same request run
alone before the attack; and the ledger every attacker writes to (counts, what each hostile job must
end as, and every broken promise seen on the way)."""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from producer import Client
from tests.attack_stack import Stack


@dataclass(frozen=True)
class Expectation:
    attack: str
    kind: str  # "failed" (naming `needle`), "finished", "cancelled" (or ended before the cancel), "ended"
    needle: Optional[str] = None


class Ledger:
    """What the attackers and good clients report, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, Counter[str]] = {}
        self.violations: list[str] = []
        self.expected: dict[str, Expectation] = {}
        self.good_jobs: dict[str, str] = {}  # job id -> the good request's label
        # Ids pushed onto a queue again while their job ran: the one case a job runs twice (its first
        # result stays: docs/operations.md, "What one Redis shares").
        self.pushed_while_running: set[str] = set()
        self.stopping = threading.Event()

    def count(self, attack: str, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts.setdefault(attack, Counter())[what] += n

    def violation(self, attack: str, message: str) -> None:
        with self._lock:
            self.violations.append(f"[{attack}] {message}")

    def check(self, condition: bool, attack: str, message: str) -> bool:
        if not condition:
            self.violation(attack, message)
        return condition

    def expect(self, job_id: str, attack: str, kind: str, needle: Optional[str] = None) -> None:
        with self._lock:
            self.expected[job_id] = Expectation(attack, kind, needle)
        self.count(attack, f"jobs expected {kind}")

    def good_job(self, job_id: str, label: str) -> None:
        with self._lock:
            self.good_jobs[job_id] = label

    def some_good_jobs(self, n: int) -> list[str]:
        with self._lock:
            return list(self.good_jobs)[-n:]

    def summary(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {attack: dict(sorted(c.items())) for attack, c in sorted(self.counts.items())}


class Actor(threading.Thread):
    """One class of traffic in a thread: `round()` again and again until the ledger says stop; an
    exception in a round is a violation (what the class met that it did not expect), not the end."""

    attack = "actor"
    pause_s = 0.05

    def __init__(self, stack: Stack, ledger: Ledger) -> None:
        super().__init__(name=self.attack, daemon=True)
        self.stack, self.ledger = stack, ledger

    def run(self) -> None:
        while not self.ledger.stopping.is_set():
            try:
                self.round()
                self.ledger.count(self.attack, "rounds")
            except Exception as exc:  # noqa: BLE001 (recorded, shown at the end)
                self.ledger.violation(self.attack, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
                time.sleep(0.5)
            self.ledger.stopping.wait(self.pause_s)

    def round(self) -> None:
        raise NotImplementedError

    def check(self, condition: bool, message: str) -> bool:
        return self.ledger.check(condition, self.attack, message)

    def count(self, what: str, n: int = 1) -> None:
        self.ledger.count(self.attack, what, n)


# ---------------------------------------------------------------- server-sent events


def sse(response: httpx.Response) -> Iterator[tuple[str, str]]:
    """(event, data) of each event of an SSE response (`message` where it names none)."""
    event, data = "message", []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event, "\n".join(data)


# ---------------------------------------------------------------- good requests and their channels

GOOD = {
    "greedy": {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
               "ignore_eos": True},
    "seeded": {"model": "tiny", "prompt": "A message queue carries", "max_tokens": 24, "temperature": 0.9,
               "top_p": 0.95, "seed": 11, "ignore_eos": True},
    "seeded-n2": {"model": "tiny", "prompt": "Write a short poem", "max_tokens": 16, "temperature": 1.0, "seed": 5,
                  "n": 2, "ignore_eos": True},
    "fake": {"model": "fake", "prompt": "fake engine text", "max_tokens": 40},
}
CHANNELS = ("chat-stream", "chat-blocking", "jobs-events", "producer", "producer-stream")
Tokens = list[list[int]]


def _chat_body(request: dict[str, Any], stream: bool) -> dict[str, Any]:
    body = {k: v for k, v in request.items() if k != "prompt"}
    return {**body, "messages": [{"role": "user", "content": request["prompt"]}], "stream": stream,
            "return_token_ids": True}


def _choices(n: int) -> Tokens:
    return [[] for _ in range(n)]


def run_good(stack: Stack, producer: Client, channel: str, label: str,
             ledger: Optional[Ledger] = None) -> tuple[Tokens, str]:
    """One good request through one channel; the token ids of each choice, and the job's id."""
    request = GOOD[label]
    n = request.get("n", 1)
    if channel == "chat-blocking":
        with stack.http("acme") as http:
            response = http.post("/chat/completions", json=_chat_body(request, False))
        assert response.status_code == 200, (response.status_code, response.text[:500])
        job_id = response.headers["x-mlxq-job-id"]
        if ledger:
            ledger.good_job(job_id, label)
        return [choice["token_ids"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])], job_id
    if channel == "chat-stream":
        tokens, done, errors = _choices(n), False, []
        with stack.http("acme") as http, http.stream("POST", "/chat/completions",
                                                     json=_chat_body(request, True)) as response:
            assert response.status_code == 200, (response.status_code, response.read()[:500])
            job_id = response.headers["x-mlxq-job-id"]
            if ledger:
                ledger.good_job(job_id, label)
            for _, data in sse(response):
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    errors.append(chunk["error"])
                for choice in chunk.get("choices", []):
                    tokens[choice["index"]].extend(choice.get("token_ids") or [])
        assert done and not errors, (done, errors)
        return tokens, job_id
    if channel == "jobs-events":
        with stack.http("acme") as http:
            job = http.post("/jobs", json={**request, "stream": True})
            assert job.status_code == 200, job.text[:500]
            job_id = job.json()["id"]
            if ledger:
                ledger.good_job(job_id, label)
            tokens, end = _choices(n), None
            with http.stream("GET", f"/jobs/{job_id}/events") as response:
                assert response.status_code == 200, response.read()[:500]
                for event, data in sse(response):
                    payload = json.loads(data)
                    assert event in ("token", "end"), (event, payload)
                    if event == "token":
                        tokens[payload["index"]].extend(payload["token_ids"])
                    else:
                        end = payload
            assert end is not None and end["status"] == "finished", end
            polled = http.get(f"/jobs/{job_id}").json()
            assert polled["status"] == "finished", polled
            assert [c["token_ids"] for c in polled["result"]["choices"]] == tokens, (polled, tokens)
        return tokens, job_id
    if channel == "producer":
        job_id = producer.submit(request)
        if ledger:
            ledger.good_job(job_id, label)
        result = producer.wait(job_id, timeout=300)
        assert result.status == "finished", result
        return [choice.token_ids for choice in result.choices], job_id
    if channel == "producer-stream":
        job_id = producer.submit({**request, "stream": True})
        if ledger:
            ledger.good_job(job_id, label)
        tokens = _choices(n)
        for event in producer.stream(job_id, timeout=300):
            assert event["event"] in ("token", "end"), event
            if event["event"] == "token":
                tokens[event["index"]].extend(event["token_ids"])
            else:
                assert event["status"] == "finished", event
        return tokens, job_id
    raise AssertionError(channel)


def alone(stack: Stack, producer: Client) -> dict[tuple[str, str], Tokens]:
    """Every good request through every channel, one at a time with nothing else running."""
    return {(channel, label): run_good(stack, producer, channel, label)[0] for channel in CHANNELS for label in GOOD}


class GoodClient(Actor):
    """One channel's good traffic: every good request in turn, each compared with its run alone."""

    def __init__(self, stack: Stack, ledger: Ledger, producer: Client, channel: str,
                 reference: dict[tuple[str, str], Tokens]) -> None:
        self.attack = f"good:{channel}"
        super().__init__(stack, ledger)
        self.producer, self.channel, self.reference = producer, channel, reference
        self._turn = 0

    def round(self) -> None:
        label = list(GOOD)[self._turn % len(GOOD)]
        self._turn += 1
        tokens, job_id = run_good(self.stack, self.producer, self.channel, label, self.ledger)
        if self.check(tokens == self.reference[(self.channel, label)],
                      f"{label} (job {job_id}): {tokens} != alone {self.reference[(self.channel, label)]}"):
            self.count(f"{label} same as alone")


def wait_all(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
