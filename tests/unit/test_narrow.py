"""Contract v2's pure parts: candidates, the pinned decide schema, assembly, guards, the join."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import httpx
import orjson
import pytest
import structlog.testing

from consolidation.errors import InvalidLLMOutput
from consolidation.llm import ask_v2, narrow
from consolidation.llm.prompts import (
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    build_request,
)
from consolidation.llm.prompts_v2 import (
    CHANGE_CONFIRM_PROMPT,
    CONFIRM_PROMPT,
    Decision,
    Question,
    Shown,
    confirm_chat,
    decide_chat,
    parse_confirm,
    parse_decisions,
    parse_rewrite,
    rewrite_chat,
)
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer
from tests.support.engine import http_llm

OPTIONS = narrow.NarrowOptions()


def inputs(facts: list[str], observations: list[str] = ()) -> narrow.PassInputs:  # type: ignore[assignment]
    when = datetime(2026, 1, 1, tzinfo=UTC)
    request = build_request(
        "b",
        ("alice",),
        None,
        [
            FactInput(uuid.uuid4(), text, ("alice",), when.replace(month=i + 1))
            for i, text in enumerate(facts)
        ],
        [ObservationInput(uuid.uuid4(), text, 1, when) for text in observations],
    )
    return narrow.pass_inputs(request)


def test_the_decide_schema_pins_each_fact_to_new_or_its_own_candidates() -> None:
    questions = [
        Question(Shown("f2", "Anna moved to Munich."), (Shown("o1", "Anna lives in Berlin."),)),
        Question(Shown("f3", "Bob plays cello."), (Shown("f1", "Bob plays the cello."),)),
    ]
    chat = decide_chat("b", ("x",), None, questions)
    properties = chat.schema["properties"]
    assert properties["f2"]["enum"] == ["new", "same:o1", "update:o1"]
    assert properties["f3"]["enum"] == ["new", "same:f1", "update:f1"]
    assert chat.schema["required"] == ["f2", "f3"]
    assert chat.schema["additionalProperties"] is False
    user = orjson.loads(chat.user)
    assert (user["contract"], user["task"]) == ("v2", "decide")
    assert [c["ref"] for c in user["facts"][0]["candidates"]] == ["o1"]


def test_decide_and_confirm_requests_show_no_dates_and_rewrites_do() -> None:
    fact = Shown("f2", "Anna moved to Munich.", "2026-03-01T09:00:00Z")
    observation = Shown("o1", "Anna lives in Berlin.", "2026-01-01T09:00:00Z")
    decide = decide_chat("b", ("x",), None, [Question(fact, (observation,))])
    confirm = confirm_chat("b", ("x",), None, fact, observation)
    rewrite = rewrite_chat("b", ("x",), None, observation, [fact])
    assert "2026" not in decide.user
    assert "2026" not in confirm.user
    shown = orjson.loads(rewrite.user)
    assert shown["facts"][0]["occurred_at"] == "2026-03-01"  # the date, not the time of day
    assert shown["observation"]["updated_at"] == "2026-01-01"


def test_an_answer_outside_a_facts_choices_is_unusable() -> None:
    question = Question(Shown("f2", "Anna moved."), (Shown("o1", "Anna lives in Berlin."),))
    assert parse_decisions('{"f2": "update:o1"}', [question]) == {"f2": Decision("update", "o1")}
    for answer in ('{"f2": "update:o2"}', '{"f2": "same:f1"}', "{}", "not json", '["new"]'):
        with pytest.raises(InvalidLLMOutput):
            parse_decisions(answer, [question])


def test_a_rewrite_answer_needs_a_non_empty_text() -> None:
    assert parse_rewrite('{"text": "  Anna lives in Munich. "}') == "Anna lives in Munich."
    for answer in ('{"text": ""}', '{"txt": "a"}', "Anna lives in Munich."):
        with pytest.raises(InvalidLLMOutput):
            parse_rewrite(answer)


def test_facts_with_nothing_near_get_no_question_and_near_ones_get_their_few_nearest() -> None:
    given = inputs(
        ["Bob plays the cello.", "Alice lives in Berlin.", "Alice lives in Berlin with Tom."],
        ["Alice lives in a flat in Berlin.", "Carol sells boats."],
    )
    found = narrow.pick_candidates(given, None, OPTIONS)
    asked = {q.fact.ref: [c.ref for c in q.candidates] for q in found.questions}
    assert asked == {"f2": ["o1"], "f3": ["o1", "f2"]}


def test_without_vectors_candidates_share_word_stems_not_only_words() -> None:
    given = inputs(
        ["Because of my peanut allergy I always carry an EpiPen."],
        ["I'm allergic to peanuts.", "I drink my coffee black."],
    )
    found = narrow.pick_candidates(given, None, OPTIONS)
    assert [c.ref for q in found.questions for c in q.candidates] == ["o1"]
    assert narrow.overlap("I'm allergic to peanuts.", "my peanut allergy") == 1.0


def test_with_vectors_candidates_are_the_nearest_above_the_cosine_floor() -> None:
    given = inputs(["one", "two"], ["near", "far", "nearer"])
    vectors = {
        "one": [1.0, 0.0],
        "two": [0.0, 1.0],
        "near": [0.8, 0.6],
        "far": [0.0, 1.0],
        "nearer": [0.95, 0.31],
    }
    found = narrow.pick_candidates(given, vectors, narrow.NarrowOptions(candidates=1))
    asked = {q.fact.ref: [c.ref for c in q.candidates] for q in found.questions}
    assert asked == {"f1": ["o3"], "f2": ["o2"]}


def test_an_observation_is_cut_into_its_sentences_without_the_dates_a_join_adds() -> None:
    joined = narrow.join(
        Shown("o1", "I have a cat named Miso.", None),
        [Shown("f1", "Miso, my cat, is a grey tabby.", "2025-07-19T00:00:00Z")],
    )
    assert narrow.sentences(joined) == (
        "I have a cat named Miso.",
        "Miso, my cat, is a grey tabby.",
    )
    assert narrow.sentences("My GP is Dr. Okafor. Ursula K. Le Guin wrote it. Backups: 02:00.") == (
        "My GP is Dr. Okafor.",
        "Ursula K. Le Guin wrote it.",
        "Backups: 02:00.",
    )
    assert narrow.sentences("Version 1.29 runs on EKS.") == ("Version 1.29 runs on EKS.",)


def test_a_fact_is_as_near_an_observation_as_its_nearest_sentence() -> None:
    grown = "I have a cat named Miso. Miso, my cat, is a grey tabby."
    given = inputs(["My cat Miso turned 5."], [grown, "I live in Paris."])
    assert narrow.embedded_texts(given) == ["My cat Miso turned 5.", grown, "I live in Paris."]
    assert narrow.embedded_texts(given, by_sentence=True) == [
        "My cat Miso turned 5.",
        grown,
        "I live in Paris.",
        "I have a cat named Miso.",
        "Miso, my cat, is a grey tabby.",
    ]
    vectors = {
        "My cat Miso turned 5.": [1.0, 0.0],
        grown: [0.5, 0.866],  # cosine 0.5: the whole text, diluted by its second sentence
        "I have a cat named Miso.": [0.9, 0.436],  # cosine 0.9
        "Miso, my cat, is a grey tabby.": [0.0, 1.0],
        "I live in Paris.": [0.6, 0.8],  # cosine 0.6, nearer than the whole grown text
    }
    one = narrow.NarrowOptions(candidates=1)
    found = narrow.pick_candidates(given, vectors, one, by_sentence=True)
    (question,) = found.questions
    assert [c.ref for c in question.candidates] == ["o1"]
    assert found.nearness["f1", "o1"] == pytest.approx(0.9, abs=0.01)
    # Not by sentence (a model's candidates), or without the sentences' vectors, only the whole
    # text counts.
    found = narrow.pick_candidates(given, vectors, one)
    assert [c.ref for c in found.questions[0].candidates] == ["o2"]
    del vectors["I have a cat named Miso."]
    found = narrow.pick_candidates(given, vectors, one, by_sentence=True)
    assert [c.ref for c in found.questions[0].candidates] == ["o2"]


def test_the_engine_assembles_the_plan_so_new_facts_keep_their_own_text() -> None:
    given = inputs(
        ["Alice lives in Berlin.", "Bob plays the cello.", "Alice lives in Berlin.", "Alice runs."],
        ["Alice likes tea."],
    )
    decisions = {
        "f3": Decision("same", "f1"),
        "f4": Decision("update", "o1"),
    }
    groups = narrow.assemble(given, decisions)
    plan = narrow.to_plan(given, groups, {2: "Alice likes tea. Alice runs."})
    ids = {f.ref: f.id for f in given.facts}
    assert [(c.text, c.memory_ids) for c in plan.creates] == [
        ("Alice lives in Berlin.", (ids["f1"], ids["f3"])),
        ("Bob plays the cello.", (ids["f2"],)),
    ]
    (update,) = plan.updates
    assert (update.observation_id, update.text, update.memory_ids) == (
        given.observations[0].id,
        "Alice likes tea. Alice runs.",
        (ids["f4"],),
    )
    assert plan.action_of(ids["f3"]) == "created"


def test_a_restatement_of_an_observation_cites_it_without_touching_its_text() -> None:
    given = inputs(["Alice likes tea!"], ["Alice likes tea."])
    plan = narrow.to_plan(given, narrow.assemble(given, {"f1": Decision("same", "o1")}), {})
    (update,) = plan.updates
    assert update.text == "Alice likes tea."
    assert not plan.creates


def test_two_observations_that_end_with_the_same_text_are_one() -> None:
    given = inputs(["Alice likes tea.", "Tea is what Alice likes."], ["Alice likes tea.", "Tea."])
    decisions = {"f1": Decision("same", "o1"), "f2": Decision("update", "o2")}
    plan = narrow.to_plan(given, narrow.assemble(given, decisions), {1: "alice likes  tea."})
    (merge,) = plan.merges
    assert merge.observation_ids == (given.observations[0].id, given.observations[1].id)
    assert set(merge.memory_ids) == {given.facts[0].id, given.facts[1].id}
    assert not plan.creates and not plan.updates
    # A create with an observation's text joins it instead of duplicating it.
    again = inputs(["Alice likes tea."], ["Alice likes tea."])
    plan = narrow.to_plan(again, narrow.assemble(again, {}), {})
    assert not plan.creates
    assert [u.observation_id for u in plan.updates] == [again.observations[0].id]


OLD = Shown("o1", "Anna lives in Berlin.", "2026-01-02T00:00:00Z")
MOVED = [Shown("f2", "Anna moved to Munich.", "2026-03-01T00:00:00Z")]


@pytest.mark.parametrize(
    "text",
    [
        "Anna lived in Berlin; since 2026-03-01 she lives in Munich.",
        "Anna moved to Munich on March 1, 2026; previously she lived in Berlin.",
    ],
)
def test_a_rewrite_that_keeps_both_and_adds_only_dates_passes_the_guards(text: str) -> None:
    assert narrow.rewrite_problems(OLD, MOVED, text) == []


def test_the_guards_catch_invented_words_a_dropped_observation_and_a_missed_fact() -> None:
    (invented,) = narrow.rewrite_problems(
        OLD, MOVED, "Anna, a rocket scientist, moved from Berlin to Munich."
    )
    assert "rocket" in invented and "scientist" in invented
    (dropped,) = narrow.rewrite_problems(OLD, MOVED, "Anna moved to Munich.")
    assert "drops what the observation said" in dropped
    (missed,) = narrow.rewrite_problems(OLD, MOVED, "Anna lives in Berlin.")
    assert "f2" in missed


def test_a_rewrite_may_name_the_facts_dates_but_not_when_the_observation_was_written() -> None:
    old = Shown("o1", "Anna lives in Berlin.", "2026-11-27T15:40:22Z")  # the run's own write
    written = "Anna lives in Berlin; on 27 November 2026 she moved to Munich."
    (invented,) = narrow.rewrite_problems(old, MOVED, written)
    assert invented.endswith(": 27, november")  # 2026 is the fact's year too
    assert narrow.rewrite_problems(old, MOVED, written, old_is_fact=True) == []
    happened = "Anna lives in Berlin; on 1 March 2026 she moved to Munich."
    assert narrow.rewrite_problems(old, MOVED, happened) == []


def test_a_rewrite_may_name_a_month_only_as_a_text_or_a_date_it_was_given_names_it() -> None:
    old = Shown("o1", "Hollis Agri service the tractor every March.", "2025-01-23T10:00:00Z")
    fact = Shown("f1", "Hollis Agri do the tractor's yearly service in March.", "2025-11-26T10:00Z")
    invented = "Hollis Agri service the tractor every March; it was changed to April in 2025."
    assert narrow.rewrite_problems(old, [fact], invented) == [
        "the text adds words found in neither the observation nor the facts: april"
    ]
    dated = "Hollis Agri service the tractor every March, yearly, as of Nov 26, 2025."
    assert narrow.rewrite_problems(old, [fact], dated) == []
    # "may" is a verb as often as a month.
    assert narrow.rewrite_problems(old, [fact], dated.replace("as of", "as it may be of")) == []


FREEZE = Shown("o1", "There is a change freeze from 20 December to 3 January.")
LATER = Shown("f1", "The holiday change freeze now ends on 6 January instead of 3 January.")


@pytest.mark.parametrize(
    "text",
    [
        "The holiday change freeze is from 20 December, now ending on 3 January instead of "
        "6 January.",
        "The change freeze from 20 December now ends on 3 January, moved from 6 January to 3 "
        "January.",
    ],
)
def test_a_rewrite_that_states_a_change_the_other_way_round_is_sent_back(text: str) -> None:
    problems = narrow.rewrite_problems(FREEZE, [LATER], text)
    assert any("f1 the other way round" in problem for problem in problems)


@pytest.mark.parametrize(
    "text",
    [
        "The holiday change freeze is from 20 December to 6 January instead of 3 January.",
        "The change freeze was from 20 December to 3 January and now ends on 6 January.",
    ],
)
def test_a_range_or_the_change_stated_as_the_fact_says_it_is_no_reversal(text: str) -> None:
    assert narrow.rewrite_problems(FREEZE, [LATER], text) == []


def test_changes_are_read_from_from_to_instead_of_and_replaced_with() -> None:
    def words(old: str, new: str) -> list[tuple[frozenset[str], frozenset[str]]]:
        return [(frozenset(old.split()), frozenset(new.split()))]

    assert narrow.changes("The Lisbon trip moved from 10 May to 14 June.") == words(
        "10 may", "14 june"
    )
    assert narrow.changes("It ends on 6 January instead of 3 January.") == words(
        "3 january", "ends 6 january"
    )
    assert narrow.changes("We replaced Nagios with Prometheus and Grafana.") == words(
        "nagios", "prometheus grafana"
    )
    assert narrow.changes("Dr. Okafor raised my dose to 10 mg.") == []


@pytest.mark.parametrize(
    "text",
    [
        "We have a bookstall at the Hartley Literary Festival from 17 to 19 October 2025.",
        "From Monday to Friday nobody serves; customers pay into the trust tin by the door.",
        "Ruth now works from 9 am to 5 pm.",
        "The Lisbon trip is from 10 May to 14 June.",
    ],
)
def test_from_a_to_b_that_spans_a_time_is_no_change(text: str) -> None:
    assert narrow.changes(text) == []


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [
        ("The meeting moves from Monday to Tuesday.", "monday", "tuesday"),
        ("The trip was postponed from 10 May to 14 June.", "10 may", "14 june"),
        ("Rent goes up from 900 to 950 euros.", "900", "950 euros"),
    ],
)
def test_from_a_to_b_after_a_word_of_change_or_between_values_is_a_change(
    text: str, old: str, new: str
) -> None:
    assert narrow.changes(text) == [(frozenset(old.split()), frozenset(new.split()))]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The opening says from when; the old value is the later from-to's.
        ("From March 2026 the rent rises from £900 to £950.", [({"900"}, {"950"})]),
        # An opening from-when and a later "to" name no old value.
        ("From 1 February 2026 a standard consult goes up to £53.", []),
        ("From April 2026 the shop price for six eggs goes up to £2.60.", []),
        # A dot between digits is a value's, not a clause's end.
        ("The egg price went from £2.40 to £2.60.", [({"2.40"}, {"2.60"})]),
        ("We upgraded from Python 3.11 to 3.12.", [({"python", "3.11"}, {"3.12"})]),
    ],
)
def test_a_change_of_value_is_read_past_an_opening_from_when_and_through_decimals(
    text: str, expected: list[tuple[set[str], set[str]]]
) -> None:
    assert narrow.changes(text) == [(frozenset(old), frozenset(new)) for old, new in expected]


def test_a_price_change_turned_round_is_told_by_its_decimals() -> None:
    fact = "The egg price went from £2.40 to £2.60."
    assert narrow.turns_round(fact, "The shop's egg price went from £2.60 to £2.40.")
    assert not narrow.turns_round(fact, "The shop's egg price went from £2.40 to £2.60.")
    # A text that states the old price and not the new is what the change ends.
    assert narrow.ended_values(fact, "Six eggs cost £2.40 at the shop.") == [frozenset({"2.40"})]
    assert narrow.ended_values(fact, "Six eggs cost £2.60 at the shop.") == []


def test_a_rewrite_that_puts_the_newest_facts_words_in_another_tense_is_sent_back() -> None:
    football = Shown("o1", "Leo plays football at the FC Nord club.")
    quit = [Shown("f1", "Leo quit football and joined the swimming club.", "2026-01-10")]
    present = "Leo plays football at the FC Nord club, but now joins the swimming club."
    (retensed,) = narrow.rewrite_problems(football, quit, present)
    assert "f1 in another tense" in retensed and retensed.endswith(": joins")
    told = "Leo played football at the FC Nord club; he quit and joined the swimming club."
    assert narrow.rewrite_problems(football, quit, told) == []
    # The older texts' words may change tense once the state changed ("lived"), and so may
    # the words that order states.
    assert (
        narrow.other_tense("Anna lived in Berlin.", "Anna moved to Munich.", OLD.text.split()) == []
    )
    nagios = "We replaced Nagios with Prometheus."
    assert narrow.other_tense("Prometheus, replacing Nagios.", nagios, []) == []


def test_the_join_dates_each_new_fact_and_puts_the_newest_last() -> None:
    later = Shown("f3", "Anna moved to Hamburg", "2026-06-01T00:00:00Z")
    text = narrow.join(OLD, [later, *MOVED])
    assert text == (
        "Anna lives in Berlin. As of 2026-03-01: Anna moved to Munich. "
        "As of 2026-06-01: Anna moved to Hamburg."
    )
    assert narrow.join(OLD, [Shown("f4", "anna lives in Berlin")]) == "Anna lives in Berlin."
    assert narrow.rewrite_problems(OLD, MOVED, narrow.join(OLD, MOVED)) == []


def test_without_a_model_the_nearest_candidate_is_the_same_or_an_update_above_the_floor() -> None:
    given = inputs(["Alice lives in Berlin.", "Alice lives in Berlin.", "Alice lives in Munich."])
    vectors = {
        "Alice lives in Berlin.": [1.0, 0.0],
        "Alice lives in Munich.": [0.8, 0.6],
    }
    found = narrow.pick_candidates(given, vectors, OPTIONS)
    decisions = narrow.local_decisions(found, OPTIONS)
    assert decisions == {"f2": Decision("same", "f1"), "f3": Decision("update", "f1")}
    plan = narrow.to_plan(
        given,
        narrow.assemble(given, decisions),
        {0: narrow.join(given.facts[0].shown(), [given.facts[2].shown()])},
    )
    (create,) = plan.creates
    assert create.text.endswith("As of 2026-03-01: Alice lives in Munich.")
    assert len(create.memory_ids) == 3


def test_the_offline_policy_answers_both_v2_tasks_within_their_schemas() -> None:
    question = Question(
        Shown("f2", "Alice lives in Berlin with Tom"), (Shown("o1", "Alice lives in Berlin."),)
    )
    chat = decide_chat("b", ("x",), None, [question])
    answer = narrow.offline_answer(orjson.loads(chat.user))
    assert parse_decisions(orjson.dumps(answer).decode(), [question]) == {
        "f2": Decision("update", "o1")
    }
    rewrite = rewrite_chat("b", ("x",), None, OLD, MOVED)
    text = parse_rewrite(orjson.dumps(narrow.offline_answer(orjson.loads(rewrite.user))).decode())
    assert text == narrow.join(OLD, MOVED)


async def test_the_fake_llm_speaks_v2_over_http() -> None:
    question = Question(
        Shown("f1", "Alice lives in Berlin"), (Shown("o1", "Alice lives in Berlin."),)
    )
    chat = decide_chat("b", ("x",), None, [question])
    with FakeLLMServer(FakeLLMConfig()) as fake:
        async with httpx.AsyncClient(base_url=fake.url, timeout=10.0) as client:
            response = await client.post(
                "/chat/completions",
                json={
                    "model": "fake",
                    "messages": chat.messages(),
                    "response_format": {"type": "json_object"},
                },
            )
    assert response.status_code == 200
    content = response.json()["choices"][0]["message"]["content"]
    assert orjson.loads(content) == {"f1": "same:o1"}


def test_a_same_whose_candidate_does_not_say_it_all_is_applied_as_an_update() -> None:
    given = inputs(
        ["Anna lives in Munich now.", "Anna lives in Berlin!"], ["Anna lives in Berlin."]
    )
    found = narrow.pick_candidates(given, None, OPTIONS)
    said = {"f1": Decision("same", "o1"), "f2": Decision("same", "o1")}
    assert narrow.checked_decisions(found, said) == {
        "f1": Decision("update", "o1"),
        "f2": Decision("same", "o1"),
    }


ATLAS = [
    "The Atlas backend is written in Go.",
    "Maria leads the design work on Atlas.",
    "The Atlas budget is 120k EUR.",
    "The Atlas backend code is Go.",
]


def test_a_word_most_texts_of_the_pass_share_tells_no_subject() -> None:
    common = narrow.common_stems(ATLAS)
    assert "atla" in common  # "Atlas" is in all four
    assert narrow.telling_words(ATLAS[0], ATLAS[1], common) == set()
    assert narrow.telling_words(ATLAS[0], ATLAS[3], common) == {"backen", "go"}
    # Two or three texts are too few to call anything common.
    assert narrow.common_stems(ATLAS[:2]) == frozenset()
    # A bare number ("2026") or a word that says how often ("always") tells nothing.
    assert narrow.telling_words("Launch in 2026.", "Budget for 2026.", frozenset()) == set()
    none: frozenset[str] = frozenset()
    assert narrow.telling_words("I always carry an EpiPen.", "Coffee, always black.", none) == set()


def test_each_candidate_counts_the_telling_words_it_shares_with_its_fact() -> None:
    given = inputs(ATLAS[1:], ATLAS[:1])
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert found.shared["f3", "o1"] == 2  # backend, Go
    assert found.shared["f1", "o1"] == 0  # only Atlas


def test_a_same_or_update_sharing_fewer_than_two_telling_words_is_doubtful() -> None:
    given = inputs(
        [
            "My niece Anna studies medicine in Leipzig.",
            "I moved from Paris to Berlin.",
            "My sister Anna lives in Vienna, in Wieden.",
            "I started a new job at Globex.",
        ],
        ["My daughter Anna is in third grade.", "I live in Paris.", "My sister Anna is in Vienna."],
    )
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    said = {
        "f1": Decision("update", "o1"),  # one name shared: two different Annas
        "f2": Decision("update", "o2"),  # one name, but it announces a change: a move
        "f3": Decision("same", "o3"),  # Anna, sister, Vienna
        "f4": Decision("update", "o2"),  # announces a change, but shares nothing
    }
    assert narrow.unlinked(found, said) == ["f1", "f2", "f4"]
    # "Anna" is in most texts of the pass, so the two Annas share no telling word: without
    # embeddings that is no link at all. The move stands as said; the new job is asked again.
    assert [narrow.stronger(found, ref, said[ref]) for ref in ("f1", "f2", "f4")] == [
        Decision("new"),
        said["f2"],
        None,
    ]
    assert narrow.announces_change("I'm settled in Berlin now.")
    assert not narrow.announces_change("Maria leads the design work on Atlas.")


def test_the_scopes_own_name_tells_no_subject() -> None:
    given = inputs(["Runbooks live in the ops wiki."], ["The ops standup is at 09:30 on weekdays."])
    ops = dataclasses.replace(given, scope=("ops",))
    options = narrow.NarrowOptions(lexical_floor=0.0)
    assert narrow.pick_candidates(given, None, options).shared["f1", "o1"] == 1
    assert narrow.pick_candidates(ops, None, options).shared["f1", "o1"] == 0
    assert narrow.scope_stems(["project-atlas", "ops"]) == {"projec", "atla", "ops"}


def test_a_pick_that_shares_no_telling_word_and_is_not_the_nearest_is_new_without_asking() -> None:
    given = inputs(
        ["Runbooks live in the ops wiki.", "I started a new job at Globex."],
        ["The ops standup is at 09:30.", "I work as an accountant at Acme Corp."],
    )
    ops = dataclasses.replace(given, scope=("ops",))
    found = narrow.pick_candidates(ops, None, narrow.NarrowOptions(lexical_floor=0.0))
    said = {"f1": Decision("same", "o1"), "f2": Decision("update", "o2")}
    assert narrow.unlinked(found, said) == ["f1", "f2"]
    assert narrow.stronger(found, "f1", said["f1"]) == Decision("new")
    # A fact that announces a change may share no word with the state it replaces: asked.
    assert narrow.stronger(found, "f2", said["f2"]) is None
    # With embeddings the cosine is a sign of its own: a pick that is the fact's nearest is
    # asked (a paraphrase may share no word), one that is not is new.
    vectors = {
        "Runbooks live in the ops wiki.": [1.0, 0.0],
        "I started a new job at Globex.": [0.0, 1.0],
        "The ops standup is at 09:30.": [0.9, 0.1],
        "I work as an accountant at Acme Corp.": [0.5, 0.5],
    }
    near = narrow.pick_candidates(ops, vectors, narrow.NarrowOptions(cosine_floor=0.0))
    assert near.shared["f1", "o1"] == near.shared["f1", "o2"] == 0
    assert narrow.stronger(near, "f1", said["f1"]) is None
    assert narrow.stronger(near, "f1", Decision("same", "o2")) == Decision("new")


def test_a_candidate_that_says_it_all_or_is_nearly_the_same_vector_is_decided_without_asking() -> (
    None
):
    given = inputs(
        ["Alice lives in Berlin.", "Alice adores tea.", "Bob fears spiders."],
        ["Alice lives in Berlin, in Mitte.", "Alice loves tea."],
    )
    vectors = {
        "Alice lives in Berlin.": [1.0, 0.0, 0.0],
        "Alice lives in Berlin, in Mitte.": [0.9, 0.3, 0.0],
        "Alice adores tea.": [0.0, 1.0, 0.05],
        "Alice loves tea.": [0.0, 1.0, 0.0],
        "Bob fears spiders.": [0.5, 0.5, 0.7],
    }
    found = narrow.pick_candidates(given, vectors, OPTIONS)
    assert narrow.sure_decisions(found, OPTIONS) == {
        "f1": Decision("same", "o1"),  # o1 says all f1 says
        "f2": Decision("same", "o2"),  # cosine 0.999
    }


def test_the_confirm_question_is_pinned_to_yes_or_no() -> None:
    fact = Shown("f1", "Anna Lindqvist handles our vendor contracts.")
    chat = confirm_chat("b", ["ops"], None, fact, Shown("o1", "Anna Kowalski is our DBA."))
    assert orjson.loads(chat.user)["task"] == "confirm"
    assert chat.schema["properties"] == {"same_subject": {"type": "string", "enum": ["yes", "no"]}}
    assert parse_confirm('{"same_subject": "yes"}') is True
    assert parse_confirm('```json\n{"same_subject": "no"}\n```') is False
    with pytest.raises(InvalidLLMOutput):
        parse_confirm('{"same_subject": "maybe"}')
    offline = narrow.offline_answer(orjson.loads(chat.user))
    assert offline == {"same_subject": "no"}


def test_a_doubtful_decision_moves_to_the_one_candidate_that_shares_enough() -> None:
    leo = inputs(
        ["Leo quit football and joined the swimming club."],
        ["Leo is allergic to cats.", "Leo plays football at the FC Nord club.", "Mum swims."],
    )
    found = narrow.pick_candidates(leo, None, narrow.NarrowOptions(lexical_floor=0.0))
    # One shared name and a change announced, but another candidate shares two words.
    said = Decision("update", "o1")
    assert narrow.stronger(found, "f1", said) == Decision("update", "o2")

    given = inputs(
        ["The Atlas launch has been postponed from 1 March to 15 April."],
        [
            "The Atlas budget is 120k EUR.",
            "The Atlas launch is planned for 1 March.",
            "The weekly Atlas sync is on Tuesdays.",
        ],
    )
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    wrong = Decision("update", "o1")
    assert narrow.unlinked(found, {"f1": wrong}) == ["f1"]
    assert narrow.stronger(found, "f1", wrong) == Decision("update", "o2")
    assert narrow.unlinked(found, {"f1": Decision("update", "o2")}) == []


def test_a_pick_moves_to_the_candidate_that_shares_clearly_more() -> None:
    given = inputs(
        ["Our production workloads are hosted in AWS eu-central-1, Frankfurt."],
        [
            "Engineers reach production hosts only through the WireGuard VPN.",
            "Production runs in the Frankfurt region of AWS (eu-central-1).",
        ],
    )
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert narrow.clearer(found, "f1", Decision("same", "o1")) == Decision("same", "o2")
    assert narrow.clearer(found, "f1", Decision("same", "o2")) == Decision("same", "o2")
    assert narrow.clearer(found, "f1", Decision("new")) == Decision("new")
    # One telling word more is no clear sign: the model's pick stands.
    close = inputs(
        ["Leo quit football and joined the swimming club."],
        ["Leo plays football at the FC Nord club.", "Leo swims at the club on Fridays."],
    )
    found = narrow.pick_candidates(close, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert narrow.clearer(found, "f1", Decision("update", "o2")) == Decision("update", "o2")


def test_a_change_pointed_at_what_it_names_nothing_of_moves_to_the_one_it_names() -> None:
    def beside(third: str) -> narrow.Candidates:
        given = inputs(
            ["I'm settled in Berlin now, living in Kreuzberg."],
            [
                "My sister Anna lives in Vienna.",
                "I live in Paris. I moved from Paris to Berlin last week.",
                third,
            ],
        )
        return narrow.pick_candidates(
            given, None, narrow.NarrowOptions(lexical_floor=0.0, candidates=3)
        )

    found = beside("I drink my coffee black.")
    assert [found.shared["f1", o] for o in ("o1", "o2", "o3")] == [0, 1, 0]
    for kind in ("update", "same"):
        moved = narrow.stronger(found, "f1", Decision(kind, "o1"))
        assert moved == Decision(kind, "o2")
    # Two candidates that each name something of it: no sign which, the pick is asked about
    # (an update) or new (a same), as before.
    found = beside("My brother studies in Berlin.")
    assert narrow.stronger(found, "f1", Decision("update", "o1")) is None
    assert narrow.stronger(found, "f1", Decision("same", "o1")) == Decision("new")


def test_an_announced_change_stands_on_its_nearest_candidate_by_cosine() -> None:
    # "A new job at Globex" shares no word with "I work as an accountant at Acme": by cosine
    # the Acme observation is its nearest candidate, and the change announced stands there;
    # pointed at a farther candidate, or with no change announced, it is asked again.
    given = inputs(
        ["I started a new job as a data analyst at Globex.", "I work as a data analyst."],
        ["I work as an accountant at Acme Corp.", "I run along the river on Sundays."],
    )
    vectors = {
        "I started a new job as a data analyst at Globex.": [1.0, 0.2, 0.0],
        "I work as a data analyst.": [0.9, 0.2, 0.3],
        "I work as an accountant at Acme Corp.": [0.8, 0.6, 0.0],
        "I run along the river on Sundays.": [0.6, 0.0, 0.8],
    }
    found = narrow.pick_candidates(given, vectors, narrow.NarrowOptions(cosine_floor=0.0))
    job = found.question("f1")
    assert {c.ref for c in job.candidates} >= {"o1", "o2"}
    assert found.shared["f1", "o1"] == 0
    assert narrow.stronger(found, "f1", Decision("update", "o1")) == Decision("update", "o1")
    assert narrow.stronger(found, "f1", Decision("update", "o2")) is None
    # Called the same as its nearest, it stands too: a change restates nothing, so checked
    # decisions makes it the update it is; the same as a farther candidate is new, unasked.
    assert narrow.stronger(found, "f1", Decision("same", "o1")) == Decision("same", "o1")
    assert narrow.checked_decisions(found, {"f1": Decision("same", "o1")})["f1"] == Decision(
        "update", "o1"
    )
    assert narrow.stronger(found, "f1", Decision("same", "o2")) == Decision("new")
    # Without embeddings the nearness is lexical: nothing shared, nothing stands.
    lexical = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert narrow.stronger(lexical, "f1", Decision("update", "o1")) is None


def test_a_state_given_from_when_it_holds_is_no_new_day_of_a_dated_thing() -> None:
    # "Since ..." gives the new state's values like any fact: no day, so not the sow's farrowing
    # date; a change said in words may drop the day ("postponed"), as before.
    ration = "Since November 2025 we buy the sow and weaner ration from Corran Feeds."
    peggy = "Peggy, our Tamworth sow, is due to farrow on 12 June 2025."
    assert narrow.measures_other(ration, peggy)
    assert not narrow.measures_other("Peggy's farrowing has been postponed.", peggy)
    assert not narrow.measures_other(
        "Since May 2025 we buy pig nuts from Corran.", "We buy pig nuts."
    )
    # The sow, nearest by cosine and a word shared, is not shown: any pick of it would be set
    # apart and the fact made new (the 1.5B model picked it, the old feed beside it). Nothing
    # shown is the change's nearest, so no pick stands on nearness: not the ewes' vaccine, which
    # MiniLM puts a hair nearer than the old feed, nor the old feed; each is asked about.
    old_feed = "We get our pig nuts from Darwell Mills."
    vaccine = "Heptavac for the ewes goes in a month ahead of lambing."
    given = inputs([ration], [peggy, old_feed, vaccine])
    vectors = {ration: [1.0, 0.0], peggy: _at(0.40), old_feed: _at(0.30), vaccine: _at(0.31)}
    found = narrow.pick_candidates(given, vectors, OPTIONS)
    assert [c.text for c in found.question("f1").candidates] == [vaccine, old_feed]
    assert narrow.stronger(found, "f1", Decision("update", "o2")) is None
    assert narrow.stronger(found, "f1", Decision("update", "o3")) is None
    assert narrow.apart(found, {"f1": Decision("update", "o2")}) == []
    # The offline consolidator, which links a change to its nearest, leaves it apart.
    assert narrow.local_decisions(found, OPTIONS) == {"f1": Decision("new")}
    # A fact that announces no change is still shown the sow, and a pick of it set apart.
    weight = "Peggy weighs about 200 kg."
    found = narrow.pick_candidates(
        inputs([weight], [peggy]), None, narrow.NarrowOptions(lexical_floor=0.0)
    )
    said = {"f1": Decision("update", "o1")}
    assert [c.ref for c in found.question("f1").candidates] == ["o1"]
    assert narrow.apart(found, said) == ["f1"]


def _at(cos: float) -> list[float]:
    """A unit vector at cosine ``cos`` of [1, 0]."""
    return [cos, (1 - cos * cos) ** 0.5]


def _near(fact: str, cosines: dict[str, float]) -> narrow.Candidates:
    """The candidates of ``fact`` among observations at the given cosines of it, no floor."""
    vectors = {fact: [1.0, 0.0], **{text: _at(cos) for text, cos in cosines.items()}}
    given = inputs([fact], list(cosines))
    return narrow.pick_candidates(given, vectors, narrow.NarrowOptions(cosine_floor=0.0))


def test_a_change_nearest_to_what_it_names_nothing_of_moves_to_the_one_it_names() -> None:
    # MiniLM puts the drugs wholesaler nearest to the late evening's move; the fact names
    # something ("late") of the late surgery alone, which measures nothing else of it.
    fact = "As of March 2026 the late evening moves to Tuesdays."
    wholesaler = "We order our drugs from Harbour Vet Supplies; next-day delivery by 3pm."
    surgery = "Late surgery is on Wednesdays; we stay open until 7pm."
    alarm = "The fire alarm is tested every Monday at 8:30."
    found = _near(fact, {wholesaler: 0.45, surgery: 0.42, alarm: 0.41})
    assert [c.text for c in found.question("f1").candidates][:2] == [wholesaler, surgery]
    assert found.shared["f1", "o1"] == 0 and found.shared["f1", "o2"] == 1
    assert narrow.stronger(found, "f1", Decision("update", "o1")) == Decision("update", "o2")
    # A pick that names something of the fact stands, nearest or not.
    assert narrow.stronger(found, "f1", Decision("update", "o2")) == Decision("update", "o2")
    # What it names something of measures another property (a dated thing): not shown, so the
    # nearest stands ("Since April 2026 Ravi Desai does my books" of the old accountant; the
    # congress booked for 26 to 29 March, which the 1.5B model called the same, is not shown).
    books = "Since April 2026 Ravi Desai does my books and tax return."
    accountant = "My accountant is Gillian Marsh at Marsh & Co."
    congress = "I'm booked on the BSAVA congress in Manchester, 26 to 29 March 2026."
    swim = "I swim at the leisure centre on Saturday mornings."
    found = _near(books, {accountant: 0.37, congress: 0.33, swim: 0.32})
    assert [c.text for c in found.question("f1").candidates] == [accountant, swim]
    assert narrow.stronger(found, "f1", Decision("update", "o1")) == Decision("update", "o1")
    assert narrow.stronger(found, "f1", Decision("same", "o1")) == Decision("same", "o1")


@pytest.mark.parametrize(
    ("fact", "cos", "linked"),
    [
        # Two telling words ("peanut", "allergy") are enough from the pair cosine (MiniLM: 0.57).
        ("Because of my peanut allergy I carry an EpiPen.", 0.57, True),
        ("Because of my peanut allergy I carry an EpiPen.", 0.52, False),
        # One telling word ("Paris") only when the fact announces a change.
        ("My flat in Paris is close to the canal.", 0.66, False),
        ("I moved from Paris to Berlin.", 0.45, True),
        # No word shared: a change stands on its nearest candidate only.
        ("I started a new job as a data analyst at Globex.", 0.45, True),
        ("I go running on Sundays.", 0.66, False),
    ],
)
def test_without_a_model_words_and_a_change_announced_link_below_the_cosine_alone(
    fact: str, cos: float, linked: bool
) -> None:
    old = {
        "Because of my peanut allergy I carry an EpiPen.": "I have a severe peanut allergy.",
        "My flat in Paris is close to the canal.": "I live in Paris.",
        "I moved from Paris to Berlin.": "I live in Paris.",
        "I started a new job as a data analyst at Globex.": "I work as an accountant at Acme.",
        "I go running on Sundays.": "I drink my coffee black.",
    }[fact]
    given = inputs([fact], [old, "The cat is called Miso."])
    vectors = {
        fact: [1.0, 0.0, 0.0],
        old: [*_at(cos), 0.0],
        "The cat is called Miso.": [0.41, 0.0, 0.91],
    }
    found = narrow.pick_candidates(given, vectors, OPTIONS)
    decision = narrow.local_decisions(found, OPTIONS)["f1"]
    assert decision == (Decision("update", "o1") if linked else Decision("new"))


def test_without_a_model_words_alone_do_not_link_when_there_are_vectors() -> None:
    # "The billing service" is most of both texts, so the v1 offline policy's word overlap
    # calls them one subject; with vectors below the pair cosine they stay two. (MiniLM puts
    # them 0.58 apart, above it: in ops-team's `billing` scope "billing" tells nothing, so they
    # share one telling word there; in a scope named otherwise they would be joined.)
    fact, old = "Lena owns the billing service.", "The billing service is written in Kotlin."
    given = inputs([fact], [old])
    found = narrow.pick_candidates(given, {fact: [1.0, 0.0], old: _at(0.5)}, OPTIONS)
    assert narrow.local_decisions(found, OPTIONS) == {"f1": Decision("new")}
    lexical = narrow.pick_candidates(given, None, OPTIONS)
    assert narrow.local_decisions(lexical, OPTIONS) == {"f1": Decision("update", "o1")}


def test_two_telling_words_at_the_pair_cosine_need_no_question() -> None:
    # "cat" and "Miso" shared at 0.7: sure, no call; at 0.6, or at 0.7 sharing one word, asked.
    fact = "Miso, my cat, is a grey tabby."
    for old, cos, sure in [
        ("I have a cat named Miso.", 0.7, True),
        ("I have a cat named Miso.", 0.6, False),
        ("I have a dog named Miso.", 0.7, False),
    ]:
        given = inputs([fact], [old])
        found = narrow.pick_candidates(given, {fact: [1.0, 0.0], old: _at(cos)}, OPTIONS)
        expected = {"f1": Decision("same", "o1")} if sure else {}
        assert narrow.sure_decisions(found, OPTIONS) == expected, (old, cos)


def test_without_embeddings_three_telling_words_need_no_question() -> None:
    key = (
        "Mr. Jansen next door has our spare key.",
        "Our neighbour, Mr. Jansen, keeps a spare key.",
    )
    backups = ("Database backups are kept for 35 days.", "Database backups run every night.")
    for (fact, old), sure in [(key, True), (backups, False)]:
        found = narrow.pick_candidates(inputs([fact], [old]), None, OPTIONS)
        expected = {"f1": Decision("same", "o1")} if sure else {}
        assert narrow.sure_decisions(found, OPTIONS) == expected, fact
    # With vectors the cosine decides: three words at 0.5 are asked.
    fact, old = key
    found = narrow.pick_candidates(
        inputs([fact], [old]), {fact: [1.0, 0.0], old: _at(0.5)}, OPTIONS
    )
    assert narrow.sure_decisions(found, OPTIONS) == {}


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("Database backups run every night at 02:00 UTC.", {"time of day"}),
        ("Database backups are kept for 35 days.", {"duration"}),
        ("Every incident gets a blameless review within five working days.", {"duration"}),
        ("Our uptime target for customers is 99.9 percent.", {"share"}),
        ("The monthly AWS bill is about 18k EUR.", {"amount of money"}),
        ("The Atlas launch is planned for 1 March 2026.", set()),  # a date may be when it was said
        ("The standup is at 9am and takes 15 minutes.", {"time of day", "duration"}),
        ("My cat Miso turned 5 this year.", set()),  # a bare number: no kind of value
        ("She is 35 years old.", set()),  # an age, not a duration
        ("May I bring the city week plan?", set()),
    ],
)
def test_the_kinds_of_value_a_text_gives(text: str, kinds: set[str]) -> None:
    assert narrow.measures(text) == kinds


def test_a_fact_measuring_another_property_of_the_subject_is_new_whatever_the_model_said() -> None:
    given = inputs(
        [
            "Database backups are kept for 35 days.",  # how long; the observation says when
            "Database backups now run every six hours.",  # announces a change of the schedule
            "Database backups run nightly at 2am.",  # the same kind of value: a restatement
            "Database backups are stored in S3.",  # no value: the words decide, as before
        ],
        ["Database backups run every night at 02:00 UTC."],
    )
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    said = {ref: Decision("update", "o1") for ref in ("f1", "f2", "f3", "f4")}
    assert narrow.apart(found, said) == ["f1"]
    assert narrow.apart(found, {"f1": Decision("new")}) == []


@pytest.mark.parametrize(
    ("text", "day"),
    [
        ("Our autumn poetry evening is booked for 16 October.", True),
        ("The launch moved to the 3rd of May.", True),
        ("The review is on March 1st.", True),
        ("Our DBA was Anna Kowalski on September 1, 2025.", True),
        ("Royal College fees renew on the first of April.", True),
        ("The fair is on the twenty-first of June.", True),
        ("The audit is on June the thirtieth.", True),
        ("The book club meets on the first Thursday of every month.", False),  # no calendar day
        ("The second of the three March invoices was late.", False),
        ("My passport expires in August 2029.", False),  # a month, not a day
        ("May I bring the plan on Monday?", False),
        ("I live in Paris. As of 2026-03-01: I moved to Berlin.", False),  # the join's dating
        ("Backups run at 02:00 on 2026-03-01.", False),  # ISO: the service's own dating
    ],
)
def test_whether_a_text_names_a_day_of_the_calendar(text: str, day: bool) -> None:
    assert narrow.names_a_day(text) is day


def test_what_is_said_of_a_dated_thing_without_its_day_is_another_property_of_it() -> None:
    event = "Our autumn poetry evening is booked for 16 October."
    assert narrow.measures_other("Idris Vale is the guest poet at the poetry evening.", event)
    assert narrow.measures_other("The poetry evening starts at 7pm.", event)
    # A restatement names the day; a new date names the new one or announces the change.
    assert not narrow.measures_other("The poetry evening is on 16 October.", event)
    assert not narrow.measures_other("The poetry evening is now on 30 October.", event)
    assert not narrow.measures_other("The poetry evening has been postponed.", event)
    # ... in digits or in words.
    renewal = "My RCVS registration renewal is due on 1 April every year."
    assert not narrow.measures_other("Royal College fees renew on the first of April.", renewal)
    # Only the candidate's day counts: an undated candidate is judged by the words.
    assert not narrow.measures_other(event, "Idris Vale is the guest poet at the poetry evening.")
    given = inputs(["Idris Vale is the guest poet at the poetry evening."], [event])
    found = narrow.pick_candidates(given, None, OPTIONS)
    assert narrow.apart(found, {"f1": Decision("update", "o1")}) == ["f1"]


def test_a_candidate_measuring_another_property_is_never_sure_nor_linked_without_a_model() -> None:
    fact, old = "Database backups are kept for 35 days.", "Database backups run daily at 02:00."
    given = inputs([fact], [old])
    found = narrow.pick_candidates(given, {fact: [1.0, 0.0], old: _at(0.85)}, OPTIONS)
    assert narrow.sure_decisions(found, OPTIONS) == {}
    assert narrow.local_decisions(found, OPTIONS) == {"f1": Decision("new")}
    # The same pair without the schedule's time is one subject by its cosine.
    plain = "Database backups run daily."
    found = narrow.pick_candidates(
        inputs([fact], [plain]), {fact: [1.0, 0.0], plain: _at(0.85)}, OPTIONS
    )
    assert narrow.sure_decisions(found, OPTIONS) == {"f1": Decision("same", "o1")}
    assert narrow.local_decisions(found, OPTIONS) == {"f1": Decision("update", "o1")}


def _one_fact(fact: str, observations: Sequence[str], scope: str) -> PassRequest:
    """The pass request of ``fact`` in ``scope``, with ``observations`` recalled, in order."""
    when = datetime(2026, 1, 1, tzinfo=UTC)
    return build_request(
        "b",
        (scope,),
        None,
        [FactInput(uuid.uuid4(), fact, (scope,), when)],
        [ObservationInput(uuid.uuid4(), text, 1, when) for text in observations],
    )


async def _answered(
    request: PassRequest, script: list[dict[str, str]], embed: ask_v2.Embed | None = None
) -> tuple[PassPlan, int]:
    """The plan of ``request`` with the fake LLM answering ``script``, and how many requests
    reached it."""
    with FakeLLMServer(FakeLLMConfig()) as fake:
        fake.control(script=script)
        llm = http_llm(fake.url)
        try:
            plan = await ask_v2.answer_pass(request, llm.complete, embed, OPTIONS)
        finally:
            await llm.aclose()
        return plan, fake.stats()["requests"]


async def test_a_weak_pick_moved_to_a_candidate_measuring_another_property_is_new() -> None:
    # The model points at the artifacts bucket (one telling word, "S3"); the one candidate
    # sharing two is the schedule, which measures when, not how long: the fact is new, and
    # no confirm question is asked about either.
    fact = "Database backups are kept for 35 days in S3."
    observations = [
        "S3 holds the build artifacts.",
        "Database backups run every night at 02:00 UTC.",
    ]
    request = _one_fact(fact, observations, "ops")
    found = narrow.pick_candidates(narrow.pass_inputs(request), None, OPTIONS)
    assert [c.text for c in found.question("f1").candidates] == observations[::-1]
    assert narrow.stronger(found, "f1", Decision("update", "o1")) == Decision("update", "o2")
    # The request numbers what it shows: the bucket, second, is o2 there.
    plan, requests = await _answered(request, [{"content": '{"f1": "update:o2"}'}])
    assert requests == 1  # the decide call alone
    assert [c.text for c in plan.creates] == [fact]
    assert plan.updates == () and plan.merges == ()


def test_a_change_near_nothing_is_shown_every_observation_and_other_facts_none() -> None:
    observations = ["I work as an accountant at Acme Corp.", "I live in Berlin.", "I play chess."]
    given = inputs(["I started a new job at Globex.", "Bananas are yellow."], observations)
    found = narrow.pick_candidates(given, None, OPTIONS)
    assert [q.fact.ref for q in found.questions] == ["f1"]
    assert [c.text for c in found.question("f1").candidates] == observations
    # The model's pick of the old job shares no word with it: asked once more, not believed.
    said = {"f1": Decision("update", "o1")}
    assert narrow.unlinked(found, said) == ["f1"]
    assert narrow.stronger(found, "f1", said["f1"]) is None
    # A change restates nothing it names nothing of: "same" as the chess is new, unasked.
    assert narrow.stronger(found, "f1", Decision("same", "o3")) == Decision("new")
    # With vectors, nothing above the cosine floor is nothing near: no question.
    vectors = {text: [0.0, 1.0] for text in observations}
    vectors |= {"I started a new job at Globex.": [1.0, 0.0], "Bananas are yellow.": [-1.0, 0.0]}
    assert narrow.pick_candidates(given, vectors, OPTIONS).questions == ()


def test_a_change_near_only_another_property_is_shown_what_may_be_its_old_state() -> None:
    fact = "Since April 2026 Ravi Desai does my books and tax return."
    congress = "I'm booked on the BSAVA congress in Manchester, 26 to 29 March 2026."
    accountant = "My accountant is Gillian Marsh at Marsh & Co."
    swim = "On Saturday mornings I swim at Westgate Lido, my one hour off all week, from April."
    observations = [congress, "The MOT is due on 18 November.", accountant, swim]
    given = inputs([fact], observations)
    # "books" and "booked": the congress alone is near, and it names a day the fact does not.
    assert narrow.overlap(fact, congress) >= OPTIONS.lexical_floor
    assert narrow.measures_other(fact, congress)
    found = narrow.pick_candidates(given, None, OPTIONS)
    # Shown every observation but the dated ones, which any pick would set apart; the swim,
    # which shares "April" with the fact (too little of its text to be near), first.
    assert [c.text for c in found.question("f1").candidates] == [swim, accountant]
    # Without the announced change, it keeps its one near candidate (which apart sets aside).
    plain = inputs(["Ravi Desai does my books and tax return."], observations)
    assert [
        c.text for c in narrow.pick_candidates(plain, None, OPTIONS).questions[0].candidates
    ] == [congress]
    # A change near a candidate that may be its old state is shown that candidate alone.
    nightline = "Out-of-hours calls are diverted to Nightline Vets in Brampton."
    castlegate = (
        "We've switched our out-of-hours cover to Castlegate Emergency Vets from 1 September."
    )
    switched = narrow.pick_candidates(
        inputs([castlegate], [nightline, *observations]), None, OPTIONS
    )
    assert [c.text for c in switched.question("f1").candidates] == [nightline]


@pytest.mark.parametrize(
    ("text", "change"),
    [
        ("From March 2026 the kids' section is stocked entirely through Kestrel.", True),
        ("From January 2026, 8% of my drawings goes into the pension.", True),
        ("As of Monday, the standup is at 10:00.", True),
        ("Starting next week the shop closes at 18:00.", True),
        ("We have a bookstall at the festival from 17 to 19 October.", False),
        ("From 20 December to 3 January there is a change freeze.", False),
        ("From Monday to Friday nobody serves; customers pay into the trust tin.", False),
        ("From 1 May until 30 June the shop opens on Sundays.", False),
        ("From April 2026 the shop price for six eggs goes up to £2.60.", True),
        ("From next month the rota goes back to two shifts.", True),
        ("From the start the shop sold second-hand books.", False),
        ("Since April 2026 Ravi Desai does my books and tax return.", True),
        ("Since November 2025 we buy the sow and weaner ration from Corran Feeds.", True),
        ("Since then the shop has opened late on Thursdays.", False),
        ("Since the roof leaks we store the hay in the barn.", False),
        ("Fresh bread arrives from Tuesday's bakery.", False),
    ],
)
def test_a_text_that_opens_with_from_when_it_holds_announces_a_change(
    text: str, change: bool
) -> None:
    assert narrow.announces_change(text) is change


def test_a_change_is_shown_candidates_below_the_cosine_floor_and_a_fact_is_not() -> None:
    old = "We order our children's books from Pemberton Wholesale."
    change = "From March 2026 the kids' section is stocked through Kestrel Distribution."
    same_words = "The kids' section is stocked through Kestrel Distribution."
    vectors = {old: _at(0.35), change: [1.0, 0.0], same_words: [1.0, 0.0]}
    for fact, shown in [(change, [old]), (same_words, [])]:
        found = narrow.pick_candidates(inputs([fact], [old]), vectors, OPTIONS)
        assert [c.text for q in found.questions for c in q.candidates] == shown, fact
    # Not below the change's own floor.
    vectors[old] = _at(0.25)
    assert narrow.pick_candidates(inputs([change], [old]), vectors, OPTIONS).questions == ()


def test_a_count_in_words_shares_a_stem_with_the_count_in_digits() -> None:
    a = "Author events are capped at 40 seats because of the fire limit."
    b = "Fire regulations mean no more than forty people at a reading."
    assert narrow.overlap(a, b) > narrow.overlap(a, b.replace("forty", "fifty"))
    found = narrow.pick_candidates(inputs([b], [a]), None, OPTIONS)
    assert [c.text for q in found.questions for c in q.candidates] == [a]
    # A count is no telling word: "fire" is the one they share.
    assert found.shared["f1", "o1"] == 1


def test_three_telling_words_are_no_sure_link_when_the_fact_tells_twice_as_many() -> None:
    club = "The book club meets on the first Thursday of every month at 7pm."
    crime = "The crime fiction reading group meets on the third Thursday of each month at 7pm."
    found = narrow.pick_candidates(inputs([crime], [club]), None, OPTIONS)
    assert found.shared["f1", "o1"] == 3
    assert found.telling["f1"] > 6
    assert narrow.sure_decisions(found, OPTIONS) == {}


async def test_a_pick_sharing_less_than_half_of_what_the_fact_names_is_asked_once_more() -> None:
    fact = "The crime fiction reading group meets on the third Thursday of each month at 7pm."
    club = "The book club meets on the first Thursday of every month at 7pm."
    given = inputs([fact], [club])
    found = narrow.pick_candidates(given, None, OPTIONS)
    assert (found.shared["f1", "o1"], found.telling["f1"]) == (3, 8)
    said = {"f1": Decision("update", "o1")}
    assert narrow.unlinked(found, said) == []  # three words: a strong link on its own
    assert narrow.thin(found, said) == ["f1"]
    # Half or more of the fact's words shared, or a change announced: the pick stands.
    for other in (
        "The book club meets on the first Thursday of every month at 7pm in the back room.",
        "The book club now meets on the first Thursday of every month at 7pm.",
    ):
        found = narrow.pick_candidates(inputs([other], [club]), None, OPTIONS)
        assert narrow.thin(found, {"f1": Decision("update", "o1")}) == [], other
    request = _one_fact(fact, [club], "shop")
    # Its one candidate: whatever the model picked would be asked about, so the yes/no
    # question is the first call, and a yes is the update.
    for answer, creates in (("no", [fact]), ("yes", [])):
        plan, requests = await _answered(
            request,
            [
                {"content": f'{{"same_subject": "{answer}"}}'},
                {"content": f'{{"text": "{club} {fact}"}}'},
            ],
        )
        assert requests == (1 if answer == "no" else 2)
        assert [c.text for c in plan.creates] == creates, answer
        assert len(plan.updates) == (0 if answer == "no" else 1)


def test_one_candidate_skips_the_decide_call_when_any_pick_of_it_would_be_overruled() -> None:
    def settle(fact: str, *observations: str) -> tuple[dict[str, Decision], list[str], list[str]]:
        found = narrow.pick_candidates(
            inputs([fact], list(observations)), None, narrow.NarrowOptions(lexical_floor=0.0)
        )
        return narrow.without_decide(found, found.questions)

    # Another property of the one candidate: new without a call.
    backups = "Database backups run every night at 02:00 UTC."
    assert settle("Database backups are kept for 35 days.", backups) == (
        {"f1": Decision("new")},
        ["f1"],
        [],
    )
    # No telling word shared, no change announced, no cosine: new without a call.
    assert settle("Maria leads the design work.", "The Atlas backend is written in Go.") == (
        {"f1": Decision("new")},
        [],
        [],
    )
    # One word shared, or three of eight: any pick is asked about, so the question comes first.
    club = "The book club meets on the first Thursday of every month at 7pm."
    crime = "The crime fiction reading group meets on the third Thursday of each month at 7pm."
    assert settle(crime, club) == ({}, [], ["f1"])
    assert settle("Maria leads design on the Atlas backend.", "The backend is in Go.") == (
        {},
        [],
        ["f1"],
    )
    # Asked as before: a strong link (same or update is the model's to say); a change (a same
    # of what it names nothing of is new, an update is asked about: the pick decides); two
    # candidates (which one is the model's to say).
    for fact, observations in (
        ("The book club now meets on the first Thursday at 7pm.", [club]),
        ("I started a new job at Globex.", ["I work as an accountant at Acme."]),
        (crime, [club, "The crime fiction shelf is by the door."]),
    ):
        assert settle(fact, *observations) == ({}, [], []), fact


def test_a_yes_to_the_one_candidate_is_a_same_only_when_it_already_says_all() -> None:
    for fact, kind in (
        ("Leo plays football.", "same"),
        ("Leo plays football on Fridays.", "update"),
    ):
        given = inputs([fact], ["Leo plays football at the FC Nord club."])
        found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
        assert narrow.confirmed_pick(found, "f1") == Decision(kind, "o1")


HOME = "I live in Paris, in the 11th arrondissement."
FLAT = "My flat in Paris is close to the Canal Saint-Martin."
MOVED_AWAY = "I moved from Paris to Berlin last week."


def test_a_change_ends_the_observations_beside_its_own_that_state_its_old_value() -> None:
    sister = "My sister Anna lives in Vienna."
    found = _near(MOVED_AWAY, {HOME: 0.51, FLAT: 0.49, sister: 0.43})
    found = dataclasses.replace(
        found,
        questions=tuple(
            dataclasses.replace(q, candidates=(*q.candidates, Shown("o3", sister)))
            for q in found.questions
        ),
    )
    # Updating either Paris observation ends the other; Vienna states nothing of Paris.
    assert narrow.made_stale(found, {"f1": Decision("update", "o1")}) == {"f1": ["o2"]}
    assert narrow.made_stale(found, {"f1": Decision("same", "o2")}) == {"f1": ["o1"]}
    assert narrow.made_stale(found, {"f1": Decision("new")}) == {}
    # A change that does not say what it replaces ends nothing beside what it updates.
    settled = "I'm settled in Berlin now, living in Kreuzberg; no more Paris."
    found = _near(settled, {HOME: 0.5, FLAT: 0.45})
    assert narrow.made_stale(found, {"f1": Decision("update", "o1")}) == {}


def test_an_observation_stating_the_new_value_or_one_another_fact_takes_is_not_ended() -> None:
    in_berlin = "My flat in Paris is sublet while I look for one in Berlin."
    found = _near(MOVED_AWAY, {HOME: 0.51, in_berlin: 0.45})
    assert narrow.made_stale(found, {"f1": Decision("update", "o1")}) == {}
    # The old value must be what the updated observation states: one word of the target is
    # not its old value ("Paris" of a flat when the update is of the sister's Vienna).
    found = _near(MOVED_AWAY, {"My sister Anna lives in Vienna.": 0.5, FLAT: 0.45})
    assert narrow.made_stale(found, {"f1": Decision("update", "o1")}) == {}
    # Another fact of the pass restates the flat: that fact's decision takes it.
    given = inputs([MOVED_AWAY, FLAT], [HOME, FLAT])
    found = narrow.pick_candidates(given, None, OPTIONS)
    decisions = {"f1": Decision("update", "o1"), "f2": Decision("same", "o2")}
    assert narrow.made_stale(found, decisions) == {}


def test_the_values_a_change_ends_are_those_a_text_states_without_the_new_one() -> None:
    (paris,) = narrow.ended_values(MOVED_AWAY, FLAT)
    assert paris == narrow.ended_values(MOVED_AWAY, HOME)[0] and len(paris) == 1
    assert narrow.ended_values(MOVED_AWAY, "My flat in Paris is sublet; I live in Berlin.") == []
    assert narrow.ended_values(MOVED_AWAY, "My sister Anna lives in Vienna.") == []
    # A change that does not say what it replaces ends no value.
    assert narrow.ended_values("I live in Berlin now.", HOME) == []


def test_an_ended_observation_is_merged_into_the_one_the_change_updates() -> None:
    given = inputs([MOVED_AWAY], [HOME, FLAT])
    groups = narrow.assemble(given, {"f1": Decision("update", "o1")}, {"f1": ["o2"]})
    (group,) = groups
    assert group.base.text == f"{HOME} {FLAT}"
    plan = narrow.to_plan(given, groups, {0: narrow.join(group.base, [given.facts[0].shown()])})
    (merge,) = plan.merges
    assert merge.observation_ids == (given.observations[0].id, given.observations[1].id)
    assert merge.memory_ids == (given.facts[0].id,)
    assert merge.text == f"{HOME} {FLAT} As of 2026-01-01: {MOVED_AWAY}"
    assert not plan.creates and not plan.updates


@pytest.mark.parametrize("answer", ["yes", "no"])
async def test_a_model_is_asked_whether_a_change_ends_an_observation_beside_its_own(
    answer: str,
) -> None:
    request = _one_fact(MOVED_AWAY, [HOME, FLAT], "user")
    ids = [o.id for o in narrow.pass_inputs(request).observations]
    rewritten = f"{HOME} {FLAT} {MOVED_AWAY}" if answer == "yes" else f"{HOME} {MOVED_AWAY}"
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        fake.control(
            script=[
                {"content": '{"f1": "update:o1"}'},
                # "Paris" is in every text of the pass, so no telling word: the pick is asked.
                {"content": '{"same_subject": "yes"}'},
                {"content": f'{{"same_subject": "{answer}"}}'},
                {"content": orjson.dumps({"text": rewritten}).decode()},
            ]
        )
        llm = http_llm(fake.url)
        try:
            plan = await ask_v2.answer_pass(request, llm.complete, None, OPTIONS)
        finally:
            await llm.aclose()
        calls = fake.stats()["calls"]
    # Decide, the pick's question, what the change ends asked as of a change, the rewrite.
    assert [c["messages"][0][1] for c in calls[1:3]] == [CONFIRM_PROMPT, CHANGE_CONFIRM_PROMPT]
    assert orjson.loads(calls[2]["messages"][1][1])["observation"]["text"] == FLAT
    assert len(calls) == 4
    if answer == "yes":
        (merge,) = plan.merges
        assert (merge.observation_ids, merge.text) == (tuple(ids), rewritten)
        assert not plan.updates
    else:
        (update,) = plan.updates
        assert (update.observation_id, update.text) == (ids[0], rewritten)
        assert not plan.merges
    assert not plan.creates


async def test_a_decide_request_numbers_the_observations_it_shows_in_their_order() -> None:
    # The pass recalled them in another order (its refs): the request says o1 and o2 whatever
    # that order was, and the answer is taken back to the pass's refs.
    question = Question(
        Shown("f2", "Alice now plays chess at the club."),
        (
            Shown("o3", "Alice plays chess."),
            Shown("f1", "Alice joined the club."),
            Shown("o1", "Alice likes tea."),
        ),
    )
    numbered, refs = ask_v2._numbered([question])
    assert [c.ref for c in numbered[0].candidates] == ["o1", "f1", "o2"]
    assert refs == {"o1": "o3", "o2": "o1"}
    given = inputs(["Alice joined the club.", question.fact.text], ["Alice likes tea."])
    for answer, decision in (
        ("update:o1", Decision("update", "o3")),
        ("same:o2", Decision("same", "o1")),
        ("same:f1", Decision("same", "f1")),
        ("new", Decision("new")),
    ):
        with FakeLLMServer(FakeLLMConfig()) as fake:
            fake.control(script=[{"content": orjson.dumps({"f2": answer}).decode()}])
            llm = http_llm(fake.url)
            try:
                said = await ask_v2._decide(llm.complete, given, [question])
            finally:
                await llm.aclose()
        assert said == {"f2": decision}, answer


DOSE = "I take 5 mg of amlodipine every morning for my blood pressure."
GP = "My GP is Dr. Okafor at the Eastside practice."
RAISED = "Dr. Okafor raised my amlodipine dose from 5 mg to 10 mg."


def test_the_words_both_values_of_a_change_share_do_not_keep_a_text_from_stating_the_old() -> None:
    # "mg" is in both values: the dose at 5 mg states the old one, not the new.
    assert narrow.ended_values(RAISED, DOSE) == [frozenset({"5", "mg"})]
    assert narrow.ended_values(RAISED, "I take 10 mg of amlodipine now.") == []
    assert narrow.ended_values(RAISED, GP) == []
    upgraded = "The main database was upgraded from Postgres 14 to Postgres 16."
    assert narrow.ended_values(upgraded, "The main database runs Postgres 14.")
    assert narrow.ended_values(upgraded, "The main database runs Postgres 16.") == []


def test_a_change_pointed_at_what_does_not_state_its_old_value_moves_to_the_one_that_does() -> None:
    given = inputs([RAISED], [GP, DOSE])
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert [c.text for c in found.questions[0].candidates] == [GP, DOSE]
    for kind in ("same", "update"):
        assert narrow.onto_old_value(found, "f1", Decision(kind, "o1")) == Decision(kind, "o2")
        assert narrow.onto_old_value(found, "f1", Decision(kind, "o2")) == Decision(kind, "o2")
    assert narrow.onto_old_value(found, "f1", Decision("new")) == Decision("new")
    # Two candidates state the old value: the model's pick stands, whichever it is.
    found = _near(MOVED_AWAY, {HOME: 0.51, FLAT: 0.49})
    assert narrow.onto_old_value(found, "f1", Decision("update", "o2")) == Decision("update", "o2")
    # A fact that does not say what it replaces keeps its pick.
    given = inputs(["Dr. Okafor now sees me on Fridays."], [DOSE, GP])
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    picked = Decision("update", "o1")
    assert narrow.onto_old_value(found, "f1", picked) == picked


def test_a_range_is_not_moved_onto_the_observation_that_names_its_first_day() -> None:
    # Read as a change from Monday to Friday, the trust tin "replaced" the cleaner's Monday.
    cleaner = "The cleaner comes in on Monday evenings."
    given = inputs([TRUST_TIN], [HONESTY_BOX, cleaner])
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    refs = {c.text: c.ref for c in found.questions[0].candidates}
    assert refs.keys() == {HONESTY_BOX, cleaner}
    picked = Decision("same", refs[HONESTY_BOX])
    assert narrow.onto_old_value(found, "f1", picked) == picked
    assert narrow.made_stale(found, {"f1": picked}) == {}


HONESTY_BOX = "The farm shop is unstaffed on weekdays and runs on an honesty box."
TRUST_TIN = "From Monday to Friday nobody serves; customers pay into the trust tin by the door."
SELF_SERVICE = "Weekday sales in the shop are self-service, paid through the honesty box."


def test_a_fact_that_joins_one_observation_may_bridge_another_of_its_candidates() -> None:
    found = _near(SELF_SERVICE, {HONESTY_BOX: 0.63, TRUST_TIN: 0.53})
    assert narrow.bridged(found, {"f1": Decision("update", "o1")}, {}, OPTIONS) == {"f1": ["o2"]}
    assert narrow.bridged(found, {"f1": Decision("same", "o2")}, {}, OPTIONS) == {"f1": ["o1"]}
    assert narrow.bridged(found, {"f1": Decision("new")}, {}, OPTIONS) == {}
    # What a change ends is asked as of the change (made_stale), not again as a bridge.
    assert narrow.bridged(found, {"f1": Decision("update", "o1")}, {"f1": ["o2"]}, OPTIONS) == {}


def test_with_embeddings_a_bridge_is_asked_only_of_an_observation_near_the_fact() -> None:
    # The 0.5B model says yes to both questions of the travel insurance for the frequent flyer
    # programme (0.41 by MiniLM): a candidate, but no wording of the same thing.
    miles = "I collect miles with Lufthansa Miles & More."
    insurance = "Our annual travel insurance is with Allianz."
    found = _near(
        "My frequent flyer programme is Lufthansa Miles & More.", {miles: 0.8, insurance: 0.41}
    )
    assert narrow.bridged(found, {"f1": Decision("same", "o1")}, {}, OPTIONS) == {}
    near = narrow.NarrowOptions(bridge_cosine=0.4)
    assert narrow.bridged(found, {"f1": Decision("same", "o1")}, {}, near) == {"f1": ["o2"]}


def test_no_bridge_is_asked_of_a_change_or_of_another_property_or_a_picked_observation() -> None:
    found = _near(MOVED_AWAY, {HOME: 0.51, FLAT: 0.49})
    assert narrow.bridged(found, {"f1": Decision("update", "o1")}, {}, OPTIONS) == {}
    backups = "Database backups run every night at 02:00 UTC."
    found = _near(
        "Database backups are kept for 35 days.", {"Backups go to S3.": 0.6, backups: 0.6}
    )
    assert narrow.bridged(found, {"f1": Decision("same", "o1")}, {}, OPTIONS) == {}
    # Two facts of the pass, each pointing at one of the two: neither is bridged away.
    given = inputs([SELF_SERVICE, TRUST_TIN], [HONESTY_BOX, TRUST_TIN])
    found = narrow.pick_candidates(given, _SALES_VECTORS, narrow.NarrowOptions(cosine_floor=0.0))
    decisions = {"f1": Decision("same", "o1"), "f2": Decision("same", "o2")}
    assert narrow.bridged(found, decisions, {}, OPTIONS) == {}
    assert narrow.bridged(found, {"f1": Decision("same", "o1")}, {}, OPTIONS) == {"f1": ["o2"]}


def test_without_embeddings_no_bridge_is_asked() -> None:
    given = inputs([SELF_SERVICE], [HONESTY_BOX, TRUST_TIN])
    found = narrow.pick_candidates(given, None, narrow.NarrowOptions(lexical_floor=0.0))
    assert [c.text for c in found.question("f1").candidates] == [HONESTY_BOX, TRUST_TIN]
    assert narrow.bridged(found, {"f1": Decision("same", "o1")}, {}, OPTIONS) == {}


# The honesty box sure of the third wording (cosine 0.85), the trust tin 0.55 from it.
_SALES_VECTORS = {
    SELF_SERVICE: [1.0, 0.0, 0.0],
    HONESTY_BOX: [*_at(0.85), 0.0],
    TRUST_TIN: [0.55, 0.0, (1 - 0.55**2) ** 0.5],
}


async def _sales_embed(texts: Sequence[str]) -> list[str | None]:
    return [orjson.dumps(_SALES_VECTORS[t]).decode() for t in texts]


async def test_a_bridge_both_yes_no_questions_say_yes_to_merges_the_two_observations() -> None:
    request = _one_fact(SELF_SERVICE, [HONESTY_BOX, TRUST_TIN], "sales")
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        # The honesty box is sure (0.85); the bridge's two questions are asked, and the
        # rewrite of the merged observation is the fake's own answer.
        yes = {"content": '{"same_subject": "yes"}'}
        fake.control(script=[yes, yes])
        llm = http_llm(fake.url)
        try:
            with structlog.testing.capture_logs() as logs:
                plan = await ask_v2.answer_pass(request, llm.complete, _sales_embed, OPTIONS)
        finally:
            await llm.aclose()
        asked = [
            orjson.loads(next(c for role, c in call["messages"] if role == "user"))
            for call in fake.stats()["calls"]
        ]
    # The fact of the other observation, then the two observations: whether they are one.
    assert [a.get("task") for a in asked] == ["confirm", "confirm", "rewrite"]
    pairs = [(a["fact"]["text"], a["observation"]["text"]) for a in asked[:2]]
    assert pairs == [(SELF_SERVICE, TRUST_TIN), (TRUST_TIN, HONESTY_BOX)]
    assert asked[2]["observation"]["text"] == f"{HONESTY_BOX} {TRUST_TIN}"
    (merge,) = plan.merges
    ids = narrow.pass_inputs(request)
    assert merge.observation_ids == (ids.observations[0].id, ids.observations[1].id)
    assert merge.memory_ids == (ids.facts[0].id,)
    assert plan.creates == () and plan.updates == ()
    (logged,) = [e for e in logs if e["event"] == "v2_bridges"]
    assert logged["bridges"] == [
        {"fact": SELF_SERVICE, "joins": HONESTY_BOX, "merges": [TRUST_TIN]}
    ]


@pytest.mark.parametrize("answers", [["no"], ["yes", "no"]])
async def test_a_bridge_either_question_refuses_leaves_the_other_observation_alone(
    answers: list[str],
) -> None:
    request = _one_fact(SELF_SERVICE, [HONESTY_BOX, TRUST_TIN], "sales")
    script = [{"content": orjson.dumps({"same_subject": a}).decode()} for a in answers]
    plan, requests = await _answered(request, script, _sales_embed)
    assert requests == len(answers) + 1  # the questions, then the rewrite of the one joined
    ids = narrow.pass_inputs(request)
    assert plan.merges == () and plan.creates == ()
    assert [u.observation_id for u in plan.updates] == [ids.observations[0].id]


async def test_without_a_model_a_bridge_merges_when_the_other_observation_is_linked_too() -> None:
    request = _one_fact(SELF_SERVICE, [HONESTY_BOX, TRUST_TIN], "sales")
    vectors = {SELF_SERVICE: [1.0, 0.0, 0.0], HONESTY_BOX: [*_at(0.75), 0.0]}

    async def embed(texts: Sequence[str]) -> list[str | None]:
        far = [0.72, 0.0, (1 - 0.72**2) ** 0.5]
        return [orjson.dumps(vectors.get(t, far)).decode() for t in texts]

    plan = await ask_v2.answer_pass(request, None, embed, OPTIONS)
    ids = narrow.pass_inputs(request)
    (merge,) = plan.merges
    assert merge.observation_ids == (ids.observations[0].id, ids.observations[1].id)
    # Below the offline consolidator's own link, the other observation stays apart.
    vectors[TRUST_TIN] = [0.45, 0.0, (1 - 0.45**2) ** 0.5]
    plan = await ask_v2.answer_pass(request, None, embed, OPTIONS)
    assert plan.merges == ()
