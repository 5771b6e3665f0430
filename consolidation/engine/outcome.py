"""How an attempt ends: a pure decision from its error, its stop reason and its lease.

:func:`decide_end` says what to record; :mod:`consolidation.engine.attempt` records it. Kept apart
so the policy (which errors spend an attempt, which hand the operation back) reads, and is
tested, without a database.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from consolidation import db, queue
from consolidation.engine.stop import SiblingFailed, StopReason
from consolidation.errors import LeaseLost, LLMConfigError, OperationCancelled

if TYPE_CHECKING:
    from consolidation.queue import Lease

# An attempt that ends because the database was unavailable (a restart, a dropped or terminated
# session, too many connections, read-only) is handed back without spending one of max_attempts,
# at most this many times per operation (takeovers after an expired lease included); past that it
# spends attempts like any other error, so an operation whose database keeps failing still ends
# (docs/reliability.md).
MAX_INTERRUPTIONS = queue.MAX_INTERRUPTIONS
MAX_INTERRUPTION_DELAY_S = 300.0

CANCELLED_MESSAGE = "cancelled on request"
SHUTDOWN_MESSAGE = "interrupted by shutdown"


class EndKind(enum.Enum):
    """What is recorded for an attempt."""

    COMPLETED = "completed"  # finished: ``completed``
    LOST = "lost"  # another worker owns the attempt: nothing is written
    CANCELLED = "cancelled"  # finished: ``cancelled``
    YIELDED = "yielded"  # slice over: back to pending behind the waiting ones, progress kept
    SHUT_DOWN = "shut_down"  # back to pending at once, no attempt spent
    PAUSED = "paused"  # token budget used: back to pending until the window frees, progress kept
    INTERRUPTED = "interrupted"  # the database was unreachable: back later, no attempt spent
    FAILED = "failed"  # finished: ``failed``
    RETRY = "retry"  # back to pending after ``delay_s``, the attempt spent


@dataclass(frozen=True)
class EndDecision:
    """What to record for an attempt: the kind of end, the operator's message, the delay before
    the operation may run again (hand-backs only)."""

    kind: EndKind
    message: str | None = None
    delay_s: float = 0.0


def decide_end(
    error: BaseException | None,
    stop_reason: StopReason | None,
    lease: Lease,
    backoff_s: float,
) -> EndDecision:
    """The end of an attempt that raised ``error`` (None: it finished) with ``stop_reason`` set;
    ``backoff_s`` is the first retry's delay (``CONSOLIDATION_RETRY_BACKOFF_S``)."""
    if error is None:
        return EndDecision(EndKind.COMPLETED)
    if stop_reason is StopReason.LEASE_LOST or isinstance(error, LeaseLost):
        return EndDecision(EndKind.LOST, str(error) or "lease lost")
    if stop_reason is StopReason.CANCEL or isinstance(error, OperationCancelled):
        return EndDecision(EndKind.CANCELLED, CANCELLED_MESSAGE)
    if stop_reason is StopReason.SLICE:
        return EndDecision(EndKind.YIELDED)
    if stop_reason is StopReason.BUDGET:
        return EndDecision(EndKind.PAUSED)
    if stop_reason is StopReason.SHUTDOWN:
        return EndDecision(EndKind.SHUT_DOWN, SHUTDOWN_MESSAGE)
    message = describe(error)
    if isinstance(error, db.DATABASE_DOWN) and lease.interruptions < MAX_INTERRUPTIONS:
        return EndDecision(
            EndKind.INTERRUPTED,
            f"the database was unavailable ({message}); handed back without spending an attempt "
            f"(interruption {lease.interruptions + 1} of at most {MAX_INTERRUPTIONS})",
            min(backoff_s * 2**lease.interruptions, MAX_INTERRUPTION_DELAY_S),
        )
    of = f"attempt {lease.attempt} of {lease.max_attempts}"
    if isinstance(error, LLMConfigError):
        return EndDecision(EndKind.FAILED, f"{message} (not retried: a configuration error; {of})")
    if lease.attempt >= lease.max_attempts:
        return EndDecision(EndKind.FAILED, f"{message}; no attempts left ({of})")
    delay = backoff_s * 2 ** (lease.attempt - 1)
    return EndDecision(EndKind.RETRY, f"{message}; retried in {delay:g} s ({of})", delay)


def describe(error: BaseException) -> str:
    """``Type: message`` (or the type alone), as stored in ``operations.error``."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


_ERROR_PRIORITY = (LeaseLost, OperationCancelled, LLMConfigError)


def first_error(errors: Sequence[BaseException]) -> BaseException:
    """The error that decides the operation's fate: the first, unless a weightier one exists."""
    real = [e for e in errors if not isinstance(e, SiblingFailed)] or list(errors)
    for kind in _ERROR_PRIORITY:
        for error in real:
            if isinstance(error, kind):
                return error
    return real[0]
