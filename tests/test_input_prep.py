"""The image input preparer (worker/input_prep.py) on its own threads, with reads that block until
told: a job without reads is ready while other jobs' reads hang; a read past the job's deadline
fails that job alone, naming the input's field; a failed read ends its job at once; the prepare
gets every read's bytes by field."""

from __future__ import annotations

import threading
import time

import pytest

from worker.images import ImageError
from worker.input_prep import InputPreparer, SlowInputs


def ready_within(preparer: InputPreparer, seconds: float, until: str | None = None) -> dict[str, object]:
    """What becomes ready within `seconds` (or until job `until` is ready)."""
    done: dict[str, object] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(preparer) and until not in done:
        preparer.wait(0.05)
        for job_id, future in preparer.ready():
            done[job_id] = future.exception() or future.result()
    return done


def test_slow_reads_fail_their_own_jobs_and_never_hold_up_the_others():
    release = threading.Event()
    started: list[str] = []

    def hanging(field: str, url: str, deadline: float) -> bytes:
        started.append(field)
        release.wait(30)
        return b"late"

    def quick(field: str, url: str, deadline: float) -> bytes:
        if url == "broken":
            raise ImageError(f"{field}: broken")
        return url.encode()

    preparer = InputPreparer(io_threads=3, io_timeout_s=1.0)
    try:
        for i in range(4):  # more hanging reads than I/O threads
            preparer.submit(f"tarpit-{i}", SlowInputs([(f"tarpit[{i}]", "x")], hanging, lambda fetched: fetched))
        preparer.submit("inline", SlowInputs([], None, lambda fetched: "prepared"))
        early = ready_within(preparer, 5, until="inline")
        assert early == {"inline": "prepared"}
        assert sorted(preparer.job_ids()) == [f"tarpit-{i}" for i in range(4)]  # still hanging
        later = ready_within(preparer, 5)
        for i in range(4):
            error = later[f"tarpit-{i}"]
            assert isinstance(error, ImageError), error
            assert str(error) == f"tarpit[{i}]: reading the image took longer than 1 s (MLXQ_IMAGE_FETCH_TIMEOUT_S)"
        assert sorted(started) == ["tarpit[0]", "tarpit[1]", "tarpit[2]"]  # the fourth, queued, was cancelled unstarted
        release.set()
        preparer.submit("failing", SlowInputs([("a", "one"), ("b", "broken")], quick, lambda fetched: fetched))
        failing = ready_within(preparer, 5)["failing"]
        assert isinstance(failing, ImageError) and str(failing) == "b: broken"
        preparer.submit("two", SlowInputs([("a", "one"), ("b", "two")], quick, lambda fetched: dict(fetched)))
        assert ready_within(preparer, 5) == {"two": {"a": b"one", "b": b"two"}}
    finally:
        release.set()
        preparer.shutdown()


def test_a_prepare_that_raises_fails_its_job_only():
    preparer = InputPreparer(io_threads=1, io_timeout_s=5)
    try:
        def bad(fetched: object) -> object:
            raise ValueError("messages: the model's image processor refused the images")

        preparer.submit("bad", SlowInputs([], None, bad))
        preparer.submit("good", SlowInputs([], None, lambda fetched: "ok"))
        done = ready_within(preparer, 5)
        assert done["good"] == "ok" and isinstance(done["bad"], ValueError)
    finally:
        preparer.shutdown()


@pytest.mark.parametrize("url,expected", [("data:image/png;base64,AAAA", False), ("https://x/a.png", True),
                                          ("file:///srv/a.png", True), ("cats/1.png", True),
                                          ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4", False),
                                          ("A" * 400, False), ("tabbycat", True)])
def test_which_inputs_need_io(url, expected):
    from worker.images import needs_io

    assert needs_io(url) is expected


def test_the_inputs_to_read_come_from_the_raw_request_named_as_its_fields_and_never_past_the_image_limit():
    from worker.images import io_image_inputs

    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    payload = {"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "look"}, part("https://x/a.png"),
                                                         part("data:image/png;base64,AAAA"), part("cats/1.png")]}]}
    assert io_image_inputs(payload, 8) == [("messages[1].content[1].image_url", "https://x/a.png"),
                                           ("messages[1].content[3].image_url", "cats/1.png")]
    assert io_image_inputs(payload, 2) == []  # three images: validation refuses it before anything is read
    for broken in (None, {"messages": "x"}, {"messages": [{"content": [{"type": "image_url", "image_url": 3}]}]}):
        assert io_image_inputs(broken, 8) == []
