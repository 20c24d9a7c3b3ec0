"""LoRA adapters through real worker processes: adapters from MLXQ_ADAPTER_DIR and base-model jobs
served together, each equal to mlx-lm alone with the adapter fused; an adapter the worker does not
have fails its job naming `adapter`; an adapter published through Redis (`publish_adapter`, CLI
`mlxq publish-adapter`) is served from then on, also by a worker that starts later; a broken one is
refused in the acknowledgement."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from producer import Client
from tests.reference import fused_alone, greedy_alone
from tests.workers import start_worker, stop, workers_live

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    import worker  # noqa: F401  (OpenBLAS before MLX)
    from mlx_lm import load

    from worker.tiny_model import make_tiny_adapter

    model, _ = load(tiny_model_dir)
    served = tmp_path_factory.mktemp("served")
    make_tiny_adapter(served / "alpha", model, seed=11, strength=0.4)
    make_tiny_adapter(served / "beta", model, keys=("mlp.down_proj",), rank=2, scale=20.0, seed=12, strength=0.3)
    published = tmp_path_factory.mktemp("published")
    make_tiny_adapter(published / "delta", model, keys=("self_attn.o_proj",), rank=6, scale=8.0, seed=13,
                      strength=0.4)
    # rank 3 in the tensors, for a layer this model does not have
    make_tiny_adapter(published / "broken", model, seed=14)
    config = json.loads((published / "broken" / "adapter_config.json").read_text())
    import mlx.core as mx

    tensors = mx.load(str(published / "broken" / "adapters.safetensors"))
    tensors = {name.replace("q_proj", "w_proj"): value for name, value in tensors.items()}
    mx.save_safetensors(str(published / "broken" / "adapters.safetensors"), tensors)
    (published / "broken" / "adapter_config.json").write_text(json.dumps(config))
    return served, published, model


def request(adapter=None, max_tokens=12):
    body = {"model": "tiny", "prompt_token_ids": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": True}
    if adapter is not None:
        body["adapter"] = adapter
    return body


def test_a_worker_serves_adapter_and_base_jobs_together_and_adapters_published_through_redis(
        redis_url, tiny_model_dir, adapters):
    served, published, model = adapters
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    expected = {name: fused_alone(tiny_model_dir, served / name, PROMPT, 12) for name in ("alpha", "beta")}
    expected[None] = greedy_alone(model, PROMPT, 12, set())
    expected["delta"] = fused_alone(tiny_model_dir, published / "delta", PROMPT, 12)
    assert len({tuple(tokens) for tokens, _ in expected.values()}) == 4  # each adapter changes the output
    worker = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="lora",
                          env={"MLXQ_ADAPTER_DIR": str(served)})
    late = None
    try:
        workers_live(conn, 1)
        names = ["alpha", None, "beta", "alpha", None, "beta", "missing"]
        jobs = [(name, client.submit(request(name))) for name in names]
        for name, job_id in jobs:
            result = client.wait(job_id, timeout=120)
            if name == "missing":
                assert result.status == "failed" and result.error.type == "InvalidRequest"
                assert result.error.message.startswith("adapter: this worker has no adapter 'missing'")
                continue
            assert result.status == "finished", result.error
            assert result.adapter == name
            tokens, logprobs = expected[name]
            assert result.choices[0].token_ids == tokens, name
            assert result.choices[0].logprobs == pytest.approx(logprobs, abs=1e-3), name
        # Not served before it is published; streamed through Redis, checked, then served.
        before = client.wait(client.submit(request("delta")), timeout=60)
        assert before.status == "failed" and "no adapter 'delta'" in before.error.message
        outcome = client.publish_adapter("tiny", "delta", str(published / "delta"), upload=True, timeout=60)
        assert outcome.ok, outcome
        after = client.wait(client.submit(request("delta")), timeout=60)
        assert after.status == "finished" and after.choices[0].token_ids == expected["delta"][0]
        # A broken adapter is refused, naming the layer; the CLI says so and exits 1.
        outcome = client.publish_adapter("tiny", "broken", str(published / "broken"), upload=True, timeout=60)
        assert not outcome.ok and "w_proj" in outcome.errors["lora"], outcome
        cli = subprocess.run([sys.executable, "-m", "mlxq", "publish-adapter", "tiny", "broken",
                              str(published / "broken"), "--url", redis_url, "--timeout", "60"],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and "w_proj" in cli.stderr, cli.stderr
        still = client.wait(client.submit(request("broken")), timeout=60)
        assert still.status == "failed" and still.error.message.startswith("adapter:")
        # A worker that starts later catches up with the published adapter (no MLXQ_ADAPTER_DIR).
        late = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="late")
        workers_live(conn, 2)
        out = stop(worker)
        assert worker.returncode == 0, out
        caught_up = client.wait(client.submit(request("delta")), timeout=120)
        assert caught_up.worker == "late" and caught_up.choices[0].token_ids == expected["delta"][0]
    finally:
        stop(worker)
        if late is not None:
            out = stop(late)
            assert late.returncode == 0, out
