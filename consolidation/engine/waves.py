"""The wave pipeline: waves fetched ahead, their groups queued for slots; and the wave closer,
which commits a wave's markers and progress once its groups are done (DESIGN §2)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import asyncpg
import structlog

from consolidation import budgets, metrics, queue, store
from consolidation.engine.asker import Asker
from consolidation.engine.budget import TokenBudget
from consolidation.engine.group import GroupRunner
from consolidation.engine.member import BatchReport, MemoryState
from consolidation.engine.openings import Openings
from consolidation.engine.outcome import first_error
from consolidation.engine.plan import fill_last_batches, plan_wave, planned_passes
from consolidation.engine.recall import RecallPlanner
from consolidation.engine.slots import Claim, SlotAllocator
from consolidation.engine.stop import Checkpoint, StopReason, StopSignal, settled
from consolidation.engine.summary import ProgressCallback, RunSummary
from consolidation.errors import LeaseLost, OperationCancelled
from consolidation.queue import Lease
from consolidation.scopes import Scope

# Waves fetched and queued ahead (each holds its memories): a scope's chain that continues into
# them is seen, and its next group is ready, when its current one ends.
MAX_WAVES_IN_FLIGHT = 4


class WaveCloser:
    """Closes the waves of one run, one at a time: the batches' perf and log lines, the wave's
    markers (one statement), the tokens its passes used, the summary and the stored progress;
    then whether to stop (a cancel seen in the progress write, a slice over)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        lease: Lease,
        summary: RunSummary,
        stop: StopSignal,
        *,
        wave_size: int,
        slice_s: float | None,
        on_progress: ProgressCallback | None,
        log: structlog.typing.FilteringBoundLogger,
        budget: TokenBudget | None = None,
    ) -> None:
        self.pool = pool
        self.budget = budget or TokenBudget()
        self.lease = lease
        self.summary = summary
        self.stop = stop
        self.wave_size = wave_size
        self.slice_s = slice_s
        self.on_progress = on_progress
        self.log = log
        self.started = time.monotonic()
        self._closing = asyncio.Lock()

    def report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.summary)

    async def close(
        self,
        number: int,
        states: Sequence[MemoryState],
        reports: Sequence[Sequence[BatchReport]],
        started: float,
        interrupted: bool,
    ) -> None:
        async with self._closing:  # one wave's close at a time
            if interrupted:
                # Interrupted: an apply may have committed although its caller never heard back (it
                # was cancelled, or the connection dropped, after the server's commit). The journal
                # knows; without this its memories would wait for the next operation's recovery.
                await self._reread_journal(states)
            outcome = {id(s): s.result() for s in states if s.finished() or s.failure is not None}
            for group_reports in reports:
                for report in group_reports:
                    for member in report.members:
                        action = outcome.get(id(member))
                        if action is not None:
                            report.perf.count_action(action)
                    self.summary.perf += report.perf
                    self.log.info(
                        "batch",
                        wave=number,
                        group=report.group,
                        batch=report.number,
                        scopes=[list(s) for s in report.scopes],
                        **report.perf.to_dict(),
                    )
            await self._record_tokens(number, reports)
            consolidated = [s.memory.id for s in states if s.finished()]
            failed = {s.memory.id: s.failure for s in states if s.failure is not None}
            try:
                marked = await store.commit_wave_markers(
                    self.pool, self.lease, consolidated, failed
                )
            except LeaseLost:
                self._lost(number, "markers")
                raise
            for action, count in Counter(outcome.values()).items():
                if action is not None:
                    metrics.MEMORIES.labels(action=action).inc(count)
            recovered = sum(action is None for action in outcome.values())
            # Counted as the fenced statement reports them, not as asked.
            self.summary.waves += 1
            self.summary.processed += marked.consolidated + marked.failed
            self.summary.consolidated += marked.consolidated
            self.summary.failed += marked.failed
            self.summary.recovered += recovered
            self.log.info(
                "wave",
                wave=number,
                memories=len(states),
                consolidated=marked.consolidated,
                failed=marked.failed,
                recovered=recovered,
                seconds=round(time.monotonic() - started, 4),
            )
            try:
                cancel = await queue.record_progress(self.pool, self.lease, self.summary.progress())
            except LeaseLost:
                self._lost(number, "progress")
                raise
            if cancel:
                self.stop.set(StopReason.CANCEL)
            elif await self._slice_over(full_wave=len(states) >= self.wave_size):
                self.stop.set(StopReason.SLICE)
            self.report()

    async def _record_tokens(self, number: int, reports: Sequence[Sequence[BatchReport]]) -> None:
        """Record the tokens the wave's passes used against the bank's budget — before the
        markers, whose fence does not matter here: the tokens were spent either way."""
        tokens = sum(
            r.perf.prompt_tokens + r.perf.completion_tokens for group in reports for r in group
        )
        window = None
        if tokens > 0:
            window = await budgets.record_usage(
                self.pool, self.lease.bank_id, self.lease.operation_id, tokens, self.budget.setting
            )
            metrics.BANK_TOKENS.labels(bank_id=self.lease.bank_id).inc(tokens)
        self.budget.recorded(number, window)

    def _lost(self, number: int, write: str) -> None:
        """A fenced write of the close matched nothing: another worker owns the attempt now."""
        self.log.warning("lease_lost", wave=number, write=write, attempt=self.lease.attempt)
        self.stop.set(StopReason.LEASE_LOST)

    async def _slice_over(self, full_wave: bool) -> bool:
        """Whether to give the slot up: the slice has run out and another operation waits for
        a slot. A wave shorter than the wave size was most likely the bank's last."""
        if self.slice_s is None or not full_wave:
            return False
        if time.monotonic() - self.started < self.slice_s:
            return False
        return await queue.others_waiting(self.pool, self.lease)

    async def _reread_journal(self, states: Sequence[MemoryState]) -> None:
        unsure = {s.memory.id: s for s in states if s.failure is None and s.remaining()}
        if not unsure:
            return
        journal = await store.journal_of(self.pool, self.lease.operation_id, list(unsure))
        for memory_id, scope, action in journal:
            state = unsure[memory_id]
            if scope in state.todo:
                state.applied.setdefault(scope, action)


@dataclass(eq=False)
class WavePipeline:
    """Every pending memory of a run's bank, wave after wave (:meth:`run`)."""

    pool: asyncpg.Pool
    lease: Lease
    wave_size: int
    batch_size: int
    asker: Asker
    recalls: RecallPlanner
    slots: SlotAllocator
    openings: Openings
    groups: GroupRunner
    closer: WaveCloser
    checkpoint: Checkpoint
    # Pending memories read beyond a wave to fill its groups' last batches (0: a wave is one
    # fetch of wave_size memories).
    lookahead: int = 0
    _last_writer: dict[Scope, Claim] = field(default_factory=dict, init=False)
    # Memories fetched and not in a wave yet, in consolidation order; the cursor is past them.
    _ahead: deque[store.WaveMemory] = field(default_factory=deque, init=False)
    _cursor: tuple[datetime, uuid.UUID] | None = field(default=None, init=False)
    # The last fetch found fewer memories than it asked for: the bank had no more then.
    _drained: bool = field(default=False, init=False)
    # The group tasks not done yet: a stop cancels them, never a wave's task, which must live
    # to commit its markers.
    _running: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _waves_launched: int = field(default=0, init=False)

    async def run(self) -> None:
        """Consolidate every pending memory of the bank (within the scope filter).

        Waves are pipelined: up to MAX_WAVES_IN_FLIGHT waves are fetched ahead and their groups
        queued, so a slot freed near a wave's end is taken by a later wave's group at once
        instead of idling until the wave's slowest group is done. A group never starts before
        the earlier groups that write one of its scopes have finished (a scope's memories are
        applied in consolidation order, across waves); among the ready groups, a freed slot goes
        to the one with the longest critical path through the queued waves
        (:class:`consolidation.engine.slots.SlotAllocator`). Each wave still gathers its own
        groups and commits its own markers (:meth:`_run_wave`); the next wave is fetched when
        one closes. Cancelled, it cancels the groups and returns once every wave in flight has
        committed its markers, however often it is cancelled meanwhile.
        """
        exhausted = False
        in_flight: deque[asyncio.Task[None]] = deque()
        try:
            while True:
                while not exhausted and self._wants_another_wave(len(in_flight)):
                    if in_flight:
                        # A wave fetched ahead serves later slots; the first calls go first.
                        await self.openings.behind()
                        if not self._wants_another_wave(len(in_flight)):
                            break  # a group failed for good meanwhile: its error is the run's
                    self.checkpoint.check()  # between waves
                    wave = await self._next_wave()
                    if not wave:
                        exhausted = True
                        break
                    in_flight.append(self._launch_wave(wave))
                if not in_flight:
                    return
                await asyncio.wait({in_flight[0]})
                if in_flight[0].exception() is not None:
                    # Its error may only say that a group of a later wave failed for good
                    # (SiblingFailed): the error of the run is the weightiest of all the waves'.
                    await asyncio.wait(in_flight)
                    raise first_error(
                        [e for t in in_flight if not t.cancelled() and (e := t.exception())]
                    )
                in_flight.popleft()
        except asyncio.CancelledError:
            self._cancel_groups()
            raise
        finally:
            # Waves still in flight end first: their running passes finish (or are cancelled
            # with us) and each commits its markers, before the operation's end is recorded.
            while in_flight:
                try:
                    await asyncio.wait(in_flight)
                    break
                except asyncio.CancelledError:
                    self._cancel_groups()
            for task in in_flight:
                # Observed: the error that decides the run was raised above, or a stop was.
                if not task.cancelled():
                    task.exception()

    async def _next_wave(self) -> list[store.WaveMemory]:
        """The next wave_size pending memories, in consolidation order, then those of the
        memories read ahead that fill the last batches of its groups
        (:func:`consolidation.engine.plan.fill_last_batches`). Empty when none is pending."""
        wanted = self.wave_size + self.lookahead
        if len(self._ahead) < wanted and not (self._drained and self._ahead):
            asked = wanted - len(self._ahead)
            fetched = await store.fetch_wave(
                self.pool, self.lease.bank_id, self._cursor, asked, self.lease.scope_filter
            )
            self._drained = len(fetched) < asked
            if fetched:
                self._cursor = (fetched[-1].order, fetched[-1].id)
                self._ahead.extend(fetched)
        wave = [self._ahead.popleft() for _ in range(min(self.wave_size, len(self._ahead)))]
        if self.lookahead and wave and self._ahead:
            joining, behind = fill_last_batches(wave, self._ahead, self.batch_size, self._todo)
            if joining:
                wave += joining
                self._ahead = deque(behind)
        return wave

    def _todo(self, memory: store.WaveMemory) -> tuple[Scope, ...]:
        """The scopes a memory of this run still has to pass: not journaled, and asked for."""
        wanted = self._wanted
        return tuple(
            s
            for s in memory.scopes
            if s not in memory.journaled and (wanted is None or s in wanted)
        )

    @functools.cached_property
    def _wanted(self) -> frozenset[Scope] | None:
        scopes = self.lease.scope_filter
        return None if scopes is None else frozenset(scopes)

    def _cancel_groups(self) -> None:
        for task in self._running:
            task.cancel()

    def _wants_another_wave(self, waves_in_flight: int) -> bool:
        """Keep MAX_WAVES_IN_FLIGHT waves fetched and queued: the slot allocator can only favour
        a chain's next group if that group's wave is known."""
        if self.checkpoint.aborted:
            return False  # a group failed for good: the waves in flight end, then its error
        return waves_in_flight < MAX_WAVES_IN_FLIGHT

    def _launch_wave(self, wave: Sequence[store.WaveMemory]) -> asyncio.Task[None]:
        """Plan a wave and queue its groups for slots, each behind the earlier groups that write
        one of its scopes; returns the wave's task (it ends once its markers are committed)."""
        states = [MemoryState(m, todo=self._todo(m)) for m in wave]
        self._waves_launched += 1
        number = self._waves_launched
        facts = self.asker.prefetch(
            [s.memory.text for s in states if s.todo],
            self.closer.summary.perf,
            keep=2 * MAX_WAVES_IN_FLIGHT * max(self.wave_size, len(wave)),
        )
        groups = plan_wave(states, self.batch_size, MemoryState.remaining)
        reports: list[list[BatchReport]] = [[] for _ in groups]
        self.closer.budget.track(number, reports)
        tasks = []
        for index, group in enumerate(groups):
            scopes = {s for m in group for s in m.todo}
            claim = self.slots.queue(
                calls=sum(1 for _ in planned_passes(group, self.batch_size, MemoryState.remaining)),
                wave=number,
                position=index,
                after=[self._last_writer[s] for s in scopes if s in self._last_writer],
            )
            if claim.holds:
                self.openings.start(claim)  # before the fetch of the next wave can be sent
            task = asyncio.create_task(
                self.groups.run(index, group, reports[index], claim, facts),
                name=f"wave-{number}-group-{index}",
            )
            # Whatever becomes of the task — even cancelled before it ever ran — its slot, if
            # it took one, is freed and the groups behind it in its scopes may go.
            task.add_done_callback(functools.partial(self._group_ended, claim))
            self._running.add(task)
            for scope in scopes:
                self._last_writer[scope] = claim
            tasks.append(task)
        return asyncio.create_task(
            self._run_wave(number, states, reports, tasks), name=f"wave-{number}"
        )

    def _group_ended(self, claim: Claim, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self.recalls.ended(claim)
        self.openings.done(claim)
        self.slots.finish(claim)

    async def _run_wave(
        self,
        number: int,
        states: Sequence[MemoryState],
        reports: Sequence[Sequence[BatchReport]],
        groups: Sequence[asyncio.Task[None]],
    ) -> None:
        """Gather the wave's groups, then commit its markers — also when it was cancelled: the
        close is awaited to its end (a cancel cannot cut it short), so the operation never ends
        with a close still writing."""
        started = time.monotonic()
        results: list[BaseException | None] | None = None
        try:
            results = await asyncio.gather(*groups, return_exceptions=True)
        finally:
            interrupted = results is None or any(results)
            close = asyncio.ensure_future(
                self.closer.close(number, states, reports, started, interrupted)
            )
            await settled(close)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise first_error(errors)
        if self.checkpoint.signal.reason is StopReason.CANCEL:
            raise OperationCancelled("cancel requested")
