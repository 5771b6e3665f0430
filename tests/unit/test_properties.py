"""Property tests (hypothesis) of the pure core, complementing test_scopes, test_prompts and
test_perf: write-scope resolution, grouping of real memories into batches, answer validation
(a valid answer maps exactly; any single violation is rejected) and PerfLog merging.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import fields
from datetime import UTC, datetime
from itertools import combinations
from typing import Any
from uuid import UUID

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from consolidation.errors import InvalidLLMOutput, ValidationError
from consolidation.llm import prompts as prompts_module
from consolidation.llm.prompts import (
    MAX_OBSERVATION_CHARS,
    CreateAction,
    FactInput,
    MergeAction,
    ObservationInput,
    PassRequest,
    UpdateAction,
    build_request,
    is_placeholder,
    parse_answer,
)
from consolidation.memories import parse_memory
from consolidation.perf import PerfLog
from consolidation.scopes import (
    MAX_COMBINATION_TAGS,
    Scope,
    batched,
    normalize_scope,
    partition,
    scope_from_db,
    scopes_from_db,
    write_scopes,
)
from tests.unit.test_perf import perf_logs

# --- write scopes -------------------------------------------------------------------------------

# Valid tags: printable, not blank, no control characters (U+001F is the scope-key separator).
_tag = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs"), max_codepoint=0x2FFF),
    min_size=1,
    max_size=12,
).filter(lambda t: t.strip() != "")
_small_tag = st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h", "é", "x y", "'; --"])
_tags = st.lists(st.one_of(_small_tag, _tag), max_size=9)
_mode = st.one_of(
    st.none(),
    st.sampled_from(["combined", "per_tag", "all_combinations", "shared"]),
    st.lists(st.lists(st.one_of(_small_tag, _tag), max_size=4), min_size=1, max_size=4),
)


@given(_tags, _mode)
def test_write_scopes_are_sorted_unique_normalized_and_never_empty(
    tags: list[str], mode: Any
) -> None:
    try:
        scopes = write_scopes(tags, mode)
    except ValidationError:
        assert mode == "all_combinations" and len(set(tags)) > MAX_COMBINATION_TAGS
        return
    assert scopes, "a memory always writes at least one scope"
    assert list(scopes) == sorted(set(scopes))
    assert all(scope == normalize_scope(scope) for scope in scopes)


@given(_tags, _mode, st.randoms())
def test_write_scopes_depend_only_on_the_set_of_tags(tags: list[str], mode: Any, rnd: Any) -> None:
    shuffled = tags + tags[: len(tags) // 2]
    rnd.shuffle(shuffled)
    try:
        expected = write_scopes(tags, mode)
    except ValidationError:
        with pytest.raises(ValidationError):
            write_scopes(shuffled, mode)
        return
    assert write_scopes(shuffled, mode) == expected


@given(_tags, _mode)
def test_write_scopes_match_the_contract_of_each_mode(tags: list[str], mode: Any) -> None:
    distinct = sorted(set(tags))
    if mode == "all_combinations" and len(distinct) > MAX_COMBINATION_TAGS:
        with pytest.raises(ValidationError):
            write_scopes(tags, mode)
        return
    got = set(write_scopes(tags, mode))
    if mode is None or mode == "combined":
        assert got == {tuple(distinct)}
    elif mode == "shared":
        assert got == {()}
    elif mode == "per_tag":
        one_tag_each: set[Scope] = {(t,) for t in distinct}
        assert got == (one_tag_each or {()})
    elif mode == "all_combinations":
        subsets = {c for n in range(1, len(distinct) + 1) for c in combinations(distinct, n)}
        assert got == (subsets or {()})
        assert len(got) == (2 ** len(distinct) - 1 if distinct else 1)
    else:
        assert got == {normalize_scope(s) for s in mode}


@given(_tags, _mode)
def test_ingestion_resolves_the_same_scopes_and_they_round_trip_through_their_database_form(
    tags: list[str], mode: Any
) -> None:
    try:
        memory = parse_memory({"text": "x", "tags": tags, "observation_scopes": mode})
    except ValidationError:
        with pytest.raises(ValidationError):
            write_scopes(tags, mode)
        return
    assert memory.scopes == write_scopes(tags, mode)
    assert scopes_from_db(orjson.loads(orjson.dumps(memory.scopes))) == memory.scopes
    for scope in memory.scopes:
        assert scope_from_db(list(scope)) == scope


# --- grouping real memories into groups and batches -----------------------------------------


@given(st.lists(st.tuples(st.lists(_small_tag, max_size=4), _mode), max_size=30), st.integers(1, 5))
def test_memories_split_into_groups_and_batches_without_loss_overlap_or_reordering(
    specs: list[tuple[list[str], Any]], batch_size: int
) -> None:
    memories = []
    for index, (tags, mode) in enumerate(specs):
        try:
            memories.append((index, write_scopes(tags, mode)))
        except ValidationError:
            continue
    groups = partition(memories, lambda m: m[1])
    seen: list[int] = []
    scope_owner: dict[Scope, int] = {}
    for number, group in enumerate(groups):
        indexes = [index for index, _ in group]
        assert indexes == sorted(indexes), "order is kept inside a group"
        batches = batched(group, batch_size)
        assert [m for b in batches for m in b] == group, "batches are the group, in order"
        assert all(1 <= len(b) <= batch_size for b in batches)
        for _, scopes in group:
            for scope in scopes:
                assert scope_owner.setdefault(scope, number) == number, "groups share a scope"
        seen += indexes
    assert sorted(seen) == [index for index, _ in memories], "every memory in exactly one group"


# --- answer validation ----------------------------------------------------------------------


def _request(n_facts: int, n_observations: int) -> PassRequest:
    facts = [FactInput(UUID(int=i), f"fact {i}", ("t",), None) for i in range(1, n_facts + 1)]
    observations = [
        ObservationInput(UUID(int=1000 + i), f"obs {i}", i, datetime(2026, 1, 1, tzinfo=UTC))
        for i in range(1, n_observations + 1)
    ]
    return build_request("bank", ("t",), None, facts, observations)


def _placeholder_by_its_definition(text: str) -> bool:
    """is_placeholder without its shortcut: the whole text normalised, then compared."""
    if not any(unicodedata.category(c).startswith(("L", "N", "So")) for c in text):
        return True
    words = " ".join(re.sub(r"[^\w/]|_", " ", text).split())
    return words.lower() in prompts_module._PLACEHOLDERS or bool(
        re.fullmatch(r"[fo]\d+", words, re.IGNORECASE)
    )


_placeholder_parts = st.sampled_from(
    [*sorted(prompts_module._PLACEHOLDERS), "f1", "O22", "f" + "9" * 30, "…", " ", "_", "/"]
)


@given(
    st.lists(st.one_of(_placeholder_parts, st.text(max_size=8)), max_size=6).map("".join)
    | st.lists(_placeholder_parts, max_size=4).map(" - ".join)
)
def test_a_placeholder_is_told_from_its_first_words_as_from_the_whole_text(text: str) -> None:
    assert is_placeholder(text) == _placeholder_by_its_definition(text)


# Texts that say something: not blank, and not a placeholder (those are a violation below).
_text = st.text(min_size=1, max_size=40).filter(
    lambda t: t.strip() != "" and not is_placeholder(t.strip())
)


@st.composite
def valid_answers(draw: st.DrawFn) -> tuple[PassRequest, dict[str, Any]]:
    """A request and a valid answer for it (each observation ref used at most once)."""
    n_facts = draw(st.integers(1, 6))
    n_obs = draw(st.integers(0, 6))
    request = _request(n_facts, n_obs)
    fact_refs = list(request.fact_refs)
    obs_refs = draw(st.permutations(list(request.observation_refs)))
    facts = st.lists(st.sampled_from(fact_refs), max_size=3)
    creates = draw(st.lists(st.fixed_dictionaries({"text": _text, "facts": facts}), max_size=3))
    updates, merges = [], []
    free = list(obs_refs)
    for _ in range(draw(st.integers(0, 3))):
        if len(free) >= 2 and draw(st.booleans()):
            size = draw(st.integers(2, len(free)))
            used, free = free[:size], free[size:]
            merges.append({"observations": used, "text": draw(_text), "facts": draw(facts)})
        elif free:
            ref, free = free[0], free[1:]
            updates.append({"observation": ref, "text": draw(_text), "facts": draw(facts)})
    answer: dict[str, Any] = {"creates": creates, "updates": updates, "merges": merges}
    for key in ("creates", "updates", "merges"):
        if not answer[key] and draw(st.booleans()):
            del answer[key]  # missing keys mean empty lists
    return request, answer


@given(valid_answers())
def test_a_valid_answer_is_accepted_and_maps_every_ref_to_its_id(
    case: tuple[PassRequest, dict[str, Any]],
) -> None:
    request, answer = case
    plan = parse_answer(json.dumps(answer), request)
    ids = {**request.fact_refs, **request.observation_refs}
    assert [c.text for c in plan.creates] == [c["text"].strip() for c in answer.get("creates", [])]
    assert [u.observation_id for u in plan.updates] == [
        ids[u["observation"]] for u in answer.get("updates", [])
    ]
    assert [m.observation_ids for m in plan.merges] == [
        tuple(ids[r] for r in m["observations"]) for m in answer.get("merges", [])
    ]
    actions: list[CreateAction | UpdateAction | MergeAction] = [
        *plan.creates,
        *plan.updates,
        *plan.merges,
    ]
    for action, raw in zip(
        actions,
        [*answer.get("creates", []), *answer.get("updates", []), *answer.get("merges", [])],
        strict=True,
    ):
        assert list(action.memory_ids) == list(dict.fromkeys(ids[r] for r in raw["facts"]))


_VIOLATIONS = [
    "unknown_fact_ref",
    "unknown_observation_ref",
    "observation_used_twice",
    "merge_of_one",
    "merge_listing_one_observation_twice",
    "placeholder_text",
    "blank_text",
    "text_too_long",
    "text_not_string",
    "section_not_list",
    "unknown_top_level_key",
    "unknown_action_key",
    "missing_action_key",
    "fact_ref_not_string",
    "answer_not_object",
    "raw_id_as_ref",
]


def _break(answer: dict[str, Any], request: PassRequest, violation: str, data: Any) -> Any:
    """``answer`` with exactly one contract violation added."""
    obs = list(request.observation_refs)
    facts = list(request.fact_refs)
    creates = answer.setdefault("creates", [])
    updates = answer.setdefault("updates", [])
    merges = answer.setdefault("merges", [])
    actions = [*creates, *updates, *merges]
    bad_ref = data.draw(st.sampled_from(["f0", "f99", "F1", "o1x", "", " f1", "f1 ", "1", "o99"]))
    if violation == "unknown_fact_ref":
        assume(bad_ref not in facts)
        creates.append({"text": "x", "facts": [*facts[:1], bad_ref]})
    elif violation == "unknown_observation_ref":
        assume(bad_ref not in obs)
        updates.append({"observation": bad_ref, "text": "x", "facts": []})
    elif violation == "observation_used_twice":
        used = [u["observation"] for u in updates] + [r for m in merges for r in m["observations"]]
        assume(used)
        updates.append({"observation": data.draw(st.sampled_from(used)), "text": "x", "facts": []})
    elif violation == "merge_of_one":
        taken = {u["observation"] for u in updates} | {r for m in merges for r in m["observations"]}
        free = [r for r in obs if r not in taken]
        merges.append({"observations": free[:1], "text": "x", "facts": []})
    elif violation == "merge_listing_one_observation_twice":
        taken = {u["observation"] for u in updates} | {r for m in merges for r in m["observations"]}
        free = [r for r in obs if r not in taken]
        assume(len(free) >= 2)
        twice = [free[0], free[1], data.draw(st.sampled_from(free[:2]))]
        merges.append({"observations": twice, "text": "Merged.", "facts": []})
    elif violation == "placeholder_text":
        assume(actions)
        placeholder = data.draw(st.sampled_from(["...", "…", "text", "Text.", "<text>", "f1", "-"]))
        data.draw(st.sampled_from(actions))["text"] = placeholder
    elif violation in ("blank_text", "text_too_long", "text_not_string"):
        assume(actions)
        target = data.draw(st.sampled_from(actions))
        target["text"] = {
            "blank_text": data.draw(st.sampled_from(["", " ", "\n\t "])),
            "text_too_long": "y" * (MAX_OBSERVATION_CHARS + 1),
            "text_not_string": data.draw(st.sampled_from([None, 1, ["x"], {"t": "x"}])),
        }[violation]
    elif violation == "section_not_list":
        key = data.draw(st.sampled_from(["creates", "updates", "merges"]))
        answer[key] = data.draw(st.sampled_from([{}, "x", 1, None]))
    elif violation == "unknown_top_level_key":
        answer[data.draw(st.sampled_from(["bank", "scope", "deletes", "Creates"]))] = []
    elif violation in ("unknown_action_key", "missing_action_key", "fact_ref_not_string"):
        assume(actions)
        target = data.draw(st.sampled_from(actions))
        if violation == "unknown_action_key":
            target[data.draw(st.sampled_from(["bank", "scope", "id", "observation_id"]))] = "x"
        elif violation == "missing_action_key":
            del target[data.draw(st.sampled_from(sorted(target)))]
        else:
            target["facts"] = [*target["facts"], data.draw(st.sampled_from([1, None, ["f1"]]))]
    elif violation == "answer_not_object":
        return data.draw(st.sampled_from([[answer], "creates", 1, None]))
    elif violation == "raw_id_as_ref":
        raw = str(data.draw(st.sampled_from([*request.fact_refs.values(), UUID(int=99)])))
        creates.append({"text": "x", "facts": [raw]})
    return answer


@given(valid_answers(), st.sampled_from(_VIOLATIONS), st.data())
def test_an_answer_with_any_single_violation_is_never_accepted(
    case: tuple[PassRequest, dict[str, Any]], violation: str, data: st.DataObject
) -> None:
    request, answer = case
    broken = _break(answer, request, violation, data)
    with pytest.raises(InvalidLLMOutput):
        parse_answer(json.dumps(broken), request)


# --- PerfLog merging ------------------------------------------------------------------------

_INT_FIELDS = [f.name for f in fields(PerfLog) if isinstance(f.default, int)]
_FLOAT_FIELDS = [f.name for f in fields(PerfLog) if isinstance(f.default, float)]


@given(perf_logs(), perf_logs())
def test_perflog_addition_is_commutative(a: PerfLog, b: PerfLog) -> None:
    left, right = a + b, b + a
    for name in _INT_FIELDS:
        assert getattr(left, name) == getattr(right, name)
    for name in _FLOAT_FIELDS:
        assert math.isclose(getattr(left, name), getattr(right, name), rel_tol=1e-9)


@given(st.lists(perf_logs(), max_size=12), st.randoms())
def test_merging_batch_logs_in_any_grouping_and_order_loses_no_count(
    logs: list[PerfLog], rnd: Any
) -> None:
    """Like the engine: per-group totals merged into the operation's, whatever the split."""
    expected = {name: sum(getattr(log, name) for log in logs) for name in _INT_FIELDS}
    shuffled = list(logs)
    rnd.shuffle(shuffled)
    cuts = sorted(rnd.sample(range(len(shuffled) + 1), k=min(3, len(shuffled) + 1)))
    total = PerfLog()
    for start, end in zip([0, *cuts], [*cuts, len(shuffled)], strict=True):
        group = PerfLog()
        for log in shuffled[start:end]:
            group += log
        total += group
    for name in _INT_FIELDS:
        assert getattr(total, name) == expected[name], name
    round_tripped = PerfLog.from_dict(total.to_dict())
    for name in _INT_FIELDS:
        assert getattr(round_tripped, name) == expected[name], name
