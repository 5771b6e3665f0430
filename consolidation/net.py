"""Listening sockets for the HTTP servers this package runs (the API and the fake LLM)."""

from __future__ import annotations

import socket

__all__ = ["listen_socket", "socket_url"]


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0 picks one); raises OSError.

    Listening at once means clients that connect before uvicorn has started wait in the backlog
    instead of being refused, so a URL logged right after this is already true.

    The protocol is named (``IPPROTO_TCP``, not 0): asyncio sets ``TCP_NODELAY`` only on
    accepted sockets whose ``proto`` says TCP, and without it every response uvicorn writes in
    two pieces (headers, then body) waits ~40 ms for the client's delayed ACK (Nagle).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://host:port`` of a listening socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
