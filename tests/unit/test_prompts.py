"""The LLM wire contract: request building and strict answer parsing (DESIGN §3)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID, uuid4

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from consolidation import prompts
from consolidation.errors import InvalidLLMOutput
from consolidation.prompts import (
    MAX_OBSERVATION_CHARS,
    RESPONSE_SCHEMA,
    SYSTEM_PROMPT,
    CreateAction,
    FactInput,
    MergeAction,
    ObservationInput,
    PassRequest,
    UpdateAction,
    build_request,
    parse_answer,
    response_format,
)

F1, F2, F3 = (UUID(int=i) for i in (1, 2, 3))
O1, O2, O3 = (UUID(int=i) for i in (101, 102, 103))


def _request(n_facts: int = 3, n_observations: int = 3) -> PassRequest:
    facts = [FactInput(UUID(int=i), f"fact {i}", ("t",), None) for i in range(1, n_facts + 1)]
    observations = [
        ObservationInput(UUID(int=100 + i), f"obs {i}", i, datetime(2026, 1, 1, tzinfo=UTC))
        for i in range(1, n_observations + 1)
    ]
    return build_request("bank", ("t",), None, facts, observations)


def _parse(answer: object, request: PassRequest | None = None) -> prompts.PassPlan:
    return parse_answer(json.dumps(answer), request or _request())


# -- build_request ------------------------------------------------------------------------------


def test_user_content_is_exactly_the_design_object() -> None:
    m1, m2, obs = uuid4(), uuid4(), uuid4()
    request = build_request(
        "b1",
        ("project-x",),
        "help Alice",
        [
            FactInput(m1, "Alice likes tea", ("project-x",), datetime(2026, 1, 2, 3, 4, 5)),
            FactInput(m2, "Bob likes chess", (), None),
        ],
        [ObservationInput(obs, "Alice drinks tea", 3, datetime(2026, 1, 1, 12, tzinfo=UTC))],
    )
    assert json.loads(request.user_content) == {
        "bank": "b1",
        "scope": ["project-x"],
        "mission": "help Alice",
        "facts": [
            {
                "ref": "f1",
                "text": "Alice likes tea",
                "tags": ["project-x"],
                "occurred_at": "2026-01-02T03:04:05Z",
            },
            {"ref": "f2", "text": "Bob likes chess", "tags": [], "occurred_at": None},
        ],
        "observations": [
            {
                "ref": "o1",
                "text": "Alice drinks tea",
                "sources": 3,
                "updated_at": "2026-01-01T12:00:00Z",
            }
        ],
    }
    assert list(request.fact_refs.items()) == [("f1", m1), ("f2", m2)]
    assert dict(request.observation_refs) == {"o1": obs}


def test_key_order_is_stable() -> None:
    request = _request(1, 1)
    decoded = json.loads(request.user_content)
    assert list(decoded) == ["bank", "scope", "mission", "facts", "observations"]
    assert list(decoded["facts"][0]) == ["ref", "text", "tags", "occurred_at"]
    assert list(decoded["observations"][0]) == ["ref", "text", "sources", "updated_at"]


def test_shared_scope_and_no_mission_serialize_as_empty_list_and_null() -> None:
    decoded = json.loads(build_request("b", (), None, [], []).user_content)
    assert decoded == {"bank": "b", "scope": [], "mission": None, "facts": [], "observations": []}


def test_aware_timestamps_are_converted_to_utc() -> None:
    paris = timezone(timedelta(hours=1))
    fact = FactInput(uuid4(), "x", (), datetime(2026, 1, 2, 4, 4, 5, 999, tzinfo=paris))
    decoded = json.loads(build_request("b", (), None, [fact], []).user_content)
    assert decoded["facts"][0]["occurred_at"] == "2026-01-02T03:04:05Z"


@given(
    st.lists(st.text(max_size=30), max_size=5),
    st.lists(st.text(max_size=30), max_size=5),
    st.text(max_size=20),
)
def test_ids_never_appear_in_user_content(
    fact_texts: list[str], observation_texts: list[str], bank: str
) -> None:
    facts = [FactInput(uuid4(), text, ("tag",), None) for text in fact_texts]
    observations = [
        ObservationInput(uuid4(), text, 1, datetime(2026, 1, 1)) for text in observation_texts
    ]
    request = build_request(bank, ("tag",), None, facts, observations)
    for item in [*facts]:
        assert str(item.memory_id) not in request.user_content
        assert item.memory_id.hex not in request.user_content
    for obs in observations:
        assert str(obs.observation_id) not in request.user_content
        assert obs.observation_id.hex not in request.user_content
    assert json.loads(request.user_content)["facts"] == [
        {"ref": f"f{i}", "text": text, "tags": ["tag"], "occurred_at": None}
        for i, text in enumerate(fact_texts, start=1)
    ]


def test_system_prompt_is_a_constant_naming_the_contract() -> None:
    assert isinstance(SYSTEM_PROMPT, str)
    assert SYSTEM_PROMPT is prompts.SYSTEM_PROMPT
    for word in ("creates", "updates", "merges", "facts", str(MAX_OBSERVATION_CHARS)):
        assert word in SYSTEM_PROMPT
    # Providers cache the system prompt: nothing request-specific may leak into it.
    _request()
    assert prompts.SYSTEM_PROMPT == SYSTEM_PROMPT


# -- response format ---------------------------------------------------------------------------


def test_response_format_json_schema() -> None:
    assert response_format("json_schema") == {
        "type": "json_schema",
        "json_schema": {"name": "consolidation_actions", "schema": RESPONSE_SCHEMA},
    }


def test_response_format_json_object() -> None:
    assert response_format("json_object") == {"type": "json_object"}


def test_response_format_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError):
        response_format("text")


def test_response_schema_forbids_extra_keys_everywhere() -> None:
    assert RESPONSE_SCHEMA["additionalProperties"] is False
    assert set(RESPONSE_SCHEMA["properties"]) == {"creates", "updates", "merges"}
    for section in RESPONSE_SCHEMA["properties"].values():
        item = section["items"]
        assert item["additionalProperties"] is False
        assert set(item["required"]) == set(item["properties"])


def test_response_format_cannot_be_used_to_mutate_the_schema() -> None:
    response_format("json_schema")["json_schema"]["schema"]["properties"].clear()
    assert set(RESPONSE_SCHEMA["properties"]) == {"creates", "updates", "merges"}


# -- parse_answer: valid ------------------------------------------------------------------------


def test_valid_answer_maps_refs_back_to_ids() -> None:
    plan = _parse(
        {
            "creates": [{"text": "new", "facts": ["f1"]}],
            "updates": [{"observation": "o3", "text": "upd", "facts": ["f2", "f3"]}],
            "merges": [{"observations": ["o2", "o1"], "text": "merged", "facts": []}],
        }
    )
    assert plan.creates == (CreateAction("new", (F1,)),)
    assert plan.updates == (UpdateAction(O3, "upd", (F2, F3)),)
    assert plan.merges == (MergeAction((O2, O1), "merged", ()),)
    assert plan.citations() == {F1: 1, F2: 1, F3: 1}


@pytest.mark.parametrize("answer", [{}, {"creates": []}, {"updates": [], "merges": []}])
def test_missing_keys_mean_empty_lists(answer: dict[str, Any]) -> None:
    plan = _parse(answer)
    assert (plan.creates, plan.updates, plan.merges) == ((), (), ())
    assert plan.citations() == {}


def test_fact_cited_twice_in_one_action_counts_once() -> None:
    plan = _parse({"creates": [{"text": "x", "facts": ["f1", "f1", "f2"]}]})
    assert plan.creates[0].memory_ids == (F1, F2)
    assert plan.citations() == {F1: 1, F2: 1}


def test_citations_count_actions_across_sections() -> None:
    plan = _parse(
        {
            "creates": [{"text": "a", "facts": ["f1"]}, {"text": "b", "facts": ["f1", "f2"]}],
            "updates": [{"observation": "o1", "text": "c", "facts": ["f1"]}],
        }
    )
    assert plan.citations() == {F1: 3, F2: 1}


def test_text_is_stripped_and_may_be_exactly_the_limit() -> None:
    text = "x" * MAX_OBSERVATION_CHARS
    plan = _parse({"creates": [{"text": f"  {text}\n", "facts": []}]})
    assert plan.creates[0].text == text


@pytest.mark.parametrize(
    "wrap",
    [
        "```json\n{}\n```",
        "```\n{}\n```",
        "  ```JSON\n{}\n```  \n",
        "```json {} ```",
        "\n{}\n",
    ],
)
def test_markdown_fence_and_whitespace_are_tolerated(wrap: str) -> None:
    body = json.dumps({"creates": [{"text": "x", "facts": ["f1"]}]})
    plan = parse_answer(wrap.replace("{}", body), _request())
    assert plan.creates == (CreateAction("x", (F1,)),)


def test_bytes_are_accepted() -> None:
    plan = parse_answer(orjson.dumps({"creates": [{"text": "é", "facts": []}]}), _request())
    assert plan.creates[0].text == "é"


# -- parse_answer: invalid ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "not valid JSON"),
        ('{"creates": [', "not valid JSON"),
        ("Sure! Here it is: {}", "not valid JSON"),
        ("```json\n{}\n``` hope this helps", "not valid JSON"),
        ("{} {}", "not valid JSON"),
        (b"\xff\xfe", "UTF-8"),
        ("[]", "must be a JSON object, got array"),
        ('"text"', "must be a JSON object, got string"),
        ("null", "must be a JSON object, got null"),
    ],
)
def test_non_object_answers_are_rejected(content: str | bytes, reason: str) -> None:
    with pytest.raises(InvalidLLMOutput, match=reason):
        parse_answer(content, _request())


_LONG = "x" * (MAX_OBSERVATION_CHARS + 1)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"creates": [], "notes": "hi"}, "unknown top-level keys \\['notes'\\]"),
        ({"creates": None}, "creates must be an array, got null"),
        ({"updates": {}}, "updates must be an array, got object"),
        ({"creates": ["x"]}, "creates\\[0\\] must be an object, got string"),
        ({"creates": [{"text": "x"}]}, "missing keys \\['facts'\\]"),
        ({"creates": [{"text": "x", "facts": [], "why": 1}]}, "unknown keys \\['why'\\]"),
        ({"creates": [{"text": 3, "facts": []}]}, "text must be a string, got number"),
        ({"creates": [{"text": "x", "facts": "f1"}]}, "facts must be an array, got string"),
        ({"creates": [{"text": "x", "facts": [1]}]}, "facts\\[0\\] must be a string"),
        ({"creates": [{"text": "x", "facts": ["f9"]}]}, "unknown fact ref 'f9'"),
        ({"creates": [{"text": "x", "facts": ["o1"]}]}, "unknown fact ref 'o1'"),
        ({"creates": [{"text": "  \n", "facts": []}]}, "text is empty"),
        ({"creates": [{"text": _LONG, "facts": []}]}, "more than 4000"),
        (
            {"updates": [{"observation": "o9", "text": "x", "facts": []}]},
            "unknown observation ref 'o9'",
        ),
        (
            {"updates": [{"observation": "f1", "text": "x", "facts": []}]},
            "unknown observation ref 'f1'",
        ),
        (
            {"updates": [{"observation": ["o1"], "text": "x", "facts": []}]},
            "observation must be a string, got array",
        ),
        (
            {
                "updates": [
                    {"observation": "o1", "text": "x", "facts": []},
                    {"observation": "o1", "text": "y", "facts": []},
                ]
            },
            "'o1' is already used by updates\\[0\\]",
        ),
        (
            {
                "updates": [{"observation": "o2", "text": "x", "facts": []}],
                "merges": [{"observations": ["o1", "o2"], "text": "y", "facts": []}],
            },
            "'o2' is already used by updates\\[0\\]",
        ),
        (
            {
                "merges": [
                    {"observations": ["o1", "o2"], "text": "y", "facts": []},
                    {"observations": ["o3", "o1"], "text": "z", "facts": []},
                ],
            },
            "'o1' is already used by merges\\[0\\]",
        ),
        (
            {"merges": [{"observations": ["o1", "o1"], "text": "y", "facts": []}]},
            "'o1' is already used by merges\\[0\\].observations\\[0\\]",
        ),
        (
            {"merges": [{"observations": ["o1"], "text": "y", "facts": []}]},
            "a merge needs at least two",
        ),
        ({"merges": [{"observations": [], "text": "y", "facts": []}]}, "at least two"),
        (
            {"merges": [{"observations": "o1,o2", "text": "y", "facts": []}]},
            "observations must be an array, got string",
        ),
        ({"merges": [{"observations": ["o1", "o2"], "text": "", "facts": []}]}, "text is empty"),
    ],
)
def test_invalid_answers_are_rejected_with_the_reason(answer: object, reason: str) -> None:
    with pytest.raises(InvalidLLMOutput, match=reason):
        _parse(answer)


def test_every_problem_is_named_in_one_error() -> None:
    with pytest.raises(InvalidLLMOutput) as raised:
        _parse({"creates": [{"text": "", "facts": ["f9"]}], "extra": 1})
    message = str(raised.value)
    assert "extra" in message and "text is empty" in message and "'f9'" in message


def test_refs_of_another_request_are_unknown() -> None:
    small = _request(n_facts=1, n_observations=1)
    with pytest.raises(InvalidLLMOutput, match="unknown fact ref 'f2'"):
        _parse({"creates": [{"text": "x", "facts": ["f2"]}]}, small)


# -- parse_answer: robustness -------------------------------------------------------------------

_refs = st.sampled_from(["f1", "f2", "f3", "f4", "o1", "o2", "o3", "o4", "", "F1", "f01"])
_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=5), _refs, st.just("x" * 4001)
)
_json = st.recursive(
    _json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "creates",
                    "updates",
                    "merges",
                    "text",
                    "facts",
                    "observation",
                    "observations",
                    "extra",
                ]
            ),
            children,
            max_size=4,
        ),
    ),
    max_leaves=25,
)
_action_like = st.fixed_dictionaries(
    {"text": st.one_of(st.text(max_size=8), _json_leaf), "facts": st.lists(_refs, max_size=3)},
    optional={"observation": _refs, "observations": st.lists(_refs, max_size=3), "extra": _json},
)
_answer_like = st.fixed_dictionaries(
    {},
    optional={
        "creates": st.lists(_action_like, max_size=3),
        "updates": st.lists(_action_like, max_size=3),
        "merges": st.lists(_action_like, max_size=3),
    },
)


def _check_plan_or_rejection(content: str | bytes, request: PassRequest) -> None:
    try:
        plan = parse_answer(content, request)
    except InvalidLLMOutput:
        return
    known_facts = set(request.fact_refs.values())
    known_observations = set(request.observation_refs.values())
    used: list[UUID] = []
    actions: list[CreateAction | UpdateAction | MergeAction] = [
        *plan.creates,
        *plan.updates,
        *plan.merges,
    ]
    for action in actions:
        assert set(action.memory_ids) <= known_facts
        assert len(set(action.memory_ids)) == len(action.memory_ids)
        assert action.text.strip() and len(action.text) <= MAX_OBSERVATION_CHARS
    for update in plan.updates:
        used.append(update.observation_id)
    for merge in plan.merges:
        assert len(merge.observation_ids) >= 2
        used.extend(merge.observation_ids)
    assert set(used) <= known_observations
    assert len(used) == len(set(used))


@given(st.one_of(_json, _answer_like))
def test_random_answers_are_rejected_or_yield_only_known_ids(answer: object) -> None:
    _check_plan_or_rejection(json.dumps(answer), _request())


@given(st.binary(max_size=64) | st.text(max_size=64))
def test_random_bytes_are_rejected_or_yield_only_known_ids(content: str | bytes) -> None:
    _check_plan_or_rejection(content, _request())


@given(st.data())
def test_mutated_valid_answers_are_rejected_or_yield_only_known_ids(data: st.DataObject) -> None:
    valid = json.dumps(
        {
            "creates": [{"text": "new", "facts": ["f1"]}],
            "updates": [{"observation": "o3", "text": "upd", "facts": ["f2", "f3"]}],
            "merges": [{"observations": ["o2", "o1"], "text": "merged", "facts": []}],
        }
    )
    position = data.draw(st.integers(min_value=0, max_value=len(valid)))
    cut = data.draw(st.integers(min_value=0, max_value=4))
    insert = data.draw(st.sampled_from(["", "1", "o", "f", '"', ",", "]", "}", "2", "o1", "[]"]))
    mutated = valid[:position] + insert + valid[position + cut :]
    _check_plan_or_rejection(mutated, _request())
