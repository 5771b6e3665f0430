"""One pass: recall, ask the model (one repair), apply in one transaction; the next pass's call
started early, while this one's writes are applied."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

import asyncpg
import structlog

from consolidation import store
from consolidation.engine.asker import Asker
from consolidation.engine.member import MemoryState
from consolidation.engine.plan import Pass
from consolidation.engine.recall import RecallAhead, RecallPlanner
from consolidation.engine.slots import Claim, SlotAllocator
from consolidation.engine.stop import Checkpoint, settled
from consolidation.errors import InvalidLLMOutput
from consolidation.llm.prompts import (
    Chat,
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    pass_chat,
    repair_chat,
)
from consolidation.perf import PerfLog
from consolidation.queue import Lease


@dataclass
class Speculation:
    """The next pass's LLM call, started as soon as this pass's answer was known, on the recall
    it will have once this pass's writes are in, so that it runs while they are applied."""

    recall: RecallAhead
    request: PassRequest
    chat: Chat
    perf: PerfLog  # the call's own counts, added to the pass that uses (or drops) it
    task: asyncio.Task[PassPlan]
    settled: bool = False  # used or dropped, its counts added to a pass's

    async def answer(self, perf: PerfLog) -> PassPlan:
        """The call's answer, for the pass it was started for."""
        self.settled = True
        try:
            return await self.task
        finally:
            perf += self.perf

    def drop(self, perf: PerfLog) -> None:
        """Abandon the call (its pass will not be made as planned); it still counts."""
        if self.settled:
            return
        self.settled = True
        self.task.cancel()
        self.task.add_done_callback(lambda t: t.cancelled() or t.exception())
        perf += self.perf


@dataclass
class Ahead:
    """What a pass prepared for the next passes of its group: recalls, and maybe the next
    pass's LLM call already under way."""

    recalls: tuple[RecallAhead, ...] = ()
    answer: Speculation | None = None


@dataclass(eq=False)
class PassRunner:
    """Makes the passes of one run's groups (:meth:`run`)."""

    pool: asyncpg.Pool
    lease: Lease
    asker: Asker
    recalls: RecallPlanner
    slots: SlotAllocator
    checkpoint: Checkpoint
    log: structlog.typing.FilteringBoundLogger

    async def run(
        self,
        step: Pass[MemoryState],
        perf: PerfLog,
        ahead: Ahead | None,
        upcoming: Pass[MemoryState] | None,
        following: Pass[MemoryState] | None,
        claim: Claim | None = None,
    ) -> Ahead:
        """Recall (unless an earlier pass brought it), ask the LLM (one retry on an unusable
        answer), apply in one transaction; returns what it prepared for ``upcoming``.

        The passes of a group overlap without reordering anything: once this pass's answer is
        known, ``upcoming``'s LLM call starts on the recall it will have after this pass's
        writes (the recall held for it, :meth:`RecallAhead.after`), while the writes are
        applied — fetching ``following``'s recall on the way. ``upcoming`` uses that call if it
        is still the pass it was started for; it is dropped if this pass's apply fails. Applies
        stay one at a time and in order: this method returns once its own is done. The last
        pass of a group gives the group's slot (``claim``) back before its apply, so that
        another group's first call starts meanwhile; the slot is taken again should the apply
        send the pass back to the model.

        With embeddings, the facts' vectors are known since the wave started, and the vectors of
        this pass's written observations are fetched in one request before the apply (with
        ``following``'s facts, should they have dropped out of the bounded cache)."""
        recalls = self.recalls
        wanted = await recalls.wanted(step, perf)
        early = ahead.answer if ahead is not None else None
        if early is not None and early.recall.request != wanted:
            early.drop(perf)  # the plan changed (a split, a failed member): not this pass's
            early = None
            self.checkpoint.check()  # skipped for it: no new call when the operation is stopping
        around = await recalls.around(
            wanted,
            upcoming,
            following,
            ahead.recalls if ahead is not None else (),
            claim,
            perf,
            shown_known=early is not None,
        )
        if early is not None:
            recalled, request, chat = early.recall.observations, early.request, early.chat
        else:
            assert around.shown is not None
            recalled = around.shown
            request = self._request(step, recalled)
            chat = pass_chat(request)
        upcoming_recall = around.upcoming
        for attempt in (1, 2):
            started_early: Speculation | None = None
            try:
                if early is not None and attempt == 1:
                    answer = await early.answer(perf)
                else:
                    if claim is not None:
                        await self.slots.reacquire(claim)  # given back before a failed apply
                    answer = await self.asker.ask(request, chat, perf)
                write = pass_write(self.lease, step, answer)
                if (
                    upcoming is not None
                    and upcoming_recall is not None
                    and self.checkpoint.may_start()
                ):
                    started_early = self._start_early(
                        upcoming, upcoming_recall.after(write, recalled)
                    )
                elif upcoming is None and claim is not None:
                    self.slots.release(claim)  # the group's last answer is in
                if self.asker.embedder is not None:
                    write, following_recall = await self.asker.with_vectors(
                        write, around.following, perf
                    )
                    around = replace(around, following=following_recall)
                started = time.monotonic()
                apply = asyncio.ensure_future(
                    store.apply_pass(
                        self.pool,
                        self.lease,
                        write,
                        around.brought,
                        embeddings=self.asker.embedder is not None,
                    )
                )
                try:
                    # An apply once sent is waited for, even by a stopping pass: it may commit
                    # after the client gave up on it, and the wave's close must see its journal.
                    fetched_next = await settled(apply)
                except store.StaleObservation as exc:
                    raise InvalidLLMOutput(str(exc)) from exc
                finally:
                    perf.apply_s += time.monotonic() - started
            except InvalidLLMOutput as exc:
                if started_early is not None:
                    started_early.drop(perf)
                perf.llm_failures += 1
                if attempt == 2:
                    raise
                # The retry shows the model its answer and what is wrong with it.
                chat = repair_chat(chat, exc)
                self.log.info(
                    "unusable_answer_retry",
                    scope=list(step.scope),
                    reason=str(exc),
                    repair=chat.repair,
                )
                continue
            except BaseException:
                if started_early is not None:
                    started_early.drop(perf)
                raise
            for member, outcome in zip(step.members, write.outcomes, strict=True):
                member.applied[step.scope] = outcome.action
            prepared = recalls.after_apply(
                around, write, recalled, fetched_next, speculated=started_early is not None
            )
            return Ahead(prepared, started_early)
        raise AssertionError("unreachable")

    def _request(
        self, step: Pass[MemoryState], recalled: Sequence[store.RecalledObservation]
    ) -> PassRequest:
        return self.asker.request(
            step.scope,
            [
                FactInput(m.memory.id, m.memory.text, m.memory.tags, m.memory.occurred_at)
                for m in step.members
            ],
            [ObservationInput(o.id, o.text, o.sources, o.updated_at) for o in recalled],
        )

    def _start_early(self, step: Pass[MemoryState], recall: RecallAhead) -> Speculation:
        request = self._request(step, recall.observations)
        chat = pass_chat(request)
        perf = PerfLog()
        task = asyncio.create_task(self.asker.ask(request, chat, perf))
        return Speculation(recall, request, chat, perf, task)


def pass_write(lease: Lease, step: Pass[MemoryState], plan: PassPlan) -> store.PassWrite:
    """What one answered pass writes; its outcomes follow ``step.members``, in order."""
    writes = [
        store.ObservationWrite((uuid.uuid4(),), c.text, c.memory_ids, create=True)
        for c in plan.creates
    ]
    writes += [
        store.ObservationWrite((u.observation_id,), u.text, u.memory_ids, create=False)
        for u in plan.updates
    ]
    writes += [
        store.ObservationWrite(m.observation_ids, m.text, m.memory_ids, create=False)
        for m in plan.merges
    ]
    outcomes = tuple(
        store.Outcome(
            memory_id=m.memory.id,
            action=plan.action_of(m.memory.id),
            observation_ids=tuple(w.ids[0] for w in writes if m.memory.id in w.memory_ids),
        )
        for m in step.members
    )
    return store.PassWrite(lease.bank_id, step.scope, lease.operation_id, tuple(writes), outcomes)
