"""The dashboard at /ui of a real `consolidation serve`, in a real headless Chromium.

Each view is saved as a PNG (UI_SCREENSHOTS, else the test's tmp dir) for a person to look at.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select

from consolidation.testing.fake_llm import POISON_MARKER, FakeLLMConfig, FakeLLMServer
from tests.support.api import operation, post_memories, submit, wait_status
from tests.support.browser import (
    attribute,
    chromium,
    click,
    find,
    screenshots_dir,
    text,
    wait,
)
from tests.support.engine import markers
from tests.support.services import Serve, Services, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.acceptance


@pytest.fixture
def slow_fake() -> Any:
    # Slow enough that a 60-memory operation runs for 12 s or more, one wave at a time.
    with FakeLLMServer(FakeLLMConfig(latency_ms=400)) as server:
        yield server


async def _ingest(client: httpx.AsyncClient, bank: str, texts: list[str], tag: str) -> None:
    await post_memories(client, bank, [{"text": t, "tags": [tag]} for t in texts])


def _processed(driver: WebDriver, operation_id: str) -> int | None:
    value = attribute(driver, f'tr[data-operation="{operation_id}"] .progress', "data-processed")
    return None if value is None else int(value)


def _confirm(driver: WebDriver, shots: Path, name: str) -> None:
    """Accept the confirmation dialog, which must be open, after a screenshot of it."""
    wait(driver, lambda d: find(d, "dialog#confirm[open]"), "the confirmation dialog")
    driver.save_screenshot(str(shots / name))
    click(driver, "dialog#confirm[open] #confirm-yes", "the confirmation button")


async def test_the_dashboard_follows_progress_cancels_after_confirming_and_recovers_failures(
    pool: asyncpg.Pool,
    database_url: str,
    slow_fake: FakeLLMServer,
    services: Services,
    tmp_path: Path,
) -> None:
    env = worker_env(database_url, slow_fake.url, CONSOLIDATION_WAVE_SIZE="2")
    service = services.start("svc", env)
    base = await service.api_url()
    shots = screenshots_dir(tmp_path)
    print(f"\n[dashboard] screenshots in {shots}")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # carol: three memories, one of which the model cannot answer for → one failed.
        await _ingest(
            client,
            "carol",
            [
                "Carol runs the Berlin office and prefers morning meetings",
                f"Carol's calendar export is corrupted {POISON_MARKER}",
                "Carol moved the Berlin office meetings to Tuesday mornings",
            ],
            "carol",
        )
        carol_op = await submit(client, "carol")

        await wait_status(client, carol_op, "completed", 60, "carol's operation to complete")
        assert await markers(pool, "carol") == {"consolidated": 2, "failed": 1, "pending": 0}

        # alice: sixty memories in waves of two, each wave a 400 ms LLM call: a long operation,
        # started once the browser is up.
        await _ingest(
            client,
            "alice",
            [f"Alice tried tea blend number {i} and rated it {i % 5 + 1} of 5" for i in range(60)],
            "alice",
        )

        with chromium(tmp_path / "profile") as driver:
            driver.get(f"{base}/ui")
            cells = wait(
                driver,
                lambda d: (row := text(d, 'tr[data-bank="carol"]')) and row.split(),
                "carol in the banks table",
            )
            assert cells[:4] == ["carol", "0", "2", "1"]
            driver.save_screenshot(str(shots / "1-banks.png"))

            # The operations view refreshes itself: the running operation's progress moves
            # while the test never reloads the page.
            alice_op = await submit(client, "alice")
            driver.get(f"{base}/ui/operations")
            row = f'tr[data-operation="{alice_op}"]'
            first = wait(
                driver,
                lambda d: attribute(d, row, "data-status") == "running" and _processed(d, alice_op),
                "alice's operation running with some memories processed",
            )
            wait(
                driver,
                lambda d: (_processed(d, alice_op) or 0) > first,
                f"alice's progress to move past {first}",
            )
            driver.save_screenshot(str(shots / "2-operations-running.png"))
            assert driver.execute_script("return performance.navigation.type") == 0  # no reload

            click(driver, f'{row} button[data-kind="cancel"]', "alice's cancel button")
            _confirm(driver, shots, "3-cancel-confirmation.png")
            wait(
                driver,
                lambda d: attribute(d, row, "data-status") == "cancelled",
                "alice's operation shown cancelled",
            )
            assert (await operation(client, alice_op))["status"] == "cancelled"
            assert (await markers(pool, "alice"))["pending"] > 0
            driver.save_screenshot(str(shots / "4-operations-cancelled.png"))

            # A bank's failed memories, with the reason, and the recover button.
            driver.get(f"{base}/ui/banks/carol")
            failed = wait(driver, lambda d: text(d, "#failed tr[data-memory]"), "a failed row")
            assert POISON_MARKER in failed
            reason = text(driver, "#failed tr[data-memory] td.reason")
            assert reason and reason != "not recorded", reason
            driver.save_screenshot(str(shots / "5-bank-failed.png"))
            assert text(driver, 'button[data-kind="recover"]') == "Recover 1 failed"
            click(driver, 'button[data-kind="recover"]', "the recover button")
            _confirm(driver, shots, "6-recover-confirmation.png")
            wait(
                driver,
                lambda d: "1 failed memory will be consolidated again" in (text(d, "#flash") or ""),
                "the recover message",
            )
            wait(driver, lambda d: find(d, "#failed tr[data-memory]") is None, "no failed row")
            assert await markers(pool, "carol") == {"consolidated": 2, "failed": 0, "pending": 1}
            driver.save_screenshot(str(shots / "7-bank-recovered.png"))

            # Observations of one scope, with the memories they come from.
            click(driver, "ul.scopes a", "the scope carol")
            sources = wait(
                driver, lambda d: text(d, "div.observations"), "the observations of carol"
            )
            assert "Carol runs the Berlin office" in sources
            assert "Carol moved the Berlin office meetings" in sources
            assert POISON_MARKER not in sources
            driver.save_screenshot(str(shots / "8-observations.png"))


async def test_with_an_api_key_the_dashboard_asks_for_it_once_and_keeps_a_strict_cookie(
    serve: Serve, tmp_path: Path
) -> None:
    service = serve("svc", "--no-worker", API_KEY="s3cret")
    base = await service.api_url()
    shots = screenshots_dir(tmp_path)
    bearer = {"Authorization": "Bearer s3cret"}
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=bearer) as client:
        await _ingest(client, "dora", ["Dora keeps bees on the roof"], "dora")

        with chromium(tmp_path / "profile") as driver:
            driver.get(f"{base}/ui/banks/dora")
            wait(driver, lambda d: "/ui/login" in d.current_url, "the key form")
            driver.save_screenshot(str(shots / "9-login.png"))

            driver.find_element(By.ID, "key").send_keys("wrong")
            driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            error = wait(driver, lambda d: text(d, ".error"), "the refusal")
            assert error == "That is not the API key."
            assert driver.get_cookie("consolidation_session") is None

            driver.find_element(By.ID, "key").send_keys("s3cret")
            driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            wait(driver, lambda d: d.current_url.endswith("/ui/banks/dora"), "back to the page")
            cookie = driver.get_cookie("consolidation_session")
            assert cookie is not None
            assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
            assert "s3cret" not in cookie["value"]
            assert "consolidation_session" not in driver.execute_script("return document.cookie")

            # Asked once: other pages, and the API calls behind the buttons, use the cookie.
            driver.get(f"{base}/ui")
            wait(driver, lambda d: find(d, 'tr[data-bank="dora"]'), "the banks table")
            driver.get(f"{base}/ui/banks/dora")
            click(driver, 'button[data-kind="consolidate"]', "the consolidate button")
            wait(
                driver,
                lambda d: "enqueued" in (text(d, "#flash") or ""),
                "the consolidation to be enqueued",
            )
            driver.save_screenshot(str(shots / "10-signed-in-bank.png"))
            listed = (await client.get("/v1/operations", params={"bank_id": "dora"})).json()
            assert [op["status"] for op in listed["operations"]] == ["pending"]

            # Signing out drops the cookie; the pages ask for the key again.
            click(driver, "form.signout button", "sign out")
            wait(driver, lambda d: "/ui/login" in d.current_url, "the key form again")
            assert driver.get_cookie("consolidation_session") is None

        # The API's bearer auth is what it was.
        anonymous = await client.get("/v1/banks", headers={"Authorization": ""})
        assert anonymous.status_code == 401
        assert (await client.get("/v1/banks")).status_code == 200


async def test_the_dashboard_explains_a_bank_stuck_on_a_dead_llm_and_retries_a_failed_operation(
    database_url: str, services: Services, tmp_path: Path
) -> None:
    # A model that answers every request 503, and 401 to the passes of bank fay's memory.
    dead = FakeLLMConfig(fail_rate=1.0, fail_when_contains="fay-key", fail_when_status=401)
    with FakeLLMServer(dead) as llm:
        env = worker_env(database_url, llm.url, CONSOLIDATION_RETRY_BACKOFF_S="600")
        service = services.start("svc", env)
        base = await service.api_url()
        shots = screenshots_dir(tmp_path)
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            await _ingest(client, "erin", ["Erin plays the cello", "Erin lives in Lyon"], "erin")
            erin_op = await submit(client, "erin")

            async def erin_waits_to_retry() -> bool:
                op = await operation(client, erin_op)
                waiting: bool = op["status"] == "pending" and op["attempt"] == 1
                return waiting

            await wait_for(erin_waits_to_retry, timeout_s=60, what="erin's first attempt to fail")

            await _ingest(client, "fay", ["Fay's token is fay-key"], "fay")
            fay_op = await submit(client, "fay")

            await wait_status(client, fay_op, "failed", 60, "fay's operation to fail")

            with chromium(tmp_path / "profile") as driver:
                # The health strip: this process's failing LLM requests and the last error.
                driver.get(f"{base}/ui")
                failing = wait(
                    driver,
                    lambda d: int(attribute(d, '[data-health="llm"]', "data-failing") or 0),
                    "failing LLM requests in the health strip",
                )
                assert failing >= 1
                assert "this process's requests only" in (text(driver, '[data-health="llm"]') or "")
                last = text(driver, '[data-health="last-error"]') or ""
                assert "401" in last or "503" in last, last
                assert attribute(driver, '[data-health="embeddings"]', "data-configured") == "no"
                assert find(driver, 'figure[data-chart="backlog"] svg polyline') is not None
                driver.save_screenshot(str(shots / "11-health-strip.png"))

                # erin's operation says when it tries again and why the last attempt failed.
                driver.get(f"{base}/ui/operations")
                row = f'tr[data-operation="{erin_op}"]'
                note = wait(driver, lambda d: text(d, f"{row} .retry-note"), "erin's retry note")
                assert note.startswith("next attempt in") and note.endswith("(attempt 2/5)"), note
                error = text(driver, f"{row} .last-error") or ""
                assert error.startswith("LLMRetriesExhausted"), error
                assert "503" in (attribute(driver, f"{row} .last-error", "title") or "")
                driver.save_screenshot(str(shots / "12-operations-retrying.png"))

                click(driver, f"{row} td a[href^='/ui/operations/']", "erin's operation id")
                wait(driver, lambda d: d.current_url.endswith(f"/ui/operations/{erin_op}"), "page")
                stands = wait(driver, lambda d: text(d, "section.explain"), "where it stands")
                assert "next attempt in" in stands and "503" in stands
                assert "(in " in (text(driver, '[data-field="run_after"]') or "")
                driver.save_screenshot(str(shots / "13-operation-retrying.png"))

                # fay's failed operation: its PerfLog, its error, and a retry that enqueues anew.
                driver.get(f"{base}/ui/operations/{fay_op}")
                calls = wait(driver, lambda d: text(d, '[data-perf="llm_calls"]'), "the PerfLog")
                assert int(calls) >= 1
                assert "401" in (text(driver, "section.explain") or "")
                driver.save_screenshot(str(shots / "14-operation-failed.png"))
                click(driver, 'button[data-kind="retry"]', "the retry button")
                _confirm(driver, shots, "15-retry-confirmation.png")
                wait(
                    driver,
                    lambda d: "enqueued to retry" in (text(d, "#flash") or ""),
                    "the retry message",
                )
            listed = (await client.get("/v1/operations", params={"bank_id": "fay"})).json()
            assert len(listed["operations"]) == 2
            assert listed["operations"][1]["operation_id"] == fay_op


async def test_the_dashboard_charts_throughput_and_searches_observations(
    serve: Serve, tmp_path: Path
) -> None:
    service = serve("svc")
    base = await service.api_url()
    shots = screenshots_dir(tmp_path)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await _ingest(
            client,
            "gus",
            [
                "Gus switched the billing service from Go to Rust",
                "Gus runs the Postgres upgrade every spring",
                "Gus prefers tea over coffee",
            ],
            "work",
        )
        await _ingest(client, "gus", ["Gus grows tomatoes on the balcony"], "home")
        operation_id = await submit(client, "gus")

        await wait_status(client, operation_id, "completed", 60, "gus's operation to complete")

        with chromium(tmp_path / "profile") as driver:
            driver.get(f"{base}/ui/banks/gus")
            total = wait(
                driver,
                lambda d: int(attribute(d, 'figure[data-chart="throughput"]', "data-total") or 0),
                "memories in the throughput chart",
            )
            assert total == 4
            assert find(driver, 'figure[data-chart="throughput"] svg rect.bar') is not None
            assert attribute(driver, 'figure[data-chart="backlog"]', "data-latest") == "0"
            driver.save_screenshot(str(shots / "16-bank-charts.png"))

            driver.get(f"{base}/ui/banks/gus/observations")
            wait(driver, lambda d: find(d, "article.observation"), "the observations")
            Select(driver.find_element(By.NAME, "scope")).select_by_value("work")
            driver.find_element(By.NAME, "q").send_keys("postgres")
            driver.find_element(By.CSS_SELECTOR, "form.filters button[type=submit]").click()
            wait(driver, lambda d: "q=postgres" in d.current_url, "the search")
            found = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "article .text")]
            assert len(found) >= 1 and all("postgres" in t.lower() for t in found), found
            assert text(driver, "article .text mark") == "Postgres"
            assert "tomatoes" not in (text(driver, "div.observations") or "")
            driver.save_screenshot(str(shots / "17-observations-search.png"))
