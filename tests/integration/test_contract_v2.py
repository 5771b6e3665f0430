"""Contract v2 end to end: a real Postgres, the fake LLM (and embeddings) over real HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import pytest

from consolidation.llm import narrow
from consolidation.llm.client import Consolidator, LLMAnswer, OfflineConsolidator
from consolidation.llm.embeddings import HTTPEmbedder
from consolidation.llm.prompts import Chat
from consolidation.llm.prompts_v2 import Shown
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import consolidate, http_llm, ingest, markers
from tests.support.invariants import assert_consistent

V2 = Settings(llm_contract="v2")


class Recorder:
    """The real HTTP client to the fake, keeping every request's user object and schema."""

    def __init__(self, llm: Consolidator) -> None:
        self._llm = llm
        self.requests: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def complete(self, chat: Chat) -> LLMAnswer:
        self.requests.append((orjson.loads(chat.user), dict(chat.schema)))
        return await self._llm.complete(chat)

    async def aclose(self) -> None:
        await self._llm.aclose()

    def tasks(self) -> list[str | None]:
        return [user.get("task") for user, _ in self.requests]


@pytest.fixture
async def llm(fake: FakeLLMServer) -> AsyncIterator[Recorder]:
    client = Recorder(http_llm(fake.url))
    yield client
    await client.aclose()


async def texts_and_sources(pool: asyncpg.Pool, bank: str) -> dict[str, set[str]]:
    rows = await pool.fetch(
        "SELECT o.text, array_agg(m.text) AS sources FROM observations o"
        " JOIN observation_sources s ON s.observation_id = o.id"
        " JOIN memories m ON m.id = s.memory_id WHERE o.bank_id = $1 GROUP BY o.id, o.text",
        bank,
    )
    return {r["text"]: set(r["sources"]) for r in rows}


def memory(text: str, day: str, tags: tuple[str, ...] = ("alice",)) -> dict[str, Any]:
    return {"text": text, "tags": list(tags), "occurred_at": f"2026-{day}T09:00:00Z"}


async def test_v2_collapses_a_restatement_joins_an_update_and_keeps_an_unrelated_fact_apart(
    pool: asyncpg.Pool, llm: Recorder
) -> None:
    await ingest(
        pool,
        "b",
        [
            memory("Alice lives in Berlin.", "01-01"),
            memory("Bob plays the cello.", "01-02"),
            memory("Alice lives in Berlin.", "01-03"),
            memory("Alice moved from Berlin to Munich.", "03-01"),
        ],
    )
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide", "rewrite"]
    decided = [f["ref"] for user, _ in llm.requests[:1] for f in user["facts"]]
    # f1 and f2 have no candidate and f1 already says all f3 says: nothing to ask of them.
    assert decided == ["f4"]
    assert await texts_and_sources(pool, "b") == {
        "Alice lives in Berlin. As of 2026-03-01: Alice moved from Berlin to Munich.": {
            "Alice lives in Berlin.",
            "Alice moved from Berlin to Munich.",
        },
        "Bob plays the cello.": {"Bob plays the cello."},
    }
    counts = await markers(pool, "b")
    assert counts["consolidated"] == 4
    await assert_consistent(pool)

    # The next operation sees what the first wrote: a restatement is cited, its text kept.
    llm.requests.clear()
    await ingest(pool, "b", [memory("Bob plays the cello.", "04-01")])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == []
    observations = await texts_and_sources(pool, "b")
    assert len(observations) == 2
    assert observations["Bob plays the cello."] == {"Bob plays the cello."}
    cited = await pool.fetchval(
        "SELECT count(*) FROM observation_sources s JOIN observations o"
        " ON o.id = s.observation_id WHERE o.text = 'Bob plays the cello.'"
    )
    assert cited == 2


async def test_facts_with_no_candidate_make_no_call_and_keep_their_own_text(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    facts = ["Alice plays the cello.", "Bob fears spiders.", "Carol was born in Porto."]
    await ingest(pool, "b", [memory(t, f"01-0{i + 1}") for i, t in enumerate(facts)])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert fake.stats()["requests"] == 0
    assert await texts_and_sources(pool, "b") == {t: {t} for t in facts}
    actions = await pool.fetch("SELECT action FROM consolidation_outcomes")
    assert [r["action"] for r in actions] == ["created"] * 3
    assert end.summary.perf.llm_calls == 0


async def test_each_fact_is_pinned_to_new_or_its_own_candidates(
    pool: asyncpg.Pool, llm: Recorder
) -> None:
    await ingest(pool, "b", [memory("Alice lives in Berlin.", "01-01")])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    await ingest(
        pool,
        "b",
        [memory("Bob fears spiders.", "02-01"), memory("Alice lives in Berlin now.", "02-02")],
    )
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    user, schema = llm.requests[0]
    assert user["task"] == "decide"
    assert [f["ref"] for f in user["facts"]] == ["f2"]
    assert schema["properties"] == {
        "f2": {"type": "string", "enum": ["new", "same:o1", "update:o1"]}
    }
    assert schema["additionalProperties"] is False


async def test_an_invented_rewrite_is_repaired_once_then_replaced_by_the_join(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    await ingest(pool, "b", [memory("Alice lives in Berlin.", "01-01")])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    invented = orjson.dumps({"text": "Alice the astronaut moved to Munich from Berlin."}).decode()
    fake.control(
        script=[
            {"content": '{"f1": "update:o1"}'},
            {"content": invented},
            {"content": invented},
        ]
    )
    await ingest(pool, "b", [memory("Alice moved from Berlin to Munich in March.", "03-01")])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide", "rewrite", "rewrite"]
    repair = fake.stats()["calls"][2]["turns"]
    assert "astronaut" in str(repair)
    joined = narrow.join(
        Shown("o1", "Alice lives in Berlin."),
        [Shown("f1", "Alice moved from Berlin to Munich in March.", "2026-03-01T09:00:00Z")],
    )
    assert list(await texts_and_sources(pool, "b")) == [joined]
    await assert_consistent(pool)


async def test_a_decision_outside_the_enum_is_an_unusable_answer_as_in_v1(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    # Two observations, two candidates: the fact is asked about in a decide call.
    await ingest(
        pool,
        "b",
        [memory("Alice lives in Berlin.", "01-01"), memory("Alice works in Berlin.", "01-02")],
    )
    fake.control(script=[{"content": '{"same_subject": "no"}'}])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    assert len(await texts_and_sources(pool, "b")) == 2
    llm.requests.clear()
    fake.control(script=[{"content": '{"f1": "update:o7"}'}] * 4)
    await ingest(pool, "b", [memory("Alice lives in Berlin still.", "02-01")])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide"] * 4  # a repair, then the pass's retry and its repair
    assert (await markers(pool, "b"))["failed"] == 1


async def test_v1_is_unchanged_when_asked_for(pool: asyncpg.Pool, llm: Recorder) -> None:
    await ingest(pool, "b", [memory("Alice lives in Berlin.", "01-01")])
    end = await consolidate(pool, "b", llm, Settings(llm_contract="v1"))
    assert end.status == "completed", end.error
    ((user, schema),) = llm.requests
    assert "contract" not in user
    assert set(user) == {"bank", "scope", "mission", "facts", "observations"}
    assert set(schema["properties"]) == {"creates"}


@pytest.fixture
async def embedder(fake: FakeLLMServer) -> AsyncIterator[HTTPEmbedder]:
    client = HTTPEmbedder(base_url=fake.url, model="fake-embed", max_retries=2)
    yield client
    await client.aclose()


async def consolidate_offline(pool: asyncpg.Pool, embedder: HTTPEmbedder) -> None:
    """One operation of bank ``b`` by the offline consolidator with embeddings, to the end."""
    from consolidation import queue
    from consolidation.engine import run_operation

    lease = await queue.start_foreground(pool, "b", "test-worker", 30)
    end = await run_operation(pool, lease, OfflineConsolidator(), Settings(), embedder=embedder)
    assert end.status == "completed", end.error


async def test_the_offline_consolidator_with_embeddings_collapses_twins_without_a_call(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    await ingest(
        vector_pool,
        "b",
        [
            memory("Alice loves green tea.", "01-01"),
            memory("Alice plays the cello.", "01-02"),
            memory("Alice loves green tea.", "01-03"),
            memory("Alice adores green tea.", "01-04"),
        ],
    )
    await consolidate_offline(vector_pool, embedder)
    assert fake.stats()["requests"] == 0
    observations = await texts_and_sources(vector_pool, "b")
    assert observations == {
        "Alice loves green tea.": {"Alice loves green tea.", "Alice adores green tea."},
        "Alice plays the cello.": {"Alice plays the cello."},
    }


async def test_the_offline_consolidator_links_a_fact_to_the_sentence_of_a_long_observation_it_restates(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    grown = (
        "Alice has a cat named Miso. She is a grey tabby who sleeps on the sofa, chases birds in"
        " the garden and hates the vet."
    )
    restated = "Alice owns a cat named Miso."
    # The fake's vectors put the fact at about 0.51 of the whole text, under the offline
    # consolidator's link, and at 0.89 of its first sentence.
    for text, day in ((grown, "01-01"), (restated, "02-01")):
        await ingest(vector_pool, "b", [memory(text, day)])
        await consolidate_offline(vector_pool, embedder)
    assert fake.stats()["requests"] == 0
    observations = await texts_and_sources(vector_pool, "b")
    assert observations == {f"{grown} As of 2026-02-01: {restated}": {grown, restated}}


async def test_facts_per_call_puts_several_facts_in_one_decide_call(
    pool: asyncpg.Pool, llm: Recorder
) -> None:
    await ingest(
        pool,
        "b",
        [
            memory("Alice lives in Berlin.", "01-01"),
            memory("Alice lives in Berlin with Tom.", "01-02"),
            memory("Alice lives in Berlin near Tom.", "01-03"),
            memory("Alice lives in Berlin near Tom and Eva.", "01-04"),
        ],
    )
    end = await consolidate(pool, "b", llm, Settings(llm_contract="v2", llm_v2_facts_per_call=8))
    assert end.status == "completed", end.error
    # f2 has one candidate, f1, and shares none but the pass's common words with it: new
    # without a call. f3 and f4 have two each and are asked in one call.
    decides = [user for user, _ in llm.requests if user.get("task") == "decide"]
    assert [[f["ref"] for f in user["facts"]] for user in decides] == [["f3", "f4"]]


ATLAS = [
    "The Atlas backend is written in Go.",
    "The Atlas budget is 120k EUR.",
    "The weekly Atlas sync is on Tuesdays.",
]


async def test_without_embeddings_an_update_sharing_no_telling_word_is_new_without_a_question(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    tags = ("atlas",)
    await ingest(pool, "b", [memory(t, f"01-0{i + 1}", tags) for i, t in enumerate(ATLAS)])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    llm.requests.clear()
    fake.control(script=[{"content": '{"f1": "update:o1"}'}])
    await ingest(pool, "b", [memory("Maria leads the design work on Atlas.", "02-01", tags)])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide"]  # no confirm, no rewrite
    observations = await texts_and_sources(pool, "b")
    assert observations["Maria leads the design work on Atlas."] == {
        "Maria leads the design work on Atlas."
    }
    assert len(observations) == 4
    await assert_consistent(pool)


@pytest.mark.parametrize(("confirmed", "expected"), [("no", 4), ("yes", 3)])
async def test_a_same_project_update_is_confirmed_by_one_yes_or_no_question(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder, confirmed: str, expected: int
) -> None:
    tags = ("atlas",)
    await ingest(pool, "b", [memory(t, f"01-0{i + 1}", tags) for i, t in enumerate(ATLAS)])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    assert len(await texts_and_sources(pool, "b")) == 3
    llm.requests.clear()
    fake.control(
        script=[
            {"content": '{"f1": "update:o1"}'},
            {"content": orjson.dumps({"same_subject": confirmed}).decode()},
        ]
    )
    # One telling word shared with each observation ("Atlas" is in them all): too little to
    # take the model's update as said, something to ask about.
    maria = "Maria leads design work on the Atlas backend, budget planning and Tuesday meetings."
    await ingest(pool, "b", [memory(maria, "02-01", tags)])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks()[:2] == ["decide", "confirm"]
    asked = llm.requests[1][0]
    assert asked["fact"]["text"] == maria
    assert asked["observation"]["text"] in ATLAS
    observations = await texts_and_sources(pool, "b")
    assert len(observations) == expected
    alone = maria in observations
    assert alone == (confirmed == "no")
    await assert_consistent(pool)


async def test_an_update_announcing_a_change_of_what_it_names_needs_no_confirmation(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    await ingest(pool, "b", [memory("I work as an accountant at Acme.", "01-01")])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    llm.requests.clear()
    fake.control(script=[{"content": '{"f1": "update:o1"}'}])
    await ingest(pool, "b", [memory("I left Acme and started a new job at Globex.", "02-01")])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide", "rewrite"]
    (text,) = await texts_and_sources(pool, "b")
    assert "Acme" in text and "Globex" in text


async def test_an_update_onto_an_observation_measuring_another_property_is_new_without_asking(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    schedule = "Database backups run every night at 02:00 UTC."
    await ingest(pool, "b", [memory(schedule, "01-01", ("ops",))])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    llm.requests.clear()
    # The model takes how long backups are kept for an update of when they run: two telling
    # words are shared, but the fact gives a duration and the observation a time of day.
    fake.control(script=[{"content": '{"f1": "update:o1"}'}])
    retention = "Database backups are kept for 35 days."
    await ingest(pool, "b", [memory(retention, "02-01", ("ops",))])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    # Its one candidate: any pick of it would be made new, so nothing is asked at all.
    assert llm.tasks() == []
    assert await texts_and_sources(pool, "b") == {schedule: {schedule}, retention: {retention}}
    await assert_consistent(pool)


async def test_a_change_that_shares_no_word_with_the_old_state_is_still_asked_about_it(
    pool: asyncpg.Pool, fake: FakeLLMServer, llm: Recorder
) -> None:
    await ingest(pool, "b", [memory("I work as an accountant at Acme Corp.", "01-01")])
    assert (await consolidate(pool, "b", llm, V2)).status == "completed"
    llm.requests.clear()
    # Without embeddings nothing is near the new job; it announces a change, so the decide
    # call shows it every observation, and the pick, sharing no word, is confirmed.
    fake.control(
        script=[
            {"content": '{"f1": "update:o1"}'},
            {"content": '{"same_subject": "yes"}'},
        ]
    )
    await ingest(pool, "b", [memory("I started a new job as a data analyst at Globex.", "02-01")])
    end = await consolidate(pool, "b", llm, V2)
    assert end.status == "completed", end.error
    assert llm.tasks() == ["decide", "confirm", "rewrite"]
    (text,) = await texts_and_sources(pool, "b")
    assert "Globex" in text
    await assert_consistent(pool)


HONESTY_BOX = "The farm shop is unstaffed on weekdays and runs on an honesty box."
TRUST_TIN = "Nobody serves on weekdays; customers pay into the trust tin by the door."
# The fake's vectors put this 0.63 of the honesty box and 0.62 of the trust tin, which are 0.10
# apart (a candidate of neither).
BOTH = "On weekdays the shop is unstaffed; customers pay into the honesty box or the trust tin."


async def consolidate_v2(pool: asyncpg.Pool, llm: Recorder, embedder: HTTPEmbedder) -> None:
    """One operation of bank ``b`` over contract v2 with the fake's embeddings, to the end."""
    from consolidation import queue
    from consolidation.engine import run_operation

    lease = await queue.start_foreground(pool, "b", "test-worker", 30)
    end = await run_operation(pool, lease, llm, V2, embedder=embedder)
    assert end.status == "completed", end.error


@pytest.mark.parametrize("one_thing", ["yes", "no"])
async def test_a_fact_near_two_observations_an_earlier_pass_left_apart_merges_them_on_a_yes(
    vector_pool: asyncpg.Pool,
    fake: FakeLLMServer,
    llm: Recorder,
    embedder: HTTPEmbedder,
    one_thing: str,
) -> None:
    tags = ("sales",)
    for text, day in ((HONESTY_BOX, "01-01"), (TRUST_TIN, "02-01")):
        await ingest(vector_pool, "b", [memory(text, day, tags)])
        await consolidate_v2(vector_pool, llm, embedder)
    assert len(await texts_and_sources(vector_pool, "b")) == 2
    assert llm.requests == []  # each was near nothing: new without a call
    # The third is near both, and sure of the honesty box (three telling words at 0.63): the
    # fact is asked of the trust tin, and after a yes the two observations together.
    answer = {"content": orjson.dumps({"same_subject": one_thing}).decode()}
    fake.control(script=[answer, answer] if one_thing == "yes" else [answer])
    await ingest(vector_pool, "b", [memory(BOTH, "03-01", tags)])
    await consolidate_v2(vector_pool, llm, embedder)
    asked = [user for user, _ in llm.requests if user.get("task") == "confirm"]
    pairs = [(a["fact"]["text"], a["observation"]["text"]) for a in asked]
    expected = [(BOTH, TRUST_TIN), (TRUST_TIN, HONESTY_BOX)]
    assert pairs == (expected if one_thing == "yes" else expected[:1])
    observations = await texts_and_sources(vector_pool, "b")
    if one_thing == "yes":
        (sources,) = observations.values()
        assert sources == {HONESTY_BOX, TRUST_TIN, BOTH}
        # The trust tin's text is kept in its history, merged away into the honesty box.
        away = await vector_pool.fetch(
            "SELECT previous_text FROM observation_history WHERE action = 'merged_away'"
        )
        assert [r["previous_text"] for r in away] == [TRUST_TIN]
    else:
        assert len(observations) == 2
        assert observations[TRUST_TIN] == {TRUST_TIN}
    await assert_consistent(vector_pool)
