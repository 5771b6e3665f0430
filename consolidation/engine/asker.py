"""Asking the model: one pass's request, its repair, the perf it costs; the vectors of texts.

An :class:`Asker` serves one run: it builds DESIGN §3's request for a pass, sends it through the
LLM client and counts what it cost in the pass's :class:`PerfLog`. With an embedder it also keeps
the vectors of the texts the run has embedded, so a text is embedded once.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from consolidation import store
from consolidation.errors import InvalidLLMOutput
from consolidation.llm import ask_v2
from consolidation.llm.client import (
    Consolidator,
    LLMAnswer,
    LLMRetriesExhausted,
    OfflineConsolidator,
)
from consolidation.llm.embeddings import Embedder
from consolidation.llm.narrow import NarrowOptions, narrow_options
from consolidation.llm.prompts import (
    Chat,
    FactInput,
    ObservationInput,
    PassPlan,
    PassRequest,
    build_request,
    parse_answer,
    pass_chat,
    repair_chat,
)
from consolidation.perf import PerfLog
from consolidation.scopes import Scope
from consolidation.settings import Settings


def narrowing(
    settings: Settings, llm: Consolidator, embedder: Embedder | None
) -> NarrowOptions | None:
    """How a run's passes are narrowed (contract v2), or None for v1's one call a pass: a model
    speaks the configured ``LLM_CONTRACT``; the offline consolidator narrows whenever embeddings
    are configured, since only then does it know more than its words."""
    offline = isinstance(llm, OfflineConsolidator)
    wanted = embedder is not None if offline else settings.llm_contract == "v2"
    return narrow_options(settings) if wanted else None


class Asker:
    """The model and the embeddings endpoint of one run's bank; ``mission`` is the bank's."""

    def __init__(
        self,
        llm: Consolidator,
        bank_id: str,
        mission: str | None,
        embedder: Embedder | None = None,
        narrowed: NarrowOptions | None = None,
    ) -> None:
        self.llm = llm
        self.bank_id = bank_id
        self.mission = mission
        self.embedder = embedder
        self.narrowed = narrowed
        # Vectors of texts embedded (None: refused by the endpoint): a wave's facts are embedded
        # together when the wave starts, then each pass adds the texts it writes.
        self._vectors: dict[str, str | None] = {}

    def request(
        self,
        scope: Scope,
        facts: Sequence[FactInput],
        observations: Sequence[ObservationInput],
    ) -> PassRequest:
        """DESIGN §3's user message of a pass on ``scope`` of this run's bank."""
        return build_request(self.bank_id, scope, self.mission, list(facts), list(observations))

    async def ask(self, request: PassRequest, chat: Chat, perf: PerfLog) -> PassPlan:
        """The model's parsed answer to ``chat``; raises InvalidLLMOutput if it is unusable.
        Narrowed (contract v2), the same pass is answered by per-fact questions instead."""
        if self.narrowed is not None:
            offline = isinstance(self.llm, OfflineConsolidator)
            return await ask_v2.answer_pass(
                request,
                None if offline else functools.partial(self.complete, perf=perf),
                None if self.embedder is None else functools.partial(self.embed, perf=perf),
                self.narrowed,
            )
        answer = await self.complete(chat, perf)
        plan = parse_answer(answer.content, request)
        perf.llm_repaired += int(chat.repair)
        return plan

    async def complete(self, chat: Chat, perf: PerfLog) -> LLMAnswer:
        """One chat completion, counted in ``perf``."""
        started = time.monotonic()
        perf.llm_calls += 1
        perf.llm_repairs += int(chat.repair)
        perf.prompt_chars += chat.prompt_chars
        try:
            answer = await self.llm.complete(chat)
        except LLMRetriesExhausted as exc:
            # The stored result must say the pass was retried, not only that it failed.
            perf.llm_retries += exc.attempts - 1
            raise
        except InvalidLLMOutput as exc:
            perf.prompt_tokens += exc.prompt_tokens
            perf.completion_tokens += exc.completion_tokens
            raise
        finally:
            perf.llm_s += time.monotonic() - started
        perf.llm_retries += answer.retries
        perf.prompt_tokens += answer.prompt_tokens
        perf.completion_tokens += answer.completion_tokens
        return answer

    async def ask_usable(self, request: PassRequest, perf: PerfLog) -> PassPlan:
        """:meth:`ask`, and once more on an unusable answer, shown its answer and what is wrong
        with it; the second InvalidLLMOutput is raised."""
        chat = pass_chat(request)
        for attempt in (1, 2):
            try:
                return await self.ask(request, chat, perf)
            except InvalidLLMOutput as exc:
                perf.llm_failures += 1
                if attempt == 2:
                    raise
                chat = repair_chat(chat, exc)
        raise AssertionError("unreachable")

    def prefetch(self, texts: Sequence[str], perf: PerfLog, keep: int) -> asyncio.Task[Any] | None:
        """With embeddings: a task embedding ``texts`` in one request (chunked if huge), which
        the passes needing them wait for; the cache is first cut to about ``keep`` texts."""
        if self.embedder is None or not texts:
            return None
        excess = len(self._vectors) - keep
        if excess > 0:
            # Bounded, the oldest first (the waves fetched ahead still need theirs): a text
            # missing later is embedded again by the pass that needs it.
            for text in list(itertools.islice(self._vectors, excess)):
                del self._vectors[text]
        task = asyncio.create_task(self.embed(texts, perf))
        # Its error reaches every pass awaiting it; this only silences "never retrieved" when
        # the wave was cancelled before any pass did.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def embed(self, texts: Sequence[str], perf: PerfLog) -> tuple[str | None, ...]:
        """The vectors of ``texts``; those not embedded yet in ONE request."""
        assert self.embedder is not None
        # A local copy: the cache may be cut by a wave launched while we wait.
        known = {t: self._vectors[t] for t in texts if t in self._vectors}
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        if missing:
            started = time.monotonic()
            perf.embedding_requests += 1
            try:
                vectors = await self.embedder.embed(missing)
            finally:
                perf.embedding_s += time.monotonic() - started
            fetched = dict(zip(missing, vectors, strict=True))
            self._vectors.update(fetched)
            known.update(fetched)
        return tuple(known[t] for t in texts)

    async def with_vectors(
        self, write: store.PassWrite, upcoming: store.RecallRequest | None, perf: PerfLog
    ) -> tuple[store.PassWrite, store.RecallRequest | None]:
        """``write`` with the vectors of its observations' texts and ``upcoming`` with those of
        its facts: one embeddings request."""
        texts = [w.text for w in write.observations]
        following = upcoming.fact_texts if upcoming is not None else ()
        vectors = await self.embed([*texts, *following], perf)
        observations = tuple(
            replace(w, embedding=v)
            for w, v in zip(write.observations, vectors[: len(texts)], strict=True)
        )
        if upcoming is not None:
            upcoming = replace(upcoming, fact_vectors=vectors[len(texts) :])
        return replace(write, observations=observations), upcoming
