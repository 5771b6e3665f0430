"""The plain-http client against real HTTP peers on loopback: servers that answer the way
servers do (kept alive, chunked, until they close) and the way they fail (closing without an
answer, bytes that are not HTTP, an answer that comes after the client gave up)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop

from consolidation.plainhttp import BadResponse, PlainHTTP, ServerDisconnected

# Called with the request's body, the stream to answer on and the connection's number.
Answerer = Callable[[bytes, asyncio.StreamWriter, int], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    first, *lines = head.split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return first, headers, body


class Server:
    def __init__(self, answer: Answerer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while not writer.is_closing():
                try:
                    request = await _read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests.append(request)
                await self.answer(request[2], writer, number)
                await writer.drain()
        finally:
            writer.close()


@asynccontextmanager
async def serving(answer: Answerer) -> AsyncIterator[Server]:
    server = Server(answer)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with listener:
        yield server


def response(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    head = [f"HTTP/1.1 {status}", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def echo(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
    writer.write(response(b"echo " + body, "Content-Type: application/json"))


async def test_requests_share_one_kept_alive_connection_and_carry_the_headers() -> None:
    async with serving(echo) as server:
        client = PlainHTTP(server.url, {"authorization": "Bearer k", "user-agent": "t"})
        answers = [await client.post(f"{i}".encode()) for i in range(5)]
        client.close()
    assert [a.body for a in answers] == [f"echo {i}".encode() for i in range(5)]
    assert {(a.status, a.reason, a.headers["content-type"]) for a in answers} == {
        (200, "OK", "application/json")
    }
    assert server.connections == 1
    first, headers, _ = server.requests[0]
    assert first == "POST /v1/chat/completions HTTP/1.1"
    assert headers["host"] == server.url.split("/")[2]
    assert headers["authorization"] == "Bearer k"


async def test_a_chunked_answer_is_read_whole_and_a_repeated_header_keeps_both_values() -> None:
    async def chunked(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b'{"a":', b" 1", b"}"))
        writer.write(
            response(chunks + b"0\r\n\r\n", "Transfer-Encoding: chunked", "Vary: a", "Vary: b")
        )

    async with serving(chunked) as server:
        client = PlainHTTP(server.url, {})
        answers = [await client.post(b"x") for _ in range(2)]
        client.close()
    assert [a.body for a in answers] == [b'{"a": 1}', b'{"a": 1}']
    assert answers[0].headers["vary"] == "a, b"
    assert server.connections == 1


async def test_an_answer_that_runs_until_the_server_closes_is_read_whole() -> None:
    async def until_close(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
        writer.write(b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 2\r\n\r\noverloaded")
        await writer.drain()
        writer.close()

    async with serving(until_close) as server:
        client = PlainHTTP(server.url, {})
        answers = [await client.post(b"x") for _ in range(2)]
        client.close()
    assert [(a.status, a.reason, a.body) for a in answers] == [
        (503, "Service Unavailable", b"overloaded")
    ] * 2
    assert answers[0].headers["retry-after"] == "2"
    assert server.connections == 2  # nothing is sent again on a connection the server closed


async def test_a_server_closing_without_an_answer_raises_and_the_next_request_reconnects() -> None:
    async def drop_first(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
        if connection == 1:
            writer.close()
        else:
            await echo(body, writer, connection)

    async with serving(drop_first) as server:
        client = PlainHTTP(server.url, {})
        with pytest.raises(ServerDisconnected):
            await client.post(b"lost")
        answer = await client.post(b"again")
        client.close()
    assert answer.body == b"echo again"


async def test_bytes_that_are_not_http_raise_bad_response() -> None:
    async def garbage(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")

    async with serving(garbage) as server:
        client = PlainHTTP(server.url, {})
        with pytest.raises(BadResponse):
            await client.post(b"x")
        client.close()


async def test_an_answer_arriving_after_the_caller_gave_up_never_reaches_another_request() -> None:
    late = asyncio.Event()

    async def slow_first(body: bytes, writer: asyncio.StreamWriter, connection: int) -> None:
        if body == b"first":
            await late.wait()
        await echo(body, writer, connection)

    async with serving(slow_first) as server:
        client = PlainHTTP(server.url, {})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await client.post(b"first")
        late.set()  # the first answer is written now, on the connection given up
        answer = await client.post(b"second")
        client.close()
    assert answer.body == b"echo second"
    assert server.connections == 2


def test_only_plain_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="not an http:// URL"):
        PlainHTTP("https://api.openai.com/v1/chat/completions", {})


def test_on_uvloop_as_the_service_runs_it() -> None:
    async def two_requests() -> list[bytes]:
        async with serving(echo) as server:
            client = PlainHTTP(server.url, {})
            bodies = [(await client.post(b"a")).body, (await client.post(b"b")).body]
            client.close()
        assert server.connections == 1
        return bodies

    assert uvloop.run(two_requests()) == [b"echo a", b"echo b"]
