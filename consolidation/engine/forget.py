"""A forget operation: memories asked to be forgotten go, and so does what was derived from them.

It runs like any operation (one per bank at a time, claimed, leased, every write fenced):

1. the memories of the bank asked to be forgotten (``memories.forgotten_at``) when it starts;
2. each observation citing one of them that also has other sources is re-derived from those
   sources alone, through DESIGN §3 passes whose facts are those sources (in consolidation order,
   ``LLM_BATCH_SIZE`` at a time) and whose observations are only what this re-derivation made so
   far — never the old text — then replaced in one transaction (``store.replace_observation``:
   the new observations and their sources — with embeddings, their vectors —, the journal of
   the remaining sources, and the old observation with the history of everything merged into
   it deleted);
3. one transaction (``store.complete_forget``) deletes the observations left citing only
   forgotten memories and their lineage's history, withholds failure reasons that may quote the
   memories, deletes the memories (their scopes, journal and source rows go with them) and stamps
   their tombstones.

Every step is redone from what the database says (an observation already replaced is skipped, a
memory already deleted is skipped), so a crash at any point neither loses the deletion nor brings
the content back. Nothing on this path logs a memory's or an observation's text.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import structlog

from consolidation import metrics, queue, store
from consolidation.engine.asker import Asker, narrowing
from consolidation.engine.context import RunContext
from consolidation.engine.outcome import first_error
from consolidation.engine.plan import GroupPlan, Pass
from consolidation.engine.stop import Checkpoint
from consolidation.engine.summary import RunSummary
from consolidation.errors import InvalidLLMOutput
from consolidation.llm.prompts import FactInput, ObservationInput, PassPlan
from consolidation.perf import PerfLog
from consolidation.scopes import Scope

log = structlog.get_logger("consolidation.engine")

# An observation a re-derivation has made so far (written when the re-derivation is complete).
Derived = store.DerivedObservation


def fold(working: Sequence[Derived], answer: PassPlan) -> list[Derived]:
    """The re-derivation's observations after one answer, DESIGN §3's way: an update replaces the
    text and adds its facts, a merge keeps the first (new text, union of sources) and drops the
    others, a create adds one. Changed and new ones move to the end (the most recent last).
    Pure; ``answer`` only names observations of ``working`` (parse_answer saw to that)."""
    by_id = {d.id: d for d in working}
    changed: dict[uuid.UUID, Derived] = {}
    dropped: set[uuid.UUID] = set()

    def current(observation_id: uuid.UUID) -> Derived:
        return changed.get(observation_id) or by_id[observation_id]

    for update in answer.updates:
        old = current(update.observation_id)
        changed[old.id] = Derived(old.id, update.text, _union(old.memory_ids, update.memory_ids))
    for merge in answer.merges:
        kept, *others = (current(i) for i in merge.observation_ids)
        sources = kept.memory_ids
        for other in others:
            sources = _union(sources, other.memory_ids)
            dropped.add(other.id)
        changed[kept.id] = Derived(kept.id, merge.text, _union(sources, merge.memory_ids))
    out = [d for d in working if d.id not in changed and d.id not in dropped]
    out += [d for i, d in changed.items() if i not in dropped]
    out += [Derived(uuid.uuid4(), c.text, c.memory_ids) for c in answer.creates]
    return out


def _union(a: Sequence[uuid.UUID], b: Sequence[uuid.UUID]) -> tuple[uuid.UUID, ...]:
    return tuple(dict.fromkeys([*a, *b]))


@dataclass
class ForgetSummary(RunSummary):
    """What a forget operation did; stored (as JSON) in ``operations.result``. Counts only."""

    observations_affected: int = 0
    observations_rederived: int = 0
    observations_created: int = 0
    observations_deleted: int = 0
    history_deleted: int = 0
    failure_reasons_withheld: int = 0
    memories_left_out: int = 0  # remaining sources whose re-derivation answer stayed unusable

    def progress(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "processed": self.processed,
            "observations_affected": self.observations_affected,
            "observations_rederived": self.observations_rederived,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.progress(),
            "forgotten": self.processed,
            "observations_created": self.observations_created,
            "observations_deleted": self.observations_deleted,
            "history_deleted": self.history_deleted,
            "failure_reasons_withheld": self.failure_reasons_withheld,
            "memories_left_out": self.memories_left_out,
            "perf": self.perf.to_dict(),
        }


@dataclass(eq=False)
class _Source:
    """A remaining source of an observation being re-derived."""

    fact: FactInput
    settled: bool = False  # answered (cited or not), or left out after unusable answers


class ForgetRun:
    """The run of a ``forget`` operation: the engine's stop checks, lease and model, with its
    own flow (the module docstring)."""

    def __init__(self, context: RunContext) -> None:
        self.pool = context.pool
        self.lease = context.lease
        self.settings = context.settings
        self.embedder = context.embedder
        self.summary = ForgetSummary()
        self.asker = Asker(
            context.llm,
            self.lease.bank_id,
            self.settings.mission,
            self.embedder,
            narrowing(self.settings, context.llm, self.embedder),
        )
        self.checkpoint = Checkpoint(context.stop, self.lease.operation_id)
        self.log = log.bind(operation_id=str(self.lease.operation_id), bank_id=self.lease.bank_id)
        self._perf_lock = asyncio.Lock()

    async def run(self) -> RunSummary:
        mission = await store.bank_mission(self.pool, self.lease.bank_id)
        self.asker.mission = mission or self.asker.mission
        forgotten = await store.forgotten_of_bank(self.pool, self.lease.bank_id)
        self.summary.total = len(forgotten)
        if not forgotten:
            return self.summary
        affected = await store.affected_observations(self.pool, self.lease.bank_id, forgotten)
        self.summary.observations_affected = len(affected)
        await self._record_progress()
        shared = [a for a in affected if a.remaining]
        semaphore = asyncio.Semaphore(self.settings.group_parallelism)

        async def replace_one(observation: store.AffectedObservation) -> None:
            async with semaphore:
                self.checkpoint.check()
                try:
                    await self._replace(observation, forgotten)
                except BaseException:
                    self.checkpoint.abort()  # the others stop before their next pass
                    raise

        results = await asyncio.gather(*map(replace_one, shared), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise first_error(errors)
        self.checkpoint.check()
        counts = await store.complete_forget(self.pool, self.lease, forgotten)
        self.summary.processed = counts["memories"]
        self.summary.observations_deleted += counts["observations_deleted"]
        self.summary.history_deleted += counts["history_deleted"]
        self.summary.failure_reasons_withheld = counts["reasons_withheld"]
        metrics.FORGOTTEN.inc(counts["memories"])
        self.log.info(
            "memories_forgotten",
            memories=counts["memories"],
            observations_deleted=self.summary.observations_deleted,
            observations_rederived=self.summary.observations_rederived,
        )
        return self.summary

    async def _replace(
        self, observation: store.AffectedObservation, forgotten: Sequence[uuid.UUID]
    ) -> None:
        facts = await store.memory_facts(self.pool, observation.remaining)
        sources = [_Source(facts[i]) for i in observation.remaining if i in facts]
        perf = PerfLog(memories=len(sources))
        try:
            derived = await self._derive(observation.scope, sources, perf)
            if self.embedder is not None and derived:
                vectors = await self.asker.embed([d.text for d in derived], perf)
                derived = [replace(d, embedding=v) for d, v in zip(derived, vectors, strict=True)]
        finally:
            async with self._perf_lock:
                self.summary.perf += perf
        counts = await store.replace_observation(
            self.pool,
            self.lease,
            observation.id,
            forgotten,
            derived,
            embeddings=self.embedder is not None,
        )
        self.summary.observations_rederived += counts["replaced"]
        self.summary.observations_created += counts["created"]
        self.summary.observations_deleted += counts["replaced"]
        self.summary.history_deleted += counts["history_deleted"]
        self.log.info(
            "observation_rederived",
            observation_id=str(observation.id),
            scope=list(observation.scope),
            sources=len(sources),
            created=counts["created"],
            llm_calls=perf.llm_calls,
        )
        await self._record_progress()

    async def _derive(
        self, scope: Scope, sources: Sequence[_Source], perf: PerfLog
    ) -> list[Derived]:
        """Ask the model what ``sources`` alone say, batch after batch, each batch seeing what
        the earlier ones made. An unusable answer is asked again once (shown its problems, as a
        consolidation pass is), then the batch is halved;
        a single source that still gets no usable answer is left out (its journal row then
        names no observation of this scope)."""
        working: list[Derived] = []
        plan = GroupPlan(
            sources, self.settings.llm_batch_size, lambda s: () if s.settled else (scope,)
        )
        while (step := plan.next()) is not None:
            self.checkpoint.check()
            try:
                answer = await self._ask_usable(scope, step, working, perf)
            except InvalidLLMOutput as exc:
                if len(step.members) == 1:
                    step.members[0].settled = True
                    self.summary.memories_left_out += 1
                    self.log.warning(
                        "rederive_source_left_out",
                        memory_id=str(step.members[0].fact.memory_id),
                        error=type(exc).__name__,
                    )
                    continue
                plan.split(step)
                perf.splits += 1
                continue
            working = fold(working, answer)
            for member in step.members:
                member.settled = True
        return working

    async def _ask_usable(
        self, scope: Scope, step: Pass[_Source], working: Sequence[Derived], perf: PerfLog
    ) -> PassPlan:
        shown = working[-self.settings.recall_limit :] if self.settings.recall_limit else []
        now = datetime.now(UTC)
        request = self.asker.request(
            scope,
            [s.fact for s in step.members],
            [ObservationInput(d.id, d.text, len(d.memory_ids), now) for d in shown],
        )
        return await self.asker.ask_usable(request, perf)

    async def _record_progress(self) -> None:
        await queue.record_progress(self.pool, self.lease, self.summary.progress())
