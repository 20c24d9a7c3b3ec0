"""Rollouts through the queue: the requests of one batch, the samples their results hold, the toy
reward and group-normalised advantages, and the checks every batch must pass."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from policy import Sample

from schemas import GenerationResult

# Every prompt starts with the same instruction, as RL prompts often do: long enough (23 tokens) for
# the worker's prefix cache to share it, so that the checks cover prefills served from that cache.
INSTRUCTION = ("A message queue carries jobs from web servers to workers, and each worker batches many requests "
               "on one accelerator. ")
PROMPTS = [
    "The quick brown fox",
    "A message queue carries jobs",
    "Numbers 0 1 2 3",
    "Hello world! How are you",
    "Redis keeps the queue",
    "Write a short poem about the sea.",
    "Tokens are sampled one step at a time;",
    "Explain continuous batching.",
]
LOGPROB_TOLERANCE = 1e-4


def reward(token_ids: list[int]) -> float:
    """The toy reward: how many of a sample's tokens have an id that is a multiple of 8 (an eighth
    of the vocabulary: about max_tokens / 8 for the random model at the start). A count, not a
    share: a share would reward the policy for ending its samples early."""
    return float(sum(t % 8 == 0 for t in token_ids))


def group_advantages(samples: list[Sample]) -> None:
    """GRPO's advantage: each reward less its group's mean, over the group's standard deviation."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    for members in groups.values():
        rewards = [s.reward for s in members]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        for s in members:
            s.advantage = (s.reward - mean) / (std + 1e-4)


def batch_requests(model: str, step: int, prompts: int, n: int, max_tokens: int, min_version: int
                   ) -> list[dict[str, Any]]:
    """One batch: `prompts` prompts (cycling through PROMPTS) with `n` samples each, the exact
    logprobs of the distribution they are drawn from (raw logprobs at temperature 1.0, no top-p,
    top-k or penalties), and the version just published as the lowest that may run them."""
    return [{"model": model, "prompt": INSTRUCTION + PROMPTS[(step * prompts + i) % len(PROMPTS)], "n": n,
             "max_tokens": max_tokens, "temperature": 1.0, "seed": step * 1000 + i, "logprobs": True,
             "logprobs_mode": "raw", "return_prompt_token_ids": True, "min_weight_version": min_version,
             "custom_id": f"step{step}-prompt{i}"}
            for i in range(prompts)]


@dataclass
class Batch:
    """A submitted batch: its job ids and the lowest version each may run on."""

    step: int
    job_ids: list[str]
    min_version: int


@dataclass
class BatchCheck:
    """What the checks found in one batch's results."""

    jobs: int = 0
    finished: int = 0
    below_min: list[str] = field(default_factory=list)  # job ids that ran on a version below their minimum
    unknown_version: list[str] = field(default_factory=list)  # versions the trainer never published
    tokens_checked: int = 0
    max_logprob_error: float = 0.0
    mismatched: list[str] = field(default_factory=list)  # choices whose logprobs differ beyond the tolerance
    versions: Counter = field(default_factory=Counter)  # choices by the version that sampled their first token
    mixed: int = 0  # choices whose tokens came from two versions (inflight)

    @property
    def lost(self) -> int:
        return self.jobs - self.finished

    @property
    def ok(self) -> bool:
        return not (self.lost or self.below_min or self.unknown_version or self.mismatched)

    def as_json(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "finished": self.finished, "lost": self.lost, "below_min": self.below_min,
                "unknown_version": self.unknown_version, "tokens_checked": self.tokens_checked,
                "max_logprob_error": self.max_logprob_error, "mismatched": self.mismatched[:20],
                "choices_by_version": {str(v): c for v, c in sorted(self.versions.items())},
                "mixed_version_choices": self.mixed, "ok": self.ok}


def collect(batch: Batch, results: dict[str, GenerationResult], known_versions: set[int],
            replay: Callable[[list[Sample]], list[list[float]]]) -> tuple[list[Sample], BatchCheck]:
    """The batch's samples, each checked: finished, on a version at or above the request's
    minimum, with logprobs equal to the trainer's replay under the versions the result records.
    Only samples that pass are returned (to train on)."""
    check = BatchCheck(jobs=len(batch.job_ids))
    candidates: list[tuple[str, Sample]] = []
    for group, job_id in enumerate(batch.job_ids):
        result: Optional[GenerationResult] = results.get(job_id)
        if result is None or result.status != "finished":
            continue
        check.finished += 1
        for choice in result.choices:
            segments = [(int(s), int(v)) for s, v in (choice.weight_versions or [(0, choice.weight_version)])]
            used = {v for _, v in segments} | {result.weight_version, choice.weight_version}
            if any(v is None or v < batch.min_version for v in used):
                check.below_min.append(job_id)
            elif not used <= known_versions:
                check.unknown_version.append(job_id)
            elif len(choice.logprobs or []) != len(choice.token_ids) or not choice.token_ids:
                check.mismatched.append(f"{job_id}/{choice.index}")
            else:
                check.versions[segments[0][1]] += 1
                check.mixed += len({v for _, v in segments}) > 1
                candidates.append((f"{job_id}/{choice.index}", Sample(
                    group, list(result.prompt_token_ids or []), choice.token_ids, choice.logprobs or [], segments)))
    samples = []
    for (name, sample), expected in zip(candidates, replay([s for _, s in candidates])):
        errors = [abs(a - b) for a, b in zip(sample.logprobs, expected)]
        check.tokens_checked += len(expected)
        check.max_logprob_error = max(check.max_logprob_error, max(errors))
        if max(errors) > LOGPROB_TOLERANCE:
            first = next(i for i, e in enumerate(errors) if e > LOGPROB_TOLERANCE)
            check.mismatched.append(f"{name} from token {first} (versions {sample.segments})")
            continue
        sample.reward = reward(sample.token_ids)
        samples.append(sample)
    group_advantages(samples)
    return samples, check
