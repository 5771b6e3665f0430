"""Deterministic text vectors for the fake server's ``/v1/embeddings`` — pure, no model.

A text (its first ``MAX_WORDS`` words) becomes a bag of features hashed into ``dimensions``
signed buckets (the hashing trick) and normalised to unit length: each content word's crude
stem, the *concept* of words found in a small synonym table (so "Alice adores matcha" and
"Alice loves green tea" share "like" and "tea"), and the word's character trigrams at a low
weight (so "colour" and "color" stay close). Paraphrases built from the table are therefore
close, texts with no word or concept in common are nearly orthogonal, and the same text gets
the same vector in every process. Good enough to exercise hybrid recall in tests and
benchmarks; the recall-quality benchmark uses a real model (bench/recall/minilm.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re

__all__ = ["CONCEPTS", "DEFAULT_DIMENSIONS", "embed_text"]

DEFAULT_DIMENSIONS = 384

# Groups of words (or two-word phrases) that mean the same for the fake's purposes.
_SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("love", "adore", "like", "enjoy", "fond", "keen", "fan", "relish", "favourite", "favorite"),
    ("hate", "dislike", "detest", "loathe", "despise", "avoid", "cannot stand"),
    ("tea", "matcha", "green tea", "oolong", "chai", "earl grey", "sencha"),
    ("coffee", "espresso", "latte", "cappuccino", "americano", "flat white"),
    ("live", "reside", "dwell", "based", "home", "stay"),
    ("move", "relocate", "moved", "relocated", "emigrate"),
    ("work", "employ", "job", "employer", "career", "position", "office", "workplace"),
    ("buy", "purchase", "acquire", "bought", "order"),
    ("car", "vehicle", "automobile", "sedan", "suv", "hatchback"),
    ("bike", "bicycle", "cycling", "cycle", "ride"),
    ("run", "jog", "jogging", "running", "marathon"),
    ("dog", "puppy", "hound", "canine", "labrador", "terrier"),
    ("cat", "kitten", "feline", "tabby"),
    ("doctor", "physician", "gp", "medic"),
    ("sick", "ill", "unwell", "flu", "cold", "fever"),
    ("happy", "glad", "pleased", "delighted", "content", "cheerful"),
    ("sad", "unhappy", "down", "depressed", "gloomy"),
    ("start", "begin", "commence", "launch", "kick off"),
    ("stop", "quit", "cease", "end", "give up"),
    ("big", "large", "huge", "enormous", "massive"),
    ("small", "little", "tiny", "compact"),
    ("fast", "quick", "rapid", "speedy"),
    ("meeting", "call", "sync", "standup", "catch up"),
    ("book", "novel", "paperback", "read"),
    ("film", "movie", "cinema", "picture"),
    ("music", "song", "album", "band", "playlist"),
    ("food", "meal", "dinner", "lunch", "breakfast", "eat", "cuisine"),
    ("vegetarian", "vegan", "plant based", "meat free"),
    ("allergy", "allergic", "intolerant", "intolerance"),
    ("child", "kid", "son", "daughter", "baby", "toddler"),
    ("partner", "wife", "husband", "spouse", "girlfriend", "boyfriend"),
    ("house", "flat", "apartment", "home", "condo"),
    ("travel", "trip", "journey", "holiday", "vacation", "visit"),
    ("plane", "flight", "fly", "flying", "airline"),
    ("afraid", "anxious", "scared", "fear", "nervous", "panic"),
    ("sport", "football", "soccer", "tennis", "basketball", "rugby"),
    ("study", "learn", "course", "class", "lesson", "student"),
    ("program", "code", "coding", "software", "develop", "developer"),
    ("bug", "defect", "error", "fault", "issue"),
    ("deadline", "due", "cutoff", "due date"),
    ("money", "cash", "salary", "pay", "income", "wage"),
    ("phone", "mobile", "smartphone", "cellphone", "iphone"),
    ("computer", "laptop", "pc", "notebook", "macbook"),
    ("garden", "gardening", "plant", "flower", "grow"),
    ("cook", "bake", "cooking", "baking", "chef"),
    ("morning", "dawn", "sunrise", "early"),
    ("night", "evening", "late", "midnight"),
    ("weekend", "saturday", "sunday"),
    ("prefer", "rather", "favour", "favor", "choose"),
)

CONCEPTS: dict[str, str] = {word: group[0] for group in _SYNONYMS for word in group}

_STOPWORDS = frozenset(
    str.split(
        "a an the and or but of to in on at for with by from as is are was were be been being has "
        "have had do does did it its this that these those he she they we you i his her their our "
        "my your him them us me very really now then so also just every each some any not no"
    )
)
_WORD = re.compile(r"[a-z0-9]+")

_CONCEPT_WEIGHT = 1.0
_WORD_WEIGHT = 1.0
_TRIGRAM_WEIGHT = 0.2


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s", "ly"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def _concept(word: str) -> str | None:
    """The concept of ``word`` or of an inflection's base ("cycles" → "cycle" → bike)."""
    for suffix in ("", "s", "es", "d", "ed", "ing"):
        if suffix and not word.endswith(suffix):
            continue
        base = word[: len(word) - len(suffix)]
        for candidate in (base, base + "e"):
            if candidate in CONCEPTS:
                return CONCEPTS[candidate]
    return None


# Only a text's first words count: enough to tell paraphrases apart, and the cost of a long
# observation stays that of a short one (the fake shares the benchmark's CPU with the engine).
MAX_WORDS = 48


def _features(text: str) -> list[tuple[str, float]]:
    words = _WORD.findall(text.lower())[:MAX_WORDS]
    features: list[tuple[str, float]] = []
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        pair = f"{word} {words[i + 1]}" if i + 1 < len(words) else None
        if pair is not None and pair in CONCEPTS:
            features.append(("c:" + CONCEPTS[pair], _CONCEPT_WEIGHT))
            skip = True
            continue
        features.extend(_word_features(word))
    return features


@functools.lru_cache(maxsize=1 << 16)
def _word_features(word: str) -> tuple[tuple[str, float], ...]:
    """The features of one word outside a two-word concept (words recur: cached)."""
    if word in _STOPWORDS:
        return ()
    concept = _concept(word)
    if concept is not None:
        return (("c:" + concept, _CONCEPT_WEIGHT),)
    stem = _stem(word)
    padded = f"#{stem}#"
    trigrams = (("g:" + padded[j : j + 3], _TRIGRAM_WEIGHT) for j in range(len(padded) - 2))
    return (("w:" + stem, _WORD_WEIGHT), *trigrams)


@functools.lru_cache(maxsize=1 << 16)
def _bucket(feature: str, dimensions: int) -> tuple[int, float]:
    """Where a feature lands and with which sign (words and trigrams recur: cached)."""
    value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
    return value % dimensions, 1.0 if value >> 63 else -1.0


def embed_text(text: str, dimensions: int = DEFAULT_DIMENSIONS) -> list[float]:
    """The unit vector of ``text`` in ``dimensions`` dimensions (deterministic)."""
    if dimensions < 1:
        raise ValueError("dimensions must be at least 1")
    # A text touches a few dozen of the dimensions: sum and normalise only those.
    touched: dict[int, float] = {}
    for feature, weight in _features(text):
        index, sign = _bucket(feature, dimensions)
        touched[index] = touched.get(index, 0.0) + sign * weight
    vector = [0.0] * dimensions
    norm = math.sqrt(sum(x * x for x in touched.values()))
    if norm == 0.0:
        # No content word at all: a fixed direction, so the vector stays a valid unit vector.
        vector[0] = 1.0
        return vector
    for index, value in touched.items():
        vector[index] = value / norm
    return vector
