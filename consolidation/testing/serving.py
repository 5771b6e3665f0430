"""Answering one request at its planned time: a precise clock for the delays, waiting on the
client leaving or the server stopping, and the OpenAI-style error responses."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive

from consolidation.testing.config import _Plan


def _error_body(message: str, code: int) -> bytes:
    """An OpenAI-style error object."""
    if code == 401:
        kind = "authentication_error"
    elif code == 429:
        kind = "rate_limit_error"
    elif code >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body has been read, so the next message the server delivers is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Clock:
    """Resolves futures at a deadline to within a fraction of a millisecond. The event loop's
    own timers are coarser (uvloop's count whole milliseconds and fire up to one late), which a
    benchmark would charge to the engine as time the model did not take: one thread sleeps
    until the earliest deadline and hands each due future back to its loop."""

    def __init__(self) -> None:
        self._due = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, deadline: float) -> asyncio.Future[None]:
        """A future of the running loop resolved at ``deadline`` (``time.monotonic()``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._due:
            heapq.heappush(self._heap, (deadline, next(self._order), loop, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fake-clock", daemon=True)
                self._thread.start()
            self._due.notify()
        return future

    def _run(self) -> None:
        with self._due:
            while True:
                if not self._heap:
                    self._due.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._due.wait(wait)
                    continue
                _, _, loop, future = heapq.heappop(self._heap)
                with contextlib.suppress(RuntimeError):  # its loop has closed meanwhile
                    loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # not cancelled by a client that left
        future.set_result(None)


_CLOCK = _Clock()


async def _wait(receive: Receive, deadline: float | None, closing: asyncio.Event) -> str:
    """Wait until ``deadline`` (``time.monotonic()``; None: forever). Returns ``"disconnect"``
    if the client leaves first, ``"closing"`` if the server is stopping first, else
    ``"elapsed"``."""
    disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
    stopping = asyncio.ensure_future(closing.wait())
    waiting: set[asyncio.Future[Any]] = {disconnect, stopping}
    if deadline is not None:
        waiting.add(_CLOCK.at(deadline))
    try:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [future for future in waiting if not future.done()]
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.wait(pending)
    if disconnect in done:
        return "disconnect"
    return "closing" if stopping in done else "elapsed"


async def _serve(
    receive: Receive,
    closing: asyncio.Event,
    plan: _Plan,
    respond: Callable[[], tuple[Response, float]],
    finish: Callable[[int | None], None],
    since: float,
) -> Response:
    """Answer ``respond()`` once ``plan``'s delay has passed ``since`` the request arrived (the
    answer is worked out within it, as a model's is: the latency is the whole service time), a
    503 instead if the server is stopping first, nothing if the client leaves first. ``finish``
    records the status (None: the client left), before the response is sent, so "ended" never
    postdates what the client saw."""
    status: int | None = None
    try:
        answer, token_s = (None, 0.0) if plan.hang else respond()
        delay_s = plan.delay_s + token_s
        waited = "elapsed"
        if plan.hang or delay_s > 0:
            waited = await _wait(receive, None if plan.hang else since + delay_s, closing)
        if waited == "disconnect":
            # Nobody is listening any more; this response is never delivered.
            return Response(status_code=499)
        if waited == "closing":
            response = _status_response(
                _Plan(status=503, body="the fake LLM server is shutting down")
            )
        else:
            assert answer is not None  # a plan that hangs never gets here
            response = answer
        status = response.status_code
        return response
    finally:
        finish(status)


def _status_response(plan: _Plan) -> Response:
    headers = {}
    if plan.retry_after is not None:
        headers["retry-after"] = f"{plan.retry_after:g}"
    body = plan.body
    if body is None:
        content = _error_body(f"fake LLM failure {plan.status}", plan.status)
    else:
        # A plain message becomes an OpenAI-style error object; a JSON body is sent as is.
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            content = _error_body(body, plan.status)
        else:
            content = body.encode()
    return Response(
        content, status_code=plan.status, headers=headers, media_type="application/json"
    )
