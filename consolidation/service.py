"""``consolidation serve``: the HTTP API and the worker in one process and one event loop.

The process owns SIGTERM/SIGINT (not uvicorn). A signal stops the worker claiming and the API
accepting (requests in flight get up to 5 s), lets the worker drain its running operations
within the grace period (DESIGN §4), then closes the pool and the LLM client — the reverse of
start-up — and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import structlog
import uvicorn

from consolidation.errors import ConfigError
from consolidation.metrics import EventLoopLagMonitor
from consolidation.net import listen_socket, socket_url
from consolidation.runtime import open_runtime
from consolidation.settings import Settings
from consolidation.worker import Worker

log = structlog.get_logger(__name__)


class _ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service decides when the API stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_api_exposure(settings: Settings) -> None:
    """Refuse an API without a key on an address other people can reach, unless allowed.

    Every memory of every bank is readable and deletable through the API; an open port on a
    shared network must be a decision, not a default.
    """
    if settings.api_key is not None or settings.allow_unauthenticated:
        return
    if not _is_loopback(settings.http_host):
        raise ConfigError(
            f"refusing to serve the API on {settings.http_host} without a key: set "
            "CONSOLIDATION_API_KEY, or CONSOLIDATION_ALLOW_UNAUTHENTICATED=true to accept that "
            "anyone who reaches the port can read and delete every bank"
        )


def _api_socket(settings: Settings) -> socket.socket:
    check_api_exposure(settings)
    try:
        return listen_socket(settings.http_host, settings.http_port)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {settings.http_host}:{settings.http_port} ({exc.strerror}); "
            "set CONSOLIDATION_HTTP_HOST / CONSOLIDATION_HTTP_PORT"
        ) from None


async def serve(settings: Settings, *, api: bool = True, worker: bool = True) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    loop = asyncio.get_running_loop()
    shutdown = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    sock = _api_socket(settings) if api else None
    tasks: list[asyncio.Task[Any]] = []
    server: _ApiServer | None = None
    async with AsyncExitStack() as stack:
        if sock is not None:
            stack.callback(sock.close)
        rt = await stack.enter_async_context(open_runtime(settings))
        await stack.enter_async_context(EventLoopLagMonitor())
        the_worker = None
        if worker:
            the_worker = Worker(
                settings,
                rt.pool,
                rt.database_url,
                rt.llm,
                worker_id=rt.worker_id,
                embedder=rt.embedder,
            )
            tasks.append(asyncio.create_task(the_worker.run(shutdown), name="worker"))
        if sock is not None:
            from consolidation.api.routes import create_app

            contact = the_worker.contact if the_worker is not None else None
            server = _ApiServer(
                uvicorn.Config(
                    create_app(settings, rt.pool, contact=contact),
                    log_config=None,
                    access_log=False,
                    lifespan="off",
                    timeout_graceful_shutdown=5,
                )
            )
            tasks.append(asyncio.create_task(server.serve(sockets=[sock]), name="api"))
            url = socket_url(sock)
            log.info("api_listening", url=url, docs=f"{url}/docs")
        loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
        log.info("service_started", api=api, worker=worker, event_loop=loop_kind)

        stopper = asyncio.create_task(shutdown.wait())
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        exit_code = 0
        for task in done:
            if task is not stopper:
                # A part stopped on its own: that is a failure, and the rest must stop too.
                exit_code = 1
                error = task.exception() if not task.cancelled() else None
                log.error("service_part_stopped", part=task.get_name(), error=repr(error))
        log.info("shutdown_started")
        shutdown.set()
        stopper.cancel()
        if server is not None:
            server.should_exit = True
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, SystemExit):
                log.error("shutdown_error", error=repr(result))
    log.info("service_stopped", exit_code=exit_code)
    return exit_code
