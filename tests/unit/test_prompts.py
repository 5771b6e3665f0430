"""The LLM wire contract: request building and strict answer parsing (DESIGN §3)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID, uuid4

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from consolidation.errors import InvalidLLMOutput
from consolidation.llm import prompts
from consolidation.llm.prompts import (
    MAX_OBSERVATION_CHARS,
    SYSTEM_PROMPT,
    CreateAction,
    FactInput,
    MergeAction,
    ObservationInput,
    PassPlan,
    PassRequest,
    UpdateAction,
    build_request,
    parse_answer,
    pass_chat,
    repair_chat,
    response_format,
    response_schema,
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


def test_the_system_prompt_has_nothing_a_model_could_copy_as_its_answer() -> None:
    # A real model copied the old example answer ("text": "...", refs f1 and o1) 144 times
    # out of 144: the format is described in words, with no JSON, ref or filler to copy.
    assert "{" not in SYSTEM_PROMPT and "[" not in SYSTEM_PROMPT
    assert "..." not in SYSTEM_PROMPT and "…" not in SYSTEM_PROMPT
    assert re.search(r"\b[fo]\d+\b", SYSTEM_PROMPT) is None


def test_system_prompt_is_a_constant_naming_the_contract() -> None:
    assert isinstance(SYSTEM_PROMPT, str)
    assert SYSTEM_PROMPT is prompts.SYSTEM_PROMPT
    for word in ("creates", "updates", "merges", "facts", str(MAX_OBSERVATION_CHARS)):
        assert word in SYSTEM_PROMPT
    # Providers cache the system prompt: nothing request-specific may leak into it.
    _request()
    assert prompts.SYSTEM_PROMPT == SYSTEM_PROMPT


# -- response format and schema -----------------------------------------------------------------

# The keywords OpenAI strict structured outputs, vLLM and llama.cpp's grammar compiler all accept.
_PORTABLE_KEYWORDS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "description",
}


def _keywords(schema: object) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            if key == "properties":
                for sub in value.values():
                    found |= _keywords(sub)
            elif key == "items":
                found |= _keywords(value)
    return found


def test_the_schema_pins_the_refs_of_the_pass() -> None:
    schema = response_schema(_request(n_facts=2, n_observations=3))
    creates = schema["properties"]["creates"]["items"]["properties"]
    updates = schema["properties"]["updates"]["items"]["properties"]
    merges = schema["properties"]["merges"]["items"]["properties"]
    for action in (creates, updates, merges):
        assert action["facts"]["items"]["enum"] == ["f1", "f2"]
    assert updates["observation"]["enum"] == ["o1", "o2", "o3"]
    assert merges["observations"]["items"]["enum"] == ["o1", "o2", "o3"]


def test_without_observations_the_schema_allows_only_creates_and_has_no_empty_enum() -> None:
    schema = response_schema(_request(n_facts=1, n_observations=0))
    assert list(schema["properties"]) == ["creates"]
    assert schema["required"] == ["creates"]
    assert '"enum": []' not in json.dumps(schema)


@pytest.mark.parametrize(("facts", "observations"), [(1, 0), (3, 2), (8, 20)])
def test_the_schema_uses_only_portable_keywords_and_is_strict_everywhere(
    facts: int, observations: int
) -> None:
    schema = response_schema(_request(facts, observations))
    assert _keywords(schema) <= _PORTABLE_KEYWORDS
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == set(schema["properties"])
    for section in schema["properties"].values():
        item = section["items"]
        assert item["additionalProperties"] is False
        assert set(item["required"]) == set(item["properties"])


def test_response_format_forms() -> None:
    schema = response_schema(_request())
    assert response_format("json_schema", schema) == {
        "type": "json_schema",
        "json_schema": {"name": "consolidation_actions", "strict": True, "schema": schema},
    }
    assert response_format("json_object+schema", schema) == {
        "type": "json_object",
        "schema": schema,
    }
    assert response_format("json_object", schema) == {"type": "json_object"}
    assert prompts.RESPONSE_FORMATS == ("json_schema", "json_object+schema", "json_object")


def test_response_format_rejects_unknown_forms() -> None:
    with pytest.raises(ValueError):
        response_format("text", {})


# -- chats and repairs ---------------------------------------------------------------------------


def test_a_pass_chat_is_the_system_prompt_the_design_object_and_a_bounded_answer() -> None:
    request = _request(n_facts=3)
    chat = pass_chat(request)
    assert chat.messages() == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": request.user_content},
    ]
    assert chat.max_tokens == prompts.MAX_TOKENS_BASE + 3 * prompts.MAX_TOKENS_PER_FACT
    assert not chat.repair
    assert chat.schema == response_schema(request)


def test_system_role_user_puts_the_instructions_first_and_the_design_object_last() -> None:
    request = _request()
    (message,) = pass_chat(request).messages("user")
    assert message["role"] == "user"
    assert message["content"].startswith(SYSTEM_PROMPT)
    assert message["content"].endswith("\n" + request.user_content)
    assert prompts.find_request_object(message["content"]) == json.loads(request.user_content)


def test_the_design_object_is_found_alone_or_after_instructions_only() -> None:
    obj = {"bank": "b", "facts": []}
    text = json.dumps(obj)
    assert prompts.find_request_object(text) == obj
    assert prompts.find_request_object(f"Do this.\nAnd that.\n\n{text}\n") == obj
    assert prompts.find_request_object(f"{text}\nDo this.") is None
    assert prompts.find_request_object("no object here") is None
    assert prompts.find_request_object("[1, 2]") is None


def test_a_repair_sends_the_answer_back_with_its_problems() -> None:
    chat = pass_chat(_request())
    answer = '{"creates": [{"text": "...", "facts": ["f1"]}]}'
    with pytest.raises(InvalidLLMOutput) as raised:
        parse_answer(answer, _request())
    repaired = repair_chat(chat, raised.value)
    assert repaired.repair and repaired.max_tokens == chat.max_tokens
    system, user, assistant, note = repaired.messages()
    assert (system, user) == tuple(chat.messages())
    assert assistant == {"role": "assistant", "content": answer}
    assert note["role"] == "user"
    assert "creates[0].text '...' is a placeholder" in note["content"]
    assert "corrected JSON object" in note["content"]
    # A second repair replaces the first rather than growing the conversation.
    assert len(repair_chat(repaired, raised.value).messages()) == 4


def test_a_repair_of_a_cut_answer_asks_for_twice_the_tokens() -> None:
    chat = pass_chat(_request())
    cut = InvalidLLMOutput("cut", answer='{"creates": [', problems=["cut off"], truncated=True)
    assert repair_chat(chat, cut).max_tokens == 2 * chat.max_tokens


@pytest.mark.parametrize(
    "error",
    [
        InvalidLLMOutput("LLM answer has empty content"),
        InvalidLLMOutput("rejected with 400", answer="  "),
    ],
)
def test_without_an_answer_to_show_the_retry_is_the_same_request(error: InvalidLLMOutput) -> None:
    chat = pass_chat(_request())
    assert repair_chat(chat, error) is chat


def test_a_huge_unusable_answer_is_echoed_only_in_part() -> None:
    chat = pass_chat(_request())
    huge = "x" * (prompts.MAX_REPAIR_ECHO_CHARS + 5000)
    with pytest.raises(InvalidLLMOutput) as raised:
        parse_answer(huge, _request())
    repaired = repair_chat(chat, raised.value)
    echoed = repaired.turns[0][1]
    assert len(echoed) < prompts.MAX_REPAIR_ECHO_CHARS + 100
    assert echoed.endswith("[5000 more characters]")


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
    assert citations(plan) == {F1: 1, F2: 1, F3: 1}


@pytest.mark.parametrize("answer", [{}, {"creates": []}, {"updates": [], "merges": []}])
def test_missing_keys_mean_empty_lists(answer: dict[str, Any]) -> None:
    plan = _parse(answer)
    assert (plan.creates, plan.updates, plan.merges) == ((), (), ())
    assert citations(plan) == {}


def test_fact_cited_twice_in_one_action_counts_once() -> None:
    plan = _parse({"creates": [{"text": "x", "facts": ["f1", "f1", "f2"]}]})
    assert plan.creates[0].memory_ids == (F1, F2)
    assert citations(plan) == {F1: 1, F2: 1}


def test_citations_count_actions_across_sections() -> None:
    plan = _parse(
        {
            "creates": [{"text": "a", "facts": ["f1"]}, {"text": "b", "facts": ["f1", "f2"]}],
            "updates": [{"observation": "o1", "text": "c", "facts": ["f1"]}],
        }
    )
    assert citations(plan) == {F1: 3, F2: 1}


def test_a_facts_action_is_the_one_action_citing_it_or_multiple_or_skipped() -> None:
    plan = _parse(
        {
            "creates": [{"text": "a", "facts": ["f1"]}],
            "updates": [{"observation": "o1", "text": "c", "facts": ["f1", "f2"]}],
        }
    )
    assert (plan.action_of(F1), plan.action_of(F2), plan.action_of(F3)) == (
        "multiple",
        "updated",
        "skipped",
    )


def citations(plan: PassPlan) -> dict[UUID, int]:
    """How many actions cite each memory (memories cited by none are absent)."""
    counts: dict[UUID, int] = {}
    actions: list[CreateAction | UpdateAction | MergeAction] = [
        *plan.creates,
        *plan.updates,
        *plan.merges,
    ]
    for action in actions:
        for memory_id in action.memory_ids:
            counts[memory_id] = counts.get(memory_id, 0) + 1
    return counts


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
            "merges\\[0\\].observations lists 'o1' twice",
        ),
        (
            {"merges": [{"observations": ["o1", "o2", "o1"], "text": "y", "facts": []}]},
            "merges\\[0\\].observations lists 'o1' twice",
        ),
        ({"creates": [{"text": "...", "facts": ["f1"]}]}, "'...' is a placeholder"),
        ({"creates": [{"text": "…", "facts": ["f1"]}]}, "'…' is a placeholder"),
        ({"creates": [{"text": "text", "facts": ["f1"]}]}, "'text' is a placeholder"),
        ({"creates": [{"text": "<Observation text>", "facts": []}]}, "is a placeholder"),
        ({"creates": [{"text": " — !? ", "facts": ["f1"]}]}, "'— !\\?' is a placeholder"),
        ({"creates": [{"text": "f1", "facts": ["f1"]}]}, "'f1' is a placeholder"),
        (
            {"updates": [{"observation": "o1", "text": "TODO", "facts": []}]},
            "updates\\[0\\].text 'TODO' is a placeholder",
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


@pytest.mark.parametrize("text", ["42", "🙂", "x", "Text messages annoy Alice.", "N/A means none"])
def test_short_texts_that_still_say_something_are_accepted(text: str) -> None:
    assert _parse({"creates": [{"text": text, "facts": ["f1"]}]}).creates[0].text == text


def test_a_placeholder_looking_text_that_repeats_the_input_is_accepted() -> None:
    facts = [FactInput(F1, "...", ("t",), None), FactInput(F2, "TODO", ("t",), None)]
    request = build_request("bank", ("t",), None, facts, [])
    plan = _parse(
        {"creates": [{"text": "...", "facts": ["f1"]}, {"text": "TODO", "facts": ["f2"]}]}, request
    )
    assert [c.text for c in plan.creates] == ["...", "TODO"]


def test_an_invalid_answer_carries_the_answer_and_its_problems() -> None:
    content = json.dumps({"creates": [{"text": "...", "facts": ["f9"]}]})
    with pytest.raises(InvalidLLMOutput) as raised:
        parse_answer(content, _request())
    assert raised.value.answer == content
    assert len(raised.value.problems) == 2
    assert not raised.value.truncated
    with pytest.raises(InvalidLLMOutput) as raised:
        parse_answer("not json", _request())
    assert raised.value.answer == "not json"
    assert raised.value.problems and "not valid JSON" in raised.value.problems[0]


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
