"""The listening socket the API and the fake LLM serve on."""

from __future__ import annotations

import asyncio
import socket

from consolidation.net import listen_socket


async def test_accepted_connections_send_without_nagle_delay() -> None:
    # uvicorn serves a given socket through loop.create_server(sock=...). asyncio turns Nagle off
    # (TCP_NODELAY) on an accepted socket only when the socket says it is TCP; without it a
    # response written as headers + body waited ~40 ms for the peer's delayed ACK.
    sock = listen_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    nodelay: asyncio.Future[int] = loop.create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted = transport.get_extra_info("socket")
            nodelay.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await loop.create_server(Accept, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            assert await asyncio.wait_for(nodelay, 10) != 0
        finally:
            writer.close()
    finally:
        server.close()
        await server.wait_closed()
