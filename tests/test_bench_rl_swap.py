"""`mlxq bench --scenario rl`'s weight swap (mlxq/bench/scenario_rl_swap.py): the trace read back from
streams and results, a swap's cost from a trace, and a run of the real harness on the tiny model.
No timing assertions: accounting and shape only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fakeredis
import pytest

from mlxq.bench.scenario_rl_swap import LoadTrace, Span, Swap, analyze, read_trace, swap_durations
from producer import Client
from schemas import keys
from schemas.result import Choice, GenerationResult


def stream_tokens(conn: fakeredis.FakeRedis, job_id: str, times_ms: list[int]) -> None:
    for i, t in enumerate(times_ms):
        event = {"event": "token", "index": 0, "token_ids": [i], "text": ""}
        conn.xadd(keys.stream_key(job_id), {"data": json.dumps(event)}, id=f"{t}-0")


def test_a_trace_gives_an_aborted_attempts_tokens_to_no_worker() -> None:
    conn = fakeredis.FakeRedis()
    # job a: 3 tokens, then sent back by an abort, then 4 tokens on worker w2 (its result); job b: plain
    stream_tokens(conn, "a", [1000, 1010, 1020, 1500, 1510, 1520, 1530])
    stream_tokens(conn, "b", [1000, 1010])
    for job_id, tokens, worker in (("a", 4, "w2"), ("b", 2, "w1")):
        result = GenerationResult(id=job_id, status="finished", worker=worker,
                                  choices=[Choice(index=0, text="", token_ids=list(range(tokens)))])
        conn.set(keys.result_key(job_id), result.model_dump_json())
    trace = read_trace(conn, Client(connection=conn), ["a", "b"])
    assert trace.jobs == trace.finished == 2
    spans = sorted((s.worker or "-", s.start, s.end, s.tokens) for s in trace.spans)
    assert spans == [("-", 1.0, 1.02, 3), ("w1", 1.0, 1.01, 2), ("w2", 1.5, 1.53, 4)]
    assert sum(n for _, n, w in trace.events if w is None) == 3


def test_a_swaps_cost_is_the_decoding_the_fleet_did_not_do_and_the_decoding_thrown_away() -> None:
    # 10 sequences decode on one worker, a token event every 10 ms, from t=0 to t=10, except that
    # from 5.0 to 5.3 none does; and one attempt of 1 s, ending at 5.0, is thrown away.
    spans = [Span(0.0, 5.0, "w", 500) for _ in range(9)] + [Span(4.0, 5.0, None, 100), Span(0.0, 4.0, "w", 400)]
    spans += [Span(5.3, 10.0, "w", 470) for _ in range(10)]
    events = [(i / 100, 10, "w") for i in range(1000) if not 500 < i < 530]
    trace = LoadTrace(events, spans, jobs=21, finished=21)
    swap = Swap(1, "abort", 0, 1, issued_at=4.95, acks={"w": 5.25}, ok=True, swap_s={"w": 0.01})
    cost = analyze(swap, trace, steady_s=2.0)
    assert cost["sequences_decoding_before"] == pytest.approx(10.0)
    window = 5.25 + 2.0 - 4.95
    assert cost["window_s"] == pytest.approx(window)
    assert cost["idle_sequence_s"] == pytest.approx(10 * 0.3)  # nothing decoded from 5.0 to 5.3
    assert cost["discarded_tokens"] == 100 and cost["discarded_sequence_s"] == pytest.approx(1.0)
    assert cost["fleet_s_lost"] == pytest.approx((3.0 + 1.0) / 10)
    worker = cost["per_worker"]["w"]
    assert worker["longest_gap_ms"] == pytest.approx(300) and worker["step_ms"]["p50"] == pytest.approx(10)
    assert worker["ack_s"] == pytest.approx(0.3) and worker["swap_s"] == 0.01
    decoding = cost["series"]["sequences_decoding"]  # in 0.1 s bins from 1 s before the publish
    assert decoding[0] == pytest.approx(10.0) and decoding[12] == 0 and decoding[14] == pytest.approx(10.0)


def test_swap_durations_are_read_from_the_workers_log_lines(tmp_path: Path) -> None:
    (tmp_path / "bench-1-0.log").write_text("12:00:00 mlxq.worker swapped in version 3 of the weights (inflight) "
                                            "in 0.25 s\nother\n")
    assert swap_durations([tmp_path / "bench-1-0.log", tmp_path / "missing.log"]) == {("bench-1-0", 3): 0.25}


@pytest.mark.slow
def test_the_rl_swap_bench_publishes_under_each_policy_to_a_decoding_worker(tiny_model_dir: str,
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "rl-swap"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--out", str(out), "--arms", "",
            "--scenario", "rl", "--rl-parts", "swap,adapters", "--workers", "1", "--prompt-tokens", "16",
            "--rl-swap-sequences", "8", "--rl-swap-new-tokens", "24", "--rl-swap-steady", "1", "--rl-swap-rounds", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rl = json.loads((out / "report.json").read_text())["scenarios"]["rl"]
    adapters = rl["adapters"]
    assert adapters["status"] == "measured" and adapters["adapters"] == 3
    assert adapters["base_tokens_per_s"] > 0 and adapters["mixed_tokens_per_s"] > 0 and adapters["ratio"] > 0
    assert int(adapters["worker_adapter_counters"]["adapters_resident"]) == 3
    swap = rl["swap"]
    assert [(r["policy"], r["version"], r["ok"]) for r in swap["runs"]] == [
        ("drain", 1, True), ("abort", 2, True), ("inflight", 3, True)]
    for run in swap["runs"]:
        (worker,) = run["per_worker"].values()
        assert worker["swap_s"] is not None and worker["longest_gap_ms"] is not None, run
        assert run["sequences_decoding_before"] > 0 and run["fleet_s_lost"] is not None
        assert (run["discarded_tokens"] > 0) == (run["policy"] == "abort"), run  # only abort throws work away
    assert swap["load_jobs"]["1"] > 8
    assert "RL weight swap" in (out / "table.md").read_text()
    assert "RL mixed adapters" in (out / "table.md").read_text()
