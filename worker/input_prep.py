"""Preparing image jobs' inputs off the batch loop's thread, so that no input waits on another job's.

A job's inputs that need I/O (a file under MLXQ_IMAGE_DIR, a fetched URL) are each read on a pool
of I/O threads of their own, all at once, each within the job's I/O deadline (submitted at t, due by
t + MLXQ_IMAGE_FETCH_TIMEOUT_S); once they are all read, the engine's prepare (decoding, the model's
processor) runs on one CPU thread, as it did for every image job before. An inline image needs no
I/O: its job goes straight to the CPU thread, never behind another job's fetch. An input not read by
the deadline fails its own job at once, naming its field; the thread reading it is left to its own
timeouts. The loop's thread submits jobs and collects what is ready; the pools' threads only run
the reads and the prepares and complete each job's future.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Optional

from worker.images import ImageError

Read = Callable[[str, str, float], bytes]  # (field, url, deadline) -> the input's bytes


@dataclass(frozen=True)
class SlowInputs:
    """A request whose input takes long to prepare: what to read first, then the engine's prepare."""

    reads: list[tuple[str, str]]  # (field, url) of each input read from a file or fetched
    read: Optional[Read]  # how (None when there is nothing to read)
    prepare: Callable[[Mapping[str, bytes]], Any]  # the bytes read, by field -> the engine's Prompt


@dataclass
class _Job:
    outcome: "Future[Any]"
    due: float  # time.monotonic() by which every read must be done
    reads: dict[str, "Future[bytes]"] = field(default_factory=dict)
    fetched: dict[str, bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class InputPreparer:
    def __init__(self, io_threads: int, io_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="mlxq-image-io")
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="mlxq-prepare")
        self._timeout_s = io_timeout_s
        self._clock = clock
        self._jobs: dict[str, _Job] = {}  # the loop thread's

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, job_id: str, inputs: SlowInputs) -> None:
        job = _Job(Future(), self._clock() + self._timeout_s)
        self._jobs[job_id] = job
        if not inputs.reads:
            self._prepare(job, inputs)
            return
        assert inputs.read is not None
        for name, url in inputs.reads:
            job.reads[name] = self._io.submit(inputs.read, name, url, job.due)
        for name, future in list(job.reads.items()):
            future.add_done_callback(lambda done, name=name: self._read_done(job, inputs, name, done))

    def _read_done(self, job: _Job, inputs: SlowInputs, name: str, done: "Future[bytes]") -> None:
        """On the thread that finished a read: the first failure ends the job; the last read starts
        its prepare."""
        with job.lock:
            if job.outcome.done() or done.cancelled():
                return
            error = done.exception()
            if error is not None:
                job.outcome.set_exception(error)
                return
            job.fetched[name] = done.result()
            if len(job.fetched) < len(job.reads):
                return
        self._prepare(job, inputs)

    def _prepare(self, job: _Job, inputs: SlowInputs) -> None:
        prepared = self._cpu.submit(inputs.prepare, dict(job.fetched))
        prepared.add_done_callback(lambda done: self._settle(job, done))

    @staticmethod
    def _settle(job: _Job, done: "Future[Any]") -> None:
        with job.lock:
            if job.outcome.done():
                return
            error = done.exception()
            if error is not None:
                job.outcome.set_exception(error)
            else:
                job.outcome.set_result(done.result())

    def ready(self) -> list[tuple[str, "Future[Any]"]]:
        """The jobs whose inputs are ready, or failed (a read past its deadline included): each with
        its done future (its Prompt, or the error naming the field). They leave the preparer."""
        now = self._clock()
        finished = []
        for job_id, job in list(self._jobs.items()):
            if not job.outcome.done() and now >= job.due:
                self._expire(job)
            if job.outcome.done():
                del self._jobs[job_id]
                finished.append((job_id, job.outcome))
        return finished

    def _expire(self, job: _Job) -> None:
        with job.lock:
            if job.outcome.done():
                return
            late = [name for name, future in job.reads.items() if not future.done()]
            if not late:
                return  # read in time: the prepare is under way
            job.outcome.set_exception(ImageError(
                f"{late[0]}: reading the image took longer than {self._timeout_s:g} s (MLXQ_IMAGE_FETCH_TIMEOUT_S)"))
        for name in late:  # outside the lock: a cancel runs the read's done callback, which takes it
            job.reads[name].cancel()  # one still queued behind other reads never starts

    def wait(self, timeout: float) -> None:
        """Block until a job is ready, its deadline comes, or `timeout` passes."""
        if not self._jobs:
            return
        soonest = min(job.due for job in self._jobs.values()) - self._clock()
        wait([job.outcome for job in self._jobs.values()], timeout=max(0.0, min(timeout, soonest)),
             return_when=FIRST_COMPLETED)

    def discard(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def clear(self) -> None:
        self._jobs.clear()

    def shutdown(self) -> None:
        self._jobs.clear()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def job_ids(self) -> list[str]:
        return list(self._jobs)

