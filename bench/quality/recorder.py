"""A pass-through recorder: an OpenAI-compatible front for a real model server that writes down
every chat request it forwards, in the oracle's transcript format, so a real model's run of
``bench quality`` can split its prompts into their parts as an oracle run does.

    python -m bench.quality.recorder --upstream http://127.0.0.1:8080/v1 --transcript T.jsonl

prints its base URL on the first line of stdout, then forwards ``POST /v1/chat/completions``
(and ``GET /v1/models``) to the upstream unchanged, answer and status included.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.quality.oracle import OracleError, read_request
from consolidation.net import listen_socket, socket_url


def app(upstream: str, transcript: Path) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def chat(request: Request) -> Response:
        body = await request.body()
        answer = await client.post("/chat/completions", content=body, headers=_json)
        try:
            seen = read_request(body)
        except (OracleError, KeyError, TypeError, AttributeError):
            pass  # not a consolidation request: forwarded, not written down
        else:
            with transcript.open("ab") as out:
                line = {"request": seen.user, "messages": seen.messages}
                out.write(orjson.dumps(line) + b"\n")
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def models(request: Request) -> Response:
        answer = await client.get("/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
        ]
    )


_json = {"content-type": "application/json"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.recorder", description=__doc__)
    parser.add_argument("--upstream", required=True, help="the model server's base URL (…/v1)")
    parser.add_argument("--transcript", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    sock = listen_socket(args.host, args.port)
    print(f"{socket_url(sock)}/v1", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(app(args.upstream, args.transcript), log_level="warning", lifespan="off")
    )
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
