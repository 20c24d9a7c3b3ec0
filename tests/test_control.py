"""The control plane against real worker processes on the fake engine (whose tokens change with the
weight version): weight swaps under each policy, pause and resume, abort, minimum versions, a worker
that catches up, acknowledgements from every live worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from producer import AsyncClient, Client
from producer.control import ControlCalls, control_command, weights_command
from schemas import keys
from schemas.presence import WorkerPresence
from tests.workers import start_fake_worker, stop, wait_for, workers_live
from worker.engines.fake import fake_token

pytestmark = pytest.mark.slow

ALIAS = "fakemodel"
ENV = {"MLXQ_ALIAS": ALIAS}


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    """A version's directory: the fake engine has no weights to check, only files to find."""
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return tmp_path


def long_request(first: int, tokens: int, **extra: object) -> dict:
    return {"prompt_token_ids": [first, 7], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "model": ALIAS, **extra}


def expected(first: int, tokens: int, version_at: list[tuple[int, int]]) -> list[int]:
    """The fake engine's tokens for a sequence whose weights changed at the given token indexes."""
    out = []
    for i in range(tokens):
        version = [v for start, v in version_at if start <= i][-1]
        out.append(fake_token([first, 7], i, version=version))
    return out


def test_inflight_drain_and_abort_swaps(redis_url, version_dir):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    workers = [start_fake_worker(redis_url, name=f"rl-{i}", env=ENV, step_delay_s=0.02) for i in range(2)]
    try:
        workers_live(conn, 2)
        # inflight: running sequences go on under the new weights, each token's version recorded
        running = [client.submit(long_request(30 + i, 150)) for i in range(64)]  # 32 on each worker
        wait_for(lambda: all(client.status(j) == "started" for j in running), what="running")
        time.sleep(0.5)
        outcome = client.publish_weights(ALIAS, 1, str(version_dir), "inflight", timeout=30)
        assert outcome.ok and sorted(outcome.acked) == ["rl-0", "rl-1"], outcome
        for i, job_id in enumerate(running):
            choice = client.wait(job_id, timeout=60).choices[0]
            assert choice.weight_version == 0 and choice.weight_versions[0] == (0, 0), choice
            assert [v for _, v in choice.weight_versions] == [0, 1]
            assert choice.token_ids == expected(30 + i, 150, choice.weight_versions)
        # drain: running sequences finish on the old weights; jobs after the swap run on the new
        draining = [client.submit(long_request(100 + i, 100)) for i in range(64)]
        wait_for(lambda: all(client.status(j) == "started" for j in draining), what="running")
        outcome = client.publish_weights(ALIAS, 2, str(version_dir), "drain", timeout=60)
        assert outcome.ok, outcome
        after = client.submit(long_request(50, 5))
        for i, job_id in enumerate(draining):
            choice = client.wait(job_id, timeout=60).choices[0]
            assert choice.weight_version == 1 and choice.weight_versions is None
            assert choice.token_ids == expected(100 + i, 100, [(0, 1)])
        assert client.wait(after, timeout=30).choices[0].weight_version == 2
        # abort: running jobs go back to their queue and run again, whole, on the new weights
        aborted = [client.submit(long_request(170 + i, 200)) for i in range(64)]
        wait_for(lambda: all(client.status(j) == "started" for j in aborted), what="running")
        outcome = client.publish_weights(ALIAS, 3, str(version_dir), "abort", timeout=30)
        assert outcome.ok, outcome
        for i, job_id in enumerate(aborted):
            result = client.wait(job_id, timeout=60)
            assert result.status == "finished" and result.weight_version == 3
            assert result.choices[0].token_ids == expected(170 + i, 200, [(0, 3)])
        # no job lost, none ended twice: each succeeded once in rq (an aborted one was retried first)
        for job_id in running + draining + aborted:
            types = [int(fields[b"type"]) for _, fields in conn.xrange(f"rq:results:{job_id}")]
            assert types.count(1) == 1 and set(types) <= {1, 4}, (job_id, types)
    finally:
        outs = [stop(w) for w in workers]
        for worker, out in zip(workers, outs):  # shown when the test fails
            lines = [line for line in out.splitlines() if "Successfully completed" not in line]
            print(f"--- {worker.args[-1]}\n" + "\n".join(lines[-80:]))
    assert all(w.returncode == 0 for w in workers), outs


def test_pause_keep_freezes_running_sequences_until_resume(redis_url):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, name="pauser", env=ENV, step_delay_s=0.02)
    try:
        workers_live(conn, 1)
        job_id = client.submit(long_request(70, 300, stream=True))
        wait_for(lambda: client.status(job_id) == "started", what="running")
        assert client.pause(ALIAS, "keep", timeout=30).ok
        queued = client.submit(long_request(71, 3))
        frozen = conn.xlen(keys.stream_key(job_id))
        time.sleep(1.0)
        assert conn.xlen(keys.stream_key(job_id)) == frozen  # no token while paused
        assert client.status(queued) == "queued"  # and no job taken
        assert client.resume(ALIAS, timeout=30).ok
        result = client.wait(job_id, timeout=60)
        assert result.status == "finished" and result.choices[0].token_ids == expected(70, 300, [(0, 0)])
        assert client.wait(queued, timeout=30).status == "finished"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_abort_ends_running_jobs_and_min_weight_version_waits_for_the_weights(redis_url, version_dir):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, name="aborter", env=ENV, step_delay_s=0.02)
    try:
        workers_live(conn, 1)
        running = [client.submit(long_request(80 + i, 1000)) for i in range(3)]
        wait_for(lambda: all(client.status(j) == "started" for j in running), what="running")
        outcome = client.abort(job_id=running[0], timeout=30)
        assert outcome.ok and client.wait(running[0], timeout=30).status == "cancelled"
        assert client.abort(ALIAS, timeout=30).ok
        for job_id in running[1:]:
            result = client.wait(job_id, timeout=30)
            assert result.status == "cancelled" and 0 < len(result.choices[0].token_ids) < 1000
        # a job for weights the worker does not have yet waits in its queue; the one behind it too
        wanting = client.submit(long_request(90, 3, min_weight_version=5))
        behind = client.submit(long_request(91, 3))
        time.sleep(1.5)
        assert client.status(wanting) == "queued" and client.status(behind) == "queued"
        assert client.publish_weights(ALIAS, 5, str(version_dir), "inflight", timeout=30).ok
        assert client.wait(wanting, timeout=30).weight_version == 5
        assert client.wait(behind, timeout=30).status == "finished"
        assert client.reset_prefix_cache(ALIAS, timeout=30).ok
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_a_command_waits_for_a_live_worker_whose_entry_was_lost_and_it_applies_it(redis_url, version_dir):
    """A broker that failed over or restarted may have lost the workers' presence entries (a host that
    stalled past their TTL let them expire): the publish found nobody live and returned at once, not ok,
    while the worker went on to apply the version."""
    conn = redis.Redis.from_url(redis_url)
    worker = start_fake_worker(redis_url, name="unseen", env=ENV, step_delay_s=0.01)
    try:
        workers_live(conn, 1)
        conn.delete(keys.worker_key("unseen"))  # until its next heartbeat, up to 5 s away
        conn.zrem(keys.WORKERS_KEY, "unseen")
        outcome = Client(redis_url).publish_weights(ALIAS, 8, str(version_dir), "drain", timeout=30)
        assert outcome.ok and set(outcome.acked) == {"unseen"}, outcome
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_a_worker_is_live_while_its_entry_exists_though_its_hosts_clock_is_behind(redis_url):
    """Liveness is the entry's existence, which Redis's TTL decides; a worker host whose clock was behind
    the caller's by more than the entry's TTL was taken for dead (its heartbeat time plus TTL was past)."""
    conn = redis.Redis.from_url(redis_url)
    behind = time.time() - 600
    entry = WorkerPresence(name="slow-clock", alias=ALIAS, heartbeat_at=behind, ttl_s=20)
    conn.set(keys.worker_key("slow-clock"), entry.model_dump_json(), ex=20)
    conn.zadd(keys.WORKERS_KEY, {"slow-clock": behind})
    outcome = ControlCalls(conn).send(control_command("pause", ALIAS, mode="keep"), {}, timeout=0.3)
    assert outcome.missing == ["slow-clock"] and not outcome.ok, outcome


def test_a_worker_that_was_down_catches_up_and_an_unknown_path_is_refused(redis_url, version_dir, tmp_path):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    outcome = client.publish_weights(ALIAS, 4, str(version_dir), "drain", timeout=1)
    assert outcome.acked == {} and outcome.missing == []  # nobody live to answer
    worker = start_fake_worker(redis_url, name="late", env=ENV, step_delay_s=0.01)
    try:
        workers_live(conn, 1)
        caught_up = client.wait(client.submit(long_request(95, 3)), timeout=30).weight_version
        gone = tmp_path / "gone"
        gone.mkdir()
        (gone / "model.safetensors").write_bytes(b"x")
        command, chunks = weights_command(ALIAS, 6, str(gone), "inflight")
        (gone / "model.safetensors").unlink()  # vanished before the worker looked
        outcome = ControlCalls(conn).send(command, chunks, timeout=30)
        still = client.wait(client.submit(long_request(96, 3)), timeout=30).weight_version
    finally:
        out = stop(worker)
    assert caught_up == 4, out  # its first job already on the version published while it was down
    assert not outcome.ok and "late" in outcome.errors and "no .safetensors" in outcome.errors["late"], (outcome, out)
    assert still == 4, out
    assert worker.returncode == 0, out


@pytest.fixture(scope="module")
def tiny_versions(tiny_model_dir, tmp_path_factory):
    """Version 1 of the tiny model's weights (every parameter nudged), and broken versions of it."""
    import worker  # noqa: F401
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(tiny_model_dir)
    params = dict(tree_flatten(model.parameters()))
    root = tmp_path_factory.mktemp("versions")
    mx.random.seed(1)
    nudged = {k: v + 0.05 * mx.random.normal(v.shape).astype(v.dtype) for k, v in params.items()}
    (root / "v1").mkdir()
    mx.save_safetensors(str(root / "v1" / "model.safetensors"), nudged)
    name = next(iter(params))
    (root / "wrong-shape").mkdir()
    mx.save_safetensors(str(root / "wrong-shape" / "model.safetensors"),
                        {**nudged, name: mx.zeros((3, 3), dtype=params[name].dtype)})
    (root / "missing").mkdir()
    mx.save_safetensors(str(root / "missing" / "model.safetensors"), {k: v for k, v in nudged.items() if k != name})
    return root, name


def test_real_weights_swap_drained_jobs_keep_the_old_and_broken_versions_change_nothing(
        redis_url, tiny_model_dir, tiny_versions, reference):
    import worker  # noqa: F401
    from mlx_lm import load

    from tests.reference import greedy_alone

    root, first_param = tiny_versions
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    request = {"prompt_token_ids": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
               "logprobs": True}
    old_tokens, _ = reference(request["prompt_token_ids"], 40, True)
    model, _ = load(tiny_model_dir)
    model.load_weights(str(root / "v1" / "model.safetensors"))
    new_tokens, new_logprobs = greedy_alone(model, request["prompt_token_ids"], 40, set())
    assert new_tokens != old_tokens
    from tests.workers import start_worker
    worker_proc = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="swapper")
    try:
        workers_live(conn, 1)
        running = [client.submit(request) for _ in range(4)]
        # On a fast engine a job may already have finished; the old weights' tokens are checked either way.
        wait_for(lambda: all(client.status(j) in ("started", "finished") for j in running), what="running")
        # streamed through Redis, checksummed; drained: the running jobs finish on the old weights
        outcome = client.publish_weights("tiny", 1, str(root / "v1"), "drain", upload=True, timeout=120)
        assert outcome.ok, outcome
        for job_id in running:
            result = client.wait(job_id, timeout=60)
            assert result.weight_version == 0 and result.choices[0].token_ids == old_tokens
        after = client.wait(client.submit(request), timeout=60)
        assert after.weight_version == 1 and after.choices[0].token_ids == new_tokens
        assert after.choices[0].logprobs == pytest.approx(new_logprobs, abs=1e-3)
        for broken, needle in (("wrong-shape", first_param), ("missing", "missing")):
            outcome = client.publish_weights("tiny", 2, str(root / broken), "inflight", upload=True, timeout=60)
            assert not outcome.ok and needle in outcome.errors["swapper"], outcome
        command, chunks = weights_command("tiny", 2, str(root / "v1"), "inflight", upload=True)
        first_chunk = next(iter(chunks))
        chunks[first_chunk] = chunks[first_chunk][:-1] + bytes([chunks[first_chunk][-1] ^ 1])
        outcome = ControlCalls(conn).send(command, chunks, timeout=60)
        assert not outcome.ok and "checksum" in outcome.errors["swapper"], outcome
        still = client.wait(client.submit(request), timeout=60)  # on version 1 all along
        assert still.weight_version == 1 and still.choices[0].token_ids == new_tokens
    finally:
        out = stop(worker_proc)
    assert worker_proc.returncode == 0, out


def test_the_async_client_drives_the_same_control_plane(redis_url, version_dir, tmp_path):
    import asyncio

    conn = redis.Redis.from_url(redis_url)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b'\x3e\x00\x00\x00\x00\x00\x00\x00{"w": {"dtype": "F32", "shape": [4], '
                                             b'"data_offsets": [0, 16]}}' + b"\x00" * 8)
    worker = start_fake_worker(redis_url, name="async-rl", env=ENV, step_delay_s=0.02)

    async def drive() -> None:
        client = AsyncClient(redis_url)
        try:
            job_id = await client.submit(long_request(120, 200))
            while await client.status(job_id) != "started":
                await asyncio.sleep(0.05)
            paused = await client.pause(ALIAS, "abort", timeout=30)
            assert paused.ok and list(paused.acked) == ["async-rl"]
            assert (await client.publish_weights(ALIAS, 1, str(version_dir), "inflight", timeout=30)).ok
            on_v1 = conn.get(keys.weights_key(ALIAS))
            refused = await client.publish_weights(ALIAS, 2, str(cut), "inflight", upload=True, timeout=30)
            assert not refused.ok and "exceed" in refused.errors["async-rl"] and refused.withdrawn, refused
            assert conn.get(keys.weights_key(ALIAS)) == on_v1
            assert (await client.resume(ALIAS, timeout=30)).ok
            result = await client.wait(job_id, timeout=60)  # sent back by the pause, run again on version 1
            assert result.weight_version == 1 and result.choices[0].token_ids == expected(120, 200, [(0, 1)])
        finally:
            await client.close()

    try:
        workers_live(conn, 1)
        asyncio.run(drive())
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_the_gateway_drives_the_control_plane_for_admin_tenants_only(redis_url, version_dir, tmp_path):
    import httpx

    from tests.gateway import key_entry, running_gateway

    conn = redis.Redis.from_url(redis_url)
    worker = start_fake_worker(redis_url, name="gw-rl", env=ENV, step_delay_s=0.01)
    keys_setting = ",".join([key_entry("trainer", "sk-trainer"), key_entry("app", "sk-app")])
    try:
        workers_live(conn, 1)
        with running_gateway(redis_url, api_keys=keys_setting, admin_tenants="trainer") as base:
            body = {"version": 2, "path": str(version_dir), "policy": "inflight", "timeout": 30}
            refused = httpx.post(f"{base}/control/{ALIAS}/weights", json=body,
                                 headers={"Authorization": "Bearer sk-app"}, timeout=60)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
            applied = httpx.post(f"{base}/control/{ALIAS}/weights", json=body,
                                 headers={"Authorization": "Bearer sk-trainer"}, timeout=60)
            assert applied.status_code == 200, applied.text
            assert applied.json()["acked"]["gw-rl"]["weight_version"] == 2 and applied.json()["missing"] == []
            for op in ("pause", "resume", "reset_prefix_cache", "abort"):
                answer = httpx.post(f"{base}/control/{ALIAS}/{op}", json={"timeout": 30},
                                    headers={"Authorization": "Bearer sk-trainer"}, timeout=60)
                assert answer.status_code == 200 and answer.json()["acked"]["gw-rl"]["ok"], (op, answer.text)
            # The fake engine serves no adapters: the worker refuses the adapter, naming `adapter`.
            adapter = tmp_path / "lora"
            adapter.mkdir()
            (adapter / "adapter_config.json").write_text("{}")
            (adapter / "adapters.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
            answer = httpx.post(f"{base}/control/{ALIAS}/adapter",
                                json={"name": "a", "path": str(adapter), "upload": True, "timeout": 30},
                                headers={"Authorization": "Bearer sk-trainer"}, timeout=60)
            assert answer.status_code == 200, answer.text
            ack = answer.json()["acked"]["gw-rl"]
            assert not ack["ok"] and ack["message"].startswith("adapter: 'a' cannot be served here"), ack
        assert Client(redis_url).wait(Client(redis_url).submit(long_request(130, 3)), 30).weight_version == 2
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_the_cli_drives_the_control_plane(redis_url, version_dir):
    import subprocess
    import sys

    conn = redis.Redis.from_url(redis_url)
    worker = start_fake_worker(redis_url, name="cli-rl", env=ENV, step_delay_s=0.01)

    def mlxq(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mlxq", *args, "--url", redis_url, "--timeout", "30"],
                              capture_output=True, text=True, timeout=90)

    try:
        workers_live(conn, 1)
        done = mlxq("publish-weights", ALIAS, "3", str(version_dir), "--policy", "inflight")
        assert done.returncode == 0 and '"weight_version": 3' in done.stdout, done.stdout + done.stderr
        for verb in (("pause", ALIAS), ("resume", ALIAS), ("reset-prefix-cache", ALIAS), ("abort", ALIAS)):
            done = mlxq(*verb)
            assert done.returncode == 0, (verb, done.stdout + done.stderr)
        refused = mlxq("publish-weights", ALIAS, "4", str(version_dir / "nope"))
        assert refused.returncode == 2 and "path" in refused.stderr
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out


def test_a_job_sent_back_by_an_abort_restarts_its_stream(redis_url, version_dir):
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    worker = start_fake_worker(redis_url, name="restarter", env=ENV, step_delay_s=0.02)
    try:
        workers_live(conn, 1)
        job_id = client.submit(long_request(140, 300, stream=True))
        wait_for(lambda: conn.xlen(keys.stream_key(job_id)) > 5, what="tokens streamed")
        assert client.publish_weights(ALIAS, 1, str(version_dir), "abort", timeout=30).ok
        events = list(client.stream(job_id, timeout=60))
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out
    kinds = [e["event"] for e in events]
    assert kinds.count("restart") == 1 and kinds[-1] == "end"
    after = events[kinds.index("restart") + 1:]
    tokens = [t for e in after if e["event"] == "token" for t in e["token_ids"]]
    assert tokens == client.result(job_id).choices[0].token_ids == expected(140, 300, [(0, 1)])
