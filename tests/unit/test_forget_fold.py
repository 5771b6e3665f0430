"""forget.fold: a re-derivation's observations after each answer, DESIGN §3's way. Pure."""

from __future__ import annotations

import uuid

from consolidation.engine.forget import Derived, fold
from consolidation.llm.prompts import CreateAction, MergeAction, PassPlan, UpdateAction

M = [uuid.uuid4() for _ in range(5)]


def plan(
    creates: tuple[CreateAction, ...] = (),
    updates: tuple[UpdateAction, ...] = (),
    merges: tuple[MergeAction, ...] = (),
) -> PassPlan:
    return PassPlan(creates=creates, updates=updates, merges=merges)


def test_creates_are_added_last_with_their_facts() -> None:
    first = fold([], plan(creates=(CreateAction("a", (M[0],)), CreateAction("b", (M[1],)))))
    assert [(d.text, d.memory_ids) for d in first] == [("a", (M[0],)), ("b", (M[1],))]
    assert len({d.id for d in first}) == 2


def test_an_update_replaces_the_text_adds_its_facts_and_moves_it_last() -> None:
    a, b = Derived(uuid.uuid4(), "a", (M[0],)), Derived(uuid.uuid4(), "b", (M[1],))
    after = fold([a, b], plan(updates=(UpdateAction(a.id, "a2", (M[2], M[0])),)))
    assert after == [b, Derived(a.id, "a2", (M[0], M[2]))]


def test_a_merge_keeps_the_first_with_every_source_and_drops_the_others() -> None:
    a, b, c = (Derived(uuid.uuid4(), t, (m,)) for t, m in zip("abc", M, strict=False))
    after = fold([a, b, c], plan(merges=(MergeAction((b.id, a.id), "ab", (M[3],)),)))
    assert after == [c, Derived(b.id, "ab", (M[1], M[0], M[3]))]


def test_updates_merges_and_creates_of_one_answer_apply_together() -> None:
    a, b, c = (Derived(uuid.uuid4(), t, (m,)) for t, m in zip("abc", M, strict=False))
    after = fold(
        [a, b, c],
        plan(
            creates=(CreateAction("d", (M[4],)),),
            updates=(UpdateAction(c.id, "c2", ()),),
            merges=(MergeAction((a.id, b.id), "ab", ()),),
        ),
    )
    assert [d.text for d in after] == ["c2", "ab", "d"]
    assert after[1].memory_ids == (M[0], M[1])
