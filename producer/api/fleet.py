"""The live workers, read from their heartbeats (`mlxq:workers`, `mlxq:worker:<name>`), for `/v1/models`
and for the gateway's 404 (unknown model) and 503 (no live worker serves it) answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Optional

import redis.asyncio as aioredis

from producer.api import keys as api_keys
from producer.api.auth import ApiError
from producer.presence import LiveModel, aread_live, live_models

__all__ = ["Fleet", "LiveModel", "model_not_found"]

SEEN_FOR_S = 7 * 24 * 3600  # a model served this recently, without a live worker now, is answered 503


class Fleet:
    """Live workers by the model names they serve; re-read at most every `cache_s` seconds."""

    def __init__(self, connection: aioredis.Redis, cache_s: float = 1.0, configured: tuple[str, ...] = ()) -> None:
        self._connection = connection
        self._cache_s = cache_s
        self._configured = frozenset(configured)
        self._read_at = -1e9
        self._models: dict[str, LiveModel] = {}
        self._reading = asyncio.Lock()  # one read at a time; the requests behind it take its answer

    async def models(self) -> dict[str, LiveModel]:
        if time.monotonic() - self._read_at >= self._cache_s:
            async with self._reading:
                if time.monotonic() - self._read_at >= self._cache_s:
                    self._models = await self._read()
                    self._read_at = time.monotonic()
        return self._models

    async def _read(self) -> dict[str, LiveModel]:
        models = live_models(await aread_live(self._connection))  # the producer's own reading (producer/presence.py)
        if models:
            await self._connection.hset(api_keys.MODELS_SEEN, mapping={name: int(time.time()) for name in models})
        return models

    def may_wait(self, model: Optional[str]) -> bool:
        """Whether a job for `model` may wait in its queue for a worker that is not live yet: the
        asynchronous paths (`/v1/jobs`, batches) take a declared model (MLXQ_API_MODELS) whether or not
        a worker serves it now; its job runs when one comes (its TTL, or the batch's window, decides how long)."""
        return model is not None and model in self._configured

    async def require(self, model: Optional[str], queue: str, asynchronous: bool = False) -> None:
        """ApiError 404 for a model no worker is known to serve, 503 when none that serves it is live or
        listens on `queue` (unless `asynchronous` and the model is declared: `may_wait`). Without a model:
        503 unless some live worker listens on `queue`."""
        if asynchronous and self.may_wait(model):
            return
        if model is None:
            if any(queue in live.queues for live in (await self.models()).values()):
                return
            raise ApiError(503, f"No live worker listens on queue {queue!r}", "server_error", code="no_live_worker")
        live = (await self.models()).get(model)
        if live is not None:
            if queue in live.queues:
                return
            raise ApiError(503, f"No live worker serving {model!r} listens on queue {queue!r} (its priority)",
                           "server_error", code="no_live_worker")
        if await self.known(model):
            raise ApiError(503, f"No live worker serves the model {model!r}", "server_error", code="no_live_worker")
        raise model_not_found(model)

    async def known(self, model: str) -> bool:
        """Whether requests may name `model` (`unknown`)."""
        return not await self.unknown([model])

    async def unknown(self, models: Iterable[str]) -> set[str]:
        """Those of `models` no request may name, answered 404 and never put on a queue. A model is known when
        a live worker serves it, it is configured (`MLXQ_API_MODELS`), or a worker served it lately. The one
        place that says which models exist: chat, jobs and every line of a batch are checked here."""
        live = await self.models()
        rest = sorted({model for model in models if model not in live and model not in self._configured})
        if not rest:
            return set()
        seen: list[Optional[bytes]] = await self._connection.hmget(api_keys.MODELS_SEEN, rest)
        now = time.time()
        return {model for model, at in zip(rest, seen) if at is None or now - float(at) >= SEEN_FOR_S}


def model_not_found(model: str, param: str = "model") -> ApiError:
    return ApiError(404, f"The model {model!r} does not exist", param=param, code="model_not_found")
