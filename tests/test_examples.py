"""examples/: the FastAPI backend (AsyncClient: wait, poll, SSE) served by uvicorn and driven with httpx,
and the Django views (Client: enqueue, poll) through Django's test client, each against a live
fake-engine worker."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from mlxq.redis_server import free_port
from tests.workers import start_fake_worker, stop, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def worker(redis_url, monkeypatch):
    monkeypatch.setenv("MLXQ_REDIS_URL", redis_url)
    proc = start_fake_worker(redis_url, name="examples-worker", step_delay_s=0.01)
    yield proc
    out = stop(proc)
    assert proc.returncode == 0, out


def test_fastapi_example_waits_polls_and_streams(worker):
    from examples.fastapi_app.app import app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=20, what="uvicorn")
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            answered = http.post("/generate", json={"prompt": "Hello there", "max_tokens": 8})
            refused = http.post("/generate", json={"prompt": "x", "max_tokens": 0})
            job_id = http.post("/jobs", json={"prompt": "Stream me", "max_tokens": 12}).json()["id"]
            events = []
            with http.stream("GET", f"/jobs/{job_id}/events") as response:
                name = None
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line.split(":", 1)[1].strip()
                    elif line.startswith("data:"):
                        events.append((name, json.loads(line.split(":", 1)[1])))
            wait_for(lambda: http.get(f"/jobs/{job_id}").json()["status"] == "finished", timeout=15, what="its end")
            polled = http.get(f"/jobs/{job_id}").json()
            missing = http.get("/jobs/no-such-job")
    finally:
        server.should_exit = True
        thread.join(timeout=20)
    assert answered.status_code == 200, answered.text
    body = answered.json()
    assert body["status"] == "finished" and body["usage"]["completion_tokens"] > 0 and body["text"] is not None
    assert refused.status_code == 422
    assert [name for name, _ in events][-1] == "end" and events[-1][1]["status"] == "finished"
    streamed = "".join(event["text"] for name, event in events if name == "token")
    assert polled["status"] == "finished" and polled["text"] == streamed  # the tokens add up to the text
    assert missing.status_code == 404


def test_django_example_enqueues_and_polls(worker, monkeypatch):
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "examples.django_app.settings")
    import django
    from django.test import Client as DjangoClient

    django.setup()
    browser = DjangoClient()
    created = browser.post("/jobs", data=json.dumps({"prompt": "Hello Django", "max_tokens": 6}),
                           content_type="application/json")
    assert created.status_code == 202, created.content
    job_id = created.json()["id"]
    deadline = time.monotonic() + 30
    while (polled := browser.get(f"/jobs/{job_id}").json())["status"] != "finished":
        assert polled["status"] in ("queued", "started") and time.monotonic() < deadline, polled
        time.sleep(0.05)
    assert polled["text"] is not None
    bad = browser.post("/jobs", data=json.dumps({"prompt": "x", "max_tokens": -1}), content_type="application/json")
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]
    assert browser.get("/jobs/no-such-job").status_code == 404
