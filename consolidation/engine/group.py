"""A group's passes, strictly in order, with split-on-failure (DESIGN §2)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from consolidation.engine.member import BatchReport, MemoryState
from consolidation.engine.openings import Openings
from consolidation.engine.passes import Ahead, PassRunner
from consolidation.engine.plan import GroupPlan
from consolidation.engine.recall import RecallPlanner
from consolidation.engine.slots import Claim, SlotAllocator
from consolidation.engine.stop import Checkpoint, Interrupted, SiblingFailed
from consolidation.errors import InvalidLLMOutput, OperationCancelled
from consolidation.perf import PerfLog
from consolidation.scopes import Scope

# A failure reason is stored with the memory and shown to operators: the cause, not an essay.
MAX_FAILURE_REASON_CHARS = 1000


@dataclass(eq=False)
class GroupRunner:
    """Runs the groups of one run's waves (:meth:`run`)."""

    batch_size: int
    passes: PassRunner
    recalls: RecallPlanner
    slots: SlotAllocator
    openings: Openings
    checkpoint: Checkpoint
    log: structlog.typing.FilteringBoundLogger

    async def run(
        self,
        index: int,
        group: Sequence[MemoryState],
        reports: list[BatchReport],
        claim: Claim,
        facts: asyncio.Task[Any] | None = None,
    ) -> None:
        """The group's passes strictly in order: batch k+1 sees what batch k wrote, and pass
        k+1's LLM call starts once pass k's answer is known, while pass k's writes are applied
        (:meth:`PassRunner.run`). The group holds its slot (``claim``) while it asks the LLM:
        it gives it back once its last answer is in, before that pass's apply.

        Its first two recalls are fetched before it holds a slot, once it is next in line for
        one (:meth:`SlotAllocator.on_deck`): nothing else writes its scopes by then (their
        earlier writers are done, and the groups of its wave write others), and its first LLM
        call starts the moment a slot is freed. A group of one pass that waited on one earlier
        group alone has its recall already: that group's last apply fetched it
        (:meth:`RecallPlanner.after_apply`). With embeddings, the recalls wait for the wave's
        facts to be embedded (``facts``)."""
        plan = GroupPlan(group, self.batch_size, MemoryState.remaining)
        self.recalls.track(claim, plan)
        checkpoint = self.checkpoint
        ahead: Ahead | None = None
        opening: PerfLog | None = None  # the first recalls' time, for the first batch
        try:
            await self.slots.on_deck(claim)
            if facts is not None:
                # Shielded: the request serves the wave's other groups, whatever becomes of us.
                await asyncio.shield(facts)
            if checkpoint.may_start():
                handed = self.recalls.handed_over(claim, plan)
                if handed is not None:
                    ahead = Ahead((handed,))
                else:
                    await self.openings.behind(claim)
                    if claim.holds:
                        self.openings.start(claim)
                    opening = PerfLog()
                    ahead = Ahead(await self.recalls.first_recalls(plan, opening))
            self.openings.done(claim)
            await self.slots.acquire(claim)
            while (step := plan.next()) is not None:
                if not reports or reports[-1].number != step.batch:
                    batch = plan.batches[step.batch]
                    scopes = tuple(sorted({s for m in batch for s in m.todo}))
                    reports.append(
                        BatchReport(index, step.batch, scopes, batch, PerfLog(memories=len(batch)))
                    )
                perf = reports[-1].perf
                if opening is not None:
                    perf += opening
                    opening = None
                checkpoint.mind_budget()
                if not (ahead is not None and ahead.answer is not None and checkpoint.graceful()):
                    # A pass whose call is already under way is a running pass: a shutdown or
                    # the end of a slice lets it finish (and apply); nothing new starts.
                    checkpoint.check()
                prepared, ahead = ahead, None
                try:
                    try:
                        ahead = await self.passes.run(
                            step, perf, prepared, plan.peek(), plan.peek(2), claim
                        )
                    finally:
                        if prepared is not None and prepared.answer is not None:
                            prepared.answer.drop(perf)  # unless the pass used it
                except InvalidLLMOutput as exc:
                    if len(step.members) == 1:
                        self._fail(step.members[0], step.scope, exc)
                        continue
                    plan.split(step)
                    perf.splits += 1
                    self.log.info(
                        "batch_split", scope=list(step.scope), size=len(step.part), reason=str(exc)
                    )
        except (asyncio.CancelledError, SiblingFailed, Interrupted, OperationCancelled):
            raise
        except BaseException:
            checkpoint.abort()
            raise
        finally:
            if ahead is not None and ahead.answer is not None and reports:
                ahead.answer.drop(reports[-1].perf)  # stopped before the pass it was for

    def _fail(self, member: MemoryState, scope: Scope, exc: InvalidLLMOutput) -> None:
        member.failure = str(exc)[:MAX_FAILURE_REASON_CHARS]
        self.log.warning(
            "memory_failed",
            memory_id=str(member.memory.id),
            scope=list(scope),
            reason=member.failure,
        )
