"""Deadlines for what a client sends the gateway: a request's line and headers, then its body.

uvicorn closes a keep-alive connection left idle between requests (`timeout_keep_alive`), but sets no
limit on how long a request may take to arrive: a client that opens connections and sends nothing, or
a header a byte at a time, or a body it never finishes, would hold each connection (and its memory)
for as long as it likes, before any authentication. `DeadlineProtocol` is uvicorn's httptools
protocol with two timers: a request's head must arrive within `head_s` of the connection opening (or
of the request's first byte, on a kept-alive connection), then its body within `body_s`. Past either,
the connection is closed (a 408 first when the head is not complete). Responses are never timed: a
stream or a blocking request takes as long as its job.

The deadlines come from the gateway's settings through the ASGI lifespan state (`STATE_KEY`), which
uvicorn hands to every connection; serve the app with `uvicorn_options()`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["STATE_KEY", "DeadlineProtocol", "HttpDeadlines", "uvicorn_options"]

log = logging.getLogger("mlxq.api")

STATE_KEY = "mlxq_http_deadlines"
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
              b"content-length: 36\r\n\r\nthe request did not arrive in time.\n")


@dataclass(frozen=True)
class HttpDeadlines:
    head_s: float = 10.0
    body_s: float = 300.0


def uvicorn_options() -> dict[str, Any]:
    """What `uvicorn.run` / `uvicorn.Config` need, beside the app, to serve it with these deadlines."""
    return {"http": DeadlineProtocol}


class DeadlineProtocol(HttpToolsProtocol):
    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._deadlines: HttpDeadlines = app_state.get(STATE_KEY) or HttpDeadlines()
        self._timer: Optional[asyncio.TimerHandle] = None
        self._head_done = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self._deadlines.head_s, head=True)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._head_done and self._timer is not None:
            return  # the connection's first request: timed since it opened
        self._arm(self._deadlines.head_s, head=True)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self._deadlines.body_s, head=False)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, head: bool) -> None:
        self._disarm()
        self._head_done = not head
        self._timer = self.loop.call_later(seconds, self._expired, head)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, head: bool) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        what = "headers" if head else "body"
        limit = self._deadlines.head_s if head else self._deadlines.body_s
        log.info("closed a connection from %s: its request's %s did not arrive within %s s", self.client, what, limit)
        if head:
            self.transport.write(_TIMED_OUT)
        self.transport.close()
