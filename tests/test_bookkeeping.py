"""The bookkeeping thread's gate (worker/bookkeeping.py, LoopGate): bookkeeping waits while the
batch loop is between two steps, and near the expected end of a step, and never for good."""

from __future__ import annotations

import threading
import time

from worker.bookkeeping import LoopGate


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
