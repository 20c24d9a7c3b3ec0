"""Broken weight versions and adapters against real worker processes on the tiny model: a file whose
header is right but whose data is cut or whose byte ranges lie, NaN and infinite weights, a NaN
adapter, an adapter scale of Infinity. Each is refused and acknowledged `ok=false` with the reason;
the running jobs finish on the old weights, token for token; no worker dies; a version no worker
accepted is withdrawn from `mlxq:weights:<model>`, and a worker that meets one anyway (its publisher
died before withdrawing it) refuses it and serves on what it has."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import redis

from producer import Client
from producer.control import BLOB_TTL_S, weights_command
from schemas import keys
from tests.workers import start_worker, stop, wait_for

pytestmark = pytest.mark.slow

REQUEST = {"model": "tiny", "prompt_token_ids": [5, 6, 7], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
           "logprobs": True}


def header_and_data(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def broken_copy(good: Path, root: Path, name: str, how: str) -> Path:
    """A copy of the version (or adapter) directory `good` with its safetensors file broken `how`."""
    import shutil

    target = root / name
    shutil.copytree(good, target)
    file = next(target.glob("*.safetensors"))
    header, data = header_and_data(file)
    tensors = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    first, second = tensors[0], tensors[1]
    if how == "truncated":  # the header is whole, the data cut short
        write_safetensors(file, header, data[:-64])
    elif how == "overlapping":  # two tensors of the same size read the same bytes
        same = next(n for n in tensors[1:] if header[n]["shape"] == header[first]["shape"])
        header[same]["data_offsets"] = header[first]["data_offsets"]
        write_safetensors(file, header, data)
    elif how == "short-range":  # a tensor's range is shorter than its shape needs
        begin, end = header[second]["data_offsets"]
        header[second]["data_offsets"] = [begin, end - 4]
        write_safetensors(file, header, data)
    elif how in ("nan", "inf"):
        begin, _ = header[second]["data_offsets"]
        value = struct.pack("<f", float(how))
        write_safetensors(file, header, data[:begin + 8] + value + data[begin + 12:])
    else:
        raise AssertionError(how)
    return target


@pytest.fixture(scope="module")
def versions(tiny_model_dir, tmp_path_factory):
    """Version 1 of the tiny model's weights (every parameter nudged), and broken copies of it."""
    import worker  # noqa: F401  (OpenBLAS before MLX)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(tiny_model_dir)
    params = dict(tree_flatten(model.parameters()))
    root = tmp_path_factory.mktemp("versions")
    mx.random.seed(1)
    (root / "v1").mkdir()
    mx.save_safetensors(str(root / "v1" / "model.safetensors"),
                        {k: v + 0.05 * mx.random.normal(v.shape).astype(v.dtype) for k, v in params.items()})
    broken = {how: broken_copy(root / "v1", root, how, how)
              for how in ("truncated", "overlapping", "short-range", "nan", "inf")}
    return root / "v1", broken, model


NEEDLES = {"truncated": "exceed", "overlapping": "overlap", "short-range": "bytes", "nan": "not finite",
           "inf": "not finite"}


def workers_live(conn: redis.Redis, names: set[str]) -> None:
    def live() -> bool:
        return names <= {n.decode() for n in conn.zrange(keys.WORKERS_KEY, 0, -1)}

    wait_for(live, timeout=90, what=f"workers {sorted(names)} live")


def test_broken_versions_are_refused_withdrawn_and_never_stop_a_worker_or_its_jobs(
        redis_url, tiny_model_dir, versions, reference):
    import worker  # noqa: F401
    from mlx_lm import load

    from tests.reference import greedy_alone

    good, broken, _ = versions
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    long = {**REQUEST, "max_tokens": 300, "logprobs": False}
    old_long, _ = reference(long["prompt_token_ids"], 300, True)
    old_tokens, _ = reference(REQUEST["prompt_token_ids"], 24, True)
    model, _ = load(tiny_model_dir)
    model.load_weights(str(good / "model.safetensors"))
    new_tokens, _ = greedy_alone(model, REQUEST["prompt_token_ids"], 24, set())
    assert new_tokens != old_tokens
    names = {"keeper-1", "keeper-2"}
    workers = {name: start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name=name) for name in names}
    try:
        workers_live(conn, names)
        running = [client.submit(long) for _ in range(4)]
        wait_for(lambda: any(client.status(j) == "started" for j in running), what="a running job")
        # Every broken version, through Redis and from a path, with every policy: refused by both
        # workers, saying why, and withdrawn (nothing was published before it).
        for index, (how, path) in enumerate(broken.items()):
            policy = ("inflight", "abort", "drain")[index % 3]
            for upload in (True, False):
                outcome = client.publish_weights("tiny", 1, str(path), policy, upload=upload, timeout=60)
                assert not outcome.ok and set(outcome.errors) == names, (how, outcome)
                assert all(NEEDLES[how] in message for message in outcome.errors.values()), (how, outcome)
                assert outcome.withdrawn and conn.get(keys.weights_key("tiny")) is None, (how, outcome)
        for job_id in running:  # never failed, never re-run on other weights: the old weights' tokens
            result = client.wait(job_id, timeout=120)
            assert result.status == "finished" and result.weight_version == 0, result.error
            assert result.choices[0].token_ids == old_long
        # A good version is taken; a broken one after it leaves the fleet and the key on it.
        outcome = client.publish_weights("tiny", 1, str(good), "inflight", upload=True, timeout=120)
        assert outcome.ok and not outcome.withdrawn, outcome
        on_v1 = conn.get(keys.weights_key("tiny"))
        outcome = client.publish_weights("tiny", 2, str(broken["nan"]), "drain", upload=True, timeout=60)
        assert not outcome.ok and outcome.withdrawn and conn.get(keys.weights_key("tiny")) == on_v1, outcome
        after = client.wait(client.submit(REQUEST), timeout=60)
        assert after.weight_version == 1 and after.choices[0].token_ids == new_tokens
        # A publisher that died before withdrawing its broken version: a worker that starts meets it,
        # refuses it (acknowledged, with the reason) and serves on the weights it loaded.
        command, chunks = weights_command("tiny", 3, str(broken["truncated"]), "inflight", upload=True)
        with conn.pipeline(transaction=False) as pipe:
            for key, value in chunks.items():
                pipe.set(key, value, ex=BLOB_TTL_S)
            pipe.set(keys.weights_key("tiny"), command.model_dump_json())
            pipe.execute()
        workers["late"] = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="late")
        workers_live(conn, {"late"})
        wait_for(lambda: conn.hexists(keys.ack_key(command.id), "late"), timeout=60, what="late's acknowledgement")
        ack = json.loads(conn.hget(keys.ack_key(command.id), "late"))
        assert ack["ok"] is False and "exceed" in ack["message"] and ack["weight_version"] == 0, ack
        for name in sorted(names):  # the workers that were running stop cleanly, never having tripped
            proc = workers.pop(name)
            out = stop(proc)
            assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
        on_late = client.wait(client.submit(REQUEST), timeout=60)
        assert on_late.worker == "late" and on_late.weight_version == 0, on_late
        assert on_late.choices[0].token_ids == old_tokens
    finally:
        outs = {name: stop(proc) for name, proc in workers.items()}
        for name, proc in workers.items():
            assert proc.returncode == 0, outs[name][-3000:]


def test_a_publish_nobody_acknowledges_is_not_ok(redis_url, versions):
    good, _, _ = versions
    outcome = Client(redis_url).publish_weights("tiny", 1, str(good), timeout=0.5)
    assert not outcome.ok and outcome.acked == {} and outcome.missing == [] and not outcome.withdrawn
    assert redis.Redis.from_url(redis_url).exists(keys.weights_key("tiny"))  # kept for workers that start later


@pytest.fixture(scope="module")
def adapters(versions, tmp_path_factory):
    import worker  # noqa: F401
    from worker.tiny_model import make_tiny_adapter

    _, _, model = versions
    root = tmp_path_factory.mktemp("adapters")
    good = make_tiny_adapter(root / "good", model, seed=21, strength=0.4)
    bad = {how: broken_copy(good, root, how, how) for how in ("nan", "inf", "truncated", "overlapping")}
    for name, scale in (("scale-inf", "Infinity"), ("scale-nan", "NaN")):
        target = root / name
        import shutil

        shutil.copytree(good, target)
        text = (target / "adapter_config.json").read_text()
        config = json.loads(text)
        config["lora_parameters"]["scale"] = "SCALE"
        (target / "adapter_config.json").write_text(json.dumps(config).replace('"SCALE"', scale))
        bad[name] = target
    return good, bad


ADAPTER_NEEDLES = {"nan": "not finite", "inf": "not finite", "truncated": "exceed", "overlapping": "overlap",
                   "scale-inf": "scale", "scale-nan": "scale"}


def test_broken_adapters_are_refused_and_the_worker_serves_on(redis_url, tiny_model_dir, adapters, reference,
                                                               tmp_path):
    import shutil

    good, bad = adapters
    served = tmp_path / "served"
    served.mkdir()
    for name in ("nan", "scale-inf"):
        shutil.copytree(bad[name], served / name)
    conn = redis.Redis.from_url(redis_url)
    client = Client(redis_url)
    old_tokens, _ = reference(REQUEST["prompt_token_ids"], 24, True)
    worker = start_worker(redis_url, tiny_model_dir, "--alias", "tiny", name="lora-keeper",
                          env={"MLXQ_ADAPTER_DIR": str(served)})
    try:
        workers_live(conn, {"lora-keeper"})
        running = client.submit({**REQUEST, "max_tokens": 300, "logprobs": False})
        for how, path in bad.items():
            for upload in (True, False):
                outcome = client.publish_adapter("tiny", f"bad-{how}", str(path), upload=upload, timeout=60)
                assert not outcome.ok and ADAPTER_NEEDLES[how] in outcome.errors.get("lora-keeper", ""), (how, outcome)
                assert outcome.withdrawn and not conn.hexists(keys.adapters_key("tiny"), f"bad-{how}"), (how, outcome)
            refused = client.wait(client.submit({**REQUEST, "adapter": f"bad-{how}"}), timeout=60)
            assert refused.status == "failed" and refused.error.message.startswith("adapter:"), refused
        for name in ("nan", "scale-inf"):  # from MLXQ_ADAPTER_DIR: the job fails, naming the adapter
            failed = client.wait(client.submit({**REQUEST, "adapter": name}), timeout=60)
            assert failed.status == "failed" and failed.error.type == "InvalidRequest", failed
            assert ADAPTER_NEEDLES[name] in failed.error.message and failed.error.message.startswith("adapter:")
        assert client.publish_adapter("tiny", "good", str(good), upload=True, timeout=60).ok
        kept = conn.hget(keys.adapters_key("tiny"), "good")
        refused = client.publish_adapter("tiny", "good", str(bad["nan"]), upload=True, timeout=60)
        assert not refused.ok and refused.withdrawn and conn.hget(keys.adapters_key("tiny"), "good") == kept
        assert client.wait(client.submit({**REQUEST, "adapter": "good"}), timeout=60).status == "finished"
        base = client.wait(client.submit(REQUEST), timeout=60)
        assert base.status == "finished" and base.choices[0].token_ids == old_tokens
        assert client.wait(running, timeout=120).status == "finished"
        assert worker.poll() is None, "the worker died"
    finally:
        out = stop(worker)
    assert worker.returncode == 0, out[-3000:]
