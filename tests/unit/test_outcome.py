"""The end policy of an attempt, without a database: which end each error and stop reason get."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from consolidation.engine.outcome import (
    MAX_INTERRUPTION_DELAY_S,
    MAX_INTERRUPTIONS,
    EndDecision,
    EndKind,
    decide_end,
    describe,
    first_error,
)
from consolidation.engine.stop import Interrupted, SiblingFailed, StopReason
from consolidation.errors import (
    InvalidLLMOutput,
    LeaseLost,
    LLMConfigError,
    OperationCancelled,
    TransientLLMError,
)
from consolidation.queue import Lease

BACKOFF_S = 2.0


def lease(attempt: int = 1, max_attempts: int = 3, interruptions: int = 0) -> Lease:
    return Lease(uuid.uuid4(), "b", "w", attempt, None, max_attempts, interruptions=interruptions)


def test_no_error_completes_whatever_the_stop_reason() -> None:
    for reason in (None, *StopReason):
        assert decide_end(None, reason, lease(), BACKOFF_S) == EndDecision(EndKind.COMPLETED)


@pytest.mark.parametrize(
    ("error", "reason", "kind", "message"),
    [
        (LeaseLost("gone"), None, EndKind.LOST, "gone"),
        (RuntimeError(), StopReason.LEASE_LOST, EndKind.LOST, "lease lost"),
        (OperationCancelled("x"), None, EndKind.CANCELLED, "cancelled on request"),
        (TransientLLMError("x"), StopReason.CANCEL, EndKind.CANCELLED, "cancelled on request"),
        (TransientLLMError("x"), StopReason.SLICE, EndKind.YIELDED, None),
        (Interrupted("token budget used"), StopReason.BUDGET, EndKind.PAUSED, None),
        (TransientLLMError("x"), StopReason.SHUTDOWN, EndKind.SHUT_DOWN, "interrupted by shutdown"),
    ],
)
def test_stops_and_fences_decide_before_the_error(
    error: BaseException, reason: StopReason | None, kind: EndKind, message: str | None
) -> None:
    decision = decide_end(error, reason, lease(), BACKOFF_S)
    assert (decision.kind, decision.message) == (kind, message)


def test_a_lost_lease_wins_over_a_cancel() -> None:
    assert decide_end(LeaseLost("x"), StopReason.CANCEL, lease(), BACKOFF_S).kind is EndKind.LOST


def test_other_errors_spend_an_attempt_with_exponential_backoff_then_fail() -> None:
    error = TransientLLMError("LLM down")
    first = decide_end(error, None, lease(attempt=1), BACKOFF_S)
    second = decide_end(error, None, lease(attempt=2), BACKOFF_S)
    assert (first.kind, first.delay_s) == (EndKind.RETRY, BACKOFF_S)
    assert (second.kind, second.delay_s) == (EndKind.RETRY, 2 * BACKOFF_S)
    assert first.message == "TransientLLMError: LLM down; retried in 2 s (attempt 1 of 3)"
    last = decide_end(error, None, lease(attempt=3, max_attempts=3), BACKOFF_S)
    assert (last.kind, last.message) == (
        EndKind.FAILED,
        "TransientLLMError: LLM down; no attempts left (attempt 3 of 3)",
    )


def test_a_configuration_error_fails_at_once() -> None:
    decision = decide_end(LLMConfigError("401"), None, lease(attempt=1), BACKOFF_S)
    assert decision == EndDecision(
        EndKind.FAILED, "LLMConfigError: 401 (not retried: a configuration error; attempt 1 of 3)"
    )


def test_an_unreachable_database_hands_back_without_spending_until_the_interruptions_run_out() -> (
    None
):
    error = ConnectionRefusedError("refused")
    first = decide_end(error, None, lease(interruptions=0), BACKOFF_S)
    assert first.kind is EndKind.INTERRUPTED
    assert first.delay_s == BACKOFF_S
    assert "handed back without spending an attempt" in (first.message or "")
    later = decide_end(error, None, lease(interruptions=12), BACKOFF_S)
    assert later.delay_s == MAX_INTERRUPTION_DELAY_S
    spent = decide_end(error, None, lease(interruptions=MAX_INTERRUPTIONS), BACKOFF_S)
    assert spent.kind is EndKind.RETRY
    closed = decide_end(asyncpg.ConnectionDoesNotExistError("closed"), None, lease(), BACKOFF_S)
    assert closed.kind is EndKind.INTERRUPTED


def test_describe_names_the_type_and_the_message() -> None:
    assert describe(ValueError("bad")) == "ValueError: bad"
    assert describe(ValueError()) == "ValueError"


def test_the_weightiest_error_decides_and_a_siblings_stop_never_does() -> None:
    invalid, config, lost = InvalidLLMOutput("x"), LLMConfigError("y"), LeaseLost("z")
    assert first_error([invalid, config]) is config
    assert first_error([config, lost]) is lost
    sibling = SiblingFailed()
    assert first_error([sibling, invalid]) is invalid
    assert first_error([sibling]) is sibling
