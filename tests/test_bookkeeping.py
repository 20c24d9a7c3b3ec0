"""The bookkeeping thread's gate (worker/gate.py, LoopGate): bookkeeping waits while the
batch loop is between two steps, and near the expected end of a step, and never for good."""

from __future__ import annotations

import threading
import time

import pytest

from worker.gate import LoopGate, StepRhythm


def _waiter(gate: LoopGate) -> threading.Event:
    """A thread that waits at the gate once; the event is set when it got through."""
    through = threading.Event()
    threading.Thread(target=lambda: (gate.wait(), through.set()), daemon=True).start()
    return through


def test_an_idle_loop_or_a_step_without_an_expected_length_lets_bookkeeping_through() -> None:
    gate = LoopGate(max_hold_s=30)
    assert _waiter(gate).wait(5)
    gate.step_started(None)
    assert _waiter(gate).wait(5)


def test_bookkeeping_waits_between_steps_until_the_next_step_starts() -> None:
    gate = LoopGate(max_hold_s=30)
    gate.step_started(10.0)
    gate.step_ended()
    through = _waiter(gate)
    assert not through.wait(0.2)
    gate.step_started(10.0)
    assert through.wait(5)


def test_bookkeeping_waits_near_a_steps_expected_end_and_is_let_through_by_the_next_step() -> None:
    gate = LoopGate(max_hold_s=30)
    gate.step_started(0.004)  # expected to end in 4 ms: bookkeeping holds off from 3 ms on
    time.sleep(0.01)
    through = _waiter(gate)
    assert not through.wait(0.2)  # the step runs past its expected end
    gate.step_ended()
    assert not through.wait(0.1)
    gate.step_started(10.0)
    assert through.wait(5)


def test_waiting_for_the_loop_releases_the_gate() -> None:
    gate = LoopGate(max_hold_s=30)
    gate.step_ended()
    through = _waiter(gate)
    assert not through.wait(0.1)
    gate.release()  # what Bookkeeper.wait_idle does first
    assert through.wait(5)


def test_a_gate_left_closed_holds_bookkeeping_once_then_no_more_in_that_phase() -> None:
    gate = LoopGate(max_hold_s=0.05)
    gate.step_ended()
    assert _waiter(gate).wait(5)  # after max_hold_s
    started = time.perf_counter()
    for _ in range(100):
        gate.wait()
    assert time.perf_counter() - started < 1.0  # 100 holds would take 5 s
    gate.step_started(10.0)
    gate.step_ended()  # a new phase holds again
    assert not _waiter(gate).wait(0.01)


def test_the_loop_gates_bookkeeping_only_while_steps_are_long_and_off_its_cpu() -> None:
    now, cpu = [0.0], [0.0]
    rhythm = StepRhythm(min_step_s=0.002, step_to_turn=4, keep=4, clock=lambda: now[0], cpu_clock=lambda: cpu[0])

    def turn(step_s: float, turn_s: float, step_cpu_s: float = 0.0) -> tuple[object, bool]:
        expected = rhythm.step_started()
        now[0] += step_s
        cpu[0] += step_cpu_s
        gated = rhythm.step_ended()
        now[0] += turn_s
        cpu[0] += turn_s
        return expected, gated

    # near-free steps (an engine that is all Python): the loop is mostly turns, never gated
    assert [turn(0.001, 0.003, 0.001) for _ in range(6)] == [(None, False)] * 6
    # 10 ms steps with 0.3 ms turns: gated once the short steps have left the window of four
    results = [turn(0.010, 0.0003) for _ in range(6)]
    assert [gated for _, gated in results] == [False, False, False, True, True, True]
    assert results[-1][0] == pytest.approx(0.010)  # the next step is expected to last as long as the shortest
    # a step that runs long does not lengthen the expectation; a long turn alone does not ungate
    assert turn(0.050, 0.005) == (pytest.approx(0.010), True)
    assert turn(0.010, 0.0003) == (pytest.approx(0.010), True)
    # a step the loop's thread spends mostly on its CPU (host-bound) ungates at once
    assert turn(0.020, 0.0003, step_cpu_s=0.015) == (pytest.approx(0.010), False)


def test_a_stop_ends_the_backoff_of_an_upkeep_task_against_a_redis_that_is_gone() -> None:
    """A stopping worker drops upkeep tasks; one asleep in a long backoff held the stop for all of it."""
    import redis

    from mlxq.redis_server import free_port
    from worker.bookkeeping import Bookkeeper
    from worker.redis_health import RedisHealth

    gone = redis.Redis(port=free_port(), socket_connect_timeout=1)
    health = RedisHealth(gone, first_backoff_s=60, max_backoff_s=60)
    attempts: list[float] = []

    def upkeep() -> None:
        attempts.append(time.monotonic())
        gone.ping()  # refused: nothing listens there

    keeper = Bookkeeper(health).start()
    keeper.submit(upkeep, upkeep=True)
    deadline = time.monotonic() + 10
    while health.up and time.monotonic() < deadline:  # redis-py retries a refused connect itself first
        time.sleep(0.01)
    assert not health.up, "the task never met the refused connection"
    time.sleep(0.2)  # into the backoff
    started = time.monotonic()
    keeper.stop(timeout=120)
    assert time.monotonic() - started < 30, "the stop waited out the task's 60 s backoff"
    assert len(attempts) == 1 and keeper.idle
