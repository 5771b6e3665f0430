"""JSON request bodies parsed with orjson: the route class of every ``/v1`` route.

A body sent with another content type (or none: what ``curl -d`` and HTML forms send) is
refused with a 415 saying so, before FastAPI would read it as raw bytes and answer a puzzling
"Input should be a valid dictionary".
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from email.message import Message
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from consolidation.api.errors import ApiError

__all__ = ["OrjsonRoute", "is_json"]


def is_json(content_type: str | None) -> bool:
    """``application/json`` or any ``application/*+json``, parameters (charset) allowed."""
    if not content_type:
        return False
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class _OrjsonRequest(Request):
    """orjson rejects what Postgres cannot store (lone surrogates) and NaN/Infinity as bad JSON."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """An APIRoute whose request body is parsed by orjson instead of the standard library, and
    must be sent as JSON."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def orjson_handler(request: Request) -> Response:
            request = _OrjsonRequest(request.scope, request.receive)
            if takes_body:
                content_type = request.headers.get("content-type")
                if not is_json(content_type) and await request.body():
                    got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
                    raise ApiError(
                        415,
                        "unsupported_media_type",
                        f"the request body must be JSON, sent with 'Content-Type: "
                        f"application/json' (got {got})",
                    )
            return await handler(request)

        return orjson_handler
