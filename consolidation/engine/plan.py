"""Which passes a wave makes, in which order, with which members (DESIGN §1–2). Pure.

A wave's memories that still have scopes to pass are partitioned into groups whose scopes
overlap (:func:`scopes.partition`); groups run longest chain first. A group is cut into batches
of consecutive members; a batch makes one pass per scope its members still write, in sorted
scope order, each about the members that write that scope. When a pass's answer is unusable, the
batch (or the piece of it being retried) is split in halves that go to the front, and each half
plans its passes again from what its members still need — so a memory that failed alone, or a
scope already applied, is never asked for again.

The engine runs these plans; ``bench/perf/plan.py`` counts the same plans to compute ideal times.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from consolidation.scopes import Scope, batched, partition

T = TypeVar("T")

# What a member still has to pass: the engine's live answer (it shrinks as passes are applied
# and becomes empty when the member fails).
Todo = Callable[[T], Collection[Scope]]


@dataclass(frozen=True)
class Pass(Generic[T]):
    """One LLM call: ``scope`` for ``members``, made by batch ``batch`` of its group.

    ``part`` is the batch, or the half of it being retried after a split: what splits next.
    """

    batch: int
    scope: Scope
    members: tuple[T, ...]
    part: tuple[T, ...]


def part_passes(batch: int, part: Sequence[T], todo: Todo[T]) -> list[Pass[T]]:
    """The passes ``part`` makes, in order: one per scope its members still need, sorted."""
    needs = [(member, todo(member)) for member in part]
    scopes = sorted({scope for _, wants in needs for scope in wants})
    members = tuple(part)
    return [
        Pass(batch, scope, tuple(m for m, wants in needs if scope in wants), members)
        for scope in scopes
    ]


class _Part(Generic[T]):
    """A batch, or half of one, waiting its turn, with its passes once first asked for (the
    engine peeks at the next passes several times a pass). A todo only shrinks, so the passes
    planned then, less what :meth:`GroupPlan._current` leaves out, are the ones planned now."""

    __slots__ = ("_passes", "batch", "part")

    def __init__(self, batch: int, part: Sequence[T]) -> None:
        self.batch = batch
        self.part = part
        self._passes: list[Pass[T]] | None = None

    def passes(self, todo: Todo[T]) -> list[Pass[T]]:
        if self._passes is None:
            self._passes = part_passes(self.batch, self.part, todo)
        return self._passes


class GroupPlan(Generic[T]):
    """The passes of one group, strictly in order (batch k+1 recalls what batch k wrote)."""

    def __init__(self, group: Sequence[T], batch_size: int, todo: Todo[T]) -> None:
        self.batches: list[list[T]] = batched(group, batch_size)
        self._todo = todo
        self._queue: deque[_Part[T]] = deque(_Part(i, b) for i, b in enumerate(self.batches))
        self._passes: deque[Pass[T]] = deque()

    def next(self) -> Pass[T] | None:
        """The next pass to make, or None when the group is done. Members that no longer need
        the pass's scope (they failed meanwhile) are left out; a pass left with none is skipped."""
        while True:
            if not self._passes:
                if not self._queue:
                    return None
                self._passes.extend(self._queue.popleft().passes(self._todo))
                continue
            planned = self._passes.popleft()
            current = self._current(planned)
            if current is not None:
                return current

    def peek(self, ahead: int = 1) -> Pass[T] | None:
        """The pass :meth:`next` will return if the one being made now succeeds (``ahead=2``:
        the one after it, if that succeeds too)."""
        for upcoming in self._upcoming():
            ahead -= 1
            if ahead == 0:
                return upcoming
        return None

    def _upcoming(self) -> Iterator[Pass[T]]:
        for planned in self._passes:
            current = self._current(planned)
            if current is not None:
                yield current
        for queued in self._queue:
            for planned in queued.passes(self._todo):
                current = self._current(planned)
                if current is not None:
                    yield current

    def split(self, failed: Pass[T]) -> None:
        """An unusable answer for a pass of several members: forget the rest of its part's
        passes and retry the part as two halves, the first half first."""
        self._passes.clear()
        part = list(failed.part)
        half = (len(part) + 1) // 2
        self._queue.extendleft([_Part(failed.batch, part[half:]), _Part(failed.batch, part[:half])])

    def _current(self, planned: Pass[T]) -> Pass[T] | None:
        members = tuple(m for m in planned.members if planned.scope in self._todo(m))
        if not members:
            return None
        return (
            planned if len(members) == len(planned.members) else replace(planned, members=members)
        )


def planned_passes(group: Sequence[T], batch_size: int, todo: Todo[T]) -> Iterator[Pass[T]]:
    """The passes of ``group`` when every answer is usable (``todo`` taken as fixed)."""
    for batch, members in enumerate(batched(group, batch_size)):
        yield from part_passes(batch, members, todo)


def plan_wave(items: Sequence[T], batch_size: int, todo: Todo[T]) -> list[list[T]]:
    """The groups of a wave, in the order they take a slot: longest chain of passes first.

    A long group started last would finish alone after all the others, leaving the other slots
    idle until the wave's end (LPT). Ties keep the groups' own order, so the plan depends only on
    the input. Items with nothing to pass belong to no group.
    """
    groups = partition([item for item in items if todo(item)], todo)
    calls = [sum(1 for _ in planned_passes(group, batch_size, todo)) for group in groups]
    order = sorted(range(len(groups)), key=lambda i: -calls[i])
    return [groups[i] for i in order]


def fill_last_batches(
    wave: Sequence[T], ahead: Sequence[T], batch_size: int, todo: Todo[T]
) -> tuple[list[T], list[T]]:
    """The items of ``ahead`` that join ``wave`` to fill its groups' last batches, and the
    others; both in order.

    With many small groups a wave holds one or two memories of most groups, and each of their
    batches pays for the whole instructions. An item joins the group whose scopes it writes when
    all of them are that group's, the group's last batch has room, and no item before it in
    ``ahead`` writing one of the group's scopes stayed behind — so each scope's items are still
    passed in order, and an item that stays behind never waits on one that joined after it.
    """
    if batch_size <= 1:
        return [], list(ahead)
    owner: dict[Scope, int] = {}
    room: list[int] = []
    for index, group in enumerate(partition([item for item in wave if todo(item)], todo)):
        for member in group:
            for scope in todo(member):
                owner[scope] = index
        room.append(-len(group) % batch_size)
    closed: set[int] = set()
    taken: list[T] = []
    kept: list[T] = []
    for item in ahead:
        groups = {owner.get(scope, -1) for scope in todo(item)}
        if len(groups) == 1:
            (index,) = groups
            if index >= 0 and index not in closed and room[index] > 0:
                taken.append(item)
                room[index] -= 1
                continue
        # It stays behind: from now on nothing that writes its groups' scopes may pass it.
        closed.update(groups)
        kept.append(item)
    return taken, kept
