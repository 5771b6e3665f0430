"""A consolidation run: the parts of the engine put together for one claimed attempt."""

from __future__ import annotations

import structlog

from consolidation import budgets, store
from consolidation.engine.asker import Asker, narrowing
from consolidation.engine.budget import TokenBudget
from consolidation.engine.context import RunContext
from consolidation.engine.group import GroupRunner
from consolidation.engine.openings import Openings
from consolidation.engine.passes import PassRunner
from consolidation.engine.recall import RecallPlanner
from consolidation.engine.slots import SlotAllocator
from consolidation.engine.stop import Checkpoint
from consolidation.engine.summary import RunSummary
from consolidation.engine.waves import WaveCloser, WavePipeline
from consolidation.llm.client import Consolidator, HTTPConsolidator

log = structlog.get_logger("consolidation.engine")


def group_slots(group_parallelism: int, llm: Consolidator) -> int:
    """The operation's group slots: ``GROUP_PARALLELISM``, but never more than the LLM client's
    cap on requests in flight. Groups past the cap would only queue at it, where requests go
    first come first served: the slots' longest-path-first order would be lost, and a long
    chain that queued behind short groups would be left to run alone at the end."""
    cap = llm.max_concurrent if isinstance(llm, HTTPConsolidator) else None
    return group_parallelism if cap is None else min(group_parallelism, cap)


class ConsolidateRun:
    """Consolidate every pending memory of the lease's bank (within its scope filter), pausing
    once its token budget is used; the summary continues the one an earlier slice stored."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        lease, settings = context.lease, context.settings
        self.summary = RunSummary.resumed(lease.resumed)
        bound = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)
        self.asker = Asker(
            context.llm,
            lease.bank_id,
            settings.mission,
            context.embedder,
            narrowing(settings, context.llm, context.embedder),
        )
        self.budget = TokenBudget(setting=settings.bank_token_budget)
        checkpoint = Checkpoint(context.stop, lease.operation_id, self.budget)
        slots = SlotAllocator(group_slots(settings.group_parallelism, context.llm))
        openings = Openings()
        recalls = RecallPlanner(context.pool, self.asker, settings.recall_limit)
        passes = PassRunner(context.pool, lease, self.asker, recalls, slots, checkpoint, bound)
        groups = GroupRunner(
            settings.llm_batch_size, passes, recalls, slots, openings, checkpoint, bound
        )
        self.closer = WaveCloser(
            context.pool,
            lease,
            self.summary,
            context.stop,
            wave_size=settings.wave_size,
            slice_s=context.slice_s,
            on_progress=context.on_progress,
            log=bound,
            budget=self.budget,
        )
        self.pipeline = WavePipeline(
            context.pool,
            lease,
            wave_size=settings.wave_size,
            batch_size=settings.llm_batch_size,
            lookahead=settings.wave_lookahead,
            asker=self.asker,
            recalls=recalls,
            slots=slots,
            openings=openings,
            groups=groups,
            closer=self.closer,
            checkpoint=checkpoint,
        )

    async def run(self) -> RunSummary:
        pool, lease = self.context.pool, self.context.lease
        self.asker.mission = await store.bank_mission(pool, lease.bank_id) or self.asker.mission
        self.budget.window = await budgets.window(pool, lease.bank_id, self.budget.setting)
        self.summary.total = self.summary.processed + await store.count_pending(
            pool, lease.bank_id, lease.scope_filter
        )
        self.closer.report()
        await self.pipeline.run()
        return self.summary
