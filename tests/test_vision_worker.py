"""Image jobs through the whole pipeline: producer -> redis-server -> a worker process serving a tiny
qwen2_vl -> result keys and token streams. Good and bad images in one batch: the good ones equal the
same request alone through mlx-vlm, each bad one fails alone naming its field and limit, and the
worker goes on; 64 image jobs on a small KV budget all finish."""

from __future__ import annotations

import base64
import io
import os

import pytest
import redis
from PIL import Image

from producer import Client
from schemas import keys
from tests.pictures import chat, data_url, noise, picture, png_declaring
from tests.workers import start_worker, stop

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def vlm_reference(tiny_vision_model_dir):
    """mlx-vlm alone, on the same model, from the same prepared inputs."""
    import worker  # noqa: F401
    from mlx_vlm import load

    from schemas import GenerationRequest
    from tests.reference import vlm_alone
    from worker.engines.vision import VisionEngine
    from worker.images import ImagePolicy

    model, processor = load(tiny_vision_model_dir)

    def run(request: dict, image_dir: str | None = None) -> tuple[list[int], list[float], int]:
        engine = VisionEngine(model, processor, images=ImagePolicy(image_dir=image_dir))
        prompt = engine.prepare(GenerationRequest.validate_payload(request))
        tokens, distributions = vlm_alone(model, prompt, request["max_tokens"])
        return tokens, [float(d[t]) for t, d in zip(tokens, distributions)], len(prompt.token_ids)

    return run


def test_image_jobs_match_mlx_vlm_alone_and_each_bad_image_fails_alone(redis_url, tiny_vision_model_dir,
                                                                     vlm_reference, tmp_path):
    allowed, outside = tmp_path / "images", tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(noise(7))
    (outside / "secret.png").write_bytes(noise(8))
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    truncated = noise(9, (80, 80), "JPEG")
    bmp = io.BytesIO()
    Image.new("RGB", (30, 30)).save(bmp, "BMP")
    field = "messages[0].content[0].image_url"
    bad = {
        "corrupt": (chat("x", data_url(b"\x89PNG\r\n\x1a\n" + os.urandom(200)), max_tokens=4), "could not"),
        "truncated": (chat("x", data_url(truncated[: len(truncated) * 2 // 3], "image/jpeg"), max_tokens=4),
                      "could not decode the JPEG image"),
        "too-many-pixels": (chat("x", data_url(png_declaring(9000, 9000)), max_tokens=4),
                            "81000000 pixels exceed the limit of 40000000 (MLXQ_MAX_IMAGE_PIXELS)"),
        "too-many-images": (chat("x", picture(1), picture(2), picture(3), max_tokens=4),
                            "messages: 3 images exceed the limit of 2 per request (MLXQ_MAX_IMAGES)"),
        "unsupported": (chat("x", base64.b64encode(bmp.getvalue()).decode(), max_tokens=4), "unsupported image format"),
        "dot-dot": (chat("x", "../elsewhere/secret.png", max_tokens=4), "outside the image directory (MLXQ_IMAGE_DIR)"),
        "absolute": (chat("x", str(outside / "secret.png"), max_tokens=4), "outside the image directory"),
        "symlink": (chat("x", "escape.png", max_tokens=4), "outside the image directory"),
        "http": (chat("x", "http://127.0.0.1:9/cat.png", max_tokens=4), "MLXQ_IMAGE_FETCH is off"),
    }
    good = {
        "inline": chat("what is it", picture(3), max_tokens=10, top_logprobs=2, **GREEDY),
        "file": chat("and this", "cat.png", max_tokens=8, **GREEDY),
        "text": chat("just words", max_tokens=6, **GREEDY),
        "stream": chat("streamed", picture(4, (84, 56)), max_tokens=9, stream=True, **GREEDY),
        "seeded": chat("sampled", picture(5), max_tokens=8, n=2, temperature=0.8, seed=99, ignore_eos=True),
    }
    env = {"MLXQ_IMAGE_DIR": str(allowed), "MLXQ_MAX_IMAGES": "2"}
    proc = start_worker(redis_url, tiny_vision_model_dir, "--max-num-seqs", "8", name="vision", env=env)
    client = Client(redis_url)
    try:
        names = list(bad) + list(good)
        ids = dict(zip(names, client.submit_many([bad[n][0] if n in bad else good[n] for n in names])))
        events = list(client.stream(ids["stream"], timeout=120))
        results = client.wait_many(list(ids.values()), timeout=180)
        after = client.wait(client.submit(chat("still here", picture(6), max_tokens=3, **GREEDY)), timeout=60)
        stats = redis.Redis.from_url(redis_url).hgetall(keys.stats_key("vision"))
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out

    for name, (_, expected) in bad.items():
        result = results[ids[name]]
        assert result.status == "failed" and result.error.type == "InvalidRequest", name
        assert expected in result.error.message, (name, result.error.message)
        if name != "too-many-images":
            assert result.error.message.startswith(f"{field}: ") or field in result.error.message, name
    for name in ("inline", "file", "text", "stream"):
        result = results[ids[name]]
        assert result.status == "finished", (name, result.error)
        tokens, logprobs, prompt_tokens = vlm_reference(good[name], str(allowed))
        assert result.choices[0].token_ids == tokens, name
        assert result.choices[0].logprobs == pytest.approx(logprobs, abs=1e-3), name
        assert result.usage.prompt_tokens == prompt_tokens, name
    assert [len(t) for t in results[ids["inline"]].choices[0].top_logprobs] == [2] * 10
    streamed = [t for e in events if e["event"] == "token" for t in e["token_ids"]]
    assert streamed == results[ids["stream"]].choices[0].token_ids
    assert events[-1] == {"event": "end", "status": "finished", "finish_reasons": ["length"]}
    assert "".join(e["text"] for e in events if e["event"] == "token") == results[ids["stream"]].choices[0].text
    seeded = results[ids["seeded"]]
    assert seeded.status == "finished" and len({tuple(c.token_ids) for c in seeded.choices}) == 2
    assert after.status == "finished"
    assert int(stats[b"engine_images"]) >= 5 and int(stats[b"engine_vision_calls"]) >= 4


def test_a_seeded_image_request_gives_the_same_ids_on_another_worker(redis_url, tiny_vision_model_dir):
    request = chat("same everywhere", picture(12), max_tokens=10, n=2, temperature=1.0, top_k=20, seed=5,
                   ignore_eos=True)
    crowd = [chat(f"other {i}", picture(40 + i), max_tokens=12, temperature=1.3, ignore_eos=True) for i in range(4)]
    runs = []
    for name, batch in (("alone", [request]), ("crowd", crowd[:2] + [request] + crowd[2:])):
        proc = start_worker(redis_url, tiny_vision_model_dir, name=name)
        client = Client(redis_url)
        try:
            ids = client.submit_many(batch)
            results = client.wait_many(ids, timeout=120)
        finally:
            out = stop(proc)
        assert proc.returncode == 0, out
        runs.append([c.token_ids for c in results[ids[len(batch) // 2]].choices])
    assert runs[0] == runs[1]


def test_sixty_four_image_jobs_queued_at_once_on_a_small_kv_budget_all_finish(redis_url, tiny_vision_model_dir):
    env = {"MLXQ_KV_BUDGET_MB": "1"}
    proc = start_worker(redis_url, tiny_vision_model_dir, "--max-num-seqs", "32", name="budget", env=env)
    client = Client(redis_url)
    try:
        ids = client.submit_many([chat(f"picture {i}", picture(200 + i, (112, 112)), max_tokens=120,
                                       temperature=0, ignore_eos=True) for i in range(64)])
        results = client.wait_many(ids, timeout=240)
        stats = redis.Redis.from_url(redis_url).hgetall(keys.stats_key("budget"))
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out
    assert all(results[j].status == "finished" for j in ids), [results[j].error for j in ids if results[j].error]
    assert all(results[j].usage.completion_tokens == 120 for j in ids)
    # A job's KV cache (~160 tokens of 512 bytes) and its vision encoder (~0.4 MiB while it enters)
    # leave room in 1 MiB for a few at a time, far below the 32 sequences the worker would take.
    assert 2 <= int(stats[b"engine_peak_sequences"]) <= 8


def test_the_bench_image_scenario_runs_every_arm_on_the_same_requests(tiny_model_dir, tiny_vision_model_dir,
                                                                     tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench"
    argv = [sys.executable, "-m", "mlxq", "bench", "--model", tiny_model_dir, "--image-model", tiny_vision_model_dir,
            "--scenario", "images", "--image-requests", "4", "--image-new-tokens", "5", "--warmup-tokens", "2",
            "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    images = json.loads((out / "report.json").read_text())["scenarios"]["images"]
    assert "error" not in images, images
    for arm in ("alone", "mlx_vlm_batched", "mlxq", "mlxq_logprobs"):
        run = images["repeats"][0][arm]
        assert run["completed"] == 4 and run["tokens"] == 4 * 5 and run["tokens_per_s"] > 0, (arm, run)
    assert images["same_token_ids_as_alone"] == {"mlx_vlm_batched": 4, "mlxq": 4, "mlxq_logprobs": 4}
    assert images["image_tokens"]["min"] > 0 and images["ratios"]["mlxq_over_alone"] > 0
    assert "- images (4 image jobs at once" in (out / "table.md").read_text()


def test_the_vision_demo_runs_image_jobs_end_to_end(redis_url, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mlxq", "demo", "--vision", "--url", redis_url, "--jobs", "8",
                           "--max-tokens", "4", "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tiny random-weight vision-language model" in done.stdout
    assert "8 jobs from 2 threads" in done.stdout and ", 0 failed" in done.stdout
