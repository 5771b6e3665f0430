"""A keep-alive HTTP/1.1 client for ``http://`` endpoints reached without a proxy.

A self-hosted model (vLLM, Ollama, llama.cpp) on the same host or network is reached over
plain HTTP, and there a fast model's answer takes milliseconds: what the client costs per
request is a share of every chain step. aiohttp spends about 100 µs of CPU on a request and
its answer; this client spends 40, and the round trip is 60 µs shorter (docs/benchmarks.md,
#16 session 13). It does only what :class:`consolidation.http.Endpoint` asks: a POST of a body
already encoded, its whole answer read (``Content-Length``, chunked, or until the server
closes), connections kept for the next request. ``https://`` and proxied endpoints keep
aiohttp.

The request is written in the caller's task, in one write, before it first waits.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import httptools

__all__ = ["Answer", "BadResponse", "PlainHTTP", "ServerDisconnected"]


class ServerDisconnected(ConnectionError):
    """The server closed the connection before its answer was complete."""


class BadResponse(ConnectionError):
    """The server's bytes are not an HTTP/1.1 response."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One response read in full: status, reason phrase, headers (names in lower case; a
    repeated header's values joined with ``", "``), body, and whether the connection stays open."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _Connection(asyncio.Protocol):
    """One connection and the response being read on it (one request at a time)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[Answer] | None = None
        self._clear()

    def _clear(self) -> None:
        self._reason = ""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._headers_done = False

    # --- the request ----------------------------------------------------------------------

    def send(self, data: bytes, waiter: asyncio.Future[Answer]) -> None:
        assert self.transport is not None
        self._waiter = waiter
        self.transport.write(data)

    def abandon(self) -> None:
        """Close the connection: its answer, if one still comes, belongs to no request."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as an asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"the server's answer is not HTTP/1.1: {exc}"))
            self.abandon()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._headers_done and self._until_close():
            self._complete(keep_alive=False)
            return
        self._fail(
            ServerDisconnected(
                "the server closed the connection before its answer was complete"
                + (f" ({exc})" if exc is not None else "")
            )
        )

    # --- httptools callbacks --------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._complete(keep_alive=self._parser.should_keep_alive())

    # --- completing the waiter ----------------------------------------------------------

    def _until_close(self) -> bool:
        """Whether the body runs until the server closes (no length, not chunked)."""
        return (
            "content-length" not in self._headers
            and "chunked" not in self._headers.get("transfer-encoding", "").lower()
        )

    def _complete(self, keep_alive: bool) -> None:
        waiter, self._waiter = self._waiter, None
        answer = Answer(
            self._parser.get_status_code(),
            self._reason,
            self._headers,
            b"".join(self._body),
            keep_alive and not self.closed,
        )
        self._clear()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        self._clear()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class PlainHTTP:
    """``POST url`` over kept-alive connections (as many as requests in flight: the caller
    caps those). Raises :class:`OSError` (``ServerDisconnected``, ``BadResponse``, a refused
    connection) for transport trouble; the caller's timeout or cancellation closes the
    connection the request was on."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc.rpartition("@")[2]
        lines = [f"POST {target} HTTP/1.1", f"host: {authority}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self._head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle: list[_Connection] = []
        self._closed = False

    async def post(self, body: bytes) -> Answer:
        loop = asyncio.get_running_loop()
        connection = self._idle_connection()
        if connection is None:
            _, connection = await loop.create_connection(_Connection, self._host, self._port)
        waiter: asyncio.Future[Answer] = loop.create_future()
        connection.send(
            b"%scontent-length: %d\r\n\r\n%s" % (self._head, len(body), body),
            waiter,
        )
        try:
            answer = await waiter
        except BaseException:
            connection.abandon()
            raise
        if answer.keep_alive and not self._closed:
            self._idle.append(connection)
        else:
            connection.abandon()
        return answer

    def _idle_connection(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        return None

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.abandon()
