"""JSON request bodies parsed with orjson: the route class of every ``/v1`` route."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["OrjsonRoute"]


class _OrjsonRequest(Request):
    """orjson rejects what Postgres cannot store (lone surrogates) and NaN/Infinity as bad JSON."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """An APIRoute whose request body is parsed by orjson instead of the standard library."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return orjson_handler
