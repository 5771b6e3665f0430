"""Run one consolidation operation: waves, groups, batches, passes, markers, final status.

The only module that knows the whole flow (DESIGN §2). ``replay`` and the worker both call
:func:`run_operation`, so the foreground and the service run the identical engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from consolidation import metrics, queue, store
from consolidation.errors import (
    InvalidLLMOutput,
    LeaseLost,
    LLMConfigError,
    OperationCancelled,
)
from consolidation.llm import Consolidator, LLMRetriesExhausted
from consolidation.perf import PerfLog
from consolidation.prompts import (
    SYSTEM_PROMPT,
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    build_request,
    parse_answer,
)
from consolidation.queue import Lease
from consolidation.scopes import Scope, batched, partition
from consolidation.settings import Settings

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The knobs of one operation (DESIGN §8)."""

    wave_size: int = 200
    llm_batch_size: int = 8
    group_parallelism: int = 8
    recall_limit: int = 20
    mission: str | None = None
    lease_s: float = 30.0
    retry_backoff_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            wave_size=settings.wave_size,
            llm_batch_size=settings.llm_batch_size,
            group_parallelism=settings.group_parallelism,
            recall_limit=settings.recall_limit,
            mission=settings.mission,
            lease_s=settings.lease_s,
            retry_backoff_s=settings.retry_backoff_s,
        )


class StopSignal:
    """Why an operation should stop: ``cancel`` (user), ``shutdown`` (worker exiting) or
    ``lease_lost``. The first reason wins. ``cancel`` and ``lease_lost`` also abort in-flight
    work at once; ``shutdown`` lets running passes finish until :meth:`force` is called."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.event = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    def attach(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        if self.reason in ("cancel", "lease_lost"):
            task.cancel()

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()
        if reason in ("cancel", "lease_lost"):
            self.force()

    def force(self) -> None:
        """Cancel the running engine task (aborts in-flight LLM requests)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()


class _Interrupted(Exception):
    """Stop before the next pass because the worker is shutting down."""


class _SiblingFailed(Exception):
    """Stop before the next pass because another group of the wave failed for good."""


@dataclass
class _MemoryState:
    """One memory while its wave runs."""

    memory: store.WaveMemory
    todo: tuple[Scope, ...]
    applied: dict[Scope, str] = field(default_factory=dict)
    failed: bool = False

    @property
    def remaining(self) -> list[Scope]:
        return [s for s in self.todo if s not in self.applied]

    def finished(self) -> bool:
        return not self.failed and set(self.memory.scopes) <= (
            self.memory.journaled | self.applied.keys()
        )

    def action(self) -> str:
        """The per-memory result of DESIGN §2 (only what this operation did)."""
        if self.failed:
            return "failed"
        acted = [a for a in self.applied.values() if a != "skipped"]
        if len(acted) > 1:
            return "multiple"
        if acted:
            return acted[0]
        return "skipped" if self.applied else "recovered"


@dataclass
class _Chain:
    """One group's passes, in order. ``ahead`` is the recall the previous pass's apply fetched
    for the pass expected next: usable by that pass only, and only if it is the one expected
    (same scope, same facts). Nothing else writes a group's scopes in between: groups never
    share a scope and a bank runs one operation at a time."""

    ahead: tuple[store.RecallRequest, list[store.RecalledObservation]] | None = None


@dataclass
class _BatchReport:
    group: int
    number: int
    scopes: tuple[Scope, ...]
    perf: PerfLog


@dataclass
class RunSummary:
    """What an operation did; stored (as JSON) in ``operations.result``."""

    perf: PerfLog = field(default_factory=PerfLog)
    waves: int = 0
    processed: int = 0
    consolidated: int = 0
    failed: int = 0
    recovered: int = 0
    total: int = 0

    def progress(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "processed": self.processed,
            "consolidated": self.consolidated,
            "failed": self.failed,
            "waves": self.waves,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.progress(), "recovered": self.recovered, "perf": self.perf.to_dict()}


ProgressCallback = Callable[[RunSummary], None]


class OperationRun:
    """The engine for one claimed attempt of one operation."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        lease: Lease,
        llm: Consolidator,
        config: EngineConfig,
        stop: StopSignal,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.pool = pool
        self.lease = lease
        self.llm = llm
        self.config = config
        self.stop = stop
        self.on_progress = on_progress
        self.summary = RunSummary()
        self.mission = config.mission
        self._abort = False
        self.log = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)

    async def run(self) -> RunSummary:
        """Consolidate every pending memory of the bank (within the scope filter)."""
        self.mission = await store.bank_mission(self.pool, self.lease.bank_id) or self.mission
        self.summary.total = await store.count_pending(
            self.pool, self.lease.bank_id, self.lease.scope_filter
        )
        self._report()
        cursor = None
        while True:
            self._checkpoint()
            wave = await store.fetch_wave(
                self.pool,
                self.lease.bank_id,
                cursor,
                self.config.wave_size,
                self.lease.scope_filter,
            )
            if not wave:
                return self.summary
            cursor = (wave[-1].order, wave[-1].id)
            await self._run_wave(wave)

    # --- waves ----------------------------------------------------------------------------

    async def _run_wave(self, wave: Sequence[store.WaveMemory]) -> None:
        wanted = None if self.lease.scope_filter is None else set(self.lease.scope_filter)
        states = [
            _MemoryState(
                m,
                todo=tuple(
                    s for s in m.scopes if s not in m.journaled and (wanted is None or s in wanted)
                ),
            )
            for m in wave
        ]
        groups = partition([s for s in states if s.todo], lambda s: s.todo)
        reports: list[list[_BatchReport]] = [[] for _ in groups]
        semaphore = asyncio.Semaphore(self.config.group_parallelism)

        async def run_group(index: int, group: list[_MemoryState]) -> None:
            async with semaphore:
                await self._run_group(index, group, reports[index])

        # Longest chain first (LPT): a long group started last would finish alone after all
        # the others, leaving the other slots idle until the wave barrier. Stable for ties.
        order = sorted(range(len(groups)), key=lambda i: -self._planned_calls(groups[i]))
        started = time.monotonic()
        results: list[BaseException | None] = []
        try:
            launched = await asyncio.gather(
                *(run_group(i, groups[i]) for i in order), return_exceptions=True
            )
            results = [None] * len(groups)
            for i, result in zip(order, launched, strict=True):
                results[i] = result
        finally:
            # Applied work stays and gets its markers, even when the wave was cancelled.
            await asyncio.shield(self._close_wave(states, reports, started))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _first_error(errors)
        if self.stop.reason == "cancel":
            raise OperationCancelled("cancel requested")

    def _planned_calls(self, group: Sequence[_MemoryState]) -> int:
        """LLM calls the group makes if no answer is unusable: one per scope of each batch."""
        return sum(
            len({s for m in batch for s in m.todo})
            for batch in batched(group, self.config.llm_batch_size)
        )

    async def _close_wave(
        self,
        states: Sequence[_MemoryState],
        reports: Sequence[Sequence[_BatchReport]],
        started: float,
    ) -> None:
        for group_reports in reports:
            for report in group_reports:
                self.summary.perf += report.perf
                self.log.info(
                    "batch",
                    wave=self.summary.waves + 1,
                    group=report.group,
                    batch=report.number,
                    scopes=[list(s) for s in report.scopes],
                    **report.perf.to_dict(),
                )
        consolidated = [s.memory.id for s in states if s.finished()]
        failed = [s.memory.id for s in states if s.failed]
        await store.commit_wave_markers(self.pool, self.lease, consolidated, failed)
        recovered = 0
        for state in states:
            if state.finished() or state.failed:
                action = state.action()
                recovered += action == "recovered"
                metrics.MEMORIES.labels(action=action).inc()
        self.summary.waves += 1
        self.summary.processed += len(consolidated) + len(failed)
        self.summary.consolidated += len(consolidated)
        self.summary.failed += len(failed)
        self.summary.recovered += recovered
        self.log.info(
            "wave",
            wave=self.summary.waves,
            memories=len(states),
            consolidated=len(consolidated),
            failed=len(failed),
            recovered=recovered,
            seconds=round(time.monotonic() - started, 4),
        )
        if await queue.record_progress(self.pool, self.lease, self.summary.progress()):
            self.stop.set("cancel")
        self._report()

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.summary)

    # --- groups and batches ---------------------------------------------------------------

    async def _run_group(
        self, index: int, group: list[_MemoryState], reports: list[_BatchReport]
    ) -> None:
        """Batches of one group run strictly in order: batch k+1 recalls what batch k wrote."""
        try:
            batches = list(batched(group, self.config.llm_batch_size))
            chain = _Chain()
            for number, batch in enumerate(batches):
                scopes = tuple(sorted({s for m in batch for s in m.todo}))
                perf = PerfLog(memories=len(batch))
                reports.append(_BatchReport(index, number, scopes, perf))
                following = batches[number + 1] if number + 1 < len(batches) else None
                await self._run_batch(batch, perf, chain, following)
                for state in batch:
                    action = state.action()
                    if action != "recovered":
                        perf.count_action(action)
        except (asyncio.CancelledError, _SiblingFailed, _Interrupted, OperationCancelled):
            raise
        except BaseException:
            self._abort = True
            raise

    async def _run_batch(
        self,
        batch: list[_MemoryState],
        perf: PerfLog,
        chain: _Chain,
        following: list[_MemoryState] | None,
    ) -> None:
        """One pass per scope; an unusable answer splits the batch (DESIGN §2)."""
        parts: deque[list[_MemoryState]] = deque([batch])
        while parts:
            part = parts.popleft()
            scopes = _pass_scopes(part)
            for i, scope in enumerate(scopes):
                members = _pass_members(part, scope)
                # The pass after this one, if this one succeeds: its recall rides on our apply.
                upcoming: store.RecallRequest | None
                if i + 1 < len(scopes):
                    upcoming = self._recall_request(
                        scopes[i + 1], _pass_members(part, scopes[i + 1])
                    )
                else:
                    upcoming = self._first_recall(parts[0] if parts else following)
                self._checkpoint()
                try:
                    await self._run_pass(scope, members, perf, chain, upcoming)
                except InvalidLLMOutput as exc:
                    if len(members) == 1:
                        members[0].failed = True
                        self.log.warning(
                            "memory_failed",
                            memory_id=str(members[0].memory.id),
                            scope=list(scope),
                            reason=str(exc),
                        )
                        continue
                    half = (len(part) + 1) // 2
                    parts.extendleft([part[half:], part[:half]])
                    perf.splits += 1
                    self.log.info("batch_split", scope=list(scope), size=len(part), reason=str(exc))
                    break

    def _recall_request(self, scope: Scope, members: list[_MemoryState]) -> store.RecallRequest:
        texts = tuple(m.memory.text for m in members)
        return store.RecallRequest(scope, texts, self.config.recall_limit)

    def _first_recall(self, part: list[_MemoryState] | None) -> store.RecallRequest | None:
        """The recall of the first pass ``part`` will make (None if it makes none)."""
        if part is None:
            return None
        scopes = _pass_scopes(part)
        return self._recall_request(scopes[0], _pass_members(part, scopes[0])) if scopes else None

    def _checkpoint(self) -> None:
        """Checked before every pass and every wave."""
        if self.stop.reason == "cancel":
            raise OperationCancelled("cancel requested")
        if self.stop.reason == "lease_lost":
            raise LeaseLost(f"operation {self.lease.operation_id} lost its lease")
        if self.stop.reason == "shutdown":
            raise _Interrupted("worker shutting down")
        if self._abort:
            raise _SiblingFailed()

    # --- passes ---------------------------------------------------------------------------

    async def _run_pass(
        self,
        scope: Scope,
        members: list[_MemoryState],
        perf: PerfLog,
        chain: _Chain,
        upcoming: store.RecallRequest | None,
    ) -> None:
        """Recall (unless the previous apply brought it), ask the LLM (one retry on an unusable
        answer), apply in one transaction — fetching ``upcoming``'s recall on the way."""
        wanted = self._recall_request(scope, members)
        ahead, chain.ahead = chain.ahead, None
        if ahead is not None and ahead[0] == wanted:
            recalled = ahead[1]
        else:
            started = time.monotonic()
            recalled = await store.recall(
                self.pool, self.lease.bank_id, scope, wanted.fact_texts, wanted.limit
            )
            perf.recall_s += time.monotonic() - started
        request = build_request(
            self.lease.bank_id,
            scope,
            self.mission,
            [
                FactInput(m.memory.id, m.memory.text, m.memory.tags, m.memory.occurred_at)
                for m in members
            ],
            [ObservationInput(o.id, o.text, o.sources, o.updated_at) for o in recalled],
        )
        for attempt in (1, 2):
            try:
                plan = await self._ask(request, perf)
                started = time.monotonic()
                try:
                    fetched = await store.apply_pass(
                        self.pool,
                        self.lease,
                        _pass_write(self.lease, scope, members, plan),
                        upcoming,
                    )
                except store.StaleObservation as exc:
                    raise InvalidLLMOutput(str(exc)) from exc
                finally:
                    perf.apply_s += time.monotonic() - started
            except InvalidLLMOutput as exc:
                perf.llm_failures += 1
                if attempt == 2:
                    raise
                self.log.info("unusable_answer_retry", scope=list(scope), reason=str(exc))
                continue
            for m in members:
                m.applied[scope] = _action_of(m.memory.id, plan)
            if upcoming is not None and fetched is not None:
                chain.ahead = (upcoming, fetched)
            return

    async def _ask(self, request: PassRequest, perf: PerfLog) -> PassPlan:
        started = time.monotonic()
        perf.llm_calls += 1
        perf.prompt_chars += len(SYSTEM_PROMPT) + len(request.user_content)
        try:
            answer = await self.llm.complete(SYSTEM_PROMPT, request.user_content)
        except LLMRetriesExhausted as exc:
            # The stored result must say the pass was retried, not only that it failed.
            perf.llm_retries += exc.attempts - 1
            raise
        finally:
            perf.llm_s += time.monotonic() - started
        perf.llm_retries += answer.retries
        perf.prompt_tokens += answer.prompt_tokens
        perf.completion_tokens += answer.completion_tokens
        return parse_answer(answer.content, request)


def _pass_scopes(part: Sequence[_MemoryState]) -> list[Scope]:
    """The scopes ``part`` still makes passes for, in the order it makes them."""
    return sorted({s for m in part if not m.failed for s in m.remaining})


def _pass_members(part: Sequence[_MemoryState], scope: Scope) -> list[_MemoryState]:
    """The memories of ``part`` that the pass for ``scope`` is about."""
    return [m for m in part if not m.failed and scope in m.remaining]


def _action_of(memory_id: uuid.UUID, plan: PassPlan) -> str:
    kinds = [
        kind
        for kind, actions in (
            ("created", plan.creates),
            ("updated", plan.updates),
            ("merged", plan.merges),
        )
        for action in actions
        if memory_id in action.memory_ids
    ]
    if len(kinds) > 1:
        return "multiple"
    return kinds[0] if kinds else "skipped"


def _pass_write(
    lease: Lease, scope: Scope, members: Sequence[_MemoryState], plan: PassPlan
) -> store.PassWrite:
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
            action=_action_of(m.memory.id, plan),
            observation_ids=tuple(w.ids[0] for w in writes if m.memory.id in w.memory_ids),
        )
        for m in members
    )
    return store.PassWrite(lease.bank_id, scope, lease.operation_id, tuple(writes), outcomes)


_ERROR_PRIORITY = (LeaseLost, OperationCancelled, LLMConfigError)


def _first_error(errors: Sequence[BaseException]) -> BaseException:
    """The error that decides the operation's fate: the first, unless a weightier one exists."""
    real = [e for e in errors if not isinstance(e, _SiblingFailed)] or list(errors)
    for kind in _ERROR_PRIORITY:
        for error in real:
            if isinstance(error, kind):
                return error
    return real[0]


# --- the whole operation: heartbeat, engine, final status -------------------------------------


async def _keep_lease(pool: asyncpg.Pool, lease: Lease, lease_s: float, stop: StopSignal) -> None:
    """Extend the lease every lease/3; notice cancel requests and a lost lease."""
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            if await queue.heartbeat(pool, lease, lease_s):
                stop.set("cancel")
        except LeaseLost:
            log.warning("lease_lost", operation_id=str(lease.operation_id), attempt=lease.attempt)
            stop.set("lease_lost")
            return
        except Exception as exc:
            # Any other failure (a dropped connection surfaces as OSError, PostgresError,
            # InterfaceError or InternalClientError) is the database's, not the lease's: it may
            # be back before the lease runs out, so keep trying rather than let the lease lapse.
            log.warning("heartbeat_failed", operation_id=str(lease.operation_id), error=repr(exc))


@dataclass(frozen=True)
class OperationEnd:
    """How an attempt ended: the status now stored (or ``lost`` when it was not ours to write)."""

    status: str
    summary: RunSummary
    error: str | None = None


async def run_operation(
    pool: asyncpg.Pool,
    lease: Lease,
    llm: Consolidator,
    config: EngineConfig,
    *,
    stop: StopSignal | None = None,
    on_progress: ProgressCallback | None = None,
) -> OperationEnd:
    """Run one claimed attempt to its end and record the final status (shielded, fenced).

    completed → ``completed``; cancel → ``cancelled``; shutdown → back to ``pending`` without
    spending an attempt; LLM configuration error → ``failed`` at once; other errors → back to
    ``pending`` with backoff until ``max_attempts``, then ``failed``; lost lease → no write.
    """
    stop = stop or StopSignal()
    run = OperationRun(pool, lease, llm, config, stop, on_progress)
    bound = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)
    bound.info("operation_started", attempt=lease.attempt, scope_filter=lease.scope_filter)
    inner = asyncio.create_task(run.run(), name=f"operation-{lease.operation_id}")
    stop.attach(inner)
    keeper = asyncio.create_task(_keep_lease(pool, lease, config.lease_s, stop))
    outer_cancelled = False
    try:
        await asyncio.wait({inner})
    except asyncio.CancelledError:
        # The caller gave up on us (hard shutdown): stop the engine, then still record the end.
        outer_cancelled = True
        stop.set("shutdown")
        stop.force()
        await asyncio.wait({inner})
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)

    end = await asyncio.shield(_finish(pool, lease, config, inner, stop, run.summary))
    bound.info(
        "operation_finished",
        status=end.status,
        error=end.error,
        attempt=lease.attempt,
        **run.summary.progress(),
    )
    if outer_cancelled:
        raise asyncio.CancelledError()
    return end


async def _finish(
    pool: asyncpg.Pool,
    lease: Lease,
    config: EngineConfig,
    inner: asyncio.Task[RunSummary],
    stop: StopSignal,
    summary: RunSummary,
) -> OperationEnd:
    error: BaseException | None
    error = asyncio.CancelledError() if inner.cancelled() else inner.exception()
    result = summary.to_json()
    try:
        if error is None:
            await queue.finish(pool, lease, "completed", result=result)
            return OperationEnd("completed", summary)
        if stop.reason == "lease_lost" or isinstance(error, LeaseLost):
            return OperationEnd("lost", summary, str(error) or "lease lost")
        if stop.reason == "cancel" or isinstance(error, OperationCancelled):
            await queue.finish(
                pool, lease, "cancelled", result=result, error="cancelled on request"
            )
            return OperationEnd("cancelled", summary, "cancelled on request")
        if stop.reason == "shutdown":
            status = await queue.release(
                pool,
                lease,
                delay_s=0,
                error="interrupted by shutdown",
                refund_attempt=True,
                result=result,
            )
            return OperationEnd(status, summary, "interrupted by shutdown")
        message = _describe(error)
        if isinstance(error, LLMConfigError) or lease.attempt >= lease.max_attempts:
            await queue.finish(pool, lease, "failed", result=result, error=message)
            return OperationEnd("failed", summary, message)
        delay = config.retry_backoff_s * 2 ** (lease.attempt - 1)
        status = await queue.release(
            pool, lease, delay_s=delay, error=message, refund_attempt=False, result=result
        )
        return OperationEnd(status, summary, message)
    except LeaseLost as exc:
        return OperationEnd("lost", summary, str(exc))


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}"
