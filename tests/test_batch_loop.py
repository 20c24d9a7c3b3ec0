"""The batch loop's policies, in process and in milliseconds: the real loop and scheduler on the
deterministic fake engine, with a fake job source, RQ side and bookkeeping around them, and a
clock the test moves by hand. (Real worker processes prove the same behaviour end to end in
test_reliability.py and test_admission.py.)"""

from __future__ import annotations

import contextlib
import json
import queue
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from worker.allowlist import Refusal
from worker.batch_loop import ADMIT_PER_TURN_WHILE_DECODING, CANCEL_CHECK_INTERVAL_S, BatchLoop
from worker.engines.device_loss import DeviceLost
from worker.engines.fake import LOSE_DEVICE_IN_STEP, RAISE_IN_STEP, FakeEngine
from worker.loop_interfaces import InFlight, StartedJob
from worker.poll import Poll, TakenJob
from worker.scheduler import BatchScheduler
from worker.settings import WorkerSettings
from schemas.redis_busy import ServerBusy


@dataclass
class FakeJob:
    id: str
    result_ttl: Optional[int] = None


@dataclass
class FakeSource:
    waiting: list[tuple[str, dict]] = field(default_factory=list)
    cancel: set[str] = field(default_factory=set)
    polls: list[tuple[int, bool]] = field(default_factory=list)  # (room, check_cancels) of each poll

    def poll(self, room: int, check_cancels: bool) -> Poll:
        self.polls.append((room, check_cancels))
        taken, self.waiting = self.waiting[:room], self.waiting[room:]
        found = set(self.cancel) if check_cancels else set()
        return Poll([TakenJob(0, job_id.encode(), {b"request": json.dumps(r).encode()}) for job_id, r in taken],
                    found, [], len(self.waiting))

    def wait(self, timeout_s: int) -> Optional[TakenJob]:
        return self.poll(1, False).taken[0] if self.waiting else None

    def started(self, job_ids: list[str]) -> None:
        pass

    def ended(self, job_ids: list[str]) -> None:
        pass

    def stay_in_group(self) -> None:
        pass

    def version_changed(self) -> None:
        pass


@dataclass
class FakeRQ:
    stop_requested: bool = False
    stop_job_ids: set[str] = field(default_factory=set)
    timeouts: dict[str, int] = field(default_factory=dict)
    solo: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    recorded_again: list[str] = field(default_factory=list)
    busy_starts: int = 0  # the next this many starts meet the server BUSY (nothing written)

    def start_jobs(self, taken: list[TakenJob], weight_version: int = 0) -> tuple[list[StartedJob], list]:
        if self.busy_starts:
            self.busy_starts -= 1
            raise ServerBusy("BUSY Redis is busy running a script")
        started = []
        for item in taken:
            job_id = item.job_id
            inflight = InFlight(FakeJob(job_id), None, None, None,  # type: ignore[arg-type]
                                payload=json.loads(item.fields[b"request"]), solo=job_id in self.solo,
                                callbacks_allowed=True)
            refusal = Refusal("FunctionNotAllowed", "not on the allowlist") if job_id in self.refused else None
            started.append(StartedJob(inflight, 0.0, self.timeouts.get(job_id), refusal, False))
        return started, []

    def drop_taken(self, taken: list[TakenJob], running: list[InFlight]) -> None:
        self.dropped += [item.job_id for item in taken]
        self.recorded_again += [inflight.job.id for inflight in running]

    def take_stop_job_ids(self) -> set[str]:
        ids, self.stop_job_ids = self.stop_job_ids, set()
        return ids

    def notice_stop(self) -> None:
        pass

    def idle(self, burst: bool) -> None:
        pass

    def beat_now(self) -> None:
        pass

    def run_maintenance(self) -> None:
        self.calls.append("maintenance")

    def sweep(self, running: frozenset[str]) -> None:
        self.calls.append("sweep")

    def enqueue_due_retries(self) -> None:
        self.calls.append("retries")


class FakeBookkeeper:
    """Runs each task at once, as the bookkeeping thread would by the next turn."""

    idle = True

    def submit(self, task, upkeep: bool = False) -> None:
        task()

    def step_started(self, expected_s) -> None:
        pass

    def step_ended(self) -> None:
        pass

    def release(self) -> None:
        pass

    def wait_idle(self, timeout=None) -> bool:
        return True


class FakeEnding:
    def __init__(self) -> None:
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.results: dict[str, Any] = {}
        self.requeued: list[str] = []
        self.requeued_alone: list[str] = []
        self.held: Optional[list] = None  # endings kept from `done` (being written) while not None
        self.runs_dropped: set[str] = set()  # endings bookkeeping dropped, taken for another worker's
        self.claimed: list[str] = []
        self.marks_forgotten: list[str] = []

    def hand_off(self, endings, deltas, stream_ttls, stats) -> None:
        for ending in endings:
            self.results[ending.job_id] = ending.outcome.result()
            if self.held is None:
                self.done.put(ending)
            else:
                self.held.append(ending)

    def claim_copy(self, job_id: str) -> bool:
        if job_id in self.runs_dropped:
            return False
        self.claimed.append(job_id)
        return True

    def forget_marks(self, job_id: str) -> None:
        self.marks_forgotten.append(job_id)

    def requeue(self, ending, alone: bool = False) -> None:
        self.requeued.append(ending.job_id)
        if alone:
            self.requeued_alone.append(ending.job_id)
        self.done.put(ending)

    def refuse(self, refused) -> None:
        pass


class UpHealth:
    up = True

    def try_reconnect(self, wait: bool = False) -> bool:
        return True

    def lost(self, exc: BaseException) -> None:
        raise AssertionError(f"no Redis here: {exc!r}")


class AwayHealth(UpHealth):
    """Redis goes away when a call fails, and answers again at the next reconnect."""

    def __init__(self) -> None:
        self.losses: list[BaseException] = []

    def try_reconnect(self, wait: bool = False, stop_waiting: Any = None) -> bool:
        self.up = True
        return True

    def lost(self, exc: BaseException) -> None:
        self.up = False
        self.losses.append(exc)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_loop(max_num_seqs: int = 8, health: Optional[UpHealth] = None, engine: Optional[FakeEngine] = None,
              **settings: Any) -> tuple[BatchLoop, FakeSource, FakeRQ, FakeEnding, Clock]:
    source, rq, ending, clock = FakeSource(), FakeRQ(), FakeEnding(), Clock()
    scheduler = BatchScheduler(engine if engine is not None else FakeEngine(), max_num_seqs=max_num_seqs, worker_name="w")
    loop = BatchLoop(scheduler, source, rq, FakeBookkeeper(), ending, health or UpHealth(),  # type: ignore[arg-type]
                     WorkerSettings(max_num_seqs=max_num_seqs, **settings), "mlxq:stats:w", clock=clock)
    return loop, source, rq, ending, clock


def request(length: int, first: int = 5) -> dict:
    return {"prompt_token_ids": [first, 6], "max_tokens": length, "temperature": 0, "ignore_eos": True}


def turns(loop: BatchLoop, clock: Clock, count: int, step_s: float = 0.01) -> None:
    for _ in range(count):
        loop.turn()
        clock.now += step_s


def test_a_full_worker_looks_for_cancel_keys_on_a_cadence_not_every_turn():
    loop, source, _, _, clock = make_loop(max_num_seqs=2)
    source.waiting = [("a", request(1000)), ("b", request(1000))]
    turns(loop, clock, 3)
    source.polls.clear()
    turns(loop, clock, 50, step_s=0.01)  # 0.5 s of turns with no room
    checks = [p for p in source.polls if p[1]]
    assert all(room == 0 for room, _ in source.polls)
    assert len(checks) == round(0.5 / CANCEL_CHECK_INTERVAL_S)
    assert len(source.polls) == len(checks)  # a poll without room is only ever a cancel check


def test_a_full_worker_tells_its_engine_whether_jobs_wait_in_its_queues_as_each_poll_finds():
    """A full engine's speculation judges a batch by whether a row that ends sooner frees its slot for
    a waiting job (worker/engines/speculation/graded.py): the loop passes on what each poll found."""
    heard: list[bool] = []

    class Watching(FakeEngine):
        def queue_seen(self, jobs_waiting: bool) -> None:
            heard.append(jobs_waiting)

    loop, source, _, _, clock = make_loop(max_num_seqs=2, engine=Watching())
    source.waiting = [("a", request(1000)), ("b", request(1000)), ("c", request(1000))]
    turns(loop, clock, 3)
    assert heard[0] is True and len(loop.scheduler) == 2  # "c" waits
    source.waiting.clear()  # another worker took it
    turns(loop, clock, round(2 * CANCEL_CHECK_INTERVAL_S / 0.01))  # full: only the cancel checks poll
    assert heard[-1] is False and len(heard) == len(source.polls)


def test_a_worker_with_room_looks_for_cancel_keys_at_every_poll():
    loop, source, _, _, clock = make_loop(max_num_seqs=8)
    source.waiting = [("a", request(500))]
    turns(loop, clock, 10)
    assert all(check for room, check in source.polls[1:])


def test_while_sequences_decode_a_turn_admits_at_most_the_cap():
    loop, source, _, _, clock = make_loop(max_num_seqs=512)
    source.waiting = [("first", request(500))]
    turns(loop, clock, 3)  # decoding now
    source.waiting = [(f"j{i}", request(20)) for i in range(300)]
    source.polls.clear()
    loop.turn()
    assert source.polls[0][0] == ADMIT_PER_TURN_WHILE_DECODING
    assert len(loop.scheduler) == 1 + ADMIT_PER_TURN_WHILE_DECODING


def test_an_idle_worker_takes_all_it_has_room_for_at_once():
    loop, source, _, _, clock = make_loop(max_num_seqs=512)
    source.waiting = [(f"j{i}", request(20)) for i in range(300)]
    loop.turn()
    assert source.polls[0][0] == 512 and len(loop.scheduler) == 300


def test_an_id_taken_again_while_its_job_runs_or_twice_in_a_poll_starts_once_and_keeps_no_slot():
    loop, source, rq, ending, clock = make_loop(max_num_seqs=2)
    source.waiting = [("twice", request(30)), ("twice", request(30))]
    loop.turn()
    source.waiting = [("twice", request(30))]
    turns(loop, clock, 2)
    assert rq.dropped == ["twice", "twice"] and loop.scheduler.job_ids == ["twice"]
    assert rq.recorded_again == ["twice"]  # the run here, when a copy came off while it ran (not in its own poll)
    turns(loop, clock, 40)
    assert ending.results["twice"].status == "finished" and loop.scheduler.free_slots == 2


def test_a_copy_taken_while_the_run_is_ending_is_dropped_unless_that_run_was_dropped_first():
    """A sweep sends a job back to its queue once its run's records are gone; the worker whose run of it
    is ending (its result being written) takes that copy. Bookkeeping decides once which stands: the run
    (the copy is dropped; bookkeeping writes the run's records again), or, if it had already dropped the
    run for another worker's, the copy, which is then the job's next run here. Dropping both lost the job."""
    loop, source, rq, ending, clock = make_loop()
    ending.held = []
    source.waiting = [("stands", request(3)), ("dropped", request(3))]
    turns(loop, clock, 6)
    assert sorted(ending.results) == ["dropped", "stands"] and len(loop.scheduler) == 0
    first = ending.results["dropped"]
    ending.runs_dropped = {"dropped"}
    source.waiting = [("stands", request(3)), ("dropped", request(3))]
    turns(loop, clock, 1)
    assert rq.dropped == ["stands"] and ending.claimed == ["stands"] and rq.recorded_again == []
    assert loop.scheduler.job_ids == ["dropped"]  # the copy runs
    for record in ending.held:  # the old endings come back: the new run stays
        ending.done.put(record)
    ending.held = None
    turns(loop, clock, 6)
    assert ending.results["dropped"] is not first and ending.results["dropped"].status == "finished"
    assert sorted(ending.marks_forgotten) == ["dropped", "dropped", "stands"]
    assert len(loop.scheduler) == 0 and not loop.running


def test_a_job_past_its_deadline_ends_timed_out_and_its_neighbour_goes_on():
    loop, source, rq, ending, clock = make_loop()
    rq.timeouts = {"late": 1}
    source.waiting = [("late", request(1000)), ("fine", request(1000))]
    turns(loop, clock, 20, step_s=0.01)
    assert not ending.results
    clock.now += 2
    turns(loop, clock, 10)
    late = ending.results["late"]
    assert late.status == "failed" and late.error.type == "JobTimeoutException"
    assert late.choices[0].finish_reason == "timeout" and 0 < len(late.choices[0].token_ids) < 1000
    assert "fine" in loop.scheduler.job_ids


def test_cancel_keys_and_rq_stop_commands_end_running_jobs_with_their_partial_output():
    loop, source, rq, ending, clock = make_loop()
    source.waiting = [("keyed", request(1000)), ("commanded", request(1000)), ("kept", request(1000))]
    turns(loop, clock, 5)
    source.cancel = {"keyed", "not-ours"}
    rq.stop_job_ids = {"commanded"}
    turns(loop, clock, 2)
    for job_id in ("keyed", "commanded"):
        assert ending.results[job_id].status == "cancelled"
        assert ending.results[job_id].choices[0].finish_reason == "cancelled"
    assert loop.scheduler.job_ids == ["kept"]


def test_a_failed_step_requeues_its_jobs_to_run_alone_and_fails_the_one_that_fails_alone():
    loop, source, rq, ending, clock = make_loop()
    source.waiting = [("poison", request(10, first=RAISE_IN_STEP)), ("bystander", request(10))]
    turns(loop, clock, 2)
    assert sorted(ending.requeued) == ["bystander", "poison"] and not ending.results
    assert len(loop.scheduler) == 0
    rq.solo = {"poison", "bystander"}  # what the re-queue's job meta says when they come back
    source.waiting = [("poison", request(10, first=RAISE_IN_STEP))]
    turns(loop, clock, 2)
    assert ending.results["poison"].error.type == "EngineError"
    source.waiting = [("bystander", request(10))]
    turns(loop, clock, 15)
    assert ending.results["bystander"].status == "finished"


def test_a_lost_device_sends_every_job_back_and_ends_the_loop_without_touching_the_engine_again():
    """CUDA's sticky errors leave nothing runnable in the process: re-running the batch alone (the answer
    to other failed steps) would fail every job, so they all go back to their queues, those of the failed
    step to run alone, and the loop ends."""
    loop, source, rq, ending, clock = make_loop(max_num_seqs=2)
    source.waiting = [("lost", request(10, first=LOSE_DEVICE_IN_STEP)), ("bystander", request(10)),
                      ("not-taken", request(10))]
    loop.scheduler.engine.reset = lambda: pytest.fail("the engine was reset on a lost device")
    with pytest.raises(DeviceLost, match="illegal memory access"):
        turns(loop, clock, 3)
    assert sorted(ending.requeued) == ["bystander", "lost"] and not ending.results
    assert sorted(ending.requeued_alone) == ["bystander", "lost"]
    assert len(loop.scheduler) == 0 and [job_id for job_id, _ in source.waiting] == ["not-taken"]


def test_a_job_that_loses_the_device_while_alone_fails_and_the_loop_still_ends():
    loop, source, rq, ending, clock = make_loop()
    rq.solo = {"lost"}
    source.waiting = [("lost", request(10, first=LOSE_DEVICE_IN_STEP))]
    with pytest.raises(DeviceLost):
        turns(loop, clock, 3)
    assert ending.results["lost"].error.type == "EngineError"
    assert "device fail even when run alone" in ending.results["lost"].error.message and not ending.requeued


def test_a_job_sent_back_to_its_queue_is_taken_again_before_its_old_entry_leaves():
    """An abort sends the running jobs back to their queue from the bookkeeping thread, and the loop
    may take one again before that thread has given its old record back: that is the job's next run,
    not a copy of a running job (dropped as one, the job was lost: never run, never ended)."""
    loop, source, rq, ending, clock = make_loop()
    source.waiting = [("a", request(50)), ("b", request(50))]
    turns(loop, clock, 2)
    loop.requeue_running()
    held = []  # the old records, given back by the bookkeeping thread only later
    while not ending.done.empty():
        held.append(ending.done.get())
    assert sorted(ending.requeued) == ["a", "b"] and len(loop.scheduler) == 0
    source.waiting = [("a", request(50)), ("b", request(50))]  # back on the queue, taken at once
    turns(loop, clock, 1)
    assert rq.dropped == [] and sorted(loop.scheduler.job_ids) == ["a", "b"]
    for record in held:  # the old records come back: the new runs stay
        ending.done.put(record)
    turns(loop, clock, 60)
    assert ending.results["a"].status == "finished" and ending.results["b"].status == "finished"
    assert len(ending.results["a"].choices[0].token_ids) == 50


def test_a_refused_job_ends_at_once_and_never_reaches_the_engine():
    loop, source, rq, ending, clock = make_loop()
    rq.refused = {"evil"}
    source.waiting = [("evil", request(5)), ("good", request(5))]
    loop.turn()
    assert ending.results["evil"].error.type == "FunctionNotAllowed"
    assert loop.scheduler.job_ids == ["good"]


def test_the_housekeeping_timers_hand_their_work_to_bookkeeping():
    loop, source, rq, _, clock = make_loop(sweep_interval_s=5)
    source.waiting = [("a", request(4000))]
    turns(loop, clock, 105, step_s=0.1)  # 10.5 s busy
    assert rq.calls.count("retries") == 11
    assert rq.calls.count("sweep") == 2
    assert "maintenance" not in rq.calls  # rq's maintenance waits for an idle worker
    source.cancel = {"a"}
    turns(loop, clock, 3)
    assert "maintenance" in rq.calls


def test_an_idle_worker_sweeps_once_an_interval_through_rqs_maintenance_and_a_busy_one_by_the_timer():
    """rq's maintenance begins with the sweep (BatchWorker.clean_registries): an idle worker that also
    ran the sweep timer swept twice an interval."""
    loop, source, rq, _, clock = make_loop(sweep_interval_s=5)
    turns(loop, clock, 195, step_s=0.1)  # 19.5 s idle: maintenance at 0, 5, 10 and 15 s
    assert rq.calls.count("maintenance") == 4 and "sweep" not in rq.calls
    source.waiting = [("a", request(4000))]
    turns(loop, clock, 40, step_s=0.1)  # busy until 23.5 s: the timer counts from the last maintenance
    assert rq.calls.count("sweep") == 1 and rq.calls.count("maintenance") == 4


def test_jobs_taken_just_before_redis_went_busy_start_once_it_answers_and_run_like_the_others():
    """A poll took the jobs off their queue, then the server went BUSY (a producer's script) before
    their start was recorded: they stayed in their intermediate lists, and the loop forgot them (no
    result, ever). They are kept and started first when Redis answers, by a busy loop and an idle one."""
    health = AwayHealth()
    loop, source, rq, ending, clock = make_loop(health=health)
    source.waiting = [("running", request(30)), ("taken", request(20, first=7))]
    turns(loop, clock, 1)
    source.waiting = [("late", request(20, first=9))]
    rq.busy_starts = 1
    turns(loop, clock, 1)  # took "late", could not record its start
    assert len(health.losses) == 1 and source.waiting == [] and "late" not in loop.scheduler.job_ids
    turns(loop, clock, 60)
    assert {job_id: r.status for job_id, r in ending.results.items()} == dict.fromkeys(
        ["running", "taken", "late"], "finished")
    alone, alone_source, _, alone_ending, alone_clock = make_loop()
    alone_source.waiting = [("late", request(20, first=9))]
    turns(alone, alone_clock, 30)
    assert ending.results["late"].choices[0].token_ids == alone_ending.results["late"].choices[0].token_ids

    idle_health = AwayHealth()
    idle, source, rq, ending, clock = make_loop(health=idle_health)
    source.waiting = [("first", request(6))]
    rq.busy_starts = 1
    assert idle.run(max_jobs=1) == 1  # the idle wait took it; its start met BUSY; the next turn started it
    assert len(idle_health.losses) == 1 and ending.results["first"].status == "finished"


def test_a_stop_request_takes_no_new_job_and_lets_the_running_ones_finish():
    loop, source, rq, ending, clock = make_loop()
    source.waiting = [("running", request(6))]
    turns(loop, clock, 2)
    rq.stop_requested = True
    source.waiting = [("late", request(6))]
    assert loop.run() == 0  # returns once the running job has ended
    assert ending.results["running"].status == "finished"
    assert source.waiting == [("late", request(6))]


def test_the_liveness_snapshot_holds_the_running_jobs_until_bookkeeping_is_done_with_them():
    loop, source, _, ending, clock = make_loop()
    source.waiting = [("a", request(3)), ("b", request(100))]
    loop.turn()
    assert sorted(loop.running_ids()) == ["a", "b"]
    ending.hand_off = lambda endings, *args: ending.results.update({e.job_id: e for e in endings})
    turns(loop, clock, 6)
    assert "a" in ending.results and sorted(loop.running_ids()) == ["a", "b"]  # its ending is not written yet
    ending.done.put(ending.results["a"])
    loop.turn()
    assert loop.running_ids() == ["b"]


def test_the_watchdog_wraps_every_engine_step():
    watched = []

    @contextlib.contextmanager
    def watchdog():
        watched.append("in")
        yield
        watched.append("out")

    loop, source, _, _, clock = make_loop()
    loop._watchdog = watchdog
    source.waiting = [("a", request(3))]
    turns(loop, clock, 4)
    assert watched == ["in", "out"] * 4
