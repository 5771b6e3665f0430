"""Who goes first to the database: the groups holding a slot that still fetch their first recalls.

Their first LLM calls wait on those recalls, so work for a slot not held yet — a group on deck
preparing, the fetch of a wave ahead — waits behind them (:meth:`Openings.behind`). It matters
when slots are handed out together: at the start of an operation, every slot and a full deck at
once.
"""

from __future__ import annotations

import asyncio

from consolidation.engine.slots import Claim


class Openings:
    """The claims holding a slot whose groups still fetch their first recalls."""

    def __init__(self) -> None:
        self._preparing: set[Claim] = set()
        # Resolved whenever the set empties.
        self._settled: asyncio.Future[None] | None = None

    def start(self, claim: Claim) -> None:
        """``claim`` holds a slot and fetches its group's first recalls now."""
        if not self._preparing:
            self._settled = asyncio.get_running_loop().create_future()
        self._preparing.add(claim)

    def done(self, claim: Claim) -> None:
        """``claim``'s group has its first recalls (or ended)."""
        if claim not in self._preparing:
            return
        self._preparing.discard(claim)
        if not self._preparing and self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    async def behind(self, claim: Claim | None = None) -> None:
        """Wait while a group holding a slot still fetches its first recalls (or until
        ``claim`` is granted a slot itself)."""
        while self._preparing and not (claim is not None and claim.granted.done()):
            assert self._settled is not None
            waits: set[asyncio.Future[None]] = {self._settled}
            if claim is not None:
                waits.add(claim.granted)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
