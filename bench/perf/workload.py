"""Deterministic synthetic banks: tag groups with Zipf sizes, recurring topics, scope-mode mix.

The same :class:`BankShape` and seed always give the same memories (ids, texts, tags, modes,
timestamps), in the same order, so two runs of the benchmark see identical plans.

Shape of a bank:

- ``groups`` tag groups; group ``g`` has the tags ``gNN`` and ``gNN-<area>`` and owns
  ``topics_per_group`` topics (a subject plus three topic words).
- each memory picks its group from a Zipf law (weight ``1 / rank**zipf_s``), so a few groups
  are large and many are small, and the groups are interleaved in time: a wave holds a Zipf
  sample of the groups, as a real agent's stream would.
- a memory restates one of its group's topics with a varying verb and detail, so topics recur
  across batches and waves and later batches update the observations earlier ones created.
- ``observation_scopes`` follows ``modes`` (weights): omitted / ``combined`` (one scope of both
  tags), ``per_tag`` (two scopes), ``all_combinations`` (three scopes; links the group's
  combined and per-tag scopes into one engine group), ``shared`` (the bank-wide scope, one
  engine group per wave) and an explicit list ``[[gNN], [gNN, gNN-<area>]]``.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

AREAS = ("work", "home", "health", "travel", "money", "family", "hobby", "study")
VERBS = (
    "likes",
    "visits",
    "repairs",
    "mentions",
    "plans",
    "reviews",
    "photographs",
    "describes",
)
DETAILS = (
    "morning",
    "evening",
    "weekend",
    "spring",
    "summer",
    "autumn",
    "winter",
    "holiday",
    "birthday",
    "meeting",
    "trip",
    "deadline",
)
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "gr",
    "kl",
    "pl",
    "st",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]

DEFAULT_MODES: dict[str, float] = {
    "omitted": 0.56,
    "combined": 0.28,
    "per_tag": 0.06,
    "all_combinations": 0.04,
    "shared": 0.04,
    "explicit": 0.02,
}

EPOCH = datetime(2025, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class BankShape:
    """Everything that decides a bank's content."""

    memories: int
    groups: int = 64
    zipf_s: float = 1.0
    topics_per_group: int = 6
    modes: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MODES))
    seed: int = 20251121

    def key(self) -> str:
        """A short stable name for the shape (used to name and reuse template databases)."""
        modes = "-".join(f"{k[:3]}{round(v * 100)}" for k, v in sorted(self.modes.items()))
        return (
            f"n{self.memories}_g{self.groups}_z{self.zipf_s:g}_t{self.topics_per_group}"
            f"_{modes}_s{self.seed}"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def zipf_weights(groups: int, s: float) -> list[float]:
    """Normalised Zipf weights of ranks 1..groups."""
    raw = [1.0 / (rank**s) for rank in range(1, groups + 1)]
    total = math.fsum(raw)
    return [w / total for w in raw]


def _word(rng: random.Random, taken: set[str]) -> str:
    while True:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3))))
        if word not in taken:
            taken.add(word)
            return word


@dataclass(frozen=True)
class _Topic:
    subject: str
    words: tuple[str, str, str]


@dataclass(frozen=True)
class _Group:
    tags: tuple[str, str]
    topics: tuple[_Topic, ...]


def _groups(shape: BankShape, rng: random.Random) -> list[_Group]:
    taken: set[str] = set()
    groups = []
    for g in range(shape.groups):
        primary = f"g{g:02d}"
        tags = (primary, f"{primary}-{AREAS[g % len(AREAS)]}")
        topics = tuple(
            _Topic(
                subject=_word(rng, taken).capitalize(),
                words=(_word(rng, taken), _word(rng, taken), _word(rng, taken)),
            )
            for _ in range(shape.topics_per_group)
        )
        groups.append(_Group(tags, topics))
    return groups


def _observation_scopes(mode: str, tags: tuple[str, str]) -> Any:
    if mode == "omitted":
        return None
    if mode == "explicit":
        return [[tags[0]], list(tags)]
    return mode


def generate(shape: BankShape) -> Iterator[dict[str, Any]]:
    """The bank's memories as API objects (``id``, ``text``, ``tags``, ...), in time order."""
    rng = random.Random(shape.seed)
    groups = _groups(shape, rng)
    weights = zipf_weights(shape.groups, shape.zipf_s)
    # Ranks are shuffled so group size does not follow the tag name order.
    ranks = list(range(shape.groups))
    rng.shuffle(ranks)
    mode_names = list(shape.modes)
    mode_weights = [shape.modes[m] for m in mode_names]
    for i in range(shape.memories):
        group = groups[ranks[rng.choices(range(shape.groups), weights)[0]]]
        topic = rng.choice(group.topics)
        w1, w2, w3 = topic.words
        text = (
            f"{topic.subject} {rng.choice(VERBS)} the {w1} {w2} near {w3} "
            f"every {rng.choice(DETAILS)}."
        )
        memory: dict[str, Any] = {
            "id": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "text": text,
            "tags": list(group.tags),
            "occurred_at": (EPOCH + timedelta(seconds=i)).isoformat().replace("+00:00", "Z"),
        }
        scopes = _observation_scopes(rng.choices(mode_names, mode_weights)[0], group.tags)
        if scopes is not None:
            memory["observation_scopes"] = scopes
        yield memory


def chunks(shape: BankShape, size: int) -> Iterator[list[dict[str, Any]]]:
    """:func:`generate` in lists of at most ``size`` memories (bounded memory for big banks)."""
    chunk: list[dict[str, Any]] = []
    for memory in generate(shape):
        chunk.append(memory)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
