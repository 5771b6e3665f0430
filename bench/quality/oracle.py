"""The oracle: an OpenAI-compatible server that answers every consolidation call as a perfect
model would, from the banks' labels. Run against it, the quality benchmark measures what the
pipeline itself delivers: whether recall shows the twin, whether a batch sees what earlier
batches wrote, whether an answer is applied as meant.

It knows nothing but the bank files. A fact is recognised by its text; an observation by the
memory texts it contains, which is why every text the oracle writes is made of the facts'
own sentences. Each wire contract is one function (:data:`CONTRACTS`) from the request to the
assistant's JSON object; a request says which contract it speaks.

    python -m bench.quality.oracle --bank-file A.json --bank-file B.json

prints its base URL (``http://127.0.0.1:PORT/v1``) on the first line of stdout, then serves
``POST /v1/chat/completions`` (and ``/chat/completions``), ``GET /health`` and ``GET /_stats``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.quality.banks import DEFAULT_BANK_FILES, QualityBank, load_banks
from bench.quality.judge import content_words, stem
from consolidation.llm import prompts
from consolidation.llm.client import estimate_tokens
from consolidation.net import listen_socket, socket_url


class OracleError(ValueError):
    """A request the oracle cannot read (answered 400, as a server would)."""


@dataclass(frozen=True)
class LabelBook:
    """Memory texts → labels, for every bank the oracle serves."""

    labels: dict[str, dict[str, str]]  # bank id → memory text → label

    @classmethod
    def of(cls, banks: Sequence[QualityBank]) -> LabelBook:
        return cls({b.name: b.label_of_text() for b in banks})

    def fact_label(self, bank: str, text: str) -> str | None:
        return self.labels.get(bank, {}).get(text)

    def observation_labels(self, bank: str, text: str) -> frozenset[str]:
        """The labels of the memory texts an observation's text contains."""
        return frozenset(label for fact, label in self.labels.get(bank, {}).items() if fact in text)


@dataclass(frozen=True)
class ChatRequest:
    """What a contract function reads from one chat completion request."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    user: dict[str, Any]  # the JSON object of the first user message
    response_format: dict[str, Any] | None


def compose(texts: Sequence[str], new_facts: Sequence[str]) -> str:
    """An observation text made of existing texts and the new facts' own sentences, a fact
    added only when it says something the text does not (a restatement adds nothing)."""
    parts = list(texts)
    known = {stem(w) for t in parts for w in content_words(t)}
    for fact in new_facts:
        words = {stem(w) for w in content_words(fact)}
        if not parts or not words <= known:
            parts.append(fact)
            known |= words
    return " ".join(parts)


def answer_v1(book: LabelBook, request: ChatRequest) -> dict[str, Any]:
    """DESIGN §3: per label among the facts, update the label's observation when one is shown,
    merge when several are (an earlier pass could not see its twin), else create one."""
    user = request.user
    bank = str(user.get("bank"))
    facts: dict[str, list[tuple[str, str]]] = {}
    for fact in user.get("facts") or []:
        label = book.fact_label(bank, fact["text"])
        if label is not None:  # a fact no bank knows is left uncited (skipped)
            facts.setdefault(label, []).append((fact["ref"], fact["text"]))
    shown: dict[str, list[tuple[str, str]]] = {}
    for obs in user.get("observations") or []:
        labels = book.observation_labels(bank, obs["text"])
        if len(labels) == 1:
            shown.setdefault(next(iter(labels)), []).append((obs["ref"], obs["text"]))
    creates, updates, merges = [], [], []
    for label in sorted(facts.keys() | {k for k, v in shown.items() if len(v) > 1}):
        refs = [ref for ref, _ in facts.get(label, [])]
        texts = [text for _, text in facts.get(label, [])]
        observations = shown.get(label, [])
        if not observations:
            creates.append({"text": compose([], texts), "facts": refs})
        elif len(observations) == 1:
            ref, text = observations[0]
            updates.append({"observation": ref, "text": compose([text], texts), "facts": refs})
        else:
            merges.append(
                {
                    "observations": [ref for ref, _ in observations],
                    "text": compose([compose([], [t for _, t in observations])], texts),
                    "facts": refs,
                }
            )
    return {"creates": creates, "updates": updates, "merges": merges}


def _same_or_update(text: str, target: str) -> str:
    """``same`` when the target already says everything the fact says, else ``update``."""
    return "same" if compose([target], [text]) == target else "update"


def answer_v2(book: LabelBook, request: ChatRequest) -> dict[str, Any]:
    """Contract v2 (docs/architecture.md): ``decide`` picks, per fact, the candidate that
    shares its label (an observation before an earlier fact), ``new`` when none does;
    ``confirm`` says yes when both texts are of one label alone; ``rewrite`` joins the
    observation and the facts' own sentences."""
    user = request.user
    bank = str(user.get("bank"))
    if user.get("task") == "rewrite":
        observation = user["observation"]["text"]
        return {"text": compose([observation], [f["text"] for f in user.get("facts") or []])}
    if user.get("task") == "confirm":
        # The "fact" is a memory's text, or an observation's when two observations are asked of
        # (a bridge): labels by the memory texts it contains. An observation's: its facts'.
        asked = book.observation_labels(bank, user["fact"]["text"])
        labels = book.observation_labels(bank, user["observation"]["text"])
        same = len(asked) == 1 and labels == asked
        return {"same_subject": "yes" if same else "no"}
    if user.get("task") != "decide":
        raise OracleError(f"unknown v2 task {user.get('task')!r}")
    decisions = {}
    for fact in user.get("facts") or []:
        label = book.fact_label(bank, fact["text"])
        decision = "new"
        for candidate in sorted(fact.get("candidates") or [], key=lambda c: c["ref"][0] != "o"):
            ref, text = candidate["ref"], candidate["text"]
            # A fact the book does not know has the label None, which matches no fact's label.
            candidate_labels: frozenset[str | None] = (
                book.observation_labels(bank, text)
                if ref.startswith("o")
                else frozenset({book.fact_label(bank, text)})
            )
            if label is not None and candidate_labels == {label}:
                decision = f"{_same_or_update(fact['text'], text)}:{ref}"
                break
        decisions[fact["ref"]] = decision
    return decisions


Contract = Callable[[LabelBook, ChatRequest], dict[str, Any]]
# One function per wire contract; a request names its contract ("contract": "v2"), v1 none.
CONTRACTS: dict[str, Contract] = {"v1": answer_v1, "v2": answer_v2}


def contract_of(request: ChatRequest) -> str:
    return str(request.user.get("contract") or "v1")


def read_request(body: bytes) -> ChatRequest:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise OracleError(f"request body is not JSON: {exc}") from None
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise OracleError("request body must be an object with messages")
    messages = tuple(
        (str(m.get("role")), m["content"])
        for m in request["messages"]
        if isinstance(m, dict) and isinstance(m.get("content"), str)
    )
    first_user = next((content for role, content in messages if role == "user"), None)
    user = prompts.find_request_object(first_user) if first_user is not None else None
    if user is None:
        raise OracleError("no user message ending with a JSON object")
    fmt = request.get("response_format")
    return ChatRequest(messages, user, fmt if isinstance(fmt, dict) else None)


@dataclass
class Oracle:
    """The server's state: the label book, the contract it speaks, and what it answered."""

    book: LabelBook
    transcript: Path | None = None  # each request's object and answer, one JSON line a call
    stats: Counter[str] = field(default_factory=Counter)

    def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            request = read_request(body)
            contract = contract_of(request)
            if contract not in CONTRACTS:
                raise OracleError(f"no oracle for contract {contract!r}")
            answer = CONTRACTS[contract](self.book, request)
            content = orjson.dumps(answer).decode()
            self.stats[f"answered_{contract}"] += 1
            if self.transcript is not None:
                with self.transcript.open("ab") as out:
                    line = {"request": request.user, "answer": answer, "messages": request.messages}
                    out.write(orjson.dumps(line) + b"\n")
        except (OracleError, KeyError, TypeError, AttributeError) as exc:
            self.stats["rejected"] += 1
            return 400, {"error": {"message": f"oracle: {exc}", "type": "invalid_request"}}
        self.stats["answered"] += 1
        prompt = sum(estimate_tokens(content) for _, content in request.messages)
        return 200, {
            "id": f"oracle-{self.stats['answered']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "oracle",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": estimate_tokens(content),
                "total_tokens": prompt + estimate_tokens(content),
            },
        }

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            status, body = self.answer(await request.body())
            return Response(orjson.dumps(body), status, media_type="application/json")

        async def health(request: Request) -> Response:
            return Response(b'{"ok": true}', media_type="application/json")

        async def stats(request: Request) -> Response:
            return Response(orjson.dumps(dict(self.stats)), media_type="application/json")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/chat/completions", chat, methods=["POST"]),
                Route("/health", health),
                Route("/_stats", stats),
            ]
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.oracle", description=__doc__)
    parser.add_argument("--bank-file", type=Path, action="append", default=[])
    parser.add_argument("--transcript", type=Path, help="append each request and answer (JSONL)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    banks = load_banks(tuple(args.bank_file) or DEFAULT_BANK_FILES)
    oracle = Oracle(LabelBook.of(banks), args.transcript)
    sock = listen_socket(args.host, args.port)
    print(f"{socket_url(sock)}/v1", flush=True)
    server = uvicorn.Server(uvicorn.Config(oracle.app(), log_level="warning", lifespan="off"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
