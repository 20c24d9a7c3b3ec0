"""The control plane's decisions in the loop's thread (worker/control.py), with its Redis stream and its
fetching thread replaced: what a worker that starts after a publish does before it takes a job. The
same end to end, with a worker process, is tests/test_control.py's."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Optional

from producer.control import control_command
from schemas.control import ControlCommand
from worker.control import Controller
from worker.weights import FetchedVersion


class Channel:
    def __init__(self, latest: Optional[ControlCommand]) -> None:
        self.latest = latest

    def paused(self) -> None:
        return None

    def latest_weights(self) -> Optional[ControlCommand]:
        return self.latest

    def published_adapters(self) -> list[ControlCommand]:
        return []

    def read(self) -> list[ControlCommand]:
        return []


class Loader:
    def __init__(self) -> None:
        self.submitted: list[ControlCommand] = []
        self.ready: queue.Queue[FetchedVersion] = queue.Queue()

    def submit(self, command: ControlCommand) -> None:
        self.submitted.append(command)


class Loop:
    def __init__(self) -> None:
        self.weight_version = 0
        self.acks: list[tuple[str, bool]] = []

    def running_count(self) -> int:
        return 0

    def swap_weights(self, files: list[Path], version: int) -> None:
        self.weight_version = version

    def ack(self, command: ControlCommand, ok: bool, message: str, seconds: Optional[float]) -> None:
        self.acks.append((command.id, ok))


def test_a_worker_that_starts_after_a_publish_takes_no_job_until_that_version_is_in_or_refused(tmp_path):
    for error in (None, "version 4: the files are gone"):
        latest = control_command("weights", "m", version=4, path=str(tmp_path), policy="drain")
        loader, loop = Loader(), Loop()
        controller = Controller(Channel(latest), loader, version=0)  # type: ignore[arg-type]
        assert loader.submitted == [latest] and not controller.admitting
        controller.turn(loop)  # type: ignore[arg-type]
        assert not controller.admitting  # still fetching
        loader.ready.put(FetchedVersion(latest, [tmp_path / "model.safetensors"], error))
        controller.turn(loop)  # type: ignore[arg-type]
        assert controller.admitting and loop.acks == [(latest.id, error is None)]
        assert loop.weight_version == (4 if error is None else 0)


def test_a_worker_already_on_the_latest_version_takes_jobs_at_once(tmp_path):
    latest = control_command("weights", "m", version=4, path=str(tmp_path), policy="drain")
    loader = Loader()
    controller = Controller(Channel(latest), loader, version=4)  # type: ignore[arg-type]
    assert controller.admitting and loader.submitted == []
    assert Controller(Channel(None), Loader(), version=0).admitting  # type: ignore[arg-type]
