"""The embeddings client: ``POST {base_url}/embeddings`` of an OpenAI-compatible server.

Optional (``CONSOLIDATION_EMBEDDINGS_BASE_URL``): with it, recall ranks a scope's observations by
full text *and* by cosine similarity to the pass's facts (docs/architecture.md, Recall). Works
against OpenAI, vLLM, Ollama, Hugging Face TEI and llama.cpp's server: the request is
``{"model", "input": [text…]}`` (plus ``dimensions`` when configured) and the answer's
``data[i].embedding`` is read in ``data[i].index`` order.

Faults follow the LLM's rules (DESIGN §2): transport trouble (timeouts, 408/425/429/5xx,
connection errors, an answer that is not an embeddings list) is retried with backoff honouring
``Retry-After`` — within the LLM's retries and retry budget, over the same transport
(:mod:`consolidation.llm.transport`) — and then fails the *operation* (:class:`EmbeddingsRetriesExhausted`,
a TransientLLMError); 401/403/404/405, a redirect, a request the server refuses even for a probe
text, or vectors of the wrong dimension fail it at once (:class:`EmbeddingsConfigError`, an
LLMConfigError). Neither ever marks a memory failed. A text the server refuses on its own (too
long for the model, most often) gets no vector, and recall simply ranks it by full text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Unpack

import asyncpg
import orjson
import structlog

from consolidation import sql
from consolidation.db import MIGRATION_LOCK_KEY
from consolidation.errors import ConfigError, LLMConfigError
from consolidation.llm.transport import (
    Budget,
    Endpoint,
    Meters,
    Options,
    RetriesExhausted,
    Retryable,
    Route,
    excerpt,
    options_from,
)
from consolidation.metrics import EMBEDDING_INPUTS, EMBEDDING_LATENCY, EMBEDDING_REQUESTS
from consolidation.settings import Settings

__all__ = [
    "Embedder",
    "EmbeddingsConfigError",
    "EmbeddingsRetriesExhausted",
    "HTTPEmbedder",
    "Vector",
    "build_embedder",
    "require_vector_storage",
    "vector_literal",
]

log = structlog.get_logger(__name__)

# A vector in its text form, '[x,y,…]': the JSON the endpoint sent, which is also pgvector's
# input syntax. The engine only forwards vectors to Postgres, so they are never turned into
# Python floats (384 of them per text would cost more than the rest of the request).
Vector = str
# The characters of a JSON array of numbers.
_NUMBER_CHARS = b"0123456789+-.eE,"

# pgvector's limit for the `vector` type.
MAX_DIMENSIONS = 16_000
# Inputs per HTTP request; a pass sends far fewer, this only bounds a pathological one.
MAX_INPUTS_PER_REQUEST = 128
# A text every embeddings server accepts: tells "this input is refused" from "every input is".
PROBE_TEXT = "consolidation embeddings probe"

_REFUSED_STATUSES = frozenset({400, 413, 422})


class EmbeddingsConfigError(LLMConfigError):
    """The embeddings endpoint is misconfigured (auth, URL, model, dimensions): the operation
    fails at once with this message, which names the setting to fix."""


class EmbeddingsRetriesExhausted(RetriesExhausted):
    """Transport trouble outlasted every retry (``CONSOLIDATION_LLM_MAX_RETRIES`` or
    ``CONSOLIDATION_LLM_RETRY_BUDGET_S``); ``attempts`` HTTP requests were made. The operation
    fails and is retried later; no memory is marked failed."""


_ROUTE = Route(
    path="embeddings",
    label="embeddings",
    setting="CONSOLIDATION_EMBEDDINGS",
    config_error=EmbeddingsConfigError,
    exhausted=EmbeddingsRetriesExhausted,
    meters=Meters(EMBEDDING_REQUESTS, EMBEDDING_LATENCY),
    retry_event="embeddings_retry",
)


class Embedder(Protocol):
    """Something that turns texts into unit-comparable vectors of one fixed dimension."""

    @property
    def dimensions(self) -> int | None:
        """The vectors' dimension: configured, or learnt from the first answer (None before)."""
        ...

    async def embed(self, texts: Sequence[str]) -> list[Vector | None]:
        """One vector per text, in order; None for a text the server refused on its own.

        Raises EmbeddingsRetriesExhausted or EmbeddingsConfigError.
        """
        ...

    async def aclose(self) -> None:
        """Release connections; the instance is unusable afterwards."""
        ...


class _Refused(Exception):
    """The server refused the request's input (400/413/422)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class _Batch:
    """Texts of several callers that travel in one request (:meth:`HTTPEmbedder.embed`)."""

    done: asyncio.Future[list[Vector | None]]
    texts: list[str] = field(default_factory=list)
    waiters: int = 0
    task: asyncio.Task[list[Vector | None]] | None = None


class HTTPEmbedder:
    """Client for ``POST {base_url}/embeddings``; one instance per process, shared by every
    operation (its ``max_concurrent`` caps the requests in flight).

    ``dimensions`` (``CONSOLIDATION_EMBEDDINGS_DIMENSIONS``) is sent to the server, which
    shortens its vectors where the model supports it (OpenAI's text-embedding-3); unset, the
    dimension of the first answer is kept, and any later answer of another dimension is a
    configuration error (the model behind the URL changed).
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        dimensions: int | None = None,
        **options: Unpack[Options],
    ) -> None:
        if dimensions is not None and not 1 <= dimensions <= MAX_DIMENSIONS:
            raise ValueError(f"dimensions must be between 1 and {MAX_DIMENSIONS}")
        self._endpoint = Endpoint(
            _ROUTE, base_url=base_url, model=model, api_key=api_key, **options
        )
        self._url = self._endpoint.url
        self._model = model
        self._configured_dimensions = dimensions
        self._dimensions = dimensions
        self._probe_ok = False
        self._sending: _Batch | None = None  # the coalesced request in flight
        self._next: _Batch | None = None  # texts waiting for it to end

    @property
    def url(self) -> str:
        return self._url

    @property
    def model(self) -> str:
        return self._model

    @property
    def dimensions(self) -> int | None:
        return self._dimensions

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._endpoint.aclose()

    async def embed(self, texts: Sequence[str]) -> list[Vector | None]:
        """One vector per text (None for a text the server refused on its own), batched into
        as few requests as possible.

        Coalesced: while one request is in flight, the texts asked meanwhile (by every pass of
        every operation of the process) wait and go together in the next, so that many passes
        writing a few observations each cost one request rather than one each; a text waits
        at most one round trip longer. A caller cancelled leaves its batch; a batch nobody
        waits for any more is abandoned (its HTTP request aborted)."""
        if not texts:
            return []
        batch = self._next
        if batch is None:
            batch = self._next = _Batch(asyncio.get_running_loop().create_future())
        start = len(batch.texts)
        batch.texts.extend(texts)
        batch.waiters += 1
        if self._sending is None:
            self._send_next()
        try:
            vectors = await asyncio.shield(batch.done)
        except asyncio.CancelledError:
            batch.waiters -= 1
            if batch.waiters == 0:
                self._abandon(batch)
            raise
        return vectors[start : start + len(texts)]

    def _send_next(self) -> None:
        """Send the waiting batch, if any, as the request in flight."""
        batch, self._next = self._next, None
        self._sending = batch
        if batch is None:
            return
        batch.task = asyncio.create_task(self._embed_now(batch.texts))
        batch.task.add_done_callback(lambda task: self._sent(batch, task))

    def _sent(self, batch: _Batch, task: asyncio.Task[list[Vector | None]]) -> None:
        if not batch.done.done():
            if task.cancelled():
                batch.done.cancel()
            elif (error := task.exception()) is not None:
                batch.done.set_exception(error)
                batch.done.exception()  # retrieved: every waiter may have gone
            else:
                batch.done.set_result(task.result())
        if self._sending is batch:
            self._send_next()

    def _abandon(self, batch: _Batch) -> None:
        if batch is self._next:
            self._next = None
        elif batch.task is not None:
            batch.task.cancel()
        batch.done.cancel()

    async def _embed_now(self, texts: Sequence[str]) -> list[Vector | None]:
        """The texts in requests of at most MAX_INPUTS_PER_REQUEST, sent at once (a batch that
        holds waves' facts need not make the texts behind them wait several round trips); the
        first error cancels the others."""
        chunks = [
            list(texts[start : start + MAX_INPUTS_PER_REQUEST])
            for start in range(0, len(texts), MAX_INPUTS_PER_REQUEST)
        ]
        if len(chunks) == 1:
            return await self._embed_chunk(chunks[0])
        tasks = [asyncio.create_task(self._embed_chunk(chunk)) for chunk in chunks]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        return [vector for part in parts for vector in part]

    async def _embed_chunk(self, texts: list[str]) -> list[Vector | None]:
        try:
            return list(await self._request(texts))
        except _Refused as exc:
            return await self._one_by_one(texts, exc.detail)

    async def _one_by_one(self, texts: list[str], detail: str) -> list[Vector | None]:
        """After a refusal: is it the request (configuration) or some of its texts?"""
        await self._probe(detail)
        if len(texts) == 1:
            self._log_refused(texts[0], detail)
            return [None]
        out: list[Vector | None] = []
        for text in texts:
            try:
                out.extend(await self._request([text]))
            except _Refused as exc:
                self._log_refused(text, exc.detail)
                out.append(None)
        return out

    async def _probe(self, detail: str) -> None:
        if self._probe_ok:
            return
        try:
            await self._request([PROBE_TEXT])
        except _Refused as exc:
            hint = (
                "; the server may not support `dimensions`: unset "
                "CONSOLIDATION_EMBEDDINGS_DIMENSIONS"
                if self._configured_dimensions is not None
                else ""
            )
            raise EmbeddingsConfigError(
                f"embeddings endpoint POST {self._url} refuses every request (model "
                f"{self._model!r}): {exc.detail}; check CONSOLIDATION_EMBEDDINGS_MODEL{hint}"
            ) from None
        self._probe_ok = True
        log.info("embeddings_probe_ok", url=self._url, refused=detail)

    def _log_refused(self, text: str, detail: str) -> None:
        EMBEDDING_REQUESTS.labels(outcome="refused_input").inc()
        log.warning(
            "embeddings_input_refused",
            url=self._url,
            chars=len(text),
            detail=detail,
            hint="this text gets no vector and is recalled by full text only; for long texts "
            "let the server truncate (TEI --auto-truncate, vLLM --max-model-len, Ollama does)",
        )

    async def _request(self, texts: list[str]) -> list[Vector]:
        """One logical request: retried on transport trouble within the retries and the retry
        budget, then EmbeddingsRetriesExhausted."""
        body: dict[str, Any] = {"model": self._model, "input": texts}
        if self._configured_dimensions is not None:
            body["dimensions"] = self._configured_dimensions
        payload = orjson.dumps(body)
        vectors = await self._endpoint.call(
            lambda budget, _retries: self._attempt(payload, len(texts), budget)
        )
        EMBEDDING_INPUTS.inc(len(texts))
        return vectors

    async def _attempt(self, payload: bytes, count: int, budget: Budget) -> list[Vector]:
        reply = await self._endpoint.post(payload, budget)
        self._endpoint.check(reply)
        if reply.status in _REFUSED_STATUSES:
            raise _Refused(f"HTTP {reply.what}: {excerpt(reply.text)!r}")
        if reply.status >= 400 or reply.status < 200:
            raise Retryable(f"HTTP {reply.what}: {excerpt(reply.text)!r}", status=reply.status)
        return self._vectors(reply.body, reply.text, count)

    def _vectors(self, body: bytes, text: str, count: int) -> list[Vector]:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list) or len(items) != count:
            # A gateway's error page or a half-written answer: the endpoint's fault, retried.
            raise Retryable(
                f"answer is not an embeddings list of {count} item(s): {excerpt(text)!r}"
            )
        ordered: list[Vector | None] = [None] * count
        for position, item in enumerate(items):
            index = item.get("index", position) if isinstance(item, dict) else None
            vector = _literal(item.get("embedding")) if isinstance(item, dict) else None
            if (
                not isinstance(index, int)
                or not 0 <= index < count
                or ordered[index] is not None
                or vector is None
            ):
                raise Retryable(
                    f"answer item {position} is not {{index, embedding: [number…]}}: "
                    f"{excerpt(orjson.dumps(item).decode())!r}"
                )
            ordered[index] = vector.decode()
        vectors = [v for v in ordered if v is not None]
        self._check_dimensions(_dimension(vectors[0]) if vectors else 0, vectors)
        return vectors

    def _check_dimensions(self, first: int, vectors: list[Vector]) -> None:
        sizes = {_dimension(v) for v in vectors}
        if len(sizes) > 1:
            raise EmbeddingsConfigError(
                f"embeddings endpoint POST {self._url} answered vectors of several dimensions "
                f"({sorted(sizes)}) in one response: check CONSOLIDATION_EMBEDDINGS_MODEL"
            )
        if self._dimensions is None:
            if not 1 <= first <= MAX_DIMENSIONS:
                raise EmbeddingsConfigError(
                    f"embeddings endpoint POST {self._url} answered {first}-dimensional vectors; "
                    f"need 1 to {MAX_DIMENSIONS}: set CONSOLIDATION_EMBEDDINGS_DIMENSIONS"
                )
            self._dimensions = first
            log.info("embeddings_dimensions", url=self._url, model=self._model, dimensions=first)
            return
        if first != self._dimensions:
            source = (
                "CONSOLIDATION_EMBEDDINGS_DIMENSIONS"
                if self._configured_dimensions is not None
                else "the endpoint's first answer"
            )
            raise EmbeddingsConfigError(
                f"embeddings endpoint POST {self._url} answered {first}-dimensional vectors, "
                f"expected {self._dimensions} ({source}): the model behind "
                "CONSOLIDATION_EMBEDDINGS_BASE_URL changed, or CONSOLIDATION_EMBEDDINGS_MODEL / "
                "CONSOLIDATION_EMBEDDINGS_DIMENSIONS disagree with it"
            )


def _literal(value: object) -> bytes | None:
    """The text form of a non-empty JSON array of numbers, else None (checked in C: no Python
    loop over the elements)."""
    if not isinstance(value, list) or not value:
        return None
    text = orjson.dumps(value)
    return text if text.translate(None, _NUMBER_CHARS) == b"[]" else None


def _dimension(vector: Vector) -> int:
    return vector.count(",") + 1


def vector_literal(vector: Sequence[float]) -> Vector:
    """The text form of a vector of floats (``[x,y,…]``: JSON and pgvector alike)."""
    return orjson.dumps(list(vector)).decode()


def build_embedder(settings: Settings) -> HTTPEmbedder | None:
    """The embeddings client when ``CONSOLIDATION_EMBEDDINGS_BASE_URL`` is set, else None.

    Timeouts, retries, the retry budget, backoff and concurrency are the LLM's settings: one
    endpoint policy.
    """
    if settings.embeddings_base_url is None:
        return None
    key = settings.embeddings_api_key
    return HTTPEmbedder(
        base_url=settings.embeddings_base_url,
        model=settings.embeddings_model,
        api_key=key.get_secret_value() if key else None,
        dimensions=settings.embeddings_dimensions,
        **options_from(settings),
    )


EMBEDDING_COLUMNS = """
SELECT count(*) = 2 FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = 'observations'
  AND column_name IN ('embedding', 'embedding_version')
"""
PGVECTOR_AVAILABLE = "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')"


async def require_vector_storage(conn: asyncpg.Connection) -> None:
    """With embeddings configured: make sure observations can store vectors, creating the
    pgvector extension and the columns if the server gained pgvector after the migration
    (under the migration lock, as migrations). Raises ConfigError, in one line, if it cannot."""
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
    try:
        # The SQL migration 0005 runs; idempotent.
        await conn.execute(sql.read("embeddings_schema"))
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    if await conn.fetchval(EMBEDDING_COLUMNS):
        return
    if await conn.fetchval(PGVECTOR_AVAILABLE):
        raise ConfigError(
            "CONSOLIDATION_EMBEDDINGS_BASE_URL is set but this role may not create the pgvector "
            "extension: run CREATE EXTENSION vector as a superuser, or unset "
            "CONSOLIDATION_EMBEDDINGS_BASE_URL"
        )
    raise ConfigError(
        "CONSOLIDATION_EMBEDDINGS_BASE_URL is set but the database server has no pgvector "
        "extension: install pgvector (e.g. the pgvector/pgvector Postgres image) or unset "
        "CONSOLIDATION_EMBEDDINGS_BASE_URL"
    )
