"""Recall planning: which observations a pass sees, and fetching them ahead of the pass.

A pass on scope S recalls S's observations ranked by relevance to its facts (DESIGN §2). The
:class:`RecallPlanner` of a run decides where each recall comes from: the group's first two in
one statement, a later pass's from an earlier apply of its group (the apply returns it, after its
writes, in its transaction), a waiting group's only one from the last apply of the group it waits
on, else a statement of its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import asyncpg

from consolidation import store
from consolidation.engine.asker import Asker
from consolidation.engine.member import MemoryState
from consolidation.engine.plan import GroupPlan, Pass
from consolidation.engine.slots import Claim
from consolidation.perf import PerfLog


@dataclass(frozen=True)
class RecallAhead:
    """A recall fetched ahead for a pass its group makes later (DESIGN §2): by the apply of an
    earlier pass, or with the group's first recall. Nothing else writes a group's scopes in
    between — groups never share a scope and a bank runs one operation at a time — so it is
    exact for that pass once the writes its group sent since are laid over it (:meth:`after`)."""

    request: store.RecallRequest
    observations: list[store.RecalledObservation]

    def after(
        self, write: store.PassWrite, shown: Sequence[store.RecalledObservation]
    ) -> RecallAhead:
        """This recall as the pass will see it once ``write`` is applied: what ``write`` created
        or changed in the scope first (batch k+1 always sees what batch k wrote), then the rest
        as ranked, less the observations merged away, capped by the limit. ``shown`` are the
        observations the writing pass saw (their source counts; an observation's new count is
        the sum of the merged ones' and its new facts', which the next recall corrects)."""
        if write.scope != self.request.scope:
            return self
        now = datetime.now(UTC)
        sources = {o.id: o.sources for o in (*self.observations, *shown)}
        written = [
            store.RecalledObservation(
                w.ids[0],
                w.text,
                sum(sources.get(i, 0) for i in w.ids) + len(set(w.memory_ids)),
                now,
            )
            for w in write.observations
        ]
        touched = {i for w in write.observations for i in w.ids}
        rest = [o for o in self.observations if o.id not in touched]
        return replace(self, observations=(written + rest)[: self.request.limit])


@dataclass(frozen=True)
class PassRecalls:
    """The recalls around one pass (:meth:`RecallPlanner.around`): what the model is shown
    (None when an early call's recall is used), the upcoming pass's recall (this pass's writes
    are laid over it), and what this pass's apply brings back — the following pass's recall,
    or the only recall of a group waiting on this one alone (``successor``)."""

    shown: list[store.RecalledObservation] | None
    upcoming: RecallAhead | None
    following: store.RecallRequest | None
    successor: tuple[Claim, store.RecallRequest] | None = None

    @property
    def brought(self) -> store.RecallRequest | None:
        """The recall the apply fetches after its writes, in its transaction."""
        return self.following if self.successor is None else self.successor[1]


def held_for(held: Sequence[RecallAhead], wanted: store.RecallRequest | None) -> RecallAhead | None:
    """The recall among ``held`` fetched for ``wanted``, if any."""
    if wanted is None:
        return None
    return next((r for r in held if r.request == wanted), None)


class RecallPlanner:
    """Where the recalls of one run's passes come from (the module docstring)."""

    def __init__(self, pool: asyncpg.Pool, asker: Asker, limit: int) -> None:
        self.pool = pool
        self.asker = asker
        self.limit = limit
        # The plans of the groups queued, and the first recalls a group's last apply fetched
        # for a group waiting on it alone (:meth:`_successor`).
        self._plans: dict[Claim, GroupPlan[MemoryState]] = {}
        self._handed: dict[Claim, RecallAhead] = {}

    def track(self, claim: Claim, plan: GroupPlan[MemoryState]) -> None:
        """``claim``'s group runs ``plan``: a group it waits on may fetch its recall."""
        self._plans[claim] = plan

    def ended(self, claim: Claim) -> None:
        self._plans.pop(claim, None)
        self._handed.pop(claim, None)

    async def wanted(self, step: Pass[MemoryState], perf: PerfLog) -> store.RecallRequest:
        """What ``step`` recalls by; with embeddings, with its facts' vectors."""
        wanted = self._request(step)
        if self.asker.embedder is not None:
            wanted = replace(wanted, fact_vectors=await self.asker.embed(wanted.fact_texts, perf))
        return wanted

    async def _fetch(
        self, wanted: Sequence[store.RecallRequest], perf: PerfLog
    ) -> tuple[RecallAhead, ...]:
        """The recalls of ``wanted``, in one statement."""
        started = time.monotonic()
        fetched = await store.recall_many(self.pool, self.asker.bank_id, wanted)
        perf.recall_s += time.monotonic() - started
        return tuple(RecallAhead(w, o) for w, o in zip(wanted, fetched, strict=True))

    async def first_recalls(
        self, plan: GroupPlan[MemoryState], perf: PerfLog
    ) -> tuple[RecallAhead, ...]:
        """The recalls of the group's first two passes, in one statement."""
        steps = [step for step in (plan.peek(), plan.peek(2)) if step is not None]
        return await self._fetch([await self.wanted(step, perf) for step in steps], perf)

    async def around(
        self,
        wanted: store.RecallRequest,
        upcoming: Pass[MemoryState] | None,
        following: Pass[MemoryState] | None,
        held: Sequence[RecallAhead],
        claim: Claim | None,
        perf: PerfLog,
        *,
        shown_known: bool = False,
    ) -> PassRecalls:
        """The recalls around the pass recalling by ``wanted`` (its plan's next passes are
        ``upcoming`` and ``following``; ``held``, what earlier passes brought): from ``held``
        where it has them, else fetched — unless ``shown_known`` (an early call was made on the
        recall it will show)."""
        upcoming_wanted = None if upcoming is None else await self.wanted(upcoming, perf)
        shown: list[store.RecalledObservation] | None = None
        if shown_known:
            upcoming_recall = held_for(held, upcoming_wanted)
        else:
            shown, upcoming_recall = await self._for_pass(wanted, upcoming_wanted, held, perf)
        following_wanted = None if following is None else await self.wanted(following, perf)
        successor = None
        if upcoming is None and following is None and claim is not None:
            successor = self._successor(claim)
        return PassRecalls(shown, upcoming_recall, following_wanted, successor)

    def after_apply(
        self,
        recalls: PassRecalls,
        write: store.PassWrite,
        shown: Sequence[store.RecalledObservation],
        brought: list[store.RecalledObservation] | None,
        *,
        speculated: bool,
    ) -> tuple[RecallAhead, ...]:
        """What the applied ``write`` leaves for the next passes: the recall its apply
        ``brought`` back (a waiting group's is kept for it), and — unless the upcoming pass's
        call was started on it already (``speculated``) — the upcoming recall with ``write``
        laid over it."""
        if recalls.successor is not None and brought is not None:
            claim, request = recalls.successor
            self._handed[claim] = RecallAhead(request, brought)
        prepared = []
        if recalls.following is not None and brought is not None:
            prepared.append(RecallAhead(recalls.following, brought))
        if not speculated and recalls.upcoming is not None:
            prepared.append(recalls.upcoming.after(write, shown))
        return tuple(prepared)

    async def _for_pass(
        self,
        wanted: store.RecallRequest,
        upcoming: store.RecallRequest | None,
        held: Sequence[RecallAhead],
        perf: PerfLog,
    ) -> tuple[list[store.RecalledObservation], RecallAhead | None]:
        """A pass's recall and its upcoming pass's (if known): from ``held`` where it has them,
        else fetched. The first pass after a split (or of a group that could not recall ahead)
        also fetches the next pass's recall, which its own apply cannot bring in time for that
        pass's early call."""
        upcoming_recall = held_for(held, upcoming)
        own = held_for(held, wanted)
        if own is not None:
            return own.observations, upcoming_recall
        both = [wanted]
        if upcoming is not None and upcoming_recall is None:
            both.append(upcoming)
        fetched = await self._fetch(both, perf)
        return fetched[0].observations, fetched[1] if len(fetched) == 2 else upcoming_recall

    def _successor(self, claim: Claim) -> tuple[Claim, store.RecallRequest] | None:
        """For the last pass of ``claim``'s group: a queued group that waits on it alone and
        makes one pass, with the recall of that pass. The last apply fetches it after its own
        writes, in its transaction, instead of that group sending a statement of its own once
        it is ready: nothing else can write its scope in between (every other earlier writer
        is done, the groups of its wave write other scopes, later ones wait on it). Lexical
        recall only: a hybrid one needs the facts' vectors of a wave that may not have them
        yet."""
        if self.asker.embedder is not None:
            return None
        for later in claim.later:
            if later.done or later.after != {claim} or later in self._handed:
                continue
            plan = self._plans.get(later)
            only = None if plan is None else _only_pass(plan)
            if only is not None:
                return later, self._request(only)
        return None

    def handed_over(self, claim: Claim, plan: GroupPlan[MemoryState]) -> RecallAhead | None:
        """The first recall the last apply of the group ``claim`` waited on fetched for it,
        if it is still the recall of the group's one pass."""
        handed = self._handed.pop(claim, None)
        only = _only_pass(plan)
        if handed is None or only is None or handed.request != self._request(only):
            return None
        return handed

    def _request(self, step: Pass[MemoryState]) -> store.RecallRequest:
        texts = tuple(m.memory.text for m in step.members)
        return store.RecallRequest(step.scope, texts, self.limit)


def _only_pass(plan: GroupPlan[MemoryState]) -> Pass[MemoryState] | None:
    """The group's next pass if it is the last one it plans."""
    first = plan.peek()
    return first if first is not None and plan.peek(2) is None else None
