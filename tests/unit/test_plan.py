"""The pass planner: which passes a group makes, in which order, with which members."""

from __future__ import annotations

from dataclasses import dataclass, field

from consolidation.engine.plan import GroupPlan, Pass, plan_wave, planned_passes
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
