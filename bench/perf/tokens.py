"""Where a request's prompt tokens go, and how much of it repeats an earlier request. Pure.

A chat request of the v1 contract (DESIGN §3) is split into parts: ``instructions`` (the system
prompt, or the instructions that open the first user message with
``CONSOLIDATION_LLM_SYSTEM_ROLE=user``), ``frame`` (the §3 object without its two lists: keys,
bank, scope, mission, punctuation), ``observations`` and ``facts`` (the two lists as sent) and
``repair`` (a retry's previous answer and note). Parts are counted in characters; tokens are the
fake LLM's estimate (:func:`consolidation.llm.client.estimate_tokens`, four characters a token)
or, given the server's ``usage``, its prompt tokens shared out in proportion to the characters.

The shared prefix of a request is the longest prefix of its messages, serialized in order, that
an earlier request of the same run began with: what a server's prefix cache (vLLM's automatic
prefix caching, OpenAI's prompt caching) can reuse at best, with no eviction. OpenAI reuses it in
128-token blocks and only from 1,024 tokens on (:func:`openai_cached_tokens`).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from consolidation.llm import prompts
from consolidation.llm.client import estimate_tokens

PARTS = ("instructions", "frame", "observations", "facts", "repair")
CHARS_PER_TOKEN = 4
OPENAI_CACHE_MIN_TOKENS = 1024
OPENAI_CACHE_BLOCK_TOKENS = 128

Message = tuple[str, str]


@dataclass(frozen=True)
class RequestSplit:
    """One request: characters per part, the facts it showed and its prefix shared with an
    earlier request."""

    chars: dict[str, int]
    facts: int
    shared_prefix_chars: int = 0

    @property
    def total_chars(self) -> int:
        return sum(self.chars.values())

    @property
    def shared_share(self) -> float:
        return self.shared_prefix_chars / self.total_chars if self.total_chars else 0.0


def _list_chars(value: object) -> int:
    # The engine sends orjson's compact form; dumping the parsed list again gives its length.
    return len(orjson.dumps(value).decode()) if isinstance(value, list) else 0


def split_request(messages: Sequence[Message]) -> RequestSplit:
    """The characters of each part of one chat request (:data:`PARTS`)."""
    chars = dict.fromkeys(PARTS, 0)
    facts = 0
    seen_user = False
    for role, content in messages:
        if role == "system" and not seen_user:
            chars["instructions"] += len(content)
        elif role == "user" and not seen_user:
            seen_user = True
            found = prompts.find_request_object(content)
            if found is None:
                chars["frame"] += len(content)
                continue
            # The engine sends the object compact, on one line: the whole message, or its last
            # line after the instructions (CONSOLIDATION_LLM_SYSTEM_ROLE=user).
            before, newline, _ = content.rstrip().rpartition("\n")
            head = before + newline
            obj_chars = len(content) - len(head)
            chars["instructions"] += len(head)
            chars["observations"] += _list_chars(found.get("observations"))
            chars["facts"] += _list_chars(found.get("facts"))
            chars["frame"] += obj_chars - chars["observations"] - chars["facts"]
            listed = found.get("facts")
            facts = len(listed) if isinstance(listed, list) else 0
        else:
            chars["repair"] += len(content)
    return RequestSplit(chars=chars, facts=facts)


def serialized(messages: Sequence[Message]) -> str:
    """The messages as one string in order, the way a chat template lays them out."""
    return "".join(f"<{role}>{content}</{role}>" for role, content in messages)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (binary search over slices)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def shared_prefixes(requests: Iterable[str]) -> list[int]:
    """For each request, its longest common prefix with any request before it. The longest
    common prefix with a set of strings is the one with a neighbour in sorted order."""
    earlier: list[str] = []
    shared: list[int] = []
    for request in requests:
        at = bisect.bisect_left(earlier, request)
        best = 0
        for neighbour in earlier[max(0, at - 1) : at + 1]:
            best = max(best, common_prefix(request, neighbour))
        shared.append(best)
        earlier.insert(at, request)
    return shared


def openai_cached_tokens(prefix_tokens: int) -> int:
    """What OpenAI's prompt caching reuses of a shared prefix: whole 128-token blocks, from
    1,024 tokens on."""
    if prefix_tokens < OPENAI_CACHE_MIN_TOKENS:
        return 0
    return prefix_tokens // OPENAI_CACHE_BLOCK_TOKENS * OPENAI_CACHE_BLOCK_TOKENS


def split_requests(requests: Sequence[Sequence[Message]]) -> list[RequestSplit]:
    """Each request's split, with its prefix shared with the requests before it (in order)."""
    prefixes = shared_prefixes(serialized(messages) for messages in requests)
    splits = []
    for messages, prefix in zip(requests, prefixes, strict=True):
        split = split_request(messages)
        # The serialized form carries role tags the parts do not count.
        shared = min(prefix, split.total_chars)
        splits.append(RequestSplit(split.chars, split.facts, shared))
    return splits


@dataclass(frozen=True)
class TokenReport:
    """Prompt tokens per memory by part, completion tokens per memory, and prefix reuse."""

    memories: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    prompt_by_part: dict[str, float] = field(default_factory=dict)
    facts_per_request: float = 0.0
    shared_prefix_share: float = 0.0
    shared_prefix_share_median: float = 0.0
    openai_cached_share: float = 0.0

    @property
    def prompt_per_memory(self) -> float:
        return self.prompt_tokens / self.memories if self.memories else 0.0

    @property
    def completion_per_memory(self) -> float:
        return self.completion_tokens / self.memories if self.memories else 0.0

    @property
    def tokens_per_memory(self) -> float:
        return self.prompt_per_memory + self.completion_per_memory

    def to_json(self) -> dict[str, Any]:
        return {
            "memories": self.memories,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tokens_per_memory": round(self.tokens_per_memory, 1),
            "prompt_per_memory": round(self.prompt_per_memory, 1),
            "completion_per_memory": round(self.completion_per_memory, 1),
            "prompt_per_memory_by_part": {k: round(v, 1) for k, v in self.prompt_by_part.items()},
            "facts_per_request": round(self.facts_per_request, 2),
            "shared_prefix_share": round(self.shared_prefix_share, 3),
            "shared_prefix_share_median": round(self.shared_prefix_share_median, 3),
            "openai_cached_share": round(self.openai_cached_share, 3),
        }


def token_report(
    requests: Sequence[Sequence[Message]],
    memories: int,
    *,
    prompt_tokens: int | None = None,
    completion_tokens: int = 0,
) -> TokenReport:
    """The token figures of a run's requests over the ``memories`` it consolidated.

    Without ``prompt_tokens`` (the server's usage summed) the fake's estimate of each message
    is used; parts are shared out of the prompt tokens in proportion to their characters."""
    splits = split_requests(requests)
    estimated = sum(estimate_tokens(content) for messages in requests for _, content in messages)
    prompt = estimated if prompt_tokens is None else prompt_tokens
    total_chars = sum(s.total_chars for s in splits)
    per_char = prompt / total_chars if total_chars else 0.0
    by_part = {
        part: sum(s.chars[part] for s in splits) * per_char / memories if memories else 0.0
        for part in PARTS
    }
    shared_chars = sum(s.shared_prefix_chars for s in splits)
    cached = sum(
        openai_cached_tokens(s.shared_prefix_chars // CHARS_PER_TOKEN)
        if s.total_chars // CHARS_PER_TOKEN >= OPENAI_CACHE_MIN_TOKENS
        else 0
        for s in splits
    )
    return TokenReport(
        memories=memories,
        requests=len(splits),
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        prompt_by_part=by_part,
        facts_per_request=sum(s.facts for s in splits) / len(splits) if splits else 0.0,
        shared_prefix_share=shared_chars / total_chars if total_chars else 0.0,
        shared_prefix_share_median=(
            float(statistics.median(s.shared_share for s in splits)) if splits else 0.0
        ),
        openai_cached_share=cached * CHARS_PER_TOKEN / total_chars if total_chars else 0.0,
    )


def render(label: str, report: dict[str, Any]) -> str:
    """One line of a token report (its :meth:`TokenReport.to_json` form)."""
    parts = report["prompt_per_memory_by_part"]
    split = ", ".join(f"{part} {parts[part]:.0f}" for part in PARTS if parts.get(part))
    return (
        f"{label}: {report['tokens_per_memory']:.0f} tokens/memory = prompt "
        f"{report['prompt_per_memory']:.0f} ({split}) + completion "
        f"{report['completion_per_memory']:.0f}; {report['facts_per_request']:.2f} facts/request; "
        f"shared prefix {100 * report['shared_prefix_share']:.0f} % of prompt characters "
        f"(median request {100 * report['shared_prefix_share_median']:.0f} %, OpenAI-cacheable "
        f"{100 * report['openai_cached_share']:.0f} %)"
    )
