"""`GET /dashboard`: the operator page (docs/operations.md). The page polls `GET /dashboard/data` (the
fleet now, producer/fleet_stats.py, and its last minutes, producer/fleet_history.py) and draws its
charts with plotly.js, served by the gateway itself from the installed `plotly` package (no CDN).

This router's lifespan runs the gateway's history sampler and its upkeep of RQ's queue registry beside the
app's own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from producer.api.gateway import gateway
from producer.api.routes_metrics import ops_access
from producer.done_listener import stop_reader
from producer.fleet_history import HistorySampler, history_json, read_history
from producer.fleet_queues import QueuePruner
from producer.fleet_stats import aread_snapshot

__all__ = ["router"]


@contextlib.asynccontextmanager
async def _fleet_upkeep(app: FastAPI) -> AsyncIterator[None]:
    """The history sampler, and the upkeep of RQ's queue registry (producer/fleet_queues.py)."""
    gw = app.state.gateway
    sampler = HistorySampler(gw.client.connection, gw.settings.history_interval_s, gw.settings.history_window_s)

    async def served() -> set[str]:
        return {queue for model in (await gw.fleet.models()).values() for queue in model.queues}

    pruner = QueuePruner(gw.client.connection, served, gw.settings.history_interval_s)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(sampler.run(), name="mlxq-history"), loop.create_task(pruner.run(), name="mlxq-queues")]
    try:
        yield
    finally:
        for task in tasks:  # each cancelled until it ends: a cancel redis-py turned into an error was read on
            await stop_reader(task)


router = APIRouter(lifespan=_fleet_upkeep)


@functools.lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, bytes, str]:
    """plotly.js as the installed plotly package ships it: (plain, gzipped, version)."""
    import plotly
    from plotly.offline import get_plotlyjs

    plain = get_plotlyjs().encode()
    return plain, gzip.compress(plain, compresslevel=6), plotly.__version__


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    page = resources.files("producer.api").joinpath("dashboard.html").read_text(encoding="utf-8")
    return HTMLResponse(page.replace("{{plotly_version}}", _plotly_js()[2]), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/plotly.min.js", include_in_schema=False)
async def plotly_js(request: Request) -> Response:
    plain, zipped, version = _plotly_js()
    headers = {"Cache-Control": "public, max-age=604800, immutable", "ETag": f'"plotly-{version}"',
               "Vary": "Accept-Encoding"}
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(zipped, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
    return Response(plain, media_type="text/javascript", headers=headers)


@router.get("/dashboard/data", include_in_schema=False, dependencies=[Depends(ops_access)])
async def dashboard_data(request: Request) -> dict[str, Any]:
    gw = gateway(request)
    connection = gw.client.connection
    snapshot = await aread_snapshot(connection)
    history = await read_history(connection, gw.settings.history_window_s, now=snapshot.taken_at)
    return {"snapshot": snapshot.to_json(), "history": history_json(history),
            "interval_s": gw.settings.history_interval_s, "window_s": gw.settings.history_window_s}
