"""A minimal asyncio HTTP/1.1 client for the gateway scenarios: one keep-alive connection per simulated
client, JSON bodies in, a whole body or SSE data lines out. httpx with hundreds of connections spent
more CPU a request in the bench's process than the gateway it measured, on cores the gateway shares
(docs/gateway.md, Performance); this client costs little, so the numbers are the gateway's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Optional
from urllib.parse import urlsplit

__all__ = ["HTTPError", "RawConnection"]


class HTTPError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class RawConnection:
    """One keep-alive connection to `base` (`http://host:port/prefix`); requests on it go one at a time."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.host, self.port, self.prefix = parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/")
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None

    async def _send(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        self._writer.write(head + data)
        assert self._reader is not None
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        assert self._reader is not None
        if headers.get("transfer-encoding", "").lower() != "chunked":
            yield await self._reader.readexactly(int(headers.get("content-length", "0")))
            return
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await self._reader.readuntil(b"\r\n")
                return
            chunk = await self._reader.readexactly(size + 2)
            yield chunk[:-2]

    async def post(self, path: str, body: dict[str, Any]) -> bytes:
        """The whole response body; HTTPError for a status other than 200."""
        status, headers = await self._send(path, body)
        data = b"".join([chunk async for chunk in self._chunks(headers)])
        if headers.get("connection", "").lower() == "close":
            await self.close()
        if status != 200:
            raise HTTPError(status, data)
        return data

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
        """The `data:` fields of an SSE response, one by one, `[DONE]` excluded."""
        status, headers = await self._send(path, body)
        if status != 200:
            raise HTTPError(status, b"".join([chunk async for chunk in self._chunks(headers)]))
        pending = b""
        async for chunk in self._chunks(headers):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: ") and line != b"data: [DONE]\r" and line != b"data: [DONE]":
                    yield line[6:].rstrip(b"\r").decode()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            self._writer = None
