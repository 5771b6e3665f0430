"""The plan the engine forms for each wave, and the ideal time of that plan.

:class:`PlanTracker` sees every wave the engine fetches (the driver wraps ``store.fetch_wave``)
and plans it with the engine's own planner (``consolidation.engine.plan``: ``plan_wave`` and
``planned_passes`` over the same ``todo`` scopes). A batch makes one LLM call per scope it writes;
a group runs its batches (and their passes) strictly in order, so a group is a chain of calls.

Ideal times, with ``L`` the LLM latency and ``c`` the effective concurrency
(``min(group parallelism, LLM max concurrent)``):

- per wave (the engine's wave barriers kept): ``Σ_waves L × max(ceil(calls_w / c), chain_w)``
  where ``chain_w`` is the wave's longest group chain;
- without wave barriers: ``L × max(ceil(Σ calls / c), longest chain over the whole run)``, where
  groups of different waves that share a scope (transitively) form one chain, because their
  passes must still run in order.

Only the LLM time counts: database work, JSON and Python are the engine's overhead, which is
what efficiency = ideal / measured exposes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from consolidation.engine.plan import fill_last_batches, plan_wave, planned_passes
from consolidation.scopes import Scope


@dataclass
class WavePlan:
    """One wave as the engine plans it, and when it ran."""

    index: int
    memories: int
    groups: int
    batches: int
    calls: int
    longest_chain: int
    longest_scope_chain: int
    started: float
    ended: float | None = None
    statements: dict[str, int] = field(default_factory=dict)
    chains: list[int] = field(default_factory=list)  # calls of each group, first appearance first
    # (calls, scopes) of each group in the order the engine queues them (longest chain first)
    groups_queued: list[tuple[int, frozenset[Scope]]] = field(default_factory=list)

    def ideal_s(self, latency_s: float, concurrency: int) -> float:
        return latency_s * max(math.ceil(self.calls / concurrency), self.longest_chain)

    def to_json(self, latency_s: float, concurrency: int) -> dict[str, Any]:
        return {
            "index": self.index,
            "memories": self.memories,
            "groups": self.groups,
            "batches": self.batches,
            "calls": self.calls,
            "longest_chain": self.longest_chain,
            "longest_scope_chain": self.longest_scope_chain,
            "seconds": None if self.ended is None else round(self.ended - self.started, 6),
            "ideal_s": round(self.ideal_s(latency_s, concurrency), 6),
            "statements": dict(sorted(self.statements.items())),
        }


class _Chains:
    """Union-find over scopes across the whole run, summing the calls of each component."""

    def __init__(self) -> None:
        self.parent: dict[Scope, Scope] = {}
        self.calls: dict[Scope, int] = {}

    def find(self, scope: Scope) -> Scope:
        parent = self.parent.setdefault(scope, scope)
        if parent == scope:
            self.calls.setdefault(scope, 0)
            return scope
        root = self.find(parent)
        self.parent[scope] = root
        return root

    def add(self, scopes: Sequence[Scope], calls: int) -> None:
        roots = {self.find(s) for s in scopes}
        root = roots.pop()
        for other in roots:
            self.parent[other] = root
            self.calls[root] += self.calls.pop(other)
        self.calls[root] += calls

    def longest(self) -> int:
        return max(self.calls.values(), default=0)

    def components(self) -> dict[str, str]:
        """Each scope (tags joined by commas) and the scope that names its component."""
        return {",".join(s): ",".join(self.find(s)) for s in list(self.parent)}


class PlanTracker:
    """Plans every wave the engine fetches; memory use does not grow with the bank."""

    def __init__(self, batch_size: int, keep_chains: bool = False) -> None:
        self.batch_size = batch_size
        self.keep_chains = keep_chains  # per-group call counts, for the schedule model only
        self.waves: list[WavePlan] = []
        self._chains = _Chains()

    @property
    def current(self) -> WavePlan | None:
        return self.waves[-1] if self.waves else None

    def add_wave(self, wave: Sequence[Any], started: float | None = None) -> WavePlan:
        """Plan ``wave`` (``store.WaveMemory`` items) with the engine's own planner."""
        now = time.monotonic() if started is None else started
        if self.waves and self.waves[-1].ended is None:
            self.waves[-1].ended = now
        # No scope filter: the benchmark consolidates whole banks.
        todo = {id(m): tuple(s for s in m.scopes if s not in m.journaled) for m in wave}

        def todo_of(memory: Any) -> tuple[Scope, ...]:
            return todo[id(memory)]

        position = {id(m): i for i, m in enumerate(wave)}
        groups = plan_wave(wave, self.batch_size, todo_of)
        calls = batches = longest = 0
        per_scope: dict[Scope, int] = {}
        chains: dict[int, int] = {}  # first member's position → calls of its group
        queued: list[tuple[int, frozenset[Scope]]] = []
        for group in groups:
            passes = list(planned_passes(group, self.batch_size, todo_of))
            for step in passes:
                per_scope[step.scope] = per_scope.get(step.scope, 0) + 1
            calls += len(passes)
            batches += len({step.batch for step in passes})
            longest = max(longest, len(passes))
            chains[position[id(group[0])]] = len(passes)
            queued.append((len(passes), frozenset(step.scope for step in passes)))
            self._chains.add(sorted({step.scope for step in passes}), len(passes))
        plan = WavePlan(
            index=len(self.waves) + 1,
            memories=len(wave),
            groups=len(groups),
            batches=batches,
            calls=calls,
            longest_chain=longest,
            longest_scope_chain=max(per_scope.values(), default=0),
            started=now,
            # In order of first appearance (the schedule model applies its own order).
            chains=[chains[k] for k in sorted(chains)] if self.keep_chains else [],
            groups_queued=queued if self.keep_chains else [],
        )
        self.waves.append(plan)
        return plan

    def scope_chains(self) -> dict[str, str]:
        """Each scope passed, and the scope naming its chain: scopes an engine group of some wave
        passed together run one after another there, and each scope's groups follow one another
        across waves, so their calls form one chain."""
        return self._chains.components()

    def close(self, ended: float | None = None) -> None:
        """Mark the end of the last wave (the engine's final, empty fetch)."""
        if self.waves and self.waves[-1].ended is None:
            self.waves[-1].ended = time.monotonic() if ended is None else ended

    # --- totals ---------------------------------------------------------------------------

    @property
    def calls(self) -> int:
        return sum(w.calls for w in self.waves)

    def ideal_per_wave_s(self, latency_s: float, concurrency: int) -> float:
        return sum(w.ideal_s(latency_s, concurrency) for w in self.waves)

    def ideal_no_barrier_s(self, latency_s: float, concurrency: int) -> float:
        return latency_s * max(math.ceil(self.calls / concurrency), self._chains.longest())

    def summary(self, latency_s: float, concurrency: int) -> dict[str, Any]:
        return {
            "waves": len(self.waves),
            "calls": self.calls,
            "groups": sum(w.groups for w in self.waves),
            "batches": sum(w.batches for w in self.waves),
            "longest_chain_per_wave_max": max((w.longest_chain for w in self.waves), default=0),
            "longest_chain_no_barrier": self._chains.longest(),
            "ideal_per_wave_s": round(self.ideal_per_wave_s(latency_s, concurrency), 6),
            "ideal_no_barrier_s": round(self.ideal_no_barrier_s(latency_s, concurrency), 6),
        }


def simulate_wave(
    chains: Sequence[int], slots: int, latency_s: float, overhead_s: float, order: str
) -> float:
    """Makespan of one wave under the engine's scheduling: groups take ``slots`` in ``order``
    (``fifo``: order of first appearance, the engine before b173dbf; ``lpt``: longest chain
    first, the engine now) and each call costs ``latency_s + overhead_s``. A pure model, for
    what-if questions."""
    import heapq

    todo = sorted(chains, reverse=True) if order == "lpt" else list(chains)
    free = [0.0] * slots
    for calls in todo:
        start = heapq.heappop(free)
        heapq.heappush(free, start + calls * (latency_s + overhead_s))
    return max(free, default=0.0)


def simulate_pipelined(
    waves: Sequence[Sequence[tuple[int, frozenset[Scope]]]],
    slots: int,
    latency_s: float,
    overhead_s: float,
    priority: str = "wave",
    lookahead: int | None = None,
    fetch: str = "eager",
) -> float:
    """Makespan of a whole run under pipelined waves: a group takes a free slot once the earlier
    groups writing one of its scopes have ended; each call costs ``latency_s + overhead_s``; no
    wave barrier; a fetch takes no time. Among the ready groups, a freed slot goes to

    - ``priority="wave"``: the first queued (wave order, each wave longest chain first: FIFO
      slots);
    - ``priority="critical_path"``: the longest remaining path — its calls plus the longest path
      among the known groups that wait on it, transitively —, then the older wave, then the
      wave's order (the engine's, ``consolidation.engine.slots``).

    A group is known once its wave is fetched. ``lookahead`` bounds the waves fetched from the
    oldest one not done (the engine's MAX_WAVES_IN_FLIGHT; None: no bound); ``fetch="eager"``
    keeps that many fetched (the engine's), ``"lazy"`` fetches one more only while fewer ready
    groups than slots wait. A pure model, for what-if questions."""
    import heapq

    if priority not in ("wave", "critical_path"):
        raise ValueError(f"unknown priority {priority!r}")
    if fetch not in ("eager", "lazy"):
        raise ValueError(f"unknown fetch {fetch!r}")
    groups = [(w, calls, scopes) for w, wave in enumerate(waves) for calls, scopes in wave]
    waiting_on: list[set[int]] = []
    dependents: list[list[int]] = [[] for _ in groups]
    last_writer: dict[Scope, int] = {}
    for index, (_, _, scopes) in enumerate(groups):
        before = {last_writer[s] for s in scopes if s in last_writer}
        waiting_on.append(before)
        for earlier in before:
            dependents[earlier].append(index)
        for scope in scopes:
            last_writer[scope] = index
    window = len(waves) if lookahead is None else lookahead
    left_in_wave = [len(wave) for wave in waves]
    oldest = 0  # the oldest wave with a group not ended
    fetched = 0  # waves known

    def known(index: int) -> bool:
        return groups[index][0] < fetched

    def path(index: int, memo: dict[int, int]) -> int:
        if index not in memo:
            memo[index] = groups[index][1] + max(
                (path(d, memo) for d in dependents[index] if known(d)), default=0
            )
        return memo[index]

    ready = {i for i, before in enumerate(waiting_on) if not before}
    running: list[tuple[float, int]] = []
    now = 0.0
    free = slots
    while ready or running:
        while True:
            while oldest < len(waves) and left_in_wave[oldest] == 0:
                oldest += 1
            while fetched < len(waves) and fetched - oldest < window:
                lazy = fetch == "lazy" and fetched > oldest
                if lazy and sum(known(i) for i in ready) >= slots:
                    break
                fetched += 1
            candidates = [i for i in ready if known(i)]
            if not free or not candidates:
                break
            if priority == "wave":
                index = min(candidates)
            else:
                memo: dict[int, int] = {}
                index = min(candidates, key=lambda i: (-path(i, memo), i))
            ready.discard(index)
            heapq.heappush(running, (now + groups[index][1] * (latency_s + overhead_s), index))
            free -= 1
        now, done = heapq.heappop(running)
        free += 1
        left_in_wave[groups[done][0]] -= 1
        for later in dependents[done]:
            waiting_on[later].discard(done)
            if not waiting_on[later]:
                ready.add(later)
    return now


def engine_waves(
    items: Sequence[Any], wave_size: int, lookahead: int, batch_size: int
) -> list[list[Any]]:
    """``items`` (``store.WaveMemory``-like, in consolidation order) cut into waves as the
    engine's pipeline cuts them: ``wave_size`` items, then those of the next ``lookahead`` that
    fill the last batches of its groups (``WavePipeline._next_wave``)."""

    def todo(item: Any) -> tuple[Scope, ...]:
        return tuple(s for s in item.scopes if s not in item.journaled)

    waves: list[list[Any]] = []
    rest = list(items)
    while rest:
        wave, ahead = rest[:wave_size], rest[wave_size:]
        if lookahead and ahead:
            joining, behind = fill_last_batches(wave, ahead[:lookahead], batch_size, todo)
            wave += joining
            ahead = behind + ahead[lookahead:]
        waves.append(wave)
        rest = ahead
    return waves
