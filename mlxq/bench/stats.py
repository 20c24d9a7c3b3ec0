"""Percentiles and per-workload summaries of request records."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from mlxq.bench.workloads import RequestRecord, Workload


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on already sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    position = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    if low == high:
        return float(sorted_values[low])
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low))


def median(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of the values present (None ones skipped); None if there are none."""
    present = sorted(v for v in values if v is not None)
    return percentile(present, 50) if present else None


def distribution(values: Sequence[Optional[float]]) -> Optional[dict[str, float]]:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return {
        "p50": percentile(present, 50),
        "p95": percentile(present, 95),
        "p99": percentile(present, 99),
        "mean": sum(present) / len(present),
        "max": present[-1],
        "count": len(present),
    }


def summarize(workload: Workload, records: list[RequestRecord]) -> dict[str, Any]:
    """Throughput over the whole workload (first arrival to last finish) and latency percentiles.

    A request counts as completed when it finished without error and produced every token it asked
    for (n x max_tokens: every arm ignores EOS); anything else is a failure, with its reason.
    """
    expected = {r.index: r.expected_tokens for r in workload.requests}
    completed = [r for r in records if r.ok and r.tokens == expected.get(r.index)]
    done = {id(r) for r in completed}
    failed = [r for r in records if id(r) not in done]
    missing = len(workload.requests) - len(records)
    finishes = [r.finished for r in records if r.finished is not None]
    start = min((r.arrival for r in records), default=0.0)
    wall = (max(finishes) - start) if finishes else 0.0
    tokens = sum(r.tokens for r in completed)
    reasons: dict[str, int] = {}
    for record in failed:
        reason = record.error or f"{record.tokens} of {expected.get(record.index)} tokens"
        reasons[reason[:160]] = reasons.get(reason[:160], 0) + 1
    if missing:
        reasons["no record"] = missing
    return {
        "requests": len(workload.requests),
        "completed": len(completed),
        "failed": len(failed) + missing,
        "failure_reasons": reasons,
        "tokens": tokens,
        "expected_tokens": workload.expected_tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(completed) / wall if wall > 0 else None,
        "queue_s": distribution([r.started - r.arrival if r.started is not None else None for r in completed]),
        "ttft_s": distribution([r.first_token - r.arrival if r.first_token is not None else None for r in completed]),
        "e2e_s": distribution([r.finished - r.arrival if r.finished is not None else None for r in completed]),
    }


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or not denominator:
        return None
    return numerator / denominator
