"""The quality benchmark's banks, judge and oracle (pure parts; the oracle run is in
tests/integration/test_bench_quality.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.quality.banks import load_banks
from bench.quality.judge import (
    MemoryFate,
    StoredObservation,
    baselines,
    date_words,
    judge_quality,
    shortfalls,
    unsupported_words,
)
from bench.quality.oracle import ChatRequest, LabelBook, Oracle, answer_v1, answer_v2
from bench.quality.run import rejudge

BANKS = load_banks()
BY_NAME = {b.name: b for b in BANKS}


def _request(bank: str, facts: list[str], observations: list[str]) -> ChatRequest:
    user = {
        "bank": bank,
        "scope": [],
        "mission": None,
        "facts": [{"ref": f"f{i}", "text": t} for i, t in enumerate(facts, 1)],
        "observations": [{"ref": f"o{i}", "text": t} for i, t in enumerate(observations, 1)],
    }
    return ChatRequest((("user", orjson.dumps(user).decode()),), user, None)


def test_the_banks_hold_enough_labelled_memories_with_one_held_out() -> None:
    assert len(BANKS) >= 3
    assert sum(len(b.bank.memories) for b in BANKS) >= 120
    assert [b.held_out for b in BANKS].count(True) >= 1
    for qbank in BANKS:
        kinds = {label.kind for label in qbank.bank.labels.values()}
        assert kinds == {"duplicates", "state_change", "fact"}, qbank.name
        assert qbank.hard_negatives, qbank.name
        assert len({m.tags for m in qbank.bank.memories}) >= 2, qbank.name
        assert all(m.occurred_at for m in qbank.bank.memories), qbank.name


def test_every_duplicate_group_spans_more_than_one_wave_of_sixteen() -> None:
    for qbank in BANKS:
        ordered = sorted(qbank.bank.memories, key=lambda m: (m.occurred_at, str(m.id)))
        waves: dict[str, set[int]] = defaultdict(set)
        for i, m in enumerate(ordered):
            waves[m.label].add(i // 16)
        for name, label in qbank.bank.labels.items():
            if label.kind == "duplicates":
                assert len(waves[name]) > 1, (qbank.name, name)


def test_the_baselines_score_as_the_quality_notes_say() -> None:
    for qbank in BANKS:
        per_memory = baselines(qbank)["one per memory"]
        per_scope = baselines(qbank)["one per scope"]
        assert per_memory["duplicate_labels_collapsed"] == 0
        assert per_memory["state_changes_captured"] == 0
        assert per_memory["facts_kept"] == per_memory["facts"]
        assert per_memory["observations_mixing_labels"] == 0
        assert per_scope["facts_kept"] == 0
        assert per_scope["state_changes_captured"] == per_scope["state_changes"]
        assert per_scope["hard_negatives_merged"] == per_scope["hard_negative_pairs"]
        assert shortfalls(per_memory) and shortfalls(per_scope)


def test_content_no_source_gave_is_unsupported_and_a_paraphrase_is_not() -> None:
    sources = ["I live in Paris, in the 11th arrondissement.", "I moved to Berlin."]
    assert unsupported_words("The user lives in Berlin now, previously Paris.", sources) == []
    assert unsupported_words("The user lives in Munich since 2024.", sources) == [
        "2024",
        "munich",
    ]
    # What an observation said before an update supports its new text.
    assert unsupported_words("Lives in Munich.", [*sources, "Lives in Munich."]) == []


def test_the_date_a_memory_happened_supports_a_text_that_gives_it() -> None:
    support = f"Priya took over as lead. {date_words('2025-11-10T09:00:00Z')}"
    assert unsupported_words("As of 2025-11-10: Priya took over as lead.", [support]) == []
    assert unsupported_words("Priya took over as lead on November 10, 2025.", [support]) == []
    assert unsupported_words("Priya took over as lead in 2024.", [support]) == ["2024"]


def test_the_judge_counts_merged_hard_negatives_skips_and_invented_words() -> None:
    qbank = BY_NAME["ops-team"]
    keys = {m.key: m for m in qbank.bank.memories}
    annas = StoredObservation(
        ("people",),
        keys["anna-dba-1"].text + " " + keys["anna-finance-1"].text + " She likes Rust.",
        ("anna-dba-1", "anna-finance-1"),
    )
    fates = [MemoryFate("anna-dba-2", ("skipped",), None, True)]
    j = judge_quality(qbank, [annas], fates)
    assert j["hard_negatives_merged"] == 1
    assert j["observations_mixing_labels"] == 1
    assert j["unsupported"] == [{"text": annas.text, "words": ["likes", "rust"]}]
    assert j["skipped"] == [
        {"key": "anna-dba-2", "label": "anna-dba", "reason": "no action of the answer cited it"}
    ]


def test_a_hard_negative_pair_held_by_several_observations_counts_once() -> None:
    qbank = BY_NAME["ops-team"]
    keys = {m.key: m for m in qbank.bank.memories}
    both = ("anna-dba-1", "anna-finance-1")
    text = keys["anna-dba-1"].text + " " + keys["anna-finance-1"].text
    piles = [StoredObservation(("people",), text, both), StoredObservation(("ops",), text, both)]
    j = judge_quality(qbank, piles, [])
    assert j["hard_negatives_merged"] == 1
    assert j["hard_negatives_merged"] <= j["hard_negative_pairs"]


def test_the_oracle_updates_the_observation_a_fact_restates_and_keeps_hard_negatives_apart() -> (
    None
):
    book = LabelBook.of(BANKS)
    dba, dba_twin, finance = (
        "Anna Kowalski is our database administrator.",
        "Our DBA is Anna Kowalski.",
        "Anna Lindqvist from finance handles our vendor contracts.",
    )
    answer = answer_v1(book, _request("ops-team", [dba_twin, finance], [dba]))
    assert answer["updates"] == [
        {"observation": "o1", "text": f"{dba} {dba_twin}", "facts": ["f1"]}
    ]
    assert answer["creates"] == [{"text": finance, "facts": ["f2"]}]
    assert answer["merges"] == []


def test_the_oracle_merges_two_observations_of_one_label_and_skips_unknown_facts() -> None:
    book = LabelBook.of(BANKS)
    first, second = "I drink my coffee black, no sugar.", "I take my coffee black, without sugar."
    answer = answer_v1(book, _request("realmodel", ["something no bank says"], [first, second]))
    assert answer["creates"] == [] and answer["updates"] == []
    merged = {"observations": ["o1", "o2"], "text": f"{first} {second}", "facts": []}
    assert answer["merges"] == [merged]


def test_the_oracle_answers_a_chat_completion_and_rejects_what_it_cannot_read() -> None:
    oracle = Oracle(LabelBook.of(BANKS))
    request = _request("realmodel", ["I have been vegetarian since 2019."], [])
    body = orjson.dumps({"messages": [{"role": "user", "content": request.messages[0][1]}]})
    status, answer = oracle.answer(body)
    assert status == 200
    content = orjson.loads(answer["choices"][0]["message"]["content"])
    assert content["creates"] == [{"text": "I have been vegetarian since 2019.", "facts": ["f1"]}]
    status, error = oracle.answer(b"not json")
    assert status == 400 and "oracle" in error["error"]["message"]


def _v2(fields: Mapping[str, object]) -> ChatRequest:
    user = {"contract": "v2", "bank": "household-diary", "scope": ["family"], **fields}
    return ChatRequest((("user", orjson.dumps(user).decode()),), user, None)


def test_the_v2_oracle_decides_by_label_and_never_joins_a_hard_negative() -> None:
    book = LabelBook.of(BANKS)
    daughter = "My daughter Anna is in third grade."
    niece = "My niece Anna studies medicine in Leipzig."
    quit_football = "Leo quit football and joined the swimming club in January."
    facts = [
        {"ref": "f2", "text": niece, "candidates": [{"ref": "o1", "text": daughter}]},
        {
            "ref": "f3",
            "text": "Anna, my daughter, is in grade three at school.",
            "candidates": [{"ref": "f2", "text": niece}, {"ref": "o1", "text": daughter}],
        },
        {
            "ref": "f4",
            "text": quit_football,
            "candidates": [{"ref": "o2", "text": "Leo plays football at the FC Nord club."}],
        },
    ]
    answer = answer_v2(book, _v2({"task": "decide", "facts": facts}))
    assert answer == {"f2": "new", "f3": "update:o1", "f4": "update:o2"}
    rewrite = {"task": "rewrite", "observation": {"text": daughter}, "facts": [facts[1]]}
    assert answer_v2(book, _v2(rewrite)) == {"text": f"{daughter} {facts[1]['text']}"}
    for fact, observation, said in (
        (niece, daughter, "no"),
        ("Anna, my daughter, is in grade three at school.", daughter, "yes"),
    ):
        confirm = {"task": "confirm", "observation": {"text": observation}, "fact": {"text": fact}}
        assert answer_v2(book, _v2(confirm)) == {"same_subject": said}


async def test_the_recorder_forwards_a_call_unchanged_and_writes_it_down(tmp_path: Path) -> None:
    from bench.quality.run import recorder_server
    from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer

    user = {"bank": "b", "scope": ["x"], "mission": None, "facts": [], "observations": []}
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": orjson.dumps(user).decode()},
        ],
    }
    with FakeLLMServer(FakeLLMConfig()) as fake, recorder_server(fake.url, tmp_path / "q") as url:
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            answer = await client.post("/chat/completions", json=body)
            direct = await client.post(f"{fake.url}/chat/completions", json=body)
    assert answer.status_code == 200
    assert answer.json()["choices"] == direct.json()["choices"]
    (line,) = (tmp_path / "q-calls.jsonl").read_bytes().splitlines()
    assert orjson.loads(line) == {
        "request": user,
        "messages": [["system", "S"], ["user", orjson.dumps(user).decode()]],
    }


def test_a_saved_run_is_judged_again_against_the_current_labels() -> None:
    qbank = BANKS[0]
    memories = qbank.bank.memories
    # One observation per memory, the first memory skipped: what a run saves of it.
    observations = [
        {"scope": [], "text": m.text, "sources": [m.key], "prior_texts": []} for m in memories[1:]
    ]
    fates: list[dict[str, Any]] = [  # as a run saves them, in JSON
        {
            "key": m.key,
            "actions": ["skipped" if i == 0 else "created"],
            "failed_reason": None,
            "consolidated": True,
            "skip_reason": "said nothing new" if i == 0 else None,
        }
        for i, m in enumerate(memories)
    ]
    saved = {
        "banks": {
            qbank.name: {"observations": observations, "fates": fates, "judgement": {"stale": 1}},
            # Saved before fates were kept, or of a bank whose labels are gone: left as saved.
            "old-run": {"observations": [], "judgement": {"stale": 1}},
        }
    }
    again = rejudge(saved)["banks"]
    judgement = again[qbank.name]["judgement"]
    expected = judge_quality(
        qbank,
        [StoredObservation((), m.text, (m.key,)) for m in memories[1:]],
        [MemoryFate(f["key"], tuple(f["actions"]), None, True, f["skip_reason"]) for f in fates],
    )
    assert judgement == expected
    assert judgement["skipped"] == [
        {"key": memories[0].key, "label": memories[0].label, "reason": "said nothing new"}
    ]
    assert again["old-run"]["judgement"] == {"stale": 1}
