"""A real headless Chromium driven by Selenium: Debian's `chromium` and `chromium-driver`
packages (.ci/run installs them), so nothing is downloaded at run time."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait

T = TypeVar("T")

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")
# The closed network: no update checks, sync, QUIC probes or first-run pages; root needs
# --no-sandbox.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--window-size=1360,900",
)


# No host name resolves but the loopback's: a page that needs anything from the internet fails
# to load it, as on a machine without a network.
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",)


@contextmanager
def chromium(
    user_data_dir: Path, *, flags: Sequence[str] = (), network_log: bool = False
) -> Iterator[webdriver.Chrome]:
    """A fresh browser profile in ``user_data_dir``; quits the browser at the end. ``flags`` are
    added to FLAGS; ``network_log`` records every request for ``requested_urls``."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        # CI (.ci/run) installs them and requires them; a developer's first run without them
        # says what to install instead of failing the README's test command.
        message = (
            f"{', '.join(missing)} not found: apt-get install chromium chromium-driver "
            "(.ci/run does), or set CHROMIUM / CHROMEDRIVER"
        )
        if os.environ.get("CONSOLIDATION_TESTS_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *flags):
        options.add_argument(flag)
    if network_log:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    options.add_argument(f"--user-data-dir={user_data_dir}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def requested_urls(driver: webdriver.Chrome) -> list[str]:
    """The URLs the browser sent requests to since the last call (``network_log=True``); a
    request the browser itself blocked (a Content-Security-Policy) never left it, so is not one."""
    sent: dict[str, str] = {}
    blocked: set[str] = set()
    # Selenium leaves Chrome's get_log unannotated.
    entries = driver.get_log("performance")  # type: ignore[no-untyped-call]
    for entry in entries:
        message = json.loads(entry["message"])["message"]
        params = message["params"]
        if message["method"] == "Network.requestWillBeSent":
            sent[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason"):
            blocked.add(params["requestId"])
    return [url for request, url in sent.items() if request not in blocked]


def wait(
    driver: WebDriver, condition: Callable[[WebDriver], T | None], what: str, timeout_s: float = 30
) -> T:
    """Poll ``condition`` until it returns something truthy (so never None); fail naming ``what``
    after the deadline."""
    # The pages replace <main> as they refresh themselves: an element found a moment ago may be
    # gone, so a stale one counts as "not yet".
    waiter = WebDriverWait(
        driver, timeout_s, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    )
    result = waiter.until(condition, message=f"timed out after {timeout_s}s waiting for {what}")
    assert result is not None  # until returns only a truthy value
    return result


def click(driver: WebDriver, css: str, what: str) -> None:
    """Click the element matching ``css`` as soon as there is one (again if it went stale)."""

    def clicked(d: WebDriver) -> bool:
        element = find(d, css)
        if element is None:
            return False
        element.click()
        return True

    wait(driver, clicked, what)


def text(driver: WebDriver, css: str) -> str | None:
    """The text of the first element matching ``css`` (None when there is none right now)."""
    try:
        element = find(driver, css)
        return None if element is None else element.text
    except StaleElementReferenceException:
        return None


def find(driver: WebDriver, css: str) -> WebElement | None:
    """The first element matching ``css``, or None (never waits)."""
    found = driver.find_elements("css selector", css)
    return found[0] if found else None


def attribute(driver: WebDriver, css: str, name: str) -> str | None:
    """An attribute of the first element matching ``css`` (None when there is none right now)."""
    try:
        element = find(driver, css)
        return None if element is None else element.get_attribute(name)
    except StaleElementReferenceException:
        return None


def screenshots_dir(tmp_path: Path) -> Path:
    """Where a test saves its screenshots: UI_SCREENSHOTS when set, else the test's tmp dir."""
    folder = Path(os.environ.get("UI_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
