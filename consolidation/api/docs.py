"""The API's documentation pages, ``/docs`` (Swagger UI) and ``/redoc``, served with no request
leaving the service: their scripts and styles come from the ``fastapi-offline`` package, mounted
under ``/static``, instead of FastAPI's default CDN."""

from __future__ import annotations

import fastapi
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import HTMLResponse

__all__ = ["STATIC_URL", "add_docs_routes"]

STATIC_URL = "/static"
# Swagger UI would otherwise send the whole OpenAPI document to an online validator for its badge.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
# The pages may load nothing from elsewhere: ReDoc's menu, for one, shows a logo from its CDN.
# Their own start-up script is inline, and Swagger UI and ReDoc set styles inline.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; worker-src 'self' blob:; font-src 'self' data:"
)


def add_docs_routes(app: fastapi.FastAPI, openapi_url: str = "/openapi.json") -> None:
    """``/docs``, its OAuth2 redirect page, ``/redoc``, and their files under ``/static``.

    The app must be created with ``docs_url=None, redoc_url=None`` so these are the only ones."""
    app.mount(STATIC_URL, StaticFiles(packages=[("fastapi_offline", "static")]), name="static")
    redirect_url = "/docs/oauth2-redirect"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _no_elsewhere(
            get_swagger_ui_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - Swagger UI",
                oauth2_redirect_url=f"{root}{redirect_url}",
                swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
                swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
                swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
                swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
            )
        )

    @app.get(redirect_url, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return _no_elsewhere(
            get_redoc_html(
                openapi_url=f"{root}{openapi_url}",
                title=f"{app.title} - ReDoc",
                redoc_js_url=f"{root}{STATIC_URL}/redoc.standalone.js",
                redoc_favicon_url=f"{root}{STATIC_URL}/favicon.png",
                with_google_fonts=False,
            )
        )


def _no_elsewhere(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page
