"""Shared fixtures: a private redis-server per test session, a flushed connection per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from mlxq.redis_server import RedisServer


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
