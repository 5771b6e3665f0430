"""Why an operation stops early, and the checks that honour it before every pass and wave."""

from __future__ import annotations

import asyncio
import enum
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

from consolidation.errors import LeaseLost, OperationCancelled

if TYPE_CHECKING:
    from consolidation.engine.budget import TokenBudget

T = TypeVar("T")


class StopReason(enum.Enum):
    """Why an operation stops before its bank is done."""

    CANCEL = "cancel"  # asked by a user: in-flight work is aborted at once
    LEASE_LOST = "lease_lost"  # another worker owns the attempt now: in-flight work is aborted
    SHUTDOWN = "shutdown"  # the worker is exiting: running passes finish until force()
    # The operation ran past its time slice while others wait: like a shutdown, running passes
    # finish and nothing new starts; it goes back to pending with its progress (fairness).
    SLICE = "slice"
    # The bank's token budget is used: like a slice's end, running passes finish and nothing new
    # starts; it goes back to pending until the rolling window frees enough.
    BUDGET = "budget"

    @property
    def aborts_at_once(self) -> bool:
        return self not in (StopReason.SHUTDOWN, StopReason.SLICE, StopReason.BUDGET)


class StopSignal:
    """Why an operation should stop; the first reason wins. A reason that aborts at once also
    cancels the engine task (in-flight LLM requests are abandoned); ``shutdown`` lets running
    passes finish until :meth:`force` is called. The task is cancelled once, however many
    places deliver the stop: a second cancel would cut short the wave closes it waits for."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None
        self.event = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None
        self._forced = False

    def attach(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        if self._forced or (self.reason is not None and self.reason.aborts_at_once):
            self._forced = False
            self.force()

    def set(self, reason: StopReason) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()
        if reason.aborts_at_once:
            self.force()

    def force(self) -> None:
        """Cancel the running engine task (aborts in-flight LLM requests), once; before the
        task is attached, when it is."""
        if self._forced:
            return
        self._forced = True
        if self._task is not None and not self._task.done():
            self._task.cancel()


class Interrupted(Exception):
    """Stop before the next pass because the worker is shutting down, the slice is over or the
    bank's token budget is used."""


class SiblingFailed(Exception):
    """Stop before the next pass because another group of the wave failed for good."""


class Checkpoint:
    """The stop checks of one run: its :class:`StopSignal`, whether one of its units of work
    failed for good (then the others stop before their next pass, :meth:`abort`), and its bank's
    token budget, if it has one to mind."""

    def __init__(
        self, signal: StopSignal, operation_id: uuid.UUID, budget: TokenBudget | None = None
    ) -> None:
        self.signal = signal
        self.operation_id = operation_id
        self.budget = budget
        self.aborted = False

    def mind_budget(self) -> None:
        """Before a pass starts: a used token budget stops the run as gracefully as a slice's end
        (running passes finish, their markers are committed)."""
        if self.budget is not None and self.signal.reason is None and self.budget.exhausted():
            self.signal.set(StopReason.BUDGET)

    def abort(self) -> None:
        """A unit of work failed for good: the others stop before their next pass."""
        self.aborted = True

    def check(self) -> None:
        """Raise the stop that applies now, if any; called before every pass and every wave."""
        self.mind_budget()
        reason = self.signal.reason
        if reason is StopReason.CANCEL:
            raise OperationCancelled("cancel requested")
        if reason is StopReason.LEASE_LOST:
            raise LeaseLost(f"operation {self.operation_id} lost its lease")
        if reason is StopReason.SHUTDOWN:
            raise Interrupted("worker shutting down")
        if reason is StopReason.SLICE:
            raise Interrupted("time slice over")
        if reason is StopReason.BUDGET:
            raise Interrupted("token budget used")
        if self.aborted:
            raise SiblingFailed()

    def graceful(self) -> bool:
        """The operation stops, letting running passes finish (a shutdown, a slice's end, a
        used token budget)."""
        reason = self.signal.reason
        return reason is not None and not reason.aborts_at_once

    def may_start(self) -> bool:
        """Whether a pass may start now: nothing asks the operation to stop."""
        return self.signal.reason is None and not self.aborted


async def settled(task: asyncio.Future[T]) -> T:
    """``task``'s result, waiting for its end even when cancelled meanwhile (then
    CancelledError is raised once it has ended): for writes whose outcome must be known."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # observed: the cancel is what the caller hears
        raise asyncio.CancelledError()
    return task.result()
