"""Hedged requests: a second copy of a slow request, sent only into spare capacity.

A model server's latency has a heavy tail: a few calls take many times the median. In the middle
of a backlog such a straggler holds one group slot; at its end it holds up the whole operation
while every other slot is idle. With ``CONSOLIDATION_LLM_HEDGE_QUANTILE`` set (``0.95``, say), a
request still unanswered after that quantile of the latencies of the recent answered requests is
sent once more — only if a request slot under ``LLM_MAX_CONCURRENT`` is free and no request waits
for one — and the first usable reply wins; the other request is aborted. A copy never delays a
first request: a request that finds no slot free aborts the youngest copy in flight
(:meth:`Hedging.preempt`). Each copy is charged the prompt tokens of the answer (a server may
bill a request it was sent, answered or not), so per-bank budgets see what hedging spends.

Off by default: the copies' tokens are an operator's to spend. Google's "The Tail at Scale"
(Dean and Barroso, 2013) measured the same trade on its services: a few per cent more requests
for a much shorter tail.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter

__all__ = ["MIN_SAMPLES", "WINDOW", "Hedging"]

R = TypeVar("R")

# The latencies a hedge's delay is read from: the most recent answered requests.
WINDOW = 256
# No copy before this many answers: a quantile of a handful of latencies says little.
MIN_SAMPLES = 20


class Hedging:
    """When a request gets a copy, and the race between the two (see the module's docstring)."""

    def __init__(
        self,
        quantile: float,
        *,
        outcomes: Counter | None = None,
        window: int = WINDOW,
        min_samples: int = MIN_SAMPLES,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError("the hedge quantile must be between 0 and 1, exclusive")
        if min_samples < 1 or window < min_samples:
            raise ValueError("need 1 <= min_samples <= window")
        self.quantile = quantile
        self._latencies: deque[float] = deque(maxlen=window)
        self._min_samples = min_samples
        # Copies in flight, oldest first: a first request short of a slot aborts the youngest.
        self._copies: list[asyncio.Future[Any]] = []
        self._outcomes = (
            {k: outcomes.labels(outcome=k) for k in ("first", "copy", "neither", "preempted")}
            if outcomes is not None
            else None
        )

    def observe(self, seconds: float) -> None:
        """An answered request's latency (a copy's too)."""
        self._latencies.append(seconds)

    def delay(self) -> float | None:
        """How long a request may go unanswered before it gets a copy; None before
        ``min_samples`` requests have been answered."""
        latencies = self._latencies
        if len(latencies) < self._min_samples:
            return None
        ordered = sorted(latencies)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def preempt(self) -> bool:
        """Abort the youngest copy in flight, freeing its slot for a first request; False when
        there is none."""
        while self._copies:
            copy = self._copies.pop()
            if not copy.done():
                copy.cancel()
                self._count("preempted")
                return True
        return False

    async def race(
        self,
        first: Awaitable[R],
        copy: Callable[[], Awaitable[Awaitable[R] | None]],
        usable: Callable[[R], bool],
        sent: asyncio.Future[None] | None = None,
    ) -> tuple[R, int]:
        """``first``'s result, or that of the copy ``copy()`` starts once ``first`` has gone
        unanswered for :meth:`delay` (``await copy()`` is None when there is no spare slot):
        whichever is usable first, ``first`` on a tie. When neither is, ``first``'s result or
        error stands. Returns the result and the number of requests sent (1 or 2). The request
        that lost is aborted, and so is every request when the caller is cancelled.

        ``sent``, when given, resolves once ``first`` holds its slot and its request is on its
        way: the delay runs from then, not from a wait for a slot at a busy cap."""
        primary: asyncio.Future[R] = asyncio.ensure_future(first)
        racing: list[asyncio.Future[R]] = [primary]
        try:
            delay = self.delay()
            if delay is None:
                return await primary, 1
            if sent is not None:
                waits: set[asyncio.Future[Any]] = {primary, sent}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait({primary}, timeout=delay)
            if primary.done():
                return await primary, 1
            second = await copy()
            if second is None:
                return await primary, 1
            other: asyncio.Future[R] = asyncio.ensure_future(second)
            racing.append(other)
            self._copies.append(other)
            pending: set[asyncio.Future[R]] = {primary, other}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task, who in ((primary, "first"), (other, "copy")):
                    if task in done and _succeeded(task) and usable(task.result()):
                        self._count(who)
                        return task.result(), 2
            self._count("neither")
            return primary.result(), 2
        finally:
            for task in racing:
                if not task.done():
                    task.cancel()
                # An error nobody reads (the loser's) is not worth asyncio's warning.
                task.add_done_callback(_retrieve)
            self._copies = [c for c in self._copies if not c.done()]

    def _count(self, outcome: str) -> None:
        if self._outcomes is not None:
            self._outcomes[outcome].inc()


def _succeeded(task: asyncio.Future[Any]) -> bool:
    return not task.cancelled() and task.exception() is None


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
