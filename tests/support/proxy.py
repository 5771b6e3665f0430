"""A TCP proxy for fault tests, in front of a real Postgres: forwards bytes both ways and plays
the network faults a server restart cannot.

- ``hold()`` keeps every connection open but stops delivering what the server sends, as a
  network that freezes its return path would; ``release()`` delivers what was held.
- ``freeze()`` stops forwarding both ways with every socket left open: a partition that resets
  nothing, so no error ever reaches either side (new connections are accepted and get no
  answer); ``thaw()`` forwards again, delivering what was held, in order.
- ``sever()`` resets every connection, and every new one until ``restore()``.

It runs in the test's event loop: the test must not block that loop (``subprocess.wait``,
``time.sleep``) while it relies on the proxy forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


class TcpProxy:
    """``async with TcpProxy(host, port) as proxy``: listens on 127.0.0.1:``proxy.port``. A
    ``host`` that starts with ``/`` is a Unix socket directory, as in libpq."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._requests = asyncio.Event()  # client → server flows
        self._replies = asyncio.Event()  # server → client flows
        self._requests.set()
        self._replies.set()
        self._severed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    def in_front_of(cls, database_url: str) -> TcpProxy:
        """A proxy to the server of a Postgres URL (TCP, or a Unix socket given as ``?host=``,
        as the embedded server's URL is)."""
        parts = urlsplit(database_url)
        query = dict(parse_qsl(parts.query))
        port = parts.port or int(query.get("port", 5432))
        return cls(query.get("host") or parts.hostname or "127.0.0.1", port)

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.thaw()
        assert self._server is not None
        self._server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def url(self, database_url: str) -> str:
        """``database_url`` with its server replaced by the proxy."""
        parts = urlsplit(database_url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port")]
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))

    @property
    def connections(self) -> int:
        """Client connections currently open through the proxy."""
        return len(self._writers) // 2

    def hold(self) -> None:
        """Stop delivering the server's bytes to clients (connections stay open)."""
        self._replies.clear()

    def release(self) -> None:
        """Deliver what was held and forward again."""
        self._replies.set()

    def freeze(self) -> None:
        """Stop forwarding both ways; every socket stays open."""
        self._requests.clear()
        self._replies.clear()

    def thaw(self) -> None:
        """Forward both ways again, delivering whatever was held, in order."""
        self._requests.set()
        self._replies.set()

    def sever(self) -> None:
        """Reset every connection now and every new one until :meth:`restore`."""
        self._severed = True
        self._abort_all()

    def restore(self) -> None:
        self._severed = False

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _open_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self.target
        if host.startswith("/"):
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._severed:
            client_w.transport.abort()
            return
        self._writers.add(client_w)
        try:
            await self._requests.wait()  # frozen: accepted, never answered
            server_r, server_w = await self._open_target()
        except OSError:
            self._writers.discard(client_w)
            client_w.transport.abort()
            return
        if client_w not in self._writers:  # severed meanwhile
            server_w.transport.abort()
            return
        self._writers.add(server_w)
        pair = (client_w, server_w)
        for reader, writer, gate in (
            (client_r, server_w, self._requests),
            (server_r, client_w, self._replies),
        ):
            task = asyncio.create_task(self._pipe(reader, writer, gate, pair))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        gate: asyncio.Event,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    # Held: read nothing more (the sender's buffers fill, as over a dead path)
                    # and deliver nothing already read.
                    await gate.wait()
                    data = await reader.read(65536)
                    await gate.wait()
                    if not data:
                        break
                    writer.write(data)
                    await writer.drain()
        finally:
            for end in pair:
                self._writers.discard(end)
                end.close()
