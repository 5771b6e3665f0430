"""Slots for the groups of an operation's pipelined waves, the longest critical path first.

A group is queued with the earlier groups that write one of its scopes (it waits for them), its
planned LLM calls, its wave and its place in the wave's plan. A freed slot goes to the *ready*
waiting group (every earlier writer done) whose remaining critical path is the longest: its own
calls plus the longest path among the queued groups that wait on it, transitively. So a scope's
chain that continues into later waves is not left to run alone at the end behind short groups
that could have filled the slots meanwhile. Ties go to the older wave, then to the wave's own
(longest chain first) order.

Paths grow as later waves are queued; each queued group lengthens the paths of the groups it
waits on, at once. They never shrink: a group can end before the groups it waits on only when
it is cancelled, and then the operation is ending anyway.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Claim:
    """One group's place in the queue for a slot."""

    calls: int  # planned LLM calls of the group
    wave: int
    position: int  # in the wave's plan
    path: int = 0  # its calls plus the longest path of the queued claims waiting on it
    # The earlier writers of its scopes not done yet, and the queued claims waiting on it.
    after: set[Claim] = field(default_factory=set, repr=False)
    later: list[Claim] = field(default_factory=list, repr=False)
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future(), repr=False
    )
    # Set once the claim is ready and among the next in line for a slot (or holds one).
    on_deck: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future(), repr=False
    )
    holds: bool = False  # a slot is this claim's
    done: bool = False
    place: str | None = None  # ready without a slot: "deck" or "waiting" (SlotAllocator)


class SlotAllocator:
    """``slots`` slots for claims queued in order; see the module's docstring for who gets one.

    A claim waits in :meth:`acquire` and must be ended with :meth:`finish` (whether it ran,
    failed, or was cancelled before it ever started): that frees its slot, if it holds one, and
    lets the claims queued behind it become ready. Before that, :meth:`on_deck` tells a claim
    that it is among the ``deck`` ready claims a freed slot goes to first (as things stand:
    paths may still grow), so its group can prepare what it needs before it holds a slot.
    """

    def __init__(self, slots: int, deck: int | None = None) -> None:
        if slots < 1:
            raise ValueError("at least one slot is needed")
        self.free = slots
        self._deck_size = slots if deck is None else deck
        # Ready claims (every earlier writer done, no slot): the next in line on deck, the rest
        # in a heap by turn. A claim whose path grows is pushed again; its old entry is stale.
        self._deck: list[Claim] = []
        self._waiting: list[tuple[tuple[int, int, int], int, Claim]] = []
        self._pushed = itertools.count()

    def queue(self, calls: int, wave: int, position: int, after: Iterable[Claim] = ()) -> Claim:
        """Queue a group behind ``after`` (those already done are ignored); it is granted a slot
        at once when one is free and it is ready."""
        claim = Claim(calls, wave, position, path=calls)
        claim.after = {earlier for earlier in after if not earlier.done}
        for earlier in claim.after:
            earlier.later.append(claim)
            self._lengthen(earlier, claim.path)
        if not claim.after:
            self._wait(claim)
            self._grant()
        return claim

    async def acquire(self, claim: Claim) -> None:
        """Wait until ``claim`` holds a slot. Cancelled, it gives back a slot granted meanwhile,
        and nothing else."""
        try:
            await claim.granted
        except asyncio.CancelledError:
            if claim.holds:  # granted, but the waiter was cancelled before it woke up
                self._release(claim)
            else:
                self._unqueue(claim)
            raise

    async def on_deck(self, claim: Claim) -> None:
        """Wait until ``claim`` is ready and among the next in line for a slot, or holds one."""
        await claim.on_deck

    def release(self, claim: Claim) -> None:
        """Give ``claim``'s slot back before its group is over: it has no LLM call left to make,
        only its last apply. Also when groups wait on it: holding the slot through the apply
        for them idles it for an apply on every chain's step into the next wave, while the
        continuation, once ready, takes the next slot freed before groups with shorter paths
        (measured: docs/benchmarks.md, "What was tried"). :meth:`reacquire` takes a slot again
        should the group need the LLM after all."""
        if claim.holds:
            self._release(claim)

    async def reacquire(self, claim: Claim) -> None:
        """Queue ``claim`` again, as ready, and wait until it holds a slot."""
        if claim.holds:
            return
        claim.granted = asyncio.get_running_loop().create_future()
        claim.place = "deck"  # it has prepared already
        self._deck.append(claim)
        self._grant()
        await self.acquire(claim)

    def finish(self, claim: Claim) -> None:
        """``claim``'s group is over: free its slot, if it holds one, and let the groups that
        waited on it become ready. Idempotent."""
        if claim.done:
            return
        claim.done = True
        self._unqueue(claim)
        if not claim.granted.done():
            claim.granted.cancel()
        if not claim.on_deck.done():
            claim.on_deck.cancel()
        for waiting in claim.later:
            waiting.after.discard(claim)
            if not waiting.after and not waiting.done and not waiting.granted.done():
                self._wait(waiting)
        claim.later.clear()
        if claim.holds:
            self._release(claim)
        else:
            self._grant()

    def _release(self, claim: Claim) -> None:
        claim.holds = False
        self.free += 1
        self._grant()

    def _wait(self, claim: Claim) -> None:
        claim.place = "waiting"
        heapq.heappush(self._waiting, (_turn(claim), next(self._pushed), claim))

    def _unqueue(self, claim: Claim) -> None:
        if claim.place == "deck":
            self._deck.remove(claim)
        claim.place = None  # a heap entry left behind is stale

    def _first_waiting(self) -> Claim | None:
        """The waiting claim whose turn comes first, left in the heap; stale entries dropped."""
        while self._waiting:
            turn, _, claim = self._waiting[0]
            if claim.place == "waiting" and turn == _turn(claim) and not claim.granted.done():
                return claim
            heapq.heappop(self._waiting)
            if claim.place == "waiting" and turn == _turn(claim):
                claim.place = None  # its waiter was cancelled: it leaves when that wakes
        return None

    def _grant(self) -> None:
        while self.free > 0:
            # A claim whose waiter was just cancelled leaves when that waiter wakes.
            ready = [c for c in self._deck if not c.granted.done()]
            best = min(ready, key=_turn, default=None)
            first = self._first_waiting()
            if first is not None and (best is None or _turn(first) < _turn(best)):
                heapq.heappop(self._waiting)
                best = first
            elif best is not None:
                self._deck.remove(best)
            else:
                break
            best.place = None
            best.holds = True
            self.free -= 1
            best.granted.set_result(None)
            if not best.on_deck.done():
                best.on_deck.set_result(None)
        while len(self._deck) < self._deck_size and (first := self._first_waiting()) is not None:
            heapq.heappop(self._waiting)
            first.place = "deck"
            self._deck.append(first)
            if not first.on_deck.done():
                first.on_deck.set_result(None)

    def _lengthen(self, claim: Claim, later_path: int) -> None:
        """A claim waiting on ``claim`` has a path of ``later_path``: lengthen ``claim``'s path,
        and those of the claims it waits on, where that makes them longer."""
        path = claim.calls + later_path
        if path > claim.path:
            claim.path = path
            if claim.place == "waiting":
                self._wait(claim)  # its turn moved up
            for earlier in claim.after:
                self._lengthen(earlier, path)


def _turn(claim: Claim) -> tuple[int, int, int]:
    """The order in which ready claims get a slot: the longest path first, then the older
    wave, then the wave's own order."""
    return (-claim.path, claim.wave, claim.position)
