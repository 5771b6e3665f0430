"""The pass planner: which passes a group makes, in which order, with which members."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from consolidation.engine.plan import (
    GroupPlan,
    Pass,
    fill_last_batches,
    plan_wave,
    planned_passes,
)
from consolidation.scopes import Scope


@dataclass(eq=False)
class Member:
    name: str
    scopes: tuple[Scope, ...]
    applied: set[Scope] = field(default_factory=set)
    failed: bool = False

    def todo(self) -> tuple[Scope, ...]:
        return () if self.failed else tuple(s for s in self.scopes if s not in self.applied)


def todo(member: Member) -> tuple[Scope, ...]:
    return member.todo()


def described(step: Pass[Member] | None) -> tuple[int, Scope, list[str]] | None:
    if step is None:
        return None
    return step.batch, step.scope, [m.name for m in step.members]


def run_all(plan: GroupPlan[Member]) -> list[tuple[int, Scope, list[str]] | None]:
    """Make every pass successfully, checking peek() and peek(2) against next() on the way."""
    made = []
    expected, after = plan.peek(), plan.peek(2)
    while (step := plan.next()) is not None:
        assert described(step) == described(expected)
        for member in step.members:
            member.applied.add(step.scope)
        made.append(described(step))
        expected = plan.peek()
        assert described(expected) == described(after)  # what peek(2) promised one pass ago
        after = plan.peek(2)
    assert expected is None and after is None
    return made


def test_batches_run_in_order_with_one_pass_per_scope_in_sorted_order() -> None:
    a = Member("a", (("x",), ("y",)))
    b = Member("b", (("x",),))
    c = Member("c", (("y",),))
    plan = GroupPlan([a, b, c], batch_size=2, todo=todo)
    assert [[m.name for m in batch] for batch in plan.batches] == [["a", "b"], ["c"]]
    assert run_all(plan) == [
        (0, ("x",), ["a", "b"]),
        (0, ("y",), ["a"]),
        (1, ("y",), ["c"]),
    ]


def test_a_split_retries_the_part_as_two_halves_first_half_first_without_applied_scopes() -> None:
    members = [Member(n, (("s",), ("t",))) for n in "abcd"]
    plan = GroupPlan(members, batch_size=4, todo=todo)
    first = plan.next()
    assert described(first) == (0, ("s",), ["a", "b", "c", "d"])
    for member in members:
        member.applied.add(("s",))
    second = plan.next()
    assert second is not None and second.scope == ("t",)
    plan.split(second)
    # Each half passes only what it still needs: ("s",) was applied before the split.
    assert run_all(plan) == [(0, ("t",), ["a", "b"]), (0, ("t",), ["c", "d"])]


def test_a_member_that_failed_is_left_out_and_a_pass_left_empty_is_skipped() -> None:
    a = Member("a", (("s",), ("t",)))
    b = Member("b", (("s",),))
    plan = GroupPlan([a, b], batch_size=2, todo=todo)
    first = plan.next()
    assert described(first) == (0, ("s",), ["a", "b"])
    a.failed = True  # it failed alone on ("s",): its ("t",) pass must not be made
    b.applied.add(("s",))
    assert plan.peek() is None
    assert plan.next() is None


def test_a_waiting_batch_peeked_at_before_its_todo_shrank_is_made_as_it_stands_now() -> None:
    a = Member("a", (("s",),))
    b = Member("b", (("s",), ("t",)))
    c = Member("c", (("s",), ("t",)))
    plan = GroupPlan([a, b, c], batch_size=1, todo=todo)
    # Looking two passes ahead plans batch 1 while batch 0 is being made.
    assert described(plan.peek(2)) == (1, ("s",), ["b"])
    b.applied.add(("s",))  # its todo shrinks while its batch waits
    c.failed = True
    assert run_all(plan) == [(0, ("s",), ["a"]), (1, ("t",), ["b"])]


def test_planned_passes_count_one_call_per_scope_of_each_batch() -> None:
    group = [Member(f"m{i}", (("x",), ("y",)) if i % 2 else (("x",),)) for i in range(5)]
    passes = list(planned_passes(group, 2, todo))
    assert [(p.batch, p.scope) for p in passes] == [
        (0, ("x",)),
        (0, ("y",)),
        (1, ("x",)),
        (1, ("y",)),
        (2, ("x",)),
    ]


def test_a_wave_is_planned_longest_chain_first_ties_in_order_and_done_items_left_out() -> None:
    short = [Member("s1", (("a",),))]
    long = [Member(f"l{i}", (("b",),)) for i in range(3)]
    tie = [Member("t1", (("c",),))]
    done = Member("done", ())
    wave = [short[0], done, *long, tie[0]]
    groups = plan_wave(wave, 1, todo)
    assert [[m.name for m in g] for g in groups] == [["l0", "l1", "l2"], ["s1"], ["t1"]]


# -- memories read ahead fill the last batches of a wave's groups -------------------------------


def _members(*specs: tuple[str, tuple[Scope, ...]]) -> list[Member]:
    return [Member(name, scopes) for name, scopes in specs]


def _names(members: list[Member]) -> list[str]:
    return [m.name for m in members]


A, B, C = ("a",), ("b",), ("c",)


def test_read_ahead_memories_fill_each_group_up_to_a_whole_batch() -> None:
    wave = _members(("a1", (A,)), ("b1", (B,)))
    ahead = _members(("a2", (A,)), ("b2", (B,)), ("a3", (A,)), ("a4", (A,)), ("c1", (C,)))

    taken, kept = fill_last_batches(wave, ahead, 3, todo)

    assert _names(taken) == ["a2", "b2", "a3"]  # a's batch is full with a1, a2, a3
    assert _names(kept) == ["a4", "c1"]  # c has no group in the wave


def test_a_memory_left_behind_keeps_every_later_one_of_its_scopes_behind_it() -> None:
    # b2 writes a scope of the wave's group b and one it does not have: it stays, and so must
    # b3, or b's memories would reach the model out of order.
    wave = _members(("b1", (B,)))
    ahead = _members(("b2", (B, C)), ("b3", (B,)))

    taken, kept = fill_last_batches(wave, ahead, 8, todo)

    assert taken == [] and _names(kept) == ["b2", "b3"]


def test_a_memory_writing_two_groups_scopes_joins_neither() -> None:
    wave = _members(("a1", (A,)), ("b1", (B,)))
    ahead = _members(("ab", (A, B)), ("a2", (A,)), ("b2", (B,)))

    taken, kept = fill_last_batches(wave, ahead, 4, todo)

    assert taken == [] and _names(kept) == ["ab", "a2", "b2"]


def test_a_full_last_batch_takes_nothing_and_batches_of_one_never_wait() -> None:
    wave = _members(("a1", (A,)), ("a2", (A,)))
    ahead = _members(("a3", (A,)))

    assert fill_last_batches(wave, ahead, 2, todo) == ([], ahead)
    assert fill_last_batches(wave, ahead, 1, todo) == ([], ahead)


def test_memories_with_nothing_to_pass_neither_join_nor_hold_anything_back() -> None:
    done = Member("done", (A,), applied={A})
    wave = _members(("a1", (A,)))
    ahead = [done, *_members(("a2", (A,)))]

    taken, kept = fill_last_batches(wave, ahead, 4, todo)

    assert _names(taken) == ["a2"] and kept == [done]


def test_filling_keeps_every_scopes_memories_in_order() -> None:
    rng = random.Random(11)
    scopes = [A, B, C, ("a", "b"), ("d",)]
    for _ in range(300):
        items = [
            Member(f"m{i}", tuple(sorted(set(rng.sample(scopes, rng.choice((1, 1, 1, 2)))))))
            for i in range(rng.randint(1, 30))
        ]
        cut = rng.randint(1, len(items))
        wave, ahead = items[:cut], items[cut:]

        taken, kept = fill_last_batches(wave, ahead, rng.randint(1, 5), todo)

        assert sorted(_names(taken + kept)) == sorted(_names(ahead))
        assert _names(taken) == [m.name for m in ahead if m in taken]  # order kept
        # Each scope is passed in its memories' order: this wave with what joined it, then
        # the memories left behind.
        consolidated = wave + taken + kept
        for scope in scopes:
            writers = [m.name for m in consolidated if scope in m.scopes]
            assert writers == [m.name for m in items if scope in m.scopes]
