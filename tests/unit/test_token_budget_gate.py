"""The token budget's check before a pass: the window as last read plus the unclosed waves'
tokens against the budget; a used budget stops the run as gracefully as a slice's end."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from consolidation.budgets import Window
from consolidation.engine.budget import TokenBudget
from consolidation.engine.member import BatchReport
from consolidation.engine.stop import Checkpoint, Interrupted, StopReason, StopSignal
from consolidation.perf import PerfLog


def report(prompt: int, completion: int) -> BatchReport:
    return BatchReport(0, 0, (), (), PerfLog(prompt_tokens=prompt, completion_tokens=completion))


def test_the_unclosed_waves_tokens_count_until_their_usage_is_recorded() -> None:
    budget = TokenBudget(window=Window(1000, "setting", 600))
    wave: list[list[BatchReport]] = [[report(250, 50)], []]
    budget.track(1, wave)
    assert budget.unrecorded() == 300 and not budget.exhausted()
    wave[1].append(report(90, 10))  # a pass of another group ends
    assert budget.unrecorded() == 400 and budget.exhausted()
    budget.recorded(1, Window(1000, "setting", 990))  # the database counted it, and less aged out
    assert budget.unrecorded() == 0 and not budget.exhausted()


@pytest.mark.parametrize("window", [None, Window(None, "none", 10**9)])
def test_without_a_budget_nothing_is_ever_used_up(window: Window | None) -> None:
    budget = TokenBudget(window=window)
    budget.track(1, [[report(10**9, 10**9)]])
    assert not budget.exhausted()


async def test_a_used_budget_stops_the_run_before_the_next_pass_without_cancelling_it() -> None:
    signal = StopSignal()
    task = asyncio.create_task(asyncio.Event().wait())
    signal.attach(task)
    budget = TokenBudget(window=Window(100, "bank", 0))
    checkpoint = Checkpoint(signal, uuid.uuid4(), budget)
    checkpoint.check()  # nothing used yet
    budget.track(1, [[report(100, 0)]])
    checkpoint.mind_budget()
    assert signal.reason is StopReason.BUDGET and checkpoint.graceful()
    assert not checkpoint.may_start() and task.cancelling() == 0  # running passes finish
    with pytest.raises(Interrupted, match="token budget"):
        checkpoint.check()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
