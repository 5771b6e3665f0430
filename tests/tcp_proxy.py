"""A TCP forwarder in front of a real server, for network faults that a server restart cannot
play: a partition that leaves every socket open (:meth:`TcpProxy.freeze`) and a path that
resets every connection and refuses new ones (:meth:`TcpProxy.sever`).

It runs in the test's event loop, so the test must not block that loop while it relies on the
proxy forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to a TCP ``(host, port)`` or a Unix socket path. Use as
    ``async with``."""

    def __init__(self, upstream: tuple[str, int] | str) -> None:
        self.upstream = upstream
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._severed = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def in_front_of(cls, url: str) -> TcpProxy:
        """A proxy to the server of a Postgres URL (TCP, or a Unix socket given as ``?host=``,
        as the embedded server's URL does)."""
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        port = parts.port or int(query.get("port", 5432))
        if query.get("host", "").startswith("/"):
            return cls(f"{query['host']}/.s.PGSQL.{port}")
        return cls((parts.hostname or "127.0.0.1", port))

    def url_for(self, url: str) -> str:
        """``url`` with its server replaced by the proxy."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port")]
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.thaw()
        if self._server is not None:
            self._server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def connections(self) -> int:
        """Client connections currently open through the proxy."""
        return len(self._writers) // 2

    def freeze(self) -> None:
        """Stop forwarding in both directions; every socket stays open and new connections are
        accepted but get no answer (what a half-open partition looks like from either side)."""
        self._flowing.clear()

    def thaw(self) -> None:
        """Forward again, delivering whatever was held, in order."""
        self._flowing.set()

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

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._severed:
            client_w.transport.abort()
            return
        self._writers.add(client_w)
        try:
            await self._flowing.wait()
            if isinstance(self.upstream, str):
                upstream_r, upstream_w = await asyncio.open_unix_connection(self.upstream)
            else:
                upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
        except (OSError, asyncio.CancelledError):
            self._writers.discard(client_w)
            client_w.transport.abort()
            return
        if self._severed or client_w not in self._writers:
            client_w.transport.abort()
            upstream_w.transport.abort()
            return
        self._writers.add(upstream_w)
        pair = (client_w, upstream_w)
        for source, sink in ((client_r, upstream_w), (upstream_r, client_w)):
            task = asyncio.create_task(self._pipe(source, sink, pair))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while True:
                # Frozen: read nothing (the sender's buffers fill, as over a dead path) and
                # hold whatever was read already.
                await self._flowing.wait()
                data = await source.read(65536)
                await self._flowing.wait()
                if not data:
                    break
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in pair:
                self._writers.discard(writer)
                with contextlib.suppress(Exception):
                    writer.close()
