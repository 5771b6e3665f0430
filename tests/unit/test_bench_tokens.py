"""The token split of bench/perf/tokens.py: parts of a request, shared prefixes, OpenAI blocks."""

from __future__ import annotations

import random
from datetime import datetime
from uuid import uuid4

import orjson
import pytest

from bench.perf import tokens
from consolidation.llm import prompts


def _request(
    facts: list[str], observations: list[str], scope: tuple[str, ...] = ("a",)
) -> prompts.Chat:
    request = prompts.build_request(
        "bank",
        scope,
        None,
        [prompts.FactInput(uuid4(), text, scope, None) for text in facts],
        [prompts.ObservationInput(uuid4(), text, 1, datetime(2026, 1, 1)) for text in observations],
    )
    return prompts.pass_chat(request)


def test_the_parts_of_a_request_add_up_to_its_characters() -> None:
    chat = _request(["coffee black", "runs on Sundays"], ["likes tea"])
    messages = [(m["role"], m["content"]) for m in chat.messages()]

    split = tokens.split_request(messages)

    assert sum(split.chars.values()) == len(chat.system) + len(chat.user)
    assert split.chars["instructions"] == len(prompts.SYSTEM_PROMPT)
    user = orjson.loads(chat.user)
    assert split.chars["facts"] == len(orjson.dumps(user["facts"]))
    assert split.chars["observations"] == len(orjson.dumps(user["observations"]))
    assert (
        split.chars["frame"] == len(chat.user) - split.chars["facts"] - split.chars["observations"]
    )
    assert split.chars["repair"] == 0
    assert split.facts == 2


def test_instructions_in_the_user_message_count_as_instructions() -> None:
    chat = _request(["coffee black"], [])
    as_system = tokens.split_request([(m["role"], m["content"]) for m in chat.messages()])
    as_user = tokens.split_request([(m["role"], m["content"]) for m in chat.messages("user")])

    # The user message adds the blank line between the instructions and the object.
    assert as_user.chars["instructions"] == as_system.chars["instructions"] + 2
    for part in ("frame", "observations", "facts"):
        assert as_user.chars[part] == as_system.chars[part]


def test_a_repair_turn_counts_as_repair() -> None:
    chat = _request(["coffee black"], [])
    messages = [(m["role"], m["content"]) for m in chat.messages()]
    messages += [("assistant", "not json"), ("user", "That answer cannot be used")]

    split = tokens.split_request(messages)

    assert split.chars["repair"] == len("not json") + len("That answer cannot be used")


def test_the_shared_prefix_is_the_longest_with_any_earlier_request() -> None:
    shared = tokens.shared_prefixes(["abcdef", "abcxyz", "zzz", "abcdeq", "abcxy"])

    assert shared == [0, 3, 0, 5, 5]


def test_shared_prefixes_match_a_brute_force_search() -> None:
    rng = random.Random(7)
    requests = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 12))) for _ in range(60)]

    expected = [
        max((tokens.common_prefix(r, e) for e in requests[:i]), default=0)
        for i, r in enumerate(requests)
    ]

    assert tokens.shared_prefixes(requests) == expected


@pytest.mark.parametrize(
    ("a", "b", "length"),
    [("", "", 0), ("abc", "abc", 3), ("abc", "abd", 2), ("abc", "ab", 2), ("x", "y", 0)],
)
def test_common_prefix(a: str, b: str, length: int) -> None:
    assert tokens.common_prefix(a, b) == length


def test_openai_caches_whole_blocks_of_128_from_1024_tokens() -> None:
    assert tokens.openai_cached_tokens(1023) == 0
    assert tokens.openai_cached_tokens(1024) == 1024
    assert tokens.openai_cached_tokens(1151) == 1024
    assert tokens.openai_cached_tokens(1152) == 1152


def test_the_report_shares_the_server_prompt_tokens_out_by_characters() -> None:
    chats = [_request(["coffee black"], ["likes tea"]), _request(["runs"], [])]
    requests = [[(m["role"], m["content"]) for m in chat.messages()] for chat in chats]

    report = tokens.token_report(requests, 2, prompt_tokens=1000, completion_tokens=60)

    assert report.prompt_per_memory == 500
    assert report.completion_per_memory == 30
    assert sum(report.prompt_by_part.values()) == pytest.approx(500)
    # Both requests open with the same instructions: the second one shares at least them.
    assert report.shared_prefix_share > len(prompts.SYSTEM_PROMPT) / sum(
        len(c) for r in requests for _, c in r
    )


def test_without_usage_the_report_uses_the_fake_estimate() -> None:
    chat = _request(["coffee black"], [])
    messages = [(m["role"], m["content"]) for m in chat.messages()]

    report = tokens.token_report([messages], 1)

    expected = sum((len(c) + 3) // 4 for _, c in messages)
    assert report.prompt_tokens == expected
    assert report.shared_prefix_share == 0
