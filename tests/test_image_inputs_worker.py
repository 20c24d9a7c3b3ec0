"""Image inputs that need I/O through a real vision worker with fetching on: four tarpit URLs do not
delay another job's inline image (it finishes before any of them fails), each tarpit fails its own job
by the deadline, naming its field; a fetched image gives the same tokens as the same image inline; a
redirect to an internal address, a loopback URL and a FIFO under MLXQ_IMAGE_DIR each fail alone, at
once, and nothing internal is ever reached. The loopback image server is allowed through the
documented seam, MLXQ_IMAGE_FETCH_ALLOW_NETS=127.0.0.1/32."""

from __future__ import annotations

import os

import pytest

from producer import Client, WaitTimeout
from tests.pictures import chat, data_url, noise
from tests.test_image_fetch import Recorder, serve
from tests.test_vision_worker import GREEDY, vlm_reference  # noqa: F401  (the fixture)
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow

TIMEOUT_S = 6
FIELD = "messages[0].content[0].image_url"


class Images(Recorder):
    hits: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            type(self).hits.append((self.path, ""))
            body = noise(7)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()


def test_slow_inputs_fail_their_own_jobs_and_never_delay_an_inline_image(redis_url, tiny_vision_model_dir,
                                                                        vlm_reference, tmp_path):  # noqa: F811
    images_httpd, port = serve(Images, "127.0.0.1")
    internal = type("Internal", (Recorder,), {"hits": []})
    internal_httpd, internal_port = serve(internal, "::1")
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    os.mkfifo(image_dir / "pipe.png")
    base = f"http://127.0.0.1:{port}"
    tarpits = [chat("slow", f"{base}/silent?{i}", max_tokens=4) for i in range(4)]
    inline = chat("quick", data_url(noise(3)), max_tokens=8, **GREEDY)
    fetched = chat("fetched", f"{base}/cat.png", max_tokens=8, **GREEDY)
    same_inline = chat("fetched", data_url(noise(7)), max_tokens=8, **GREEDY)
    refused = {
        "redirect-inside": (chat("x", f"{base}/to?http://[::1]:{internal_port}/ok.png", max_tokens=4),
                            "not a public address"),
        "loopback": (chat("x", f"http://[::1]:{internal_port}/ok.png", max_tokens=4), "not a public address"),
        "fifo": (chat("x", "pipe.png", max_tokens=4), "not a regular file"),
    }
    env = {"MLXQ_IMAGE_FETCH": "1", "MLXQ_IMAGE_FETCH_ALLOW_NETS": "127.0.0.1/32",
           "MLXQ_IMAGE_FETCH_TIMEOUT_S": str(TIMEOUT_S), "MLXQ_IMAGE_DIR": str(image_dir)}
    proc = start_worker(redis_url, tiny_vision_model_dir, "--max-num-seqs", "8", name="vision-io", env=env)
    client = Client(redis_url)
    try:
        slow_ids = client.submit_many(tarpits)
        inline_id = client.submit(inline)  # another tenant's, right behind the tarpits
        fetched_id = client.submit(fetched)
        refused_ids = {name: client.submit(request) for name, (request, _) in refused.items()}
        try:
            results = client.wait_many([*slow_ids, inline_id, fetched_id, *refused_ids.values()], timeout=120)
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}; the worker's log:\n{stop(proc)[-4000:]}") from None
        assert proc.poll() is None, "the worker died: " + stop(proc)[-4000:]
    finally:
        out = stop(proc)
        for httpd in (images_httpd, internal_httpd):
            httpd.shutdown()
            httpd.server_close()
    assert proc.returncode == 0, out[-3000:]
    quick = results[inline_id]
    assert quick.status == "finished", quick.error
    assert quick.choices[0].token_ids == vlm_reference(inline)[0]
    for job_id in slow_ids:
        slow = results[job_id]
        assert slow.status == "failed" and slow.error.type == "InvalidRequest", slow
        assert slow.error.message.startswith(f"{FIELD}: ") and f"longer than {TIMEOUT_S} s" in slow.error.message
        assert quick.timings.finished_at < slow.timings.finished_at  # the inline image never waited on them
    got = results[fetched_id]
    assert got.status == "finished" and got.choices[0].token_ids == vlm_reference(same_inline)[0], got.error
    for name, (_, needle) in refused.items():
        result = results[refused_ids[name]]
        assert result.status == "failed" and needle in result.error.message, (name, result.error)
        assert result.timings.finished_at < min(results[j].timings.finished_at for j in slow_ids), name
    assert internal.hits == [] and [hit for hit in Images.hits if hit[0] == "/cat.png"] == [("/cat.png", "")]
