"""The offline consolidator: a deterministic lexical policy over the DESIGN §3 wire format. Pure.

Used when no LLM is configured and served by ``consolidation fake-llm``. Each fact updates the
observation it resembles most, merges the request observations it resembles if there are
several, or becomes a new observation. Every answer it returns is valid for its request.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from consolidation.llm.prompts import MAX_OBSERVATION_CHARS

# High enough that sharing only a subject ("Alice ...") does not match a three-word fact,
# low enough that a restated habit with a changed detail does.
SIMILARITY_THRESHOLD = 0.5

_STOP_WORDS_TEXT = """
    a about after again all also am an and any are as at be been before being but by can could
    did do does doing for from had has have having he her here hers him his how if in into is it
    its itself just me more most my no nor not of off on once only or other our ours out over
    own same she should so some such than that the their theirs them then there these they this
    those through to too under until up very was we were what when where which while who whom
    why will with would you your yours
"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())
_WORD = re.compile(r"[^\W_]+")
_ASCII_NON_WORD = str.maketrans({c: " " for c in map(chr, range(128)) if not c.isalnum()})
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# The same ends where every run of white space is one plain space: a sentence's mark and it.
_SPACED_SENTENCE_END = re.compile(r"[.!?] ")
# Words no text is matched on: the stop words and, in ASCII text, the one-character runs.
_IGNORED_ASCII = STOP_WORDS | frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
# A scope's observations come back in request after request until one of them changes, and
# tokenizing them again each time would be most of the fake LLM's CPU. Bounded: at most this many texts of at most
# MAX_OBSERVATION_CHARS each, with their word sets.
_TEXT_CACHE_SIZE = 1024


T = TypeVar("T")


class _Memo(Generic[T]):
    """A bounded least-recently-used cache of ``derive(text)`` that can also be told a value
    worked out another way (:func:`_append` knows an appended text's words from its parts).
    Thread-safe: a test's fake LLM thread and the engine's offline consolidator share it."""

    def __init__(self, derive: Callable[[str], T]) -> None:
        self._derive = derive
        self._values: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> T:
        with self._lock:
            if text in self._values:
                self._values.move_to_end(text)
                return self._values[text]
        value = self._derive(text)
        self.seed(text, value)
        return value

    def seed(self, text: str, value: T) -> None:
        with self._lock:
            self._values[text] = value
            self._values.move_to_end(text)
            if len(self._values) > _TEXT_CACHE_SIZE:
                self._values.popitem(last=False)


def _words(lowered: str) -> set[str]:
    """The distinct words of ``lowered``: runs of letters and digits (Unicode's, as ``\\w``
    less the underscore)."""
    if lowered.isascii():
        # The same runs, three times faster than the regular expression: every ASCII character
        # that is not a letter or digit becomes a space, and split() cuts the runs out.
        return set(lowered.translate(_ASCII_NON_WORD).split())
    return set(_WORD.findall(lowered))


def _derive_tokens(text: str) -> frozenset[str]:
    lowered = text.lower()
    if lowered.isascii():
        # Its words are ASCII letters and digits, so its one-character words are among
        # _IGNORED_ASCII: one set difference instead of a length test per word.
        return frozenset(_words(lowered) - _IGNORED_ASCII)
    return frozenset(word for word in _words(lowered) if len(word) > 1) - STOP_WORDS


_tokens = _Memo(_derive_tokens)


def overlap(a: frozenset[str], b: frozenset[str]) -> float:
    """The overlap coefficient of two word sets: shared words over the smaller set's size, 0 to
    1 (0 when either is empty)."""
    if not a or not b:
        return 0.0
    return len(a & b) / min(len(a), len(b))


def content_words(text: str) -> frozenset[str]:
    """The words ``text`` is matched on: lower-cased, stop words and one-letter words left out."""
    return _tokens(text)


def similarity(a: str, b: str) -> float:
    """Overlap coefficient of the content words of ``a`` and ``b``: 0 (none shared) to 1."""
    return overlap(_tokens(a), _tokens(b))


def _derive_normalized(text: str) -> str:
    return " ".join(text.lower().split())


_normalized = _Memo(_derive_normalized)


def _contains(hay: str, pin: str) -> bool:
    """Whether normalized ``pin`` occurs in normalized ``hay`` as whole words."""
    if not pin:
        return True
    start = hay.find(pin)
    while start != -1:
        end = start + len(pin)
        before_ok = start == 0 or not hay[start - 1].isalnum() or not pin[0].isalnum()
        after_ok = end == len(hay) or not hay[end].isalnum() or not pin[-1].isalnum()
        if before_ok and after_ok:
            return True
        start = hay.find(pin, start + 1)
    return False


def _fit(text: str) -> str:
    """Trim to the size limit by dropping the oldest sentences; never returns an empty text."""
    text = text.strip()
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    cut = _spaced_cut(text)
    return text[cut:] if cut is not None else _fit_by_sentences(text)


def _fit_by_sentences(text: str) -> str:
    """``_fit`` of a stripped text over the limit, cut into sentences."""
    sentences = _SENTENCE_END.split(text)
    # len(" ".join(sentences[start:])), kept up to date instead of joining again per sentence.
    length = sum(map(len, sentences)) + len(sentences) - 1
    start = 0
    while len(sentences) - start > 1 and length > MAX_OBSERVATION_CHARS:
        length -= len(sentences[start]) + 1
        start += 1
    # A single sentence over the limit keeps its beginning, which reads better than its end.
    return " ".join(sentences[start:])[:MAX_OBSERVATION_CHARS].strip()


def _spaced_cut(text: str) -> int | None:
    """Where ``_fit`` cuts a stripped text over the limit whose every run of white space is one
    plain space (Python counts the other white space as unprintable), else None. Joining the
    kept sentences of such a text gives back a suffix of it: the one after the first sentence
    end that leaves at most the limit, found by searching the text's end instead of cutting
    all of it into sentences (a fifth of the fake LLM's CPU once observations reach the
    limit). None too when no sentence end leaves at most the limit."""
    if not text.isprintable() or "  " in text:
        return None
    end = _SPACED_SENTENCE_END.search(text, max(0, len(text) - MAX_OBSERVATION_CHARS - 2))
    return None if end is None else end.end()


_SENTENCE_CLOSERS = frozenset(".!?…\"')»”’")


def _as_sentence(text: str) -> str:
    """``text`` ending as a sentence: a full stop added when it ends in a word or a digit."""
    text = text.rstrip()
    return text if not text or text[-1] in _SENTENCE_CLOSERS else f"{text}."


def _append(text: str, addition: str, fact: tuple[frozenset[str], str] | None = None) -> str:
    """``text`` followed by ``addition``, without repeating what one already says of the other.
    ``fact``: the words and normalized text of ``addition`` when it is a fact, which is
    compared within its request only and so kept out of the caches."""
    old = _normalized(text)
    new_words, new = (_tokens(addition), _normalized(addition)) if fact is None else fact
    if _contains(old, new):
        return _fit(text)
    if _contains(new, old):
        return _fit(addition)
    # Joined as sentences: a fact without its full stop ("… Go and Postgres") must not run on
    # into the next one ("Sam switched to …").
    text = _as_sentence(text)
    old = _as_sentence(old)
    whole = f"{text} {addition}".strip()
    # The words of the whole are those of its parts (the space between them ends a word in
    # either), so the next request that shows the text written, and the next fact of this
    # one, need not tokenize its 2-4 KB again.
    if len(whole) <= MAX_OBSERVATION_CHARS:
        _tokens.seed(whole, _tokens(text) | new_words)
        _normalized.seed(whole, f"{old} {new}" if old and new else old or new)
        return whole
    cut = _spaced_cut(whole)
    if cut is None:
        return _fit_by_sentences(whole)
    kept = whole[cut:]
    # Cut after a space, so no word spans the cut, and single-spaced, so its normalized text
    # is its lower case; in ASCII text lower case keeps every position. Then only the words of
    # the dropped beginning need looking for again, in what is kept: worth it while that
    # beginning is short (a fact pushing out the oldest sentences), not for a merge that
    # drops half of a long text.
    if whole.isascii() and cut <= len(kept) // 4:
        lowered = kept.lower()
        dropped = _derive_tokens(whole[:cut])
        gone = {word for word in dropped if not _contains(lowered, word)}
        _tokens.seed(kept, (_tokens(text) | new_words) - gone)
        _normalized.seed(kept, lowered)
    return kept


@dataclass(eq=False)  # identity matters: two entries may hold equal text
class _Entry:
    """One observation of the working set: a request observation (with whatever it absorbed
    so far) or one created earlier in this answer."""

    text: str
    refs: list[str]  # request observation refs, the kept one first; empty for a create
    facts: list[str] = field(default_factory=list)
    touched: bool = False

    # Derived on demand (and cached by text): most texts written by the last fact of a request
    # are never compared again.
    @property
    def tokens(self) -> frozenset[str]:
        return _tokens(self.text)

    @property
    def normalized(self) -> str:
        return _normalized(self.text)

    def cite(self, ref: str) -> None:
        if ref not in self.facts:
            self.facts.append(ref)
        self.touched = True


def _score(entry: _Entry, fact_normalized: str, fact_tokens: frozenset[str]) -> float:
    # An already-contained fact is the strongest match even when it has no content words.
    if _contains(entry.normalized, fact_normalized):
        return 1.0
    return overlap(entry.tokens, fact_tokens)


def consolidate(request: Mapping[str, Any]) -> dict[str, Any]:
    """Answer one DESIGN §3 request (the parsed user JSON) with a valid answer object."""
    working: list[_Entry] = []
    for obs in request.get("observations") or []:
        working.append(_Entry(text=_fit(str(obs.get("text") or "")), refs=[str(obs["ref"])]))

    for fact in request.get("facts") or []:
        ref, fact_text = str(fact["ref"]), " ".join(str(fact.get("text") or "").split())
        if not fact_text:
            continue  # nothing to say; the fact stays uncited and is reported as skipped
        # Facts are compared within their own request only: derived, not cached, so that the
        # caches hold the observation texts that come back request after request.
        fact_tokens, fact_normalized = _derive_tokens(fact_text), fact_text.lower()
        scored = [(_score(entry, fact_normalized, fact_tokens), entry) for entry in working]
        # sorted() is stable, so ties keep working-set order and the answer stays deterministic.
        matches = [
            entry
            for score, entry in sorted(scored, key=lambda pair: -pair[0])
            if score >= SIMILARITY_THRESHOLD
        ]
        existing = [entry for entry in matches if entry.refs]
        if len(existing) >= 2:
            target = existing[0]
            for other in existing[1:]:
                target.refs.extend(other.refs)
                target.facts.extend(cited for cited in other.facts if cited not in target.facts)
                target.text = _append(target.text, other.text)
                working = [entry for entry in working if entry is not other]
        elif matches:
            target = matches[0]
        else:
            target = _Entry(text="", refs=[])
            working.append(target)
        target.text = _append(target.text, fact_text, (fact_tokens, fact_normalized))
        target.cite(ref)

    answer: dict[str, Any] = {"creates": [], "updates": [], "merges": []}
    for entry in working:
        if not entry.refs:
            answer["creates"].append({"text": entry.text, "facts": entry.facts})
        elif len(entry.refs) >= 2:
            answer["merges"].append(
                {"observations": entry.refs, "text": entry.text, "facts": entry.facts}
            )
        elif entry.touched:
            answer["updates"].append(
                {"observation": entry.refs[0], "text": entry.text, "facts": entry.facts}
            )
    return answer
