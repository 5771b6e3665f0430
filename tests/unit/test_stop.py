"""The stop signal cancels the engine task once, however many places deliver a stop."""

from __future__ import annotations

import asyncio

from consolidation.engine.stop import StopReason, StopSignal, settled


async def test_an_aborting_reason_delivered_again_and_again_cancels_the_task_once() -> None:
    stop = StopSignal()
    task = asyncio.create_task(asyncio.Event().wait())
    stop.attach(task)
    stop.set(StopReason.CANCEL)
    stop.set(StopReason.CANCEL)
    stop.set(StopReason.LEASE_LOST)
    stop.force()
    assert task.cancelling() == 1
    assert stop.reason is StopReason.CANCEL  # the first reason wins
    await asyncio.gather(task, return_exceptions=True)


async def test_a_shutdown_cancels_nothing_until_forced_and_a_force_before_attach_holds() -> None:
    stop = StopSignal()
    stop.set(StopReason.SHUTDOWN)
    stop.force()
    task = asyncio.create_task(asyncio.Event().wait())
    stop.attach(task)
    assert task.cancelling() == 1
    await asyncio.gather(task, return_exceptions=True)

    graceful = StopSignal()
    other = asyncio.create_task(asyncio.Event().wait())
    graceful.attach(other)
    graceful.set(StopReason.SLICE)
    assert other.cancelling() == 0
    other.cancel()
    await asyncio.gather(other, return_exceptions=True)


async def test_a_settled_write_is_waited_for_through_cancels_and_the_cancel_is_heard_after() -> (
    None
):
    release = asyncio.Event()

    async def write() -> str:
        await release.wait()
        return "committed"

    inner = asyncio.ensure_future(write())
    waiter = asyncio.create_task(settled(inner))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    assert not waiter.done() and not inner.done()  # still waiting for the write
    release.set()
    results = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert inner.result() == "committed"
