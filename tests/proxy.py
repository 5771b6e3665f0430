"""A TCP proxy for fault tests: forwards bytes both ways and can hold the server's replies.

``hold()`` keeps every connection open but stops delivering what the server sends (it is
buffered), as a network that freezes without resetting anything would; ``release()`` delivers
what was held and forwards again. New connections are accepted and forwarded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class TcpProxy:
    """``async with TcpProxy(host, port) as proxy``: listens on 127.0.0.1:``proxy.port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

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
        self._flowing.set()
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the proxy's."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(database_url)
        netloc = parts.netloc.rsplit("@", 1)
        userinfo = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit(parts._replace(netloc=f"{userinfo}127.0.0.1:{self.port}"))

    def hold(self) -> None:
        """Stop delivering the server's bytes to clients (connections stay open)."""
        self._flowing.clear()

    def release(self) -> None:
        """Deliver what was held and forward again."""
        self._flowing.set()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self._writers |= {client_w, server_w}
        up = asyncio.create_task(self._pipe(client_r, server_w, gated=False))
        down = asyncio.create_task(self._pipe(server_r, client_w, gated=True))
        self._tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        self._tasks -= {up, down}
        for writer in (client_w, server_w):
            self._writers.discard(writer)
            writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if gated:
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()
