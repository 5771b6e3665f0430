"""The API documentation pages of a real `consolidation serve` render in a headless Chromium that
cannot reach the internet, asking nothing of any server but the service itself."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import OFFLINE, chromium, requested_urls, screenshots_dir, wait
from tests.support.services import Serve

pytestmark = pytest.mark.acceptance

NETWORK_SCHEMES = ("http:", "https:", "ws:", "wss:")


def _foreign(urls: list[str], base: str) -> list[str]:
    """The requests that went over a network to anything but the service (data:, blob: and the
    browser's own chrome:// pages stay inside the browser)."""
    return [u for u in urls if u.startswith(NETWORK_SCHEMES) and not u.startswith(f"{base}/")]


def _body_text(driver: WebDriver) -> str:
    return str(driver.execute_script("return document.body ? document.body.innerText : ''"))


async def test_swagger_ui_and_redoc_render_every_route_without_a_network(
    serve: Serve, tmp_path: Path
) -> None:
    service = serve("svc", "--no-worker")
    base = await service.api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        paths = (await http.get("/openapi.json")).json()["paths"]
        for page in ("/docs", "/redoc"):
            html = (await http.get(page)).text
            assert "http://" not in html.replace(base, "") and "https://" not in html, html
    v1_operations = sum(len(methods) for path, methods in paths.items() if path.startswith("/v1"))
    shots = screenshots_dir(tmp_path)

    with chromium(tmp_path / "profile", flags=OFFLINE, network_log=True) as driver:
        driver.get(f"{base}/docs")
        rendered = wait(
            driver,
            lambda d: len(d.find_elements("css selector", ".opblock")) >= v1_operations,
            "Swagger UI to list every /v1 operation",
        )
        assert rendered
        text = _body_text(driver)
        assert "/v1/banks/{bank_id}/memories" in text and "Ingest memories" in text
        driver.save_screenshot(str(shots / "docs-swagger-ui.png"))
        urls = requested_urls(driver)
        assert f"{base}/static/swagger-ui-bundle.js" in urls
        assert f"{base}/openapi.json" in urls
        assert _foreign(urls, base) == []

        driver.get(f"{base}/redoc")
        wait(
            driver,
            lambda d: "Delete a bank" in _body_text(d) and "Ingest memories" in _body_text(d),
            "ReDoc to render the operations",
        )
        driver.save_screenshot(str(shots / "docs-redoc.png"))
        urls = requested_urls(driver)
        assert f"{base}/static/redoc.standalone.js" in urls
        assert _foreign(urls, base) == []
