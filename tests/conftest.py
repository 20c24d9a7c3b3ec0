"""Shared fixtures: a private redis-server per test session, a flushed connection per test, the tiny
model and its greedy reference (the same request run alone through mlx-lm).

`MLXQ_REDIS_SERVER=valkey-server` runs every server the tests start on Valkey instead (mlxq/redis_server.py);
`make test` runs the Redis-level tests that way too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from mlxq.redis_server import RedisServer, find_redis_server


def pytest_report_header() -> str:
    return f"test servers: {find_redis_server()}"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    yield redis_server.url
    conn.close()


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import worker  # noqa: F401  (points MLX at OpenBLAS before it loads)
    from worker.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tiny_vision_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import worker  # noqa: F401  (points MLX at OpenBLAS before it loads)
    from worker.tiny_model import make_tiny_vision_model

    return str(make_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-vision"))


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    import worker  # noqa: F401
    from mlx_lm import load

    from tests.reference import greedy_alone

    model, tokenizer = load(tiny_model_dir)
    eos = set(tokenizer.eos_token_ids)

    def run(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False):
        return greedy_alone(model, prompt_ids, max_tokens, set() if ignore_eos else eos)

    return run


@pytest.fixture(scope="session")
def real_model() -> str:
    """The packaged SmolLM2-135M-Instruct GGUF file (`mlxq real-model`; its package is part of the
    dev setup, so a missing one fails the test with the command that installs it)."""
    import worker  # noqa: F401  (BLAS before MLX)
    from mlxq.real_model import put_in_place

    return str(put_in_place())
