"""The offline consolidator policy: always-valid, deterministic, lexical."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import orjson
from hypothesis import example, given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from consolidation.llm import offline
from consolidation.llm.client import OfflineConsolidator
from consolidation.llm.offline import SIMILARITY_THRESHOLD, consolidate, similarity
from consolidation.llm.prompts import (
    MAX_OBSERVATION_CHARS,
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    build_request,
    parse_answer,
)
from consolidation.runtime import build_consolidator
from consolidation.settings import load_settings
from tests.unit.test_prompts import citations

WHEN = datetime(2026, 1, 1, tzinfo=UTC)


def _request(facts: list[str], observations: list[str]) -> PassRequest:
    return build_request(
        "bank",
        ("alice",),
        None,
        [FactInput(UUID(int=i), text, ("alice",), None) for i, text in enumerate(facts, 1)],
        [
            ObservationInput(UUID(int=1000 + i), text, 1, WHEN)
            for i, text in enumerate(observations, 1)
        ],
    )


def _run(facts: list[str], observations: list[str]) -> tuple[dict[str, Any], PassPlan]:
    request = _request(facts, observations)
    answer = consolidate(orjson.loads(request.user_content))
    return answer, parse_answer(orjson.dumps(answer), request)


def test_threshold_separates_same_topic_from_unrelated() -> None:
    tea = "Alice drinks green tea every morning"
    assert similarity(tea, "Alice drinks green tea at work now") >= SIMILARITY_THRESHOLD
    assert similarity(tea, "Bob plays chess on weekends") < SIMILARITY_THRESHOLD
    assert similarity(tea, "Alice lives in Berlin") < SIMILARITY_THRESHOLD


def test_similarity_ignores_case_stop_words_and_short_tokens() -> None:
    assert similarity("The CAT is on a mat", "cat mat") == 1.0
    assert similarity("a I the of", "a I the of") == 0.0
    assert similarity("", "anything") == 0.0
    assert similarity("tea", "tea") == 1.0


def test_answer_always_has_the_three_keys() -> None:
    assert consolidate(
        {"bank": "b", "scope": [], "mission": None, "facts": [], "observations": []}
    ) == {
        "creates": [],
        "updates": [],
        "merges": [],
    }


def test_unrelated_facts_create_separate_observations() -> None:
    answer, plan = _run(["Alice drinks green tea every morning", "Bob plays chess on weekends"], [])
    assert answer["creates"] == [
        {"text": "Alice drinks green tea every morning", "facts": ["f1"]},
        {"text": "Bob plays chess on weekends", "facts": ["f2"]},
    ]
    assert plan.updates == ()
    assert plan.merges == ()


def test_same_topic_fact_updates_the_existing_observation() -> None:
    answer, plan = _run(
        ["Alice drinks green tea at work now"], ["Alice drinks green tea every morning."]
    )
    assert answer == {
        "creates": [],
        "updates": [
            {
                "observation": "o1",
                "text": "Alice drinks green tea every morning. Alice drinks green tea at work now",
                "facts": ["f1"],
            }
        ],
        "merges": [],
    }
    assert plan.updates[0].observation_id == UUID(int=1001)


def test_same_topic_facts_in_one_answer_grow_one_create() -> None:
    answer, _ = _run(
        ["Alice drinks green tea every morning", "Alice drinks green tea at work now"], []
    )
    assert answer["creates"] == [
        {
            "text": "Alice drinks green tea every morning. Alice drinks green tea at work now",
            "facts": ["f1", "f2"],
        }
    ]


def test_repeated_updates_accumulate_into_one_action() -> None:
    answer, plan = _run(
        ["Alice drinks green tea at work", "Alice drinks green tea with lemon"],
        ["Alice drinks green tea every morning."],
    )
    assert len(answer["updates"]) == 1
    assert answer["updates"][0]["facts"] == ["f1", "f2"]
    assert citations(plan) == {UUID(int=1): 1, UUID(int=2): 1}


def test_near_identical_observations_and_a_fact_are_merged() -> None:
    answer, plan = _run(
        ["Alice drinks green tea at work now"],
        [
            "Bob plays chess on weekends.",
            "Alice drinks green tea each morning.",
            "Alice drinks green tea every morning.",
        ],
    )
    assert answer["creates"] == answer["updates"] == []
    [merge] = answer["merges"]
    assert sorted(merge["observations"]) == ["o2", "o3"]
    assert merge["facts"] == ["f1"]
    assert "Alice drinks green tea at work now" in merge["text"]
    assert plan.merges[0].observation_ids[0] == UUID(int=1000 + int(merge["observations"][0][1:]))


def test_merge_keeps_the_most_similar_observation_first() -> None:
    answer, _ = _run(
        ["Alice drinks green tea every morning at home"],
        ["Alice drinks green tea at the office", "Alice drinks green tea every morning at home"],
    )
    assert answer["merges"][0]["observations"] == ["o2", "o1"]


def test_update_then_merge_of_the_same_observation_becomes_one_merge() -> None:
    # f1 updates o1 only; f2 then resembles both o2 and the updated o1, so they merge and the
    # earlier update folds into that merge instead of using o1 twice.
    answer, _ = _run(
        ["Alice works at the lab daily", "Alice drinks tea at the lab"],
        ["Alice works at the lab.", "Alice drinks tea."],
    )
    assert answer["updates"] == []
    assert answer["merges"] == [
        {
            "observations": ["o2", "o1"],
            "text": "Alice drinks tea. Alice works at the lab. Alice works at the lab daily. "
            "Alice drinks tea at the lab",
            "facts": ["f1", "f2"],
        }
    ]


def test_already_contained_fact_is_cited_without_changing_the_text() -> None:
    answer, _ = _run(["alice  drinks green tea"], ["Alice drinks green tea every morning."])
    assert answer["updates"] == [
        {"observation": "o1", "text": "Alice drinks green tea every morning.", "facts": ["f1"]}
    ]


def test_fact_restating_an_observation_with_more_detail_replaces_its_text() -> None:
    answer, _ = _run(["Alice drinks green tea every morning at home"], ["Alice drinks green tea"])
    assert answer["updates"] == [
        {
            "observation": "o1",
            "text": "Alice drinks green tea every morning at home",
            "facts": ["f1"],
        }
    ]


def test_contained_fact_without_content_words_is_cited_not_created() -> None:
    answer, _ = _run(["I am"], ["Who I am: a gardener."])
    assert answer["creates"] == []
    assert answer["updates"][0]["facts"] == ["f1"]


def test_blank_fact_is_left_uncited() -> None:
    answer, plan = _run(["   ", "Bob plays chess"], [])
    assert answer["creates"] == [{"text": "Bob plays chess", "facts": ["f2"]}]
    assert UUID(int=1) not in citations(plan)


def test_untouched_observations_are_not_mentioned() -> None:
    answer, _ = _run(["Bob plays chess on weekends"], ["Alice drinks green tea every morning."])
    assert answer["updates"] == answer["merges"] == []


def test_long_texts_drop_the_oldest_sentences_to_fit() -> None:
    old = " ".join(f"Alice drinks green tea number {i}." for i in range(200))
    answer, plan = _run(["Alice drinks green tea at work now"], [old])
    text = answer["updates"][0]["text"]
    assert len(text) <= MAX_OBSERVATION_CHARS
    assert text.endswith("Alice drinks green tea at work now")
    assert not text.startswith("Alice drinks green tea number 0.")
    assert plan.updates[0].text == text


def test_a_single_huge_fact_is_cut_to_the_limit() -> None:
    answer, _ = _run(["word " * 2000], [])
    assert 0 < len(answer["creates"][0]["text"]) <= MAX_OBSERVATION_CHARS


_words = st.sampled_from(
    ["alice", "bob", "tea", "green", "chess", "morning", "work", "Berlin", "the", "a", "I", "."]
)
_texts = st.one_of(
    st.lists(_words, max_size=12).map(" ".join),
    st.text(max_size=40),
    st.lists(st.sampled_from([".", "…", " ", "\t", "!", "-"]), max_size=6).map("".join),
    st.just("x " * 2500),
    st.just("Long sentence. " * 400),
)


@given(st.lists(_texts, max_size=8), st.lists(_texts, max_size=8))
@example(["."], [".:", ":."])  # merged as ".:. :.": the join's full stop after ".:"
def test_answers_always_pass_parse_answer(facts: list[str], observations: list[str]) -> None:
    request = _request(facts, observations)
    answer = consolidate(orjson.loads(request.user_content))
    assert set(answer) == {"creates", "updates", "merges"}
    plan = parse_answer(orjson.dumps(answer), request)
    # Every fact with visible text is cited by exactly one action.
    cited = citations(plan)
    for i, text in enumerate(facts, 1):
        if text.strip():
            assert cited.get(UUID(int=i)) == 1, (text, answer)
        else:
            assert UUID(int=i) not in cited


@given(st.lists(_texts, max_size=8), st.lists(_texts, max_size=8))
def test_answers_are_deterministic(facts: list[str], observations: list[str]) -> None:
    user = orjson.loads(_request(facts, observations).user_content)
    assert orjson.dumps(consolidate(user)) == orjson.dumps(consolidate(user))


# Words whose lower case depends on their neighbours (a final sigma) or changes their length.
_cased = st.lists(
    st.sampled_from(["ΟΔΟΣ", "ΣΑΣ", "Σ", "straße", "İstanbul", "tea", "Tea.", "the"]), max_size=10
).map(" ".join)


@given(st.lists(st.one_of(_texts, _cased), max_size=8), st.lists(_cased, max_size=8))
def test_an_appended_texts_words_known_from_its_parts_are_its_own(
    facts: list[str], observations: list[str]
) -> None:
    # _append tells the caches the words of the text it writes (from its parts); they must be
    # what tokenizing that text gives, or a later request would match on the wrong words.
    consolidate(orjson.loads(_request(facts, observations).user_content))
    for memo, derive in (
        (offline._tokens, offline._derive_tokens),
        (offline._normalized, offline._derive_normalized),
    ):
        known = dict(memo._values)
        assert known
        for text, value in known.items():
            assert value == derive(text), text


@given(_texts, _texts)
def test_similarity_is_symmetric_and_bounded(a: str, b: str) -> None:
    assert similarity(a, b) == similarity(b, a)
    assert 0.0 <= similarity(a, b) <= 1.0


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=200))
def test_an_ascii_texts_words_are_the_runs_the_regular_expression_finds(text: str) -> None:
    # ASCII text takes a faster path than the regular expression (every text the fake LLM
    # tokenizes in the benchmark); it must cut exactly the same words.
    lowered = text.lower()
    assert offline._words(lowered) == set(offline._WORD.findall(lowered))


def test_a_text_with_any_non_ascii_letter_is_cut_by_unicode_rules() -> None:
    assert offline._words("café_au lait, naïve") == {"café", "au", "lait", "naïve"}
    assert offline._words("tea_time: 2 cups") == {"tea", "time", "2", "cups"}


def _fit_by_sentences(text: str) -> str:
    """``offline._fit`` as it cuts every text: into sentences, the oldest dropped until the rest,
    joined by single spaces, fits."""
    text = text.strip()
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    sentences = offline._SENTENCE_END.split(text)
    while len(sentences) > 1 and len(" ".join(sentences)) > MAX_OBSERVATION_CHARS:
        sentences = sentences[1:]
    return " ".join(sentences)[:MAX_OBSERVATION_CHARS].strip()


_sentence = st.builds(
    lambda words, mark: " ".join(words) + mark,
    st.lists(st.sampled_from(["Alice", "drinks", "tea", "at", "work", "café", "9"]), min_size=1),
    st.sampled_from([".", "!", "?", "", "…"]),
)
_gap = st.sampled_from([" ", "  ", "\n", "\t", " \n ", "\u00a0"])


@given(
    st.lists(st.tuples(_sentence, _gap), min_size=1, max_size=12),
    st.integers(1, 300),
    st.booleans(),
)
def test_a_long_text_keeps_the_same_sentences_whichever_way_it_is_cut(
    parts: list[tuple[str, str]], over: int, single_spaced: bool
) -> None:
    # _fit finds the cut of a text spaced by single spaces at its end instead of splitting all
    # of it; the text kept must be the one the sentence-by-sentence cut keeps. The sentences
    # repeat until the text is ``over`` characters past the limit, so that sentence ends fall
    # anywhere around the cut.
    body = "".join(s + (" " if single_spaced else g) for s, g in parts)
    text = (body * (MAX_OBSERVATION_CHARS // len(body) + 2))[: MAX_OBSERVATION_CHARS + over]
    assert offline._fit(text) == _fit_by_sentences(text)


@given(st.one_of(st.text(max_size=80), st.text(alphabet="ab9Z_ .é", max_size=40), _cased))
def test_a_texts_content_words_skip_stop_words_and_single_characters(text: str) -> None:
    # ASCII text drops its one-character words by a set difference; the words kept must be
    # those a length test keeps.
    words = offline._words(text.lower())
    assert offline._derive_tokens(text) == {
        w for w in words if len(w) > 1 and w not in offline.STOP_WORDS
    }


_ascii_sentence = st.builds(
    lambda words, mark: " ".join(words) + mark,
    st.lists(
        st.sampled_from(["Alice", "drinks", "green", "tea", "at", "work", "9", "x1", "on-call"]),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from([".", "!", "?", ""]),
)


@given(
    st.lists(_ascii_sentence, min_size=1, max_size=10),
    st.lists(_ascii_sentence, min_size=1, max_size=3),
    st.integers(0, 200),
)
def test_a_trimmed_texts_words_known_from_what_it_dropped_are_its_own(
    sentences: list[str], fact: list[str], short_of_limit: int
) -> None:
    # An observation near the limit takes a fact and drops its oldest sentences; _append works
    # out the words of what is kept from the whole's words less those only the dropped
    # beginning had, and tells the caches. They must be what tokenizing the kept text gives.
    body = " ".join(sentences) + " "
    text = (body * (MAX_OBSERVATION_CHARS // len(body) + 1))[
        : MAX_OBSERVATION_CHARS - short_of_limit
    ].strip()
    kept = offline._append(text, " ".join(fact))
    for memo, derive in (
        (offline._tokens, offline._derive_tokens),
        (offline._normalized, offline._derive_normalized),
    ):
        if kept in memo._values:
            assert memo._values[kept] == derive(kept), kept


def test_a_fact_that_pushes_out_the_oldest_sentence_leaves_the_kept_texts_words_known() -> None:
    # The case the benchmark lives in: the caches learn the kept text's words without
    # tokenizing it, and "berlin", said only in the dropped sentence, is not among them.
    text = "Alice moved to Berlin. " + "Alice drinks green tea at work. " * 128
    text = text.strip()[:MAX_OBSERVATION_CHARS]
    kept = offline._append(text, "Alice now drinks oolong on Fridays.")
    assert not kept.startswith("Alice moved") and kept.endswith("oolong on Fridays.")
    assert kept in offline._tokens._values  # not derived: known from its parts
    assert offline._tokens._values[kept] == offline._derive_tokens(kept)
    assert "berlin" not in offline._tokens._values[kept]
    assert offline._normalized._values[kept] == offline._derive_normalized(kept)


def test_facts_folded_into_one_observation_read_as_sentences() -> None:
    text = "Sam builds the backend in Go and Postgres"
    assert offline._append(text, "Sam switched to Rust in May") == (
        "Sam builds the backend in Go and Postgres. Sam switched to Rust in May"
    )
    # A text that already ends a sentence gets no second full stop.
    assert offline._append("Sam likes tea.", "Sam likes coffee too") == (
        "Sam likes tea. Sam likes coffee too"
    )
    assert offline._append("Is Sam in?", "Sam is in") == "Is Sam in? Sam is in"


def test_the_offline_warning_says_how_it_decides() -> None:
    for extra, how in [
        ({}, "lexical similarity"),
        ({"embeddings_base_url": "http://127.0.0.1:9/v1"}, "the embeddings' cosine"),
    ]:
        with capture_logs() as logs:
            assert isinstance(build_consolidator(load_settings(**extra)), OfflineConsolidator)
        (warning,) = [e for e in logs if e["event"] == "offline_consolidator"]
        assert how in warning["message"], warning
