"""Write scopes (DESIGN §1), partition into groups, batching."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consolidation.errors import ValidationError
from consolidation.scopes import (
    MAX_COMBINATION_TAGS,
    MAX_TAG_CHARS,
    Scope,
    batched,
    normalize_scope,
    observation_scopes_problems,
    partition,
    write_scopes,
)


def test_normalize_scope_sorts_and_deduplicates() -> None:
    assert normalize_scope(["b", "a", "b"]) == ("a", "b")
    assert normalize_scope([]) == ()


@pytest.mark.parametrize("mode", [None, "combined"])
def test_combined_writes_the_normalized_tag_set(mode: str | None) -> None:
    assert write_scopes(["b", "a", "b"], mode) == (("a", "b"),)


@pytest.mark.parametrize("mode", [None, "combined"])
def test_combined_untagged_writes_the_shared_scope(mode: str | None) -> None:
    assert write_scopes([], mode) == ((),)


def test_per_tag_writes_one_scope_per_distinct_tag() -> None:
    assert write_scopes(["b", "a", "b"], "per_tag") == (("a",), ("b",))


def test_per_tag_untagged_writes_the_shared_scope() -> None:
    assert write_scopes([], "per_tag") == ((),)


def test_all_combinations_writes_every_non_empty_subset() -> None:
    assert write_scopes(["c", "a", "b", "a"], "all_combinations") == (
        ("a",),
        ("a", "b"),
        ("a", "b", "c"),
        ("a", "c"),
        ("b",),
        ("b", "c"),
        ("c",),
    )


def test_all_combinations_at_the_limit_writes_63_scopes() -> None:
    tags = [f"t{i}" for i in range(MAX_COMBINATION_TAGS)]
    assert len(write_scopes(tags, "all_combinations")) == 2**MAX_COMBINATION_TAGS - 1


def test_all_combinations_untagged_writes_the_shared_scope() -> None:
    assert write_scopes([], "all_combinations") == ((),)


def test_all_combinations_counts_distinct_tags_only() -> None:
    tags = [f"t{i}" for i in range(MAX_COMBINATION_TAGS)] * 2
    assert observation_scopes_problems("all_combinations", tags) == []


def test_all_combinations_rejects_more_than_six_tags() -> None:
    tags = [f"t{i}" for i in range(MAX_COMBINATION_TAGS + 1)]
    problems = observation_scopes_problems("all_combinations", tags)
    assert len(problems) == 1
    assert "at most 6" in problems[0]
    with pytest.raises(ValidationError) as raised:
        write_scopes(tags, "all_combinations")
    assert raised.value.problems == problems


def test_shared_writes_only_the_shared_scope() -> None:
    assert write_scopes(["a", "b"], "shared") == ((),)


def test_explicit_list_is_normalized_deduplicated_and_sorted() -> None:
    value = [["b", "a"], ["a", "b", "a"], [], ["z"]]
    assert write_scopes(["ignored"], value) == ((), ("a", "b"), ("z",))


def test_explicit_list_may_name_tags_the_memory_does_not_have() -> None:
    assert write_scopes([], [["x"]]) == (("x",),)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("everything", "is not one of"),
        ("", "is not one of"),
        (3, "not int"),
        (True, "not bool"),
        ({"a": 1}, "not dict"),
        ([], "must not be an empty list"),
        (["a"], "must be a list of tags, not str"),
        ([["a"], None], "observation_scopes[1] must be a list of tags"),
        ([["a", 1]], "observation_scopes[0][1] must be a string"),
        ([[""]], "must not be empty"),
        ([["x" * (MAX_TAG_CHARS + 1)]], f"longer than {MAX_TAG_CHARS}"),
        ([[f"t{i}" for i in range(33)]], "more than 32 distinct tags"),
    ],
)
def test_invalid_observation_scopes_are_rejected_with_a_reason(value: object, reason: str) -> None:
    problems = observation_scopes_problems(value, ["a"])
    assert problems, value
    assert any(reason in problem for problem in problems), problems
    with pytest.raises(ValidationError):
        write_scopes(["a"], value)


def test_every_problem_is_reported() -> None:
    problems = observation_scopes_problems([[""], [1], "a"], [])
    assert len(problems) == 3


@pytest.mark.parametrize(
    "value", [None, "combined", "per_tag", "all_combinations", "shared", [[]], [["a"], ["a", "b"]]]
)
def test_valid_observation_scopes_have_no_problems(value: object) -> None:
    assert observation_scopes_problems(value, ["a", "b"]) == []


def test_tag_of_maximum_length_is_accepted() -> None:
    assert observation_scopes_problems([["x" * MAX_TAG_CHARS]], []) == []


# -- partition ---------------------------------------------------------------------------------

_scope = st.lists(st.sampled_from("abcdefgh"), max_size=3).map(normalize_scope)
_items = st.lists(st.lists(_scope, max_size=3), max_size=40)


def _indexed(scope_lists: list[list[Scope]]) -> list[tuple[int, list[Scope]]]:
    return list(enumerate(scope_lists))


def _scopes_of(item: tuple[int, list[Scope]]) -> list[Scope]:
    return item[1]


@given(_items)
def test_partition_puts_every_item_in_exactly_one_group(scope_lists: list[list[Scope]]) -> None:
    items = _indexed(scope_lists)
    groups = partition(items, _scopes_of)
    flat = [index for group in groups for index, _ in group]
    assert sorted(flat) == list(range(len(items)))
    assert all(groups)


@given(_items)
def test_partition_never_puts_one_scope_in_two_groups(scope_lists: list[list[Scope]]) -> None:
    groups = partition(_indexed(scope_lists), _scopes_of)
    owner: dict[Scope, int] = {}
    for number, group in enumerate(groups):
        for _, scopes in group:
            for scope in scopes:
                assert owner.setdefault(scope, number) == number


@given(_items)
def test_partition_keeps_items_with_overlapping_scopes_together(
    scope_lists: list[list[Scope]],
) -> None:
    groups = partition(_indexed(scope_lists), _scopes_of)
    group_of = {index: number for number, group in enumerate(groups) for index, _ in group}
    for i, left in enumerate(scope_lists):
        for j, right in enumerate(scope_lists):
            if set(left) & set(right):
                assert group_of[i] == group_of[j]


@given(_items)
def test_partition_groups_are_connected_and_no_coarser_than_needed(
    scope_lists: list[list[Scope]],
) -> None:
    # Inside a group, every item is reachable from the first through shared scopes.
    for group in partition(_indexed(scope_lists), _scopes_of):
        reached = {group[0][0]}
        scopes = set(group[0][1])
        grew = True
        while grew:
            grew = False
            for index, item_scopes in group:
                if index not in reached and scopes & set(item_scopes):
                    reached.add(index)
                    scopes |= set(item_scopes)
                    grew = True
        assert reached == {index for index, _ in group}


@given(_items)
def test_partition_orders_groups_by_first_item_and_keeps_input_order(
    scope_lists: list[list[Scope]],
) -> None:
    groups = partition(_indexed(scope_lists), _scopes_of)
    firsts = [group[0][0] for group in groups]
    assert firsts == sorted(firsts)
    for group in groups:
        indexes = [index for index, _ in group]
        assert indexes == sorted(indexes)


@given(_items)
def test_partition_is_deterministic(scope_lists: list[list[Scope]]) -> None:
    items = _indexed(scope_lists)
    assert partition(items, _scopes_of) == partition(list(items), _scopes_of)


def test_partition_of_combined_scopes_groups_by_tag_set() -> None:
    items = [("m1", ("a",)), ("m2", ("b",)), ("m3", ("a",)), ("m4", ())]
    groups = partition(items, lambda item: [item[1]])
    assert [[name for name, _ in group] for group in groups] == [["m1", "m3"], ["m2"], ["m4"]]


def test_partition_joins_groups_transitively() -> None:
    items: list[tuple[str, list[Scope]]] = [
        ("m1", [("a",)]),
        ("m2", [("b",)]),
        ("m3", [("c",)]),
        ("m4", [("a",), ("c",)]),
    ]
    groups = partition(items, lambda item: item[1])
    assert [[name for name, _ in group] for group in groups] == [["m1", "m3", "m4"], ["m2"]]


def test_partition_item_without_scopes_is_alone() -> None:
    assert partition(["x", "y"], lambda _: []) == [["x"], ["y"]]


def test_partition_of_nothing_is_empty() -> None:
    assert partition([], lambda _: [()]) == []


def test_partition_handles_a_long_chain_in_one_group() -> None:
    # A chain forces deep unions; a wave of 10,000 must not recurse or go quadratic.
    n = 10_000
    items = list(range(n))
    groups = partition(items, lambda i: [(f"s{i}",), (f"s{i + 1}",)])
    assert groups == [items]


# -- batched -----------------------------------------------------------------------------------


def test_batched_makes_consecutive_chunks() -> None:
    assert batched([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert batched([1, 2], 5) == [[1, 2]]
    assert batched([], 3) == []


@pytest.mark.parametrize("size", [0, -1])
def test_batched_rejects_sizes_below_one(size: int) -> None:
    with pytest.raises(ValueError):
        batched([1], size)


@given(st.lists(st.integers()), st.integers(min_value=1, max_value=10))
def test_batched_preserves_items_and_bounds_chunk_size(items: list[int], size: int) -> None:
    chunks = batched(items, size)
    assert [item for chunk in chunks for item in chunk] == items
    assert all(1 <= len(chunk) <= size for chunk in chunks)
    assert all(len(chunk) == size for chunk in chunks[:-1])
