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
        self._deck = slots if deck is None else deck
        self._ready: list[Claim] = []  # every earlier writer done; not granted yet

    def queue(self, calls: int, wave: int, position: int, after: Iterable[Claim] = ()) -> Claim:
        """Queue a group behind ``after`` (those already done are ignored); it is granted a slot
        at once when one is free and it is ready."""
        claim = Claim(calls, wave, position, path=calls)
        claim.after = {earlier for earlier in after if not earlier.done}
        for earlier in claim.after:
            earlier.later.append(claim)
            _lengthen(earlier, claim.path)
        if not claim.after:
            self._ready.append(claim)
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
            elif claim in self._ready:
                self._ready.remove(claim)
            raise

    async def on_deck(self, claim: Claim) -> None:
        """Wait until ``claim`` is ready and among the next in line for a slot, or holds one."""
        await claim.on_deck

    def release(self, claim: Claim) -> None:
        """Give ``claim``'s slot back before its group is over: it has no LLM call left to make,
        only its last apply. Also when groups wait on it: holding the slot through the apply
        for them idles it for an apply on every chain's step into the next wave, while the
        continuation, once ready, takes the next slot freed before groups with shorter paths
        (measured: docs/benchmarks.md, #16). :meth:`reacquire` takes a slot again should the
        group need the LLM after all."""
        if claim.holds:
            self._release(claim)

    async def reacquire(self, claim: Claim) -> None:
        """Queue ``claim`` again, as ready, and wait until it holds a slot."""
        if claim.holds:
            return
        claim.granted = asyncio.get_running_loop().create_future()
        self._ready.append(claim)
        self._grant()
        await self.acquire(claim)

    def finish(self, claim: Claim) -> None:
        """``claim``'s group is over: free its slot, if it holds one, and let the groups that
        waited on it become ready. Idempotent."""
        if claim.done:
            return
        claim.done = True
        if claim in self._ready:
            self._ready.remove(claim)
        if not claim.granted.done():
            claim.granted.cancel()
        if not claim.on_deck.done():
            claim.on_deck.cancel()
        for waiting in claim.later:
            waiting.after.discard(claim)
            if not waiting.after and not waiting.done and not waiting.granted.done():
                self._ready.append(waiting)
        claim.later.clear()
        if claim.holds:
            self._release(claim)
        else:
            self._grant()

    def _release(self, claim: Claim) -> None:
        claim.holds = False
        self.free += 1
        self._grant()

    def _grant(self) -> None:
        # A claim whose waiter was just cancelled leaves the list when that waiter wakes.
        ready = [c for c in self._ready if not c.granted.done()]
        ready.sort(key=_turn)
        granted = ready[: self.free]
        for best in granted:
            self._ready.remove(best)
            best.holds = True
            self.free -= 1
            best.granted.set_result(None)
        for claim in ready[: len(granted) + self._deck]:
            if not claim.on_deck.done():
                claim.on_deck.set_result(None)


def _turn(claim: Claim) -> tuple[int, int, int]:
    """The order in which ready claims get a slot: the longest path first, then the older
    wave, then the wave's own order."""
    return (-claim.path, claim.wave, claim.position)


def _lengthen(claim: Claim, later_path: int) -> None:
    """A claim waiting on ``claim`` has a path of ``later_path``: lengthen ``claim``'s path, and
    those of the claims it waits on, where that makes them longer."""
    path = claim.calls + later_path
    if path > claim.path:
        claim.path = path
        for earlier in claim.after:
            _lengthen(earlier, path)
