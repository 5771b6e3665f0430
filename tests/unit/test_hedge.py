"""Hedged LLM requests against the real fake server over loopback: a slow request's copy goes
only into a spare slot, the first usable answer wins, and a first request takes a copy's slot."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from consolidation import runtime
from consolidation.llm.client import HTTPConsolidator, LLMRetriesExhausted
from consolidation.llm.hedge import Hedging
from consolidation.settings import load_settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.waiting import wait_for
from tests.unit.test_llm import chat, closing_clients

# Quick answers that give the hedge its latencies, then a request that never gets one.
WARM = 3


def hedges(outcome: str) -> float:
    return REGISTRY.get_sample_value("consolidation_llm_hedges_total", {"outcome": outcome}) or 0.0


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., HTTPConsolidator]]:
    async with closing_clients(HTTPConsolidator, "test-model") as make:
        yield make


def test_the_delay_is_the_quantile_of_the_recent_latencies() -> None:
    hedging = Hedging(0.95, min_samples=20, window=100)
    for seconds in range(1, 20):
        hedging.observe(float(seconds))
    assert hedging.delay() is None  # 19 answers: too few to read a tail from
    for seconds in range(20, 201):
        hedging.observe(float(seconds))
    # The window keeps the latest 100 (101..200); the 95th percentile of those.
    assert hedging.delay() == 196.0
    with pytest.raises(ValueError):
        Hedging(1.0)


async def test_a_request_with_no_answer_is_answered_by_its_copy() -> None:
    settings = load_settings(llm_hedge_quantile=0.9)  # min samples: the default
    with FakeLLMServer() as fake:
        llm = runtime.build_consolidator(settings.model_copy(update={"llm_base_url": fake.url}))
        assert isinstance(llm, HTTPConsolidator)
        try:
            warm = [await llm.complete(chat("Alice lives in Paris.")) for _ in range(20)]
            won_before = hedges("copy")
            fake.control(script=[{"hang": True}])
            answer = await llm.complete(chat("Alice lives in Paris."))
        finally:
            await llm.aclose()
        assert orjson.loads(answer.content)["creates"]
        assert hedges("copy") == won_before + 1
        # The copy is charged too: the same prompt twice.
        assert answer.prompt_tokens == 2 * warm[0].prompt_tokens
        assert answer.completion_tokens == warm[0].completion_tokens
        await wait_for(lambda: fake.stats()["aborted"] == 1, what="the hung request aborted")
        stats = fake.stats()
        assert stats["requests"] == 22 and stats["completed"] == 21 and stats["in_flight"] == 0


async def test_no_copy_is_sent_without_a_spare_slot(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        client = make_client(
            fake.url,
            max_concurrent=1,
            hedge_quantile=0.5,
            hedge_min_samples=WARM,
            timeout_s=1.0,
            max_retries=0,
        )
        for _ in range(WARM):
            await client.complete(chat("a fact"))
        fake.control(script=[{"hang": True}])
        with pytest.raises(LLMRetriesExhausted):
            await client.complete(chat("a fact"))
        assert fake.stats()["requests"] == WARM + 1


async def test_hedging_off_sends_no_copy(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        client = make_client(fake.url, timeout_s=1.0, max_retries=0)
        for _ in range(25):
            await client.complete(chat("a fact"))
        fake.control(script=[{"hang": True}])
        with pytest.raises(LLMRetriesExhausted):
            await client.complete(chat("a fact"))
        assert fake.stats()["requests"] == 26


async def test_a_first_request_takes_the_slot_of_a_copy(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        client = make_client(fake.url, max_concurrent=2, hedge_quantile=0.5, hedge_min_samples=WARM)
        for _ in range(WARM):
            await client.complete(chat("a fact"))
        preempted_before = hedges("preempted")
        fake.control(script=[{"hang": True}, {"hang": True}])
        stuck = asyncio.create_task(client.complete(chat("a stuck fact", scope=("a",))))
        try:
            # The stuck request and its copy hold both slots.
            await wait_for(lambda: fake.stats()["in_flight"] == 2, what="the copy sent")
            answer = await client.complete(chat("another fact", scope=("b",)))
            assert orjson.loads(answer.content)["creates"]
            assert hedges("preempted") == preempted_before + 1
            assert answer.prompt_tokens > 0 and not stuck.done()
            # The preempted copy's connection is closed by the client; the server sees it go
            # on its own time.
            await wait_for(lambda: fake.stats()["aborted"] == 1, what="the copy aborted")
            assert fake.stats()["requests"] == WARM + 3
        finally:
            stuck.cancel()
            await asyncio.gather(stuck, return_exceptions=True)
        await wait_for(lambda: fake.stats()["in_flight"] == 0, what="every request ended")


async def test_cancelling_the_caller_aborts_both_requests(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        client = make_client(fake.url, hedge_quantile=0.5, hedge_min_samples=WARM)
        for _ in range(WARM):
            await client.complete(chat("a fact"))
        fake.control(script=[{"hang": True}, {"hang": True}])
        call = asyncio.create_task(client.complete(chat("a fact")))
        await wait_for(lambda: fake.stats()["in_flight"] == 2, what="the copy sent")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await wait_for(lambda: fake.stats()["aborted"] == 2, what="both requests aborted")
        assert fake.stats()["in_flight"] == 0


async def test_the_delay_runs_from_when_the_request_holds_its_slot() -> None:
    # A request that waited at a busy cap longer than the delay is still hedged once it is
    # sent, and not before: its copy is asked for only after it holds its slot.
    hedging = Hedging(0.5, min_samples=1)
    hedging.observe(0.01)
    loop = asyncio.get_running_loop()
    slot = asyncio.Event()
    sent: asyncio.Future[None] = loop.create_future()
    answer: asyncio.Future[str] = loop.create_future()
    copies_asked: list[bool] = []

    async def first() -> str:
        await slot.wait()
        sent.set_result(None)
        return await answer

    async def copy() -> Any:
        copies_asked.append(sent.done())

        async def quick() -> str:
            return "copy"

        return quick()

    race = asyncio.ensure_future(hedging.race(first(), copy, lambda _: True, sent))
    # Twenty delays spent waiting for a slot: no copy yet.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(race), timeout=0.2)
    assert copies_asked == []
    slot.set()
    assert await race == ("copy", 2)
    assert copies_asked == [True]
    answer.cancel()
