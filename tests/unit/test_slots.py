"""The slot allocator: who gets a freed slot, and what a cancelled waiter gives back."""

from __future__ import annotations

import asyncio

import pytest

from consolidation.engine.slots import Claim, SlotAllocator


async def settle() -> None:
    """Let every task that can run, run (the allocator wakes waiters through futures)."""
    for _ in range(5):
        await asyncio.sleep(0)


def granted(*claims: Claim) -> list[bool]:
    return [c.holds for c in claims]


async def test_a_free_slot_is_granted_at_once_and_a_group_waits_for_its_earlier_writer() -> None:
    slots = SlotAllocator(2)
    first = slots.queue(calls=3, wave=1, position=0)
    second = slots.queue(calls=1, wave=2, position=0, after=[first])
    assert granted(first, second) == [True, False]  # a slot is free, but "second" is not ready
    assert slots.free == 1
    slots.finish(first)
    assert granted(first, second) == [False, True]
    await slots.acquire(second)


async def test_a_freed_slot_goes_to_the_longest_critical_path_then_the_older_wave() -> None:
    slots = SlotAllocator(1)
    head = slots.queue(calls=2, wave=1, position=0)  # takes the only slot
    short = slots.queue(calls=1, wave=1, position=1)
    other = slots.queue(calls=2, wave=1, position=2)
    # Ready once "head" is done: 1 call, but more wait on it in the waves fetched ahead.
    chain = slots.queue(calls=1, wave=2, position=3, after=[head])
    late_short = slots.queue(calls=1, wave=2, position=0)
    branch = slots.queue(calls=2, wave=3, position=0, after=[chain])
    longer_branch = slots.queue(calls=3, wave=4, position=0, after=[chain])
    claims = [short, other, chain, late_short, branch, longer_branch]
    order = []
    current = head
    while True:
        slots.finish(current)
        holding = [c for c in claims if c.holds]
        if not holding:
            break
        (current,) = holding
        order.append(current)
    # chain: 1 + 3 (the longer branch counts); then the branch of 3; then the two paths of 2,
    # the older wave first; then the two of 1, the older wave first.
    assert order == [chain, longer_branch, other, branch, short, late_short]
    assert slots.free == 1


async def test_ties_keep_the_waves_own_order() -> None:
    slots = SlotAllocator(1)
    head = slots.queue(calls=1, wave=1, position=0)
    b = slots.queue(calls=1, wave=2, position=1)
    a = slots.queue(calls=1, wave=2, position=0)
    slots.finish(head)
    assert granted(a, b) == [True, False]


async def test_paths_grow_as_later_waves_are_queued() -> None:
    slots = SlotAllocator(1)
    head = slots.queue(calls=1, wave=1, position=0)
    longer = slots.queue(calls=2, wave=1, position=1)
    grows = slots.queue(calls=1, wave=1, position=2)
    slots.queue(calls=5, wave=2, position=0, after=[grows])  # queued after both
    slots.finish(head)
    assert granted(longer, grows) == [False, True]


async def test_a_cancelled_waiter_takes_nothing_and_gives_back_nothing_it_did_not_take() -> None:
    slots = SlotAllocator(1)
    running = slots.queue(calls=1, wave=1, position=0)
    waiting = slots.queue(calls=1, wave=1, position=1)
    behind = slots.queue(calls=1, wave=2, position=0, after=[waiting])
    task = asyncio.create_task(slots.acquire(waiting))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slots.free == 0 and running.holds  # the running group keeps its slot
    slots.finish(waiting)  # its group is over without ever running
    assert slots.free == 0 and behind.holds is False  # "running" still holds the one slot
    slots.finish(running)
    assert behind.holds and slots.free == 0
    slots.finish(behind)
    assert slots.free == 1


async def test_a_waiter_cancelled_after_its_grant_gives_the_slot_back_once() -> None:
    slots = SlotAllocator(1)
    running = slots.queue(calls=1, wave=1, position=0)
    waiting = slots.queue(calls=1, wave=1, position=1)
    after = slots.queue(calls=1, wave=1, position=2)
    task = asyncio.create_task(slots.acquire(waiting))
    await settle()
    slots.finish(running)  # grants "waiting"; its waiter has not woken up yet
    assert waiting.holds
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after.holds and slots.free == 0  # the slot went on to the next group
    slots.finish(waiting)
    slots.finish(waiting)
    assert slots.free == 0  # finishing "waiting" (twice) frees nothing it no longer holds
    slots.finish(after)
    assert slots.free == 1


async def test_a_group_cancelled_before_it_asked_frees_its_granted_slot_when_finished() -> None:
    slots = SlotAllocator(1)
    claim = slots.queue(calls=1, wave=1, position=0)
    other = slots.queue(calls=1, wave=1, position=1)
    assert claim.holds
    slots.finish(claim)
    assert other.holds and slots.free == 0


async def test_a_waiter_cancelled_while_it_waited_on_an_earlier_writer_is_never_granted() -> None:
    slots = SlotAllocator(1)
    first = slots.queue(calls=1, wave=1, position=0)
    blocked = slots.queue(calls=5, wave=2, position=0, after=[first])
    other = slots.queue(calls=1, wave=2, position=1)
    task = asyncio.create_task(slots.acquire(blocked))
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    slots.finish(first)
    assert other.holds and not blocked.holds and slots.free == 0
    slots.finish(blocked)
    slots.finish(other)
    assert slots.free == 1


async def test_a_slot_given_back_early_goes_on_and_is_taken_again_only_when_free() -> None:
    slots = SlotAllocator(1)
    last = slots.queue(calls=1, wave=1, position=0)  # takes the only slot
    other = slots.queue(calls=1, wave=1, position=1)
    slots.release(last)  # its last answer is in; only its apply remains
    assert granted(last, other) == [False, True]
    again = asyncio.create_task(slots.reacquire(last))  # the apply sent it back to the model
    await settle()
    assert not again.done() and not last.holds
    slots.finish(other)
    await asyncio.wait_for(again, 1)
    assert granted(last, other) == [True, False]
    slots.finish(last)
    slots.release(last)  # over: nothing more to give back
    assert slots.free == 1


async def test_a_continuation_takes_the_next_slot_freed_once_it_is_ready() -> None:
    slots = SlotAllocator(1)
    head = slots.queue(calls=1, wave=1, position=0)  # takes the only slot
    short = slots.queue(calls=1, wave=1, position=1)
    other = slots.queue(calls=1, wave=1, position=2)
    continuation = slots.queue(calls=2, wave=2, position=0, after=[head])
    slots.release(head)  # given back all the same: the slot would idle through head's apply
    assert granted(head, short, other, continuation) == [False, True, False, False]
    slots.finish(head)  # its apply is done: the continuation is ready, behind "short"
    assert granted(short, other, continuation) == [True, False, False]
    slots.finish(short)  # before "other", ready since the start: its path is longer
    assert granted(other, continuation) == [False, True]


def on_deck(*claims: Claim) -> list[bool]:
    return [claim.on_deck.done() for claim in claims]


async def test_the_ready_claims_next_in_line_are_on_deck() -> None:
    slots = SlotAllocator(1, deck=2)
    running = slots.queue(calls=1, wave=1, position=0)
    three = slots.queue(calls=3, wave=1, position=1)
    two = slots.queue(calls=2, wave=1, position=2)
    one = slots.queue(calls=1, wave=1, position=3)
    assert on_deck(running, three, two, one) == [True, True, True, False]
    slots.finish(running)  # "three" takes the slot; "one" moves up
    assert granted(three) == [True] and on_deck(one, two) == [True, True]


async def test_a_claim_is_on_deck_only_once_its_earlier_writers_are_done() -> None:
    slots = SlotAllocator(1, deck=4)
    running = slots.queue(calls=1, wave=1, position=0)
    behind = slots.queue(calls=5, wave=2, position=0, after=[running])
    assert on_deck(running, behind) == [True, False]
    task = asyncio.create_task(slots.on_deck(behind))
    await settle()
    assert not task.done()
    slots.finish(running)
    await asyncio.wait_for(task, 1)
    assert granted(behind) == [True]
