"""Run one consolidation operation: waves, groups, batches, passes, markers, final status.

The only module that knows the whole flow (DESIGN §2). ``replay`` and the worker both call
:func:`run_operation`, so the foreground and the service run the identical engine.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog

from consolidation import ask_v2, db, metrics, queue, store
from consolidation.embeddings import Embedder
from consolidation.errors import (
    InvalidLLMOutput,
    LeaseLost,
    LLMConfigError,
    OperationCancelled,
)
from consolidation.llm import Consolidator, LLMAnswer, LLMRetriesExhausted, OfflineConsolidator
from consolidation.narrow import narrow_options
from consolidation.perf import PerfLog
from consolidation.plan import GroupPlan, Pass, plan_wave, planned_passes
from consolidation.prompts import (
    Chat,
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    build_request,
    parse_answer,
    pass_chat,
    repair_chat,
)
from consolidation.queue import Lease
from consolidation.scopes import Scope
from consolidation.settings import Settings
from consolidation.slots import Claim, SlotAllocator

if TYPE_CHECKING:
    from consolidation.forget import ForgetRun

log = structlog.get_logger(__name__)

# Waves fetched and queued ahead (each holds its memories): a scope's chain that continues into
# them is seen, and its next group is ready, when its current one ends.
MAX_WAVES_IN_FLIGHT = 4

# A failure reason is stored with the memory and shown to operators: the cause, not an essay.
MAX_FAILURE_REASON_CHARS = 1000


class StopReason(enum.Enum):
    """Why an operation stops before its bank is done."""

    CANCEL = "cancel"  # asked by a user: in-flight work is aborted at once
    LEASE_LOST = "lease_lost"  # another worker owns the attempt now: in-flight work is aborted
    SHUTDOWN = "shutdown"  # the worker is exiting: running passes finish until force()
    # The operation ran past its time slice while others wait: like a shutdown, running passes
    # finish and nothing new starts; it goes back to pending with its progress (fairness).
    SLICE = "slice"

    @property
    def aborts_at_once(self) -> bool:
        return self not in (StopReason.SHUTDOWN, StopReason.SLICE)


class StopSignal:
    """Why an operation should stop; the first reason wins. A reason that aborts at once also
    cancels the engine task (in-flight LLM requests are abandoned); ``shutdown`` lets running
    passes finish until :meth:`force` is called."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None
        self.event = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    def attach(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        if self.reason is not None and self.reason.aborts_at_once:
            task.cancel()

    def set(self, reason: StopReason) -> None:
        if self.reason is None:
            self.reason = reason
            self.event.set()
        if reason.aborts_at_once:
            self.force()

    def force(self) -> None:
        """Cancel the running engine task (aborts in-flight LLM requests)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()


class _Interrupted(Exception):
    """Stop before the next pass because the worker is shutting down or the slice is over."""


class _SiblingFailed(Exception):
    """Stop before the next pass because another group of the wave failed for good."""


@dataclass
class _MemoryState:
    """One memory while its wave runs."""

    memory: store.WaveMemory
    todo: tuple[Scope, ...]  # the scopes this operation passes: not journaled, within the filter
    applied: dict[Scope, str] = field(default_factory=dict)  # scope → action, this operation
    failure: str | None = None  # why it is marked failed

    def remaining(self) -> tuple[Scope, ...]:
        """The scopes still to pass (none once failed)."""
        if self.failure is not None:
            return ()
        if not self.applied:
            return self.todo  # asked for every member and scope of every pass planned
        return tuple(s for s in self.todo if s not in self.applied)

    def finished(self) -> bool:
        return self.failure is None and set(self.memory.scopes) <= (
            self.memory.journaled | self.applied.keys()
        )

    def result(self) -> str | None:
        """DESIGN §2's per-memory result of this operation, once it is finished or failed; None
        when the journal alone finished it (an earlier attempt did the work: ``recovered``)."""
        if self.failure is not None:
            return "failed"
        acted = [a for a in self.applied.values() if a != "skipped"]
        if len(acted) > 1:
            return "multiple"
        if acted:
            return acted[0]
        return "skipped" if self.applied else None


@dataclass(frozen=True)
class RecallAhead:
    """A recall fetched ahead for a pass its group makes later (DESIGN §2): by the apply of an
    earlier pass, or with the group's first recall. Nothing else writes a group's scopes in
    between — groups never share a scope and a bank runs one operation at a time — so it is
    exact for that pass once the writes its group sent since are laid over it (:meth:`after`)."""

    request: store.RecallRequest
    observations: list[store.RecalledObservation]

    def serves(self, wanted: store.RecallRequest) -> list[store.RecalledObservation] | None:
        """The recalled observations if ``wanted`` is the pass this was fetched for, else None."""
        return self.observations if wanted == self.request else None

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


@dataclass
class _Speculation:
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
class _Ahead:
    """What a pass prepared for the next passes of its group: recalls, and maybe the next
    pass's LLM call already under way."""

    recalls: tuple[RecallAhead, ...] = ()
    answer: _Speculation | None = None

    def recall_for(self, wanted: store.RecallRequest) -> RecallAhead | None:
        return next((r for r in self.recalls if r.request == wanted), None)


@dataclass
class _BatchReport:
    group: int
    number: int
    scopes: tuple[Scope, ...]
    members: Sequence[_MemoryState]
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
    slices: int = 0  # how many times the operation yielded its slot to waiting ones

    @classmethod
    def resumed(cls, result: Mapping[str, Any] | None) -> RunSummary:
        """The summary an operation's earlier slices stored, to continue; empty without one."""
        if not result:
            return cls()
        return cls(
            perf=PerfLog.from_dict(result.get("perf", {})),
            **{k: int(result.get(k, 0)) for k in _CONTINUED},
        )

    def progress(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "processed": self.processed,
            "consolidated": self.consolidated,
            "failed": self.failed,
            "waves": self.waves,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.progress(),
            "recovered": self.recovered,
            "slices": self.slices,
            "perf": self.perf.to_dict(),
        }


_CONTINUED = ("waves", "processed", "consolidated", "failed", "recovered", "slices")


ProgressCallback = Callable[[RunSummary], None]


class OperationRun:
    """The engine for one claimed attempt of one operation: waves, their groups, markers."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        lease: Lease,
        llm: Consolidator,
        settings: Settings,
        stop: StopSignal,
        on_progress: ProgressCallback | None = None,
        embedder: Embedder | None = None,
        slice_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.lease = lease
        self.llm = llm
        self.embedder = embedder
        # Vectors of the wave's texts (None: refused by the endpoint): its facts are embedded
        # together when the wave starts, then each pass adds the texts it writes.
        self._vectors: dict[str, str | None] = {}
        self.settings = settings
        self.stop = stop
        self.on_progress = on_progress
        self.slice_s = slice_s
        self.started = time.monotonic()
        self.summary = RunSummary.resumed(lease.resumed)
        self.mission = settings.mission
        self._abort = False
        self._slots = SlotAllocator(settings.group_parallelism)
        # Groups holding a slot that still fetch their first recalls: their first LLM call waits
        # on them, so the recalls of groups on deck and the fetch of a further wave go after
        # (:meth:`_behind_slot_holders`). ``_settled`` is resolved whenever the set empties.
        self._preparing: set[Claim] = set()
        self._settled: asyncio.Future[None] | None = None
        self._last_writer: dict[Scope, Claim] = {}
        # The plans of the groups queued, and the first recalls a group's last apply fetched
        # for a group waiting on it alone (:meth:`_successor_recall`).
        self._plans: dict[Claim, GroupPlan[_MemoryState]] = {}
        self._handed: dict[Claim, RecallAhead] = {}
        self._waves_launched = 0
        self._closing = asyncio.Lock()
        self.log = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)

    async def run(self) -> RunSummary:
        """Consolidate every pending memory of the bank (within the scope filter).

        Waves are pipelined: up to MAX_WAVES_IN_FLIGHT waves are fetched ahead and their groups
        queued, so a slot freed near a wave's end is taken by a later wave's group at once
        instead of idling until the wave's slowest group is done. A group never starts before
        the earlier groups that write one of its scopes have finished (a scope's memories are
        applied in consolidation order, across waves); among the ready groups, a freed slot goes
        to the one with the longest critical path through the queued waves
        (:class:`consolidation.slots.SlotAllocator`). Each wave still gathers its own groups and
        commits its own markers (:meth:`_run_wave`); the next wave is fetched when one closes.
        """
        self.mission = await store.bank_mission(self.pool, self.lease.bank_id) or self.mission
        self.summary.total = self.summary.processed + await store.count_pending(
            self.pool, self.lease.bank_id, self.lease.scope_filter
        )
        self._report()
        cursor = None
        exhausted = False
        in_flight: deque[asyncio.Task[None]] = deque()
        try:
            while True:
                while not exhausted and self._wants_another_wave(len(in_flight)):
                    if in_flight:
                        # A wave fetched ahead serves later slots; the first calls go first.
                        await self._behind_slot_holders()
                        if not self._wants_another_wave(len(in_flight)):
                            break  # a group failed for good meanwhile: its error is the run's
                    self._checkpoint()  # between waves
                    wave = await store.fetch_wave(
                        self.pool,
                        self.lease.bank_id,
                        cursor,
                        self.settings.wave_size,
                        self.lease.scope_filter,
                    )
                    if not wave:
                        exhausted = True
                        break
                    cursor = (wave[-1].order, wave[-1].id)
                    in_flight.append(self._launch_wave(wave))
                if not in_flight:
                    return self.summary
                await asyncio.wait({in_flight[0]})
                if in_flight[0].exception() is not None:
                    # Its error may only say that a group of a later wave failed for good
                    # (_SiblingFailed): the error of the run is the weightiest of all the waves'.
                    await asyncio.wait(in_flight)
                    raise _first_error([e for t in in_flight if (e := t.exception()) is not None])
                in_flight.popleft()
        except asyncio.CancelledError:
            for task in in_flight:
                task.cancel()
            raise
        finally:
            # Waves still in flight end first: their running passes finish (or are cancelled
            # with us) and each commits its markers, before the operation's end is recorded.
            while in_flight:
                try:
                    await asyncio.wait(in_flight)
                    break
                except asyncio.CancelledError:
                    for task in in_flight:
                        task.cancel()

    def _wants_another_wave(self, waves_in_flight: int) -> bool:
        """Keep MAX_WAVES_IN_FLIGHT waves fetched and queued: the slot allocator can only favour
        a chain's next group if that group's wave is known."""
        if self._abort:
            return False  # a group failed for good: the waves in flight end, then its error
        return waves_in_flight < MAX_WAVES_IN_FLIGHT

    # --- waves ----------------------------------------------------------------------------

    def _launch_wave(self, wave: Sequence[store.WaveMemory]) -> asyncio.Task[None]:
        """Plan a wave and queue its groups for slots, each behind the earlier groups that write
        one of its scopes; returns the wave's task (it ends once its markers are committed)."""
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
        self._waves_launched += 1
        number = self._waves_launched
        facts = self._prefetch_vectors(states)
        groups = plan_wave(states, self.settings.llm_batch_size, _MemoryState.remaining)
        reports: list[list[_BatchReport]] = [[] for _ in groups]
        tasks = []
        batch_size = self.settings.llm_batch_size
        for index, group in enumerate(groups):
            scopes = {s for m in group for s in m.todo}
            claim = self._slots.queue(
                calls=sum(1 for _ in planned_passes(group, batch_size, _MemoryState.remaining)),
                wave=number,
                position=index,
                after=[self._last_writer[s] for s in scopes if s in self._last_writer],
            )
            if claim.holds:
                self._prepare(claim)  # before the fetch of the next wave can be sent
            task = asyncio.create_task(
                self._run_group(index, group, reports[index], claim, facts),
                name=f"wave-{number}-group-{index}",
            )
            # Whatever becomes of the task — even cancelled before it ever ran — its slot, if
            # it took one, is freed and the groups behind it in its scopes may go.
            task.add_done_callback(functools.partial(self._group_ended, claim))
            for scope in scopes:
                self._last_writer[scope] = claim
            tasks.append(task)
        return asyncio.create_task(
            self._run_wave(number, states, reports, tasks), name=f"wave-{number}"
        )

    def _group_ended(self, claim: Claim, _: asyncio.Task[None]) -> None:
        self._plans.pop(claim, None)
        self._handed.pop(claim, None)
        self._prepared(claim)
        self._slots.finish(claim)

    def _prepare(self, claim: Claim) -> None:
        """``claim`` holds a slot and fetches its group's first recalls now."""
        if not self._preparing:
            self._settled = asyncio.get_running_loop().create_future()
        self._preparing.add(claim)

    def _prepared(self, claim: Claim) -> None:
        if claim not in self._preparing:
            return
        self._preparing.discard(claim)
        if not self._preparing and self._settled is not None and not self._settled.done():
            self._settled.set_result(None)

    async def _behind_slot_holders(self, claim: Claim | None = None) -> None:
        """Wait while a group holding a slot still fetches its first recalls (or until
        ``claim`` is granted a slot itself): their first LLM calls wait on those recalls, and
        work for a slot not held yet — a group on deck preparing, a wave fetched ahead — would
        share the database and the CPU with them. It matters when the slots are handed out
        together: at the start of an operation, every slot and a full deck at once."""
        while self._preparing and not (claim is not None and claim.granted.done()):
            assert self._settled is not None
            waits: set[asyncio.Future[None]] = {self._settled}
            if claim is not None:
                waits.add(claim.granted)
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    async def _run_wave(
        self,
        number: int,
        states: Sequence[_MemoryState],
        reports: Sequence[Sequence[_BatchReport]],
        groups: Sequence[asyncio.Task[None]],
    ) -> None:
        """Gather the wave's groups, then commit its markers — also when it was cancelled."""
        started = time.monotonic()
        results: list[BaseException | None] | None = None
        try:
            results = await asyncio.gather(*groups, return_exceptions=True)
        finally:
            interrupted = results is None or any(results)
            await asyncio.shield(self._close_wave(number, states, reports, started, interrupted))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise _first_error(errors)
        if self.stop.reason is StopReason.CANCEL:
            raise OperationCancelled("cancel requested")

    async def _close_wave(
        self,
        number: int,
        states: Sequence[_MemoryState],
        reports: Sequence[Sequence[_BatchReport]],
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
            consolidated = [s.memory.id for s in states if s.finished()]
            failed = {s.memory.id: s.failure for s in states if s.failure is not None}
            await store.commit_wave_markers(self.pool, self.lease, consolidated, failed)
            for action, count in Counter(outcome.values()).items():
                if action is not None:
                    metrics.MEMORIES.labels(action=action).inc(count)
            recovered = sum(action is None for action in outcome.values())
            self.summary.waves += 1
            self.summary.processed += len(consolidated) + len(failed)
            self.summary.consolidated += len(consolidated)
            self.summary.failed += len(failed)
            self.summary.recovered += recovered
            self.log.info(
                "wave",
                wave=number,
                memories=len(states),
                consolidated=len(consolidated),
                failed=len(failed),
                recovered=recovered,
                seconds=round(time.monotonic() - started, 4),
            )
            if await queue.record_progress(self.pool, self.lease, self.summary.progress()):
                self.stop.set(StopReason.CANCEL)
            elif await self._slice_over(full_wave=len(states) >= self.settings.wave_size):
                self.stop.set(StopReason.SLICE)
            self._report()

    async def _slice_over(self, full_wave: bool) -> bool:
        """Whether to give the slot up: the slice has run out and another operation waits for
        a slot. A wave shorter than the wave size was most likely the bank's last."""
        if self.slice_s is None or not full_wave:
            return False
        if time.monotonic() - self.started < self.slice_s:
            return False
        return await queue.others_waiting(self.pool, self.lease)

    async def _reread_journal(self, states: Sequence[_MemoryState]) -> None:
        unsure = {s.memory.id: s for s in states if s.failure is None and s.remaining()}
        if not unsure:
            return
        journal = await store.journal_of(self.pool, self.lease.operation_id, list(unsure))
        for memory_id, scope, action in journal:
            state = unsure[memory_id]
            if scope in state.todo:
                state.applied.setdefault(scope, action)

    def _report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.summary)

    # --- groups and passes ----------------------------------------------------------------

    async def _run_group(
        self,
        index: int,
        group: Sequence[_MemoryState],
        reports: list[_BatchReport],
        claim: Claim,
        facts: asyncio.Task[Any] | None = None,
    ) -> None:
        """The group's passes strictly in order: batch k+1 sees what batch k wrote, and pass
        k+1's LLM call starts once pass k's answer is known, while pass k's writes are applied
        (:meth:`_run_pass`). The group holds its slot (``claim``) while it asks the LLM: it
        gives it back once its last answer is in, before that pass's apply.

        Its first two recalls are fetched before it holds a slot, once it is next in line for
        one (:meth:`SlotAllocator.on_deck`): nothing else writes its scopes by then (their
        earlier writers are done, and the groups of its wave write others), and its first LLM
        call starts the moment a slot is freed. A group of one pass that waited on one earlier
        group alone has its recall already: that group's last apply fetched it
        (:meth:`_successor_recall`). With embeddings, the recalls wait for the wave's facts to
        be embedded (``facts``)."""
        plan = GroupPlan(group, self.settings.llm_batch_size, _MemoryState.remaining)
        self._plans[claim] = plan
        ahead: _Ahead | None = None
        opening: PerfLog | None = None  # the first recalls' time, for the first batch
        try:
            await self._slots.on_deck(claim)
            # Put on deck by a grant, most often: let the group granted the slot send its LLM
            # request first (aiohttp on Python 3.11 writes it in a task queued behind us).
            await asyncio.sleep(0)
            if facts is not None:
                # Shielded: the request serves the wave's other groups, whatever becomes of us.
                await asyncio.shield(facts)
            if self._may_start():
                ahead = self._handed_over(claim, plan)
                if ahead is None:
                    await self._behind_slot_holders(claim)
                    if claim.holds:
                        self._prepare(claim)
                    opening = PerfLog()
                    ahead = await self._first_recalls(plan, opening)
            self._prepared(claim)
            await self._slots.acquire(claim)
            while (step := plan.next()) is not None:
                if not reports or reports[-1].number != step.batch:
                    batch = plan.batches[step.batch]
                    scopes = tuple(sorted({s for m in batch for s in m.todo}))
                    reports.append(
                        _BatchReport(index, step.batch, scopes, batch, PerfLog(memories=len(batch)))
                    )
                perf = reports[-1].perf
                if opening is not None:
                    perf += opening
                    opening = None
                if not (ahead is not None and ahead.answer is not None and self._graceful_stop()):
                    # A pass whose call is already under way is a running pass: a shutdown or
                    # the end of a slice lets it finish (and apply); nothing new starts.
                    self._checkpoint()
                prepared, ahead = ahead, None
                try:
                    try:
                        ahead = await self._run_pass(
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
        except (asyncio.CancelledError, _SiblingFailed, _Interrupted, OperationCancelled):
            raise
        except BaseException:
            self._abort = True
            raise
        finally:
            if ahead is not None and ahead.answer is not None and reports:
                ahead.answer.drop(reports[-1].perf)  # stopped before the pass it was for

    async def _first_recalls(self, plan: GroupPlan[_MemoryState], perf: PerfLog) -> _Ahead:
        """The recalls of the group's first two passes, in one statement."""
        steps = [step for step in (plan.peek(), plan.peek(2)) if step is not None]
        return _Ahead(await self._recall([await self._wanted(step, perf) for step in steps], perf))

    def _successor_recall(self, claim: Claim) -> tuple[Claim, store.RecallRequest] | None:
        """For the last pass of ``claim``'s group: a queued group that waits on it alone and
        makes one pass, with the recall of that pass. The last apply fetches it after its own
        writes, in its transaction, instead of that group sending a statement of its own once
        it is ready: nothing else can write its scope in between (every other earlier writer
        is done, the groups of its wave write other scopes, later ones wait on it). Lexical
        recall only: a hybrid one needs the facts' vectors of a wave that may not have them
        yet."""
        if self.embedder is not None:
            return None
        for later in claim.later:
            if later.done or later.after != {claim} or later in self._handed:
                continue
            plan = self._plans.get(later)
            only = None if plan is None else _only_pass(plan)
            if only is not None:
                return later, self._recall_request(only)
        return None

    def _handed_over(self, claim: Claim, plan: GroupPlan[_MemoryState]) -> _Ahead | None:
        """The first recall the last apply of the group ``claim`` waited on fetched for it,
        if it is still the recall of the group's one pass."""
        handed = self._handed.pop(claim, None)
        only = _only_pass(plan)
        if handed is None or only is None or handed.request != self._recall_request(only):
            return None
        return _Ahead((handed,))

    async def _recall(
        self, wanted: Sequence[store.RecallRequest], perf: PerfLog
    ) -> tuple[RecallAhead, ...]:
        """The recalls of ``wanted``, in one statement."""
        started = time.monotonic()
        fetched = await store.recall_many(self.pool, self.lease.bank_id, wanted)
        perf.recall_s += time.monotonic() - started
        return tuple(RecallAhead(w, o) for w, o in zip(wanted, fetched, strict=True))

    def _fail(self, member: _MemoryState, scope: Scope, exc: InvalidLLMOutput) -> None:
        member.failure = str(exc)[:MAX_FAILURE_REASON_CHARS]
        self.log.warning(
            "memory_failed",
            memory_id=str(member.memory.id),
            scope=list(scope),
            reason=member.failure,
        )

    def _checkpoint(self) -> None:
        """Checked before every pass and every wave."""
        if self.stop.reason is StopReason.CANCEL:
            raise OperationCancelled("cancel requested")
        if self.stop.reason is StopReason.LEASE_LOST:
            raise LeaseLost(f"operation {self.lease.operation_id} lost its lease")
        if self.stop.reason is StopReason.SHUTDOWN:
            raise _Interrupted("worker shutting down")
        if self.stop.reason is StopReason.SLICE:
            raise _Interrupted("time slice over")
        if self._abort:
            raise _SiblingFailed()

    def _recall_request(self, step: Pass[_MemoryState]) -> store.RecallRequest:
        texts = tuple(m.memory.text for m in step.members)
        return store.RecallRequest(step.scope, texts, self.settings.recall_limit)

    def _prefetch_vectors(self, states: Sequence[_MemoryState]) -> asyncio.Task[Any] | None:
        """With embeddings: a task embedding every fact of a wave in one request (chunked if
        huge), which the wave's groups wait for before their first pass."""
        texts = [s.memory.text for s in states if s.todo]
        if self.embedder is None or not texts:
            return None
        excess = len(self._vectors) - 2 * MAX_WAVES_IN_FLIGHT * self.settings.wave_size
        if excess > 0:
            # Bounded, the oldest first (the waves fetched ahead still need theirs): a text
            # missing later is embedded again by the pass that needs it.
            for text in list(itertools.islice(self._vectors, excess)):
                del self._vectors[text]
        task = asyncio.create_task(self._embed(texts, self.summary.perf))
        # Its error reaches every group awaiting it; this only silences "never retrieved" when
        # the wave was cancelled before any group did.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _embed(self, texts: Sequence[str], perf: PerfLog) -> tuple[str | None, ...]:
        """The vectors of ``texts``; those not embedded yet in ONE request."""
        assert self.embedder is not None
        # A local copy: the cache may be cleared by a wave launched while we wait.
        known = {t: self._vectors[t] for t in texts if t in self._vectors}
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        if missing:
            started = time.monotonic()
            perf.embedding_requests += 1
            try:
                vectors = await self.embedder.embed(missing)
            finally:
                perf.embedding_s += time.monotonic() - started
            fetched = dict(zip(missing, vectors, strict=True))
            self._vectors.update(fetched)
            known.update(fetched)
        return tuple(known[t] for t in texts)

    async def _run_pass(
        self,
        step: Pass[_MemoryState],
        perf: PerfLog,
        ahead: _Ahead | None,
        upcoming: Pass[_MemoryState] | None,
        following: Pass[_MemoryState] | None,
        claim: Claim | None = None,
    ) -> _Ahead:
        """Recall (unless an earlier pass brought it), ask the LLM (one retry on an unusable
        answer), apply in one transaction; returns what it prepared for ``upcoming``.

        The passes of a group overlap without reordering anything: once this pass's answer is
        known, ``upcoming``'s LLM call starts on the recall it will have after this pass's
        writes (the recall held for it, :meth:`RecallAhead.after`), while the writes are
        applied — fetching ``following``'s recall on the way; the apply is sent once that call's
        request has left (:func:`_let_requests_leave`). ``upcoming`` uses that call if it
        is still the pass it was started for; it is dropped if this pass's apply fails. Applies
        stay one at a time and in order: this method returns once its own is done. The last
        pass of a group gives the group's slot (``claim``) back before its apply, so that
        another group's first call starts meanwhile; the slot is taken again should the apply
        send the pass back to the model.

        With embeddings, the facts' vectors are known since the wave started, and the vectors of
        this pass's written observations are fetched in one request before the apply (with
        ``following``'s facts, should they have dropped out of the bounded cache)."""
        wanted = await self._wanted(step, perf)
        early = ahead.answer if ahead is not None else None
        if early is not None and early.recall.request != wanted:
            early.drop(perf)  # the plan changed (a split, a failed member): not this pass's
            early = None
            self._checkpoint()  # skipped for it: no new call when the operation is stopping
        held = ahead.recall_for(wanted) if ahead is not None else None
        upcoming_wanted = None if upcoming is None else await self._wanted(upcoming, perf)
        upcoming_recall = None
        if upcoming_wanted is not None and ahead is not None:
            upcoming_recall = ahead.recall_for(upcoming_wanted)
        if early is not None:
            recalled, request, chat = early.recall.observations, early.request, early.chat
        else:
            if held is not None:
                recalled = held.observations
            else:
                # The first pass after a split (or of a group that could not recall ahead)
                # also fetches the next pass's recall, which its own apply cannot bring in time
                # for the early call.
                both = [wanted]
                if upcoming_wanted is not None and upcoming_recall is None:
                    both.append(upcoming_wanted)
                fetched = await self._recall(both, perf)
                recalled = fetched[0].observations
                if len(fetched) == 2:
                    upcoming_recall = fetched[1]
            request = self._pass_request(step, recalled)
            chat = pass_chat(request)
        following_recall = None if following is None else await self._wanted(following, perf)
        successor = None
        if upcoming is None and following is None and claim is not None:
            successor = self._successor_recall(claim)
        for attempt in (1, 2):
            started_early: _Speculation | None = None
            try:
                if early is not None and attempt == 1:
                    answer = await early.answer(perf)
                else:
                    if claim is not None:
                        await self._slots.reacquire(claim)  # given back before a failed apply
                    answer = await self._ask(request, chat, perf)
                write = _pass_write(self.lease, step, answer)
                if upcoming is not None and upcoming_recall is not None and self._may_start():
                    started_early = self._start_early(
                        upcoming, upcoming_recall.after(write, recalled)
                    )
                    await _let_requests_leave()
                elif upcoming is None and claim is not None:
                    self._slots.release(claim)  # the group's last answer is in
                    await _let_requests_leave()  # the first call of the group granted it
                if self.embedder is not None:
                    write, following_recall = await self._with_vectors(
                        write, following_recall, perf
                    )
                started = time.monotonic()
                try:
                    fetched_next = await store.apply_pass(
                        self.pool,
                        self.lease,
                        write,
                        following_recall if successor is None else successor[1],
                        embeddings=self.embedder is not None,
                    )
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
            if successor is not None and fetched_next is not None:
                self._handed[successor[0]] = RecallAhead(successor[1], fetched_next)
            recalls = []
            if following_recall is not None and fetched_next is not None:
                recalls.append(RecallAhead(following_recall, fetched_next))
            if started_early is None and upcoming_recall is not None:
                recalls.append(upcoming_recall.after(write, recalled))
            return _Ahead(tuple(recalls), started_early)
        raise AssertionError("unreachable")

    async def _wanted(self, step: Pass[_MemoryState], perf: PerfLog) -> store.RecallRequest:
        """What ``step`` recalls by; with embeddings, with its facts' vectors."""
        wanted = self._recall_request(step)
        if self.embedder is not None:
            wanted = replace(wanted, fact_vectors=await self._embed(wanted.fact_texts, perf))
        return wanted

    def _pass_request(
        self, step: Pass[_MemoryState], recalled: Sequence[store.RecalledObservation]
    ) -> PassRequest:
        return build_request(
            self.lease.bank_id,
            step.scope,
            self.mission,
            [
                FactInput(m.memory.id, m.memory.text, m.memory.tags, m.memory.occurred_at)
                for m in step.members
            ],
            [ObservationInput(o.id, o.text, o.sources, o.updated_at) for o in recalled],
        )

    def _graceful_stop(self) -> bool:
        """The operation stops, letting running passes finish (a shutdown, a slice's end)."""
        return self.stop.reason is not None and not self.stop.reason.aborts_at_once

    def _may_start(self) -> bool:
        """Whether a pass may start now: nothing asks the operation to stop."""
        return self.stop.reason is None and not self._abort

    def _start_early(self, step: Pass[_MemoryState], recall: RecallAhead) -> _Speculation:
        request = self._pass_request(step, recall.observations)
        chat = pass_chat(request)
        perf = PerfLog()
        task = asyncio.create_task(self._ask(request, chat, perf))
        return _Speculation(recall, request, chat, perf, task)

    async def _with_vectors(
        self, write: store.PassWrite, upcoming: store.RecallRequest | None, perf: PerfLog
    ) -> tuple[store.PassWrite, store.RecallRequest | None]:
        """``write`` with the vectors of its observations' texts and ``upcoming`` with those of
        its facts: one embeddings request."""
        texts = [w.text for w in write.observations]
        following = upcoming.fact_texts if upcoming is not None else ()
        vectors = await self._embed([*texts, *following], perf)
        observations = tuple(
            replace(w, embedding=v)
            for w, v in zip(write.observations, vectors[: len(texts)], strict=True)
        )
        if upcoming is not None:
            upcoming = replace(upcoming, fact_vectors=vectors[len(texts) :])
        return replace(write, observations=observations), upcoming

    async def _ask(self, request: PassRequest, chat: Chat, perf: PerfLog) -> PassPlan:
        # --- contract v2 hook: the pass answered by narrowed questions (consolidation.ask_v2) --
        offline = isinstance(self.llm, OfflineConsolidator)
        if (self.embedder is not None) if offline else self.settings.llm_contract == "v2":
            return await ask_v2.answer_pass(
                request,
                None if offline else functools.partial(self._complete, perf=perf),
                None if self.embedder is None else functools.partial(self._embed, perf=perf),
                narrow_options(self.settings),
            )
        # --- end of the v2 hook -------------------------------------------------------------
        answer = await self._complete(chat, perf)
        plan = parse_answer(answer.content, request)
        perf.llm_repaired += int(chat.repair)
        return plan

    async def _complete(self, chat: Chat, perf: PerfLog) -> LLMAnswer:
        """One chat completion, counted in ``perf``."""
        started = time.monotonic()
        perf.llm_calls += 1
        perf.llm_repairs += int(chat.repair)
        perf.prompt_chars += chat.prompt_chars
        try:
            answer = await self.llm.complete(chat)
        except LLMRetriesExhausted as exc:
            # The stored result must say the pass was retried, not only that it failed.
            perf.llm_retries += exc.attempts - 1
            raise
        except InvalidLLMOutput as exc:
            perf.prompt_tokens += exc.prompt_tokens
            perf.completion_tokens += exc.completion_tokens
            raise
        finally:
            perf.llm_s += time.monotonic() - started
        perf.llm_retries += answer.retries
        perf.prompt_tokens += answer.prompt_tokens
        perf.completion_tokens += answer.completion_tokens
        return answer


async def _let_requests_leave() -> None:
    """Let an LLM call just started (a task, or a group just granted a slot) send its request
    before this task sends its apply: the call's task reaches its request in its first step,
    where the plain-http client writes it; aiohttp (https or a proxy, on Python 3.11) writes it
    in a task of its own, started there, that runs on the loop's next turn. Sent first, the
    apply would delay the request by its own sending and by the Postgres backend it wakes,
    which shares the cores: measured on every pass of a chain (docs/benchmarks.md, #16
    session 12)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


def _only_pass(plan: GroupPlan[_MemoryState]) -> Pass[_MemoryState] | None:
    """The group's next pass if it is the last one it plans."""
    first = plan.peek()
    return first if first is not None and plan.peek(2) is None else None


def _pass_write(lease: Lease, step: Pass[_MemoryState], plan: PassPlan) -> store.PassWrite:
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
                stop.set(StopReason.CANCEL)
        except LeaseLost:
            log.warning("lease_lost", operation_id=str(lease.operation_id), attempt=lease.attempt)
            stop.set(StopReason.LEASE_LOST)
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
    settings: Settings,
    *,
    stop: StopSignal | None = None,
    on_progress: ProgressCallback | None = None,
    embedder: Embedder | None = None,
    slice_s: float | None = None,
) -> OperationEnd:
    """Run one claimed attempt to its end and record the final status (shielded, fenced).

    completed → ``completed``; cancel → ``cancelled``; shutdown → back to ``pending`` without
    spending an attempt; after ``slice_s`` with other operations waiting → back to ``pending``
    behind them, no attempt spent, progress kept; LLM configuration error → ``failed`` at once;
    other errors → back to ``pending`` with backoff until ``max_attempts``, then ``failed``; lost
    lease → no write. With an ``embedder``, recall is hybrid and observations are stored with
    their vectors (the database must have them: embeddings.require_vector_storage); its faults
    are the LLM's. A ``forget`` operation runs :class:`consolidation.forget.ForgetRun`.
    """
    stop = stop or StopSignal()
    run: OperationRun | ForgetRun
    if lease.kind == queue.FORGET:
        from consolidation.forget import ForgetRun  # forget.py builds on this module

        run = ForgetRun(pool, lease, llm, settings, stop, embedder=embedder)
    else:
        run = OperationRun(
            pool, lease, llm, settings, stop, on_progress, embedder=embedder, slice_s=slice_s
        )
    bound = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)
    bound.info("operation_started", attempt=lease.attempt, scope_filter=lease.scope_filter)
    inner = asyncio.create_task(run.run(), name=f"operation-{lease.operation_id}")
    stop.attach(inner)
    keeper = asyncio.create_task(_keep_lease(pool, lease, settings.lease_s, stop))
    outer_cancelled = False
    try:
        await asyncio.wait({inner})
    except asyncio.CancelledError:
        # The caller gave up on us (hard shutdown): stop the engine, then still record the end.
        outer_cancelled = True
        stop.set(StopReason.SHUTDOWN)
        stop.force()
        await asyncio.wait({inner})
    finally:
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)

    end = await asyncio.shield(_finish(pool, lease, settings, inner, stop, run.summary))
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


# An attempt that ends because the database was unreachable (a restart, a dropped or terminated
# session, too many connections) is handed back without spending one of max_attempts, at most
# this many times per operation; past that it spends attempts like any other error, so an
# operation whose database keeps failing still ends (docs/reliability.md).
MAX_INTERRUPTIONS = 20
MAX_INTERRUPTION_DELAY_S = 300.0
# The final status write is retried while the database is unreachable, for at most one lease:
# after that the lease has run out and another worker reclaims the operation anyway.
END_WRITE_RETRY_S = (0.1, 2.0)


async def _finish(
    pool: asyncpg.Pool,
    lease: Lease,
    settings: Settings,
    inner: asyncio.Task[RunSummary],
    stop: StopSignal,
    summary: RunSummary,
) -> OperationEnd:
    """Record how the attempt ended, retrying the write through a database outage."""
    error: BaseException | None
    error = asyncio.CancelledError() if inner.cancelled() else inner.exception()
    deadline = time.monotonic() + settings.lease_s
    delay, max_delay = END_WRITE_RETRY_S
    while True:
        try:
            return await _record_end(pool, lease, settings, error, stop, summary)
        except LeaseLost as exc:
            return OperationEnd("lost", summary, str(exc))
        except db.DATABASE_DOWN as exc:
            if time.monotonic() + delay > deadline:
                log.warning(
                    "operation_end_unrecorded",
                    operation_id=str(lease.operation_id),
                    attempt=lease.attempt,
                    error=repr(exc),
                    hint="the database stayed unreachable until the lease ran out; a worker "
                    "reclaims the operation once it is back",
                )
                return OperationEnd("unrecorded", summary, _describe(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


async def _record_end(
    pool: asyncpg.Pool,
    lease: Lease,
    settings: Settings,
    error: BaseException | None,
    stop: StopSignal,
    summary: RunSummary,
) -> OperationEnd:
    result = summary.to_json()
    if error is None:
        await queue.finish(pool, lease, "completed", result=result)
        return OperationEnd("completed", summary)
    if stop.reason is StopReason.LEASE_LOST or isinstance(error, LeaseLost):
        return OperationEnd("lost", summary, str(error) or "lease lost")
    if stop.reason is StopReason.CANCEL or isinstance(error, OperationCancelled):
        await queue.finish(pool, lease, "cancelled", result=result, error="cancelled on request")
        return OperationEnd("cancelled", summary, "cancelled on request")
    if stop.reason is StopReason.SLICE:
        slices = summary.slices + 1
        status = await queue.yield_operation(pool, lease, {**result, "slices": slices})
        metrics.OPERATION_SLICES.inc()
        log.info(
            "operation_yielded",
            operation_id=str(lease.operation_id),
            bank_id=lease.bank_id,
            status=status,
            slices=slices,
        )
        return OperationEnd(status, summary, None if status == "pending" else "cancelled")
    if stop.reason is StopReason.SHUTDOWN:
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
    if isinstance(error, db.DATABASE_DOWN) and lease.interruptions < MAX_INTERRUPTIONS:
        message = f"the database was unreachable ({message}); retried without spending an attempt"
        log.warning(
            "operation_interrupted",
            operation_id=str(lease.operation_id),
            bank_id=lease.bank_id,
            attempt=lease.attempt,
            interruptions=lease.interruptions + 1,
            error=message,
        )
        status = await queue.release(
            pool,
            lease,
            delay_s=min(
                settings.retry_backoff_s * 2**lease.interruptions, MAX_INTERRUPTION_DELAY_S
            ),
            error=message,
            refund_attempt=True,
            interrupted=True,
            result=result,
        )
        return OperationEnd(status, summary, message)
    if isinstance(error, LLMConfigError) or lease.attempt >= lease.max_attempts:
        await queue.finish(pool, lease, "failed", result=result, error=message)
        return OperationEnd("failed", summary, message)
    delay = settings.retry_backoff_s * 2 ** (lease.attempt - 1)
    status = await queue.release(
        pool, lease, delay_s=delay, error=message, refund_attempt=False, result=result
    )
    return OperationEnd(status, summary, message)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
