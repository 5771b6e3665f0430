"""A real headless Chromium driven by Selenium: Debian's `chromium` and `chromium-driver`
packages (.ci/run installs them), so nothing is downloaded at run time."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

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


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[WebDriver]:
    """A fresh browser profile in ``user_data_dir``; quits the browser at the end."""
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
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait(
    driver: WebDriver, condition: Callable[[WebDriver], T], what: str, timeout_s: float = 30
) -> T:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` after the deadline."""
    # The pages replace <main> as they refresh themselves: an element found a moment ago may be
    # gone, so a stale one counts as "not yet".
    waiter = WebDriverWait(
        driver, timeout_s, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    )
    result: T = waiter.until(condition, message=f"timed out after {timeout_s}s waiting for {what}")
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


def attribute(driver: WebDriver, css: str, name: str) -> Any:
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
