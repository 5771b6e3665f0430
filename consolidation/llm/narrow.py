"""Narrowed consolidation (contract v2): candidates per fact, assembly and guards. Pure.

The engine knows which observations and earlier facts each fact is near; it asks the model only
``new`` / ``same:X`` / ``update:X`` among those few (:mod:`consolidation.llm.prompts_v2`) and
assembles the pass's :class:`~consolidation.llm.prompts.PassPlan` itself: a new fact's observation
is the fact's own text, a restatement is cited without touching the text, an update rewrites one
observation at a time. So unrelated facts cannot be piled together, and whatever a rewrite says
is checked (:func:`rewrite_problems`) before it is kept.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import orjson

from consolidation.llm import offline
from consolidation.llm.prompts import (
    MAX_OBSERVATION_CHARS,
    CreateAction,
    MergeAction,
    PassPlan,
    PassRequest,
    UpdateAction,
)
from consolidation.llm.prompts_v2 import (
    CONFIRM,
    DECIDE,
    NEW,
    NO,
    REWRITE,
    SAME,
    UPDATE,
    YES,
    Decision,
    Question,
    Shown,
)
from consolidation.settings import Settings

Vector = Sequence[float]


@dataclass(frozen=True)
class NarrowOptions:
    """How candidates are picked and how many facts one decide call carries."""

    candidates: int = 2  # nearest observations per fact, and as many earlier facts
    cosine_floor: float = 0.4  # with embeddings: no candidate below it
    # ... or, for a fact that announces a change (:func:`announces_change`), this one if lower:
    # a new state says other things than the old ("stocked through Kestrel" of "we order from
    # Pemberton": 0.39).
    change_cosine_floor: float = 0.3
    lexical_floor: float = 0.2  # without: a stem overlap (:func:`overlap`) below it is none
    facts_per_call: int = 1  # a small model compares one fact with its candidates far better
    # With a model: a candidate at least this near (cosine) is the same subject without asking.
    sure_cosine: float = 0.8
    # ... or this near and sharing two telling words (:func:`telling_words`).
    sure_pair_cosine: float = 0.65
    # Deciding without a model (the offline consolidator): the nearest candidate at least this
    # near is the same subject.
    local_cosine: float = 0.7
    # ... or at least this near and sharing two telling words (:func:`telling_words`): MiniLM
    # puts rewordings that share two at 0.57 and up ("Because of my peanut allergy I always
    # carry an EpiPen" of "I'm allergic to peanuts"). A dated thing's or a measured thing's
    # other property sharing two is set apart by :func:`measures_other` (the backups' retention
    # at 0.64 of their schedule); two properties of one thing named alike are not ("Lena owns
    # the billing service" at 0.58 of "The billing service is written in Kotlin", where the
    # scope's name does not take "billing").
    local_pair_cosine: float = 0.55
    local_lexical: float = offline.SIMILARITY_THRESHOLD  # without embeddings
    # ... and at least this near, a restatement in other words: cited, its text kept.
    local_same_cosine: float = 0.9
    # A fact bridges two observations (:func:`bridged`) only from this near the other one: a
    # merge joins all both say, and a model that says yes too readily (the 0.5B) merged the
    # frequent flyer programme with the travel insurance and the deploy days with the backups'
    # schedule at 0.41; the trust tin a wording of the honesty box bridges is at 0.53.
    bridge_cosine: float = 0.5


@dataclass(frozen=True)
class Item:
    """A fact or an observation of the pass, with the id its ref stands for."""

    ref: str
    id: UUID
    text: str
    at: str | None

    def shown(self) -> Shown:
        return Shown(self.ref, self.text, self.at)


@dataclass(frozen=True)
class PassInputs:
    """What a v1 pass request carries: bank, scope, mission, facts and observations, in order."""

    bank: str
    scope: tuple[str, ...]
    mission: str | None
    facts: tuple[Item, ...]
    observations: tuple[Item, ...]

    def item(self, ref: str) -> Item:
        items = self.facts if ref.startswith("f") else self.observations
        return items[int(ref[1:]) - 1]


def pass_inputs(request: PassRequest) -> PassInputs:
    """The inputs of the pass ``request`` was built for (its §3 object and refs)."""
    payload = orjson.loads(request.user_content)
    facts = tuple(
        Item(f["ref"], request.fact_refs[f["ref"]], f["text"], f.get("occurred_at"))
        for f in payload["facts"]
    )
    observations = tuple(
        Item(o["ref"], request.observation_refs[o["ref"]], o["text"], o.get("updated_at"))
        for o in payload["observations"]
    )
    return PassInputs(
        payload["bank"], tuple(payload["scope"]), payload.get("mission"), facts, observations
    )


def cosine(a: Vector, b: Vector) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=False))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


@dataclass(frozen=True)
class Candidates:
    """Every fact's question (facts without a candidate have none) and each candidate's
    nearness, by (fact ref, candidate ref)."""

    questions: tuple[Question, ...]
    nearness: Mapping[tuple[str, str], float]
    by_cosine: frozenset[str]  # the facts whose nearness is a cosine (else lexical)
    # How many telling words (:func:`telling_words`) each (fact ref, candidate ref) shares.
    shared: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # How many stems of each questioned fact could tell its subject (:func:`own_telling_words`).
    telling: Mapping[str, int] = field(default_factory=dict)
    # Each fact's nearest text by cosine above the floor, shown or not (a change is not shown
    # what measures another property of it): a candidate is the nearest only if it is this.
    nearest: Mapping[str, str] = field(default_factory=dict)

    def question(self, ref: str) -> Question:
        return next(q for q in self.questions if q.fact.ref == ref)


_SUFFIXES = ("ing", "ed", "es", "s")
# Counts in words, as :func:`_stem` writes them in digits ("no more than forty people" and
# "capped at 40 seats"), but for "one", as often a pronoun ("the old one"), and "hundred".
_NUMBER_WORDS = """
    one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen
    sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety
    hundred
"""
_NUMBER_VALUES = (*range(1, 21), *range(30, 100, 10), 100)
_COUNTS = {
    word: str(value)
    for word, value in zip(_NUMBER_WORDS.split(), _NUMBER_VALUES, strict=True)
    if word not in ("one", "hundred")
}


def _stem(word: str) -> str:
    if word in _COUNTS:
        return _COUNTS[word]
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    return word[:6]


def _stems(text: str) -> frozenset[str]:
    return frozenset(_stem(word) for word in offline.content_words(text))


def overlap(a: str, b: str) -> float:
    """The overlap coefficient of the word stems of ``a`` and ``b``, 0 to 1: "I'm allergic to
    peanuts" and "my peanut allergy" share two stems and no word."""
    return offline.overlap(_stems(a), _stems(b))


def common_stems(texts: Iterable[str]) -> frozenset[str]:
    """Word stems found in more than half of ``texts`` (and in at least three): the name of the
    project or the person that every fact of a scope repeats. Sharing one says nothing about
    whether two facts are about the same thing ("Maria leads the design work on Atlas" and "The
    Atlas backend is written in Go")."""
    distinct = list(dict.fromkeys(texts))
    counts = Counter(stem for text in distinct for stem in _stems(text))
    return frozenset(s for s, n in counts.items() if n >= 3 and 2 * n > len(distinct))


def scope_stems(scope: Iterable[str]) -> frozenset[str]:
    """The word stems of a scope's tags ("ops", "project-atlas"): every fact of the scope is
    about them, so sharing one says nothing about whether two facts are about the same thing
    ("Runbooks live in the ops wiki" and "The ops standup is at 09:30", in scope ops)."""
    return frozenset(stem for tag in scope for stem in _stems(tag))


# Words that say how, how often or where rather than what: shared, they tell no subject ("I
# always carry an EpiPen" and "Coffee for me is always black"; "backups run every night" and
# "our monitoring runs on Nagios"; "Runbooks live in the ops wiki" and "The Atlas code lives in
# the internal GitLab").
_GENERIC_TEXT = """
    always never every often usually sometimes still also already just really each whole
    run runs running use uses used using keep keeps kept make makes made get gets got
    take takes took give gives given put puts say says said see sees seen come comes
    came want wants like likes good great best well much many lot lots thing things way ways
    one two three first last next day days week weeks month months year years time times
    part main own new old now today since ago live lives living lived based
"""
_GENERIC_STEMS = frozenset(_stem(word) for word in _GENERIC_TEXT.split())


def telling_words(a: str, b: str, common: frozenset[str]) -> frozenset[str]:
    """The stems ``a`` and ``b`` share that can tell a subject: neither common in the pass, nor
    a bare number (a year or a count two unrelated facts may both give), nor a word that says
    how or how often (``_GENERIC_TEXT``)."""
    return _telling(_stems(a) & _stems(b), common)


def own_telling_words(text: str, common: frozenset[str]) -> frozenset[str]:
    """The stems of ``text`` that could tell its subject, as :func:`telling_words` counts them."""
    return _telling(_stems(text), common)


def _telling(stems: frozenset[str], common: frozenset[str]) -> frozenset[str]:
    return frozenset(
        stem for stem in stems - common if not stem.isdigit() and stem not in _GENERIC_STEMS
    )


# A same/update whose fact and candidate share fewer telling words than this is asked once more.
STRONG_LINK = 2
# Without embeddings, a candidate sharing this many telling words with a fact is the same subject
# without asking (with embeddings the cosine says it: ``NarrowOptions.sure_pair_cosine``).
SURE_LINK = 3


# Where an observation's text is cut into sentences: after a full stop, question or exclamation
# mark that a capital or a digit follows, except after a title or an initial ("Dr. Okafor",
# "Ursula K. Le Guin").
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")
_NOT_AN_END = re.compile(r"(?:\b(?:Dr|Mr|Mrs|Ms|Prof|St|Jr|Sr|vs|No|Mt)|\b[A-Z])\.\Z")
# The date :func:`join` puts before each sentence it adds.
_AS_OF = re.compile(r"\AAs of \d{4}-\d{2}-\d{2}: ")


def sentences(text: str) -> tuple[str, ...]:
    """The sentences of ``text``, without the dates :func:`join` puts before them ("As of
    2025-07-19: Miso, my cat, is a grey tabby." is "Miso, my cat, is a grey tabby.")."""
    parts: list[str] = []
    for piece in _SENTENCE_BREAK.split(" ".join(text.split())):
        if parts and _NOT_AN_END.search(parts[-1]):
            parts[-1] = f"{parts[-1]} {piece}"
        else:
            parts.append(piece)
    return tuple(_AS_OF.sub("", part) for part in parts)


def _several_sentences(text: str) -> tuple[str, ...]:
    """The sentences of ``text`` when it has several (:func:`sentences`), else none."""
    parts = sentences(text)
    return parts if len(parts) > 1 else ()


def embedded_texts(inputs: PassInputs, *, by_sentence: bool = False) -> list[str]:
    """The texts of the pass whose vectors :func:`pick_candidates` uses, each once: the facts,
    the observations and, ``by_sentence``, each sentence of an observation of several."""
    texts = [item.text for item in (*inputs.facts, *inputs.observations)]
    for observation in inputs.observations if by_sentence else ():
        texts.extend(_several_sentences(observation.text))
    return list(dict.fromkeys(texts))


def pick_candidates(
    inputs: PassInputs,
    vectors: Mapping[str, Vector] | None,
    options: NarrowOptions,
    *,
    by_sentence: bool = False,
) -> Candidates:
    """For each fact, its ``options.candidates`` nearest observations and as many nearest
    earlier facts of the pass, above the floor: cosine when both texts have vectors (with
    ``by_sentence``, to the nearer of an observation's whole text and its nearest sentence), else
    the overlap of their word stems (:func:`overlap`). An observation grows a sentence at a time,
    and the cosine to the whole text falls as it grows ("My cat Miso turned 5 this year": 0.68 to
    "I have a cat named Miso.", 0.63 once "Miso, my cat, is a grey tabby." has joined it).

    A fact that announces a change is not shown what measures another property of it
    (:func:`measures_other`): a pick of that is set apart (:func:`apart`) and the fact made new,
    its old state left standing beside the pick. The 1.5B model took "Since November 2025 we buy
    the sow and weaner ration from Corran Feeds" for an update of the sow Peggy's farrowing date,
    with the old feed among its candidates. Its nearest by cosine (:attr:`Candidates.nearest`)
    is still taken over every text, shown or not.

    Only the offline consolidator goes by sentence: its links are cosine thresholds, which a
    grown observation falls below. A model is shown the candidates in the order of their
    nearness, and the 1.5B model's picks change with that order; going by sentence there kept
    every quality figure and cost tokens (docs/quality.md)."""
    questions: list[Question] = []
    nearness: dict[tuple[str, str], float] = {}
    by_cosine: set[str] = set()
    shared: dict[tuple[str, str], int] = {}
    telling: dict[str, int] = {}
    nearest: dict[str, str] = {}
    common = common_stems(item.text for item in (*inputs.facts, *inputs.observations))
    common |= scope_stems(inputs.scope)
    # Each text's vectors by ref: its own, then (an observation's, by sentence) its sentences'.
    known = vectors or {}
    near_vectors: dict[str, list[Vector]] = {}
    for item in (*inputs.facts, *inputs.observations):
        if item.text in known:
            several = by_sentence and item.ref.startswith("o")
            parts = _several_sentences(item.text) if several else ()
            near_vectors[item.ref] = [known[t] for t in (item.text, *parts) if t in known]
    for index, fact in enumerate(inputs.facts):
        fact_vector = known.get(fact.text)
        change = announces_change(fact.text)
        cosine_floor = options.cosine_floor
        if change:
            cosine_floor = min(cosine_floor, options.change_cosine_floor)
        chosen: list[Item] = []
        best: tuple[float, str] | None = None
        # A change's nearness to each observation it may be shown, floor or not: its fallback.
        eligible: dict[str, float] = {}
        for pool in (inputs.observations, inputs.facts[:index]):
            scored: list[tuple[float, int, Item]] = []
            for position, other in enumerate(pool):
                other_vectors = near_vectors.get(other.ref)
                if fact_vector is not None and other_vectors:
                    score = max(cosine(fact_vector, v) for v in other_vectors)
                    floor = cosine_floor
                    by_cosine.add(fact.ref)
                    if score >= floor and (best is None or (score, other.ref) > best):
                        best = (score, other.ref)
                else:
                    score = overlap(fact.text, other.text)
                    floor = options.lexical_floor
                if change and measures_other(fact.text, other.text):
                    continue  # a pick of it would be set apart (:func:`apart`): not shown
                if change and pool is inputs.observations:
                    eligible[other.ref] = score
                if score >= floor:
                    scored.append((score, position, other))
            scored.sort(key=lambda entry: (-entry[0], entry[1]))
            for score, _, other in scored[: options.candidates]:
                nearness[fact.ref, other.ref] = score
                chosen.append(other)
        if fact.ref not in by_cosine and change and not chosen:
            # Without vectors a new state may share no word with the old ("I started a new job
            # at Globex" of "I work at Acme"): near nothing but what measures another property
            # of it ("Since April 2026 Ravi Desai does my books" shares "book" with "I'm booked
            # on the congress, 26 to 29 March" and no word with "My accountant is Gillian
            # Marsh"), it is shown every observation of the pass that could be its old state,
            # the nearer first as any candidates: "As of March 2026 the late evening moves to
            # Tuesdays" shares "late" with the late surgery, too little of its long text to be
            # near. (With vectors, nothing above the cosine floor is nothing near.)
            # Its nearness is each observation's word overlap, computed above.
            chosen = sorted(
                (o for o in inputs.observations if o.ref in eligible),
                key=lambda o: -eligible[o.ref],
            )
            nearness.update(((fact.ref, ref), score) for ref, score in eligible.items())
        if not chosen:
            continue
        if best is not None:
            nearest[fact.ref] = best[1]
        telling[fact.ref] = len(own_telling_words(fact.text, common))
        for other in chosen:
            shared[fact.ref, other.ref] = len(telling_words(fact.text, other.text, common))
        questions.append(Question(fact.shown(), tuple(c.shown() for c in chosen)))
    return Candidates(tuple(questions), nearness, frozenset(by_cosine), shared, telling, nearest)


def sure_decisions(found: Candidates, options: NarrowOptions) -> dict[str, Decision]:
    """The facts the model need not be asked about: a candidate says what the fact says in the
    same words (not merely among many others: a long observation holds most short facts' words),
    or (with embeddings) is at cosine ``options.sure_cosine`` or nearer, or at
    ``options.sure_pair_cosine`` sharing two telling words ("Miso, my cat, is a grey tabby" of
    "I have a cat named Miso"), or (without) shares :data:`SURE_LINK` telling words, at least
    half of those the fact has ("Mr. Jansen next door has our spare key" of "Our neighbour, Mr.
    Jansen, keeps a spare key to the flat"; not "The crime fiction reading group meets on the
    third Thursday of each month at 7pm" of the book club that meets on the first Thursday at
    7pm) — ``same`` as the nearest such candidate
    (:func:`checked_decisions` makes it an update if it says less)."""
    sure: dict[str, Decision] = {}
    for question in found.questions:
        ref = question.fact.ref
        cosines = ref in found.by_cosine
        best: tuple[float, str] | None = None
        for candidate in question.candidates:
            score = found.nearness.get((ref, candidate.ref), 0.0)
            telling = _shared(found, ref, candidate.ref)
            certain = (
                restates(candidate.text, question.fact.text)
                or (cosines and score >= options.sure_cosine)
                or (cosines and score >= options.sure_pair_cosine and telling >= STRONG_LINK)
                or (not cosines and telling >= SURE_LINK and _half_told(found, ref, candidate.ref))
            )
            if (
                certain
                and (best is None or score > best[0])
                and not measures_other(question.fact.text, candidate.text)
            ):
                best = (score, candidate.ref)
        if best is not None:
            sure[ref] = Decision(SAME, best[1])
    return sure


# Words by which a fact announces that a state changed ("I started a new job at Globex", "I'm
# settled in Berlin now"): such a fact replaces something, often in words the old state never used.
_CHANGE_TEXT = """
    new now moved started switched replaced changed took quit joined left resigned postponed
    raised lowered upgraded stopped became instead longer
"""
CHANGE_WORDS = frozenset(_CHANGE_TEXT.split())


# A text that opens by saying from when it holds ("From March 2026 the kids' section is stocked
# through Kestrel", "As of Monday, ...", "Starting next week ...", "Since April 2026 Ravi Desai
# does my books") gives a new state, often in words the old one never used. A range that opens
# the text ("From 17 to 19 October we ...", "From Monday to Friday nobody serves") is when
# something lasts, not since when: its "to" comes within the three words after "from"; a later
# "to" is the new state's ("From April 2026 the shop price for six eggs goes up to £2.60").
_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_WHEN = (
    r"(?:january|february|march|april|may|june|july|august|september|october|november|december|"
    + "|".join(_WEEKDAYS)
    + r"|next|this|today|tomorrow|\d)"
)
_FROM_WHEN = re.compile(
    rf"\A\W*(?:from|as of|since|starting|effective|beginning)\s+(?:the\s+)?{_WHEN}"
    r"(?!\S*(?:\s+[^\s,.;]+){0,2}?\s+(?:to|until|till)\b)",
    re.IGNORECASE,
)


def says_change(text: str) -> bool:
    """Whether ``text`` says in words that something changed (:data:`CHANGE_WORDS`)."""
    return not CHANGE_WORDS.isdisjoint(offline.content_words(text))


def announces_change(text: str) -> bool:
    """Whether ``text`` says outright that something changed (:func:`says_change`) or opens by
    saying from when it holds (:data:`_FROM_WHEN`)."""
    return says_change(text) or bool(_FROM_WHEN.match(text))


# What a fact can measure of its subject. Two texts that each give a value, of no common kind, say
# different things of it ("Database backups run every night at 02:00 UTC" and "Database backups
# are kept for 35 days": when, and how long), whatever words they share. A calendar date is not
# one of them: a rewrite dates the facts it folds in ("Our DBA was Anna Kowalski on September 1,
# 2025"), so an observation's date may say when it was learnt, not what it measures.
_COUNT = "(?:\\d+|" + "|".join(_NUMBER_WORDS.split()) + ")"
_MEASURES = {
    "time of day": re.compile(r"\b\d{1,2}:\d{2}\b|\b\d{1,2} ?[ap]m\b|half past|o'clock|\bnoon\b"),
    "duration": re.compile(
        rf"\b{_COUNT} (?:working |business )?(?:minute|hour|day|week|month|year)s?\b(?! old)"
    ),
    "share": re.compile(r"\d %|\d%|\bper ?cent\b"),
    "amount of money": re.compile(
        r"[€$£] ?\d|\d(?:k|m)? ?(?:eur|euros?|usd|dollars?|gbp|pounds?|chf)\b"
    ),
}


def measures(text: str) -> frozenset[str]:
    """The kinds of value ``text`` gives (:data:`_MEASURES`): a time of day, a duration, ..."""
    lowered = text.lower()
    return frozenset(kind for kind, pattern in _MEASURES.items() if pattern.search(lowered))


# The names of each month, January first: as a memory names a day, as a rewrite may write a date.
_MONTH_NAMES = (
    ("january", "jan"),
    ("february", "feb"),
    ("march", "mar"),
    ("april", "apr"),
    ("may",),
    ("june", "jun"),
    ("july", "jul"),
    ("august", "aug"),
    ("september", "sep", "sept"),
    ("october", "oct"),
    ("november", "nov"),
    ("december", "dec"),
)
_MONTH_WORDS = frozenset(name for names in _MONTH_NAMES for name in names)


# A day of the calendar as a memory names it: "16 October", "the 3rd of May", "March 1st", "the
# first of April", "June the twenty-first"; not a month and year ("August 2029"), nor an ISO date,
# which is how the service dates what it folds in. A day in words is an ordinal ("the first
# Thursday of the month" is no day of the calendar): before its month, with "of".
_MONTHS = "(?:" + "|".join(sorted(_MONTH_WORDS, key=lambda w: (-len(w), w))) + r")\.?"
_ORDINAL_TEXT = """
    first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth
    fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth
"""
_ORDINALS = (
    r"(?:(?:twenty|thirty)[- ](?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)|"
    + "|".join(_ORDINAL_TEXT.split())
    + ")"
)
_DAY = re.compile(
    rf"\b\d{{1,2}}(?:st|nd|rd|th)?(?: of)? {_MONTHS}(?![a-z])|\b{_MONTHS} \d{{1,2}}(?:st|nd|rd|th)?\b(?!\d)"
    rf"|\b{_ORDINALS} of {_MONTHS}(?![a-z])|\b{_MONTHS} (?:the )?{_ORDINALS}\b"
)


def names_a_day(text: str) -> bool:
    """Whether ``text`` names a day of the calendar (:data:`_DAY`), outside the dates
    :func:`join` puts before the sentences it adds."""
    return any(_DAY.search(sentence.lower()) for sentence in sentences(text))


def measures_other(fact: str, candidate: str) -> bool:
    """Whether ``fact`` says another property of the subject than ``candidate``, not a
    restatement nor an update of it: it gives a value of a kind the candidate does not, which
    gives values of other kinds only; or the candidate names a day ("Our autumn poetry evening
    is booked for 16 October") and the fact names none ("Idris Vale is the guest poet at the
    poetry evening"): a restatement of a date says the day, a new date names the new one, and
    whatever else is said of a dated thing (who, where, how) is another property of it.
    A fact that says a change in words may change what is measured ("Backups now run every six
    hours" of "Backups run every night at 02:00") or the day ("The poetry evening has been
    postponed"), so it is never told apart this way. One that only opens by saying from when it
    holds gives the new state's values like any other fact: "Since November 2025 we buy the sow
    and weaner ration from Corran Feeds" is no new day of "Peggy, our Tamworth sow, is due to
    farrow on 12 June 2025"."""
    if says_change(fact):
        return False
    given, other = measures(fact), measures(candidate)
    if given and other and given.isdisjoint(other):
        return True
    return names_a_day(candidate) and not names_a_day(fact)


def apart(found: Candidates, decisions: Mapping[str, Decision]) -> list[str]:
    """The facts whose ``same``/``update`` points at a candidate that measures something else of
    the subject (:func:`measures_other`): each is ``new``, as no question would make it more."""
    apart: list[str] = []
    for ref, decision in decisions.items():
        if decision.kind == NEW:
            continue
        question = found.question(ref)
        if measures_other(question.fact.text, candidate_text(question, decision.target) or ""):
            apart.append(ref)
    return apart


def without_decide(
    found: Candidates, asked: Sequence[Question]
) -> tuple[dict[str, Decision], list[str], list[str]]:
    """Which of ``asked`` need no decide call: a fact with one candidate, when whatever the
    model picked of it (``same`` or ``update``) the engine would make of the pick the same.

    Returns the facts made ``new`` without a call, the ones among them that measure another
    property of their candidate (:func:`apart`; the rest share no telling word with it and
    announce no change, without embeddings: :func:`stronger`), and the facts to ask the yes/no
    question of directly: any pick would be doubtful (:func:`unlinked` with no rule to settle
    it, or :func:`thin`), so a decide call would only say "update" before the question that
    settles it. The 1.5B model all but never answers a decide with ``new`` (docs/quality.md):
    for such a fact the call only cost tokens and time."""
    settled: dict[str, Decision] = {}
    measuring: list[str] = []
    direct: list[str] = []
    for question in asked:
        if len(question.candidates) != 1:
            continue
        ref, target = question.fact.ref, question.candidates[0].ref
        picks = [{ref: Decision(kind, target)} for kind in (SAME, UPDATE)]
        if apart(found, picks[0]):
            settled[ref] = Decision(NEW)
            measuring.append(ref)
        elif unlinked(found, picks[0]):
            made = {stronger(found, ref, pick[ref]) for pick in picks}
            if made == {None}:
                direct.append(ref)
            elif made == {Decision(NEW)}:
                settled[ref] = Decision(NEW)
        elif thin(found, picks[0]):
            direct.append(ref)
    return settled, measuring, direct


def confirmed_pick(found: Candidates, ref: str) -> Decision:
    """The decision on the one candidate of a fact asked the yes/no question directly
    (:func:`without_decide`), when the answer is yes: ``same`` when it already says all the
    fact says, else ``update``."""
    question = found.question(ref)
    (candidate,) = question.candidates
    kind = SAME if says_all(candidate.text, question.fact.text) else UPDATE
    return Decision(kind, candidate.ref)


def candidate_text(question: Question, ref: str | None) -> str | None:
    """The text of ``question``'s candidate ``ref``; None if it has no such candidate."""
    return next((c.text for c in question.candidates if c.ref == ref), None)


def _shared(found: Candidates, ref: str, target: str) -> int:
    return found.shared.get((ref, target), 0)


def _half_told(found: Candidates, ref: str, target: str) -> bool:
    """Whether the telling words fact ``ref`` shares with ``target`` are at least half of
    those the fact has: else most of what the fact names is not in the candidate."""
    return 2 * _shared(found, ref, target) >= found.telling.get(ref, 0)


def unlinked(found: Candidates, decisions: Mapping[str, Decision]) -> list[str]:
    """The facts whose ``same``/``update`` is doubtful: the fact and its candidate share fewer
    than :data:`STRONG_LINK` telling words — one name ("Anna", "Lisbon"), one word of a trade
    ("database", "service") — where a small model takes "same project" or "same person" for
    "same subject"."""
    return [
        ref
        for ref, decision in decisions.items()
        if decision.kind != NEW
        and decision.target is not None
        and _shared(found, ref, decision.target) < STRONG_LINK
    ]


def thin(found: Candidates, decisions: Mapping[str, Decision]) -> list[str]:
    """The facts whose ``same``/``update`` shares :data:`STRONG_LINK` telling words or more with
    its candidate but fewer than half of those the fact has, and announces no change: most of
    what the fact names is not in the candidate ("The crime fiction reading group meets on the
    third Thursday of each month at 7pm" of the book club that meets on the first Thursday at
    7pm: three of eight). Without embeddings such a link is not sure (:func:`sure_decisions`);
    the model's pick is no surer, so it is asked once more."""
    found_thin: list[str] = []
    for ref, decision in decisions.items():
        if decision.kind == NEW or decision.target is None:
            continue
        text = found.question(ref).fact.text
        if (
            _shared(found, ref, decision.target) >= STRONG_LINK
            and not _half_told(found, ref, decision.target)
            and not announces_change(text)
        ):
            found_thin.append(ref)
    return found_thin


# A pick is moved to a candidate that shares at least this many more telling words with the fact.
CLEARLY_MORE = 2


def clearer(found: Candidates, ref: str, decision: Decision) -> Decision:
    """``decision``, or the same kind of decision on the candidate that shares clearly more with
    the fact: at least :data:`CLEARLY_MORE` telling words more than the model's pick, and more
    than any other candidate. The model pointed at the wrong one of two near candidates ("Our
    production workloads are hosted in AWS eu-central-1, Frankfurt" as the same as "Engineers
    reach production hosts only through the WireGuard VPN", with "Production runs in the
    Frankfurt region of AWS" beside it)."""
    if decision.kind == NEW or decision.target is None:
        return decision
    picked = _shared(found, ref, decision.target)
    ranked = sorted(
        ((_shared(found, ref, c.ref), c.ref) for c in found.question(ref).candidates),
        reverse=True,
    )
    (best, target), runner_up = ranked[0], ranked[1][0] if len(ranked) > 1 else -1
    if target != decision.target and best >= picked + CLEARLY_MORE and best > runner_up:
        return Decision(decision.kind, target)
    return decision


def onto_old_value(found: Candidates, ref: str, decision: Decision) -> Decision:
    """``decision``, or the same kind of decision on the one candidate that states the value
    the fact's change replaces (:func:`ended_values`) when the model's pick states none: a
    change that says what it replaces names the observation it changes. Shown "My GP is Dr.
    Okafor at the Eastside practice" and "I take 5 mg of amlodipine every morning for my blood
    pressure", the 1.5B model without embeddings took "Dr. Okafor raised my amlodipine dose
    from 5 mg to 10 mg" for an update of the GP, and the dose was left at 5 mg. Two candidates
    stating the old value leave the pick to the model (either, :func:`made_stale` ends the
    other)."""
    if decision.kind == NEW or decision.target is None:
        return decision
    question = found.question(ref)
    fact = question.fact.text
    stating = [c.ref for c in question.candidates if ended_values(fact, c.text)]
    if len(stating) == 1 and decision.target not in stating:
        return Decision(decision.kind, stating[0])
    return decision


def stronger(found: Candidates, ref: str, decision: Decision) -> Decision | None:
    """What to make of a doubtful same/update without asking again, or None to ask.

    The model said the fact is not new and pointed at a candidate sharing too little with it: when
    exactly one other candidate shares :data:`STRONG_LINK` telling words, the same kind of decision
    on that one ("The Atlas launch has been postponed" as an update of the budget, with the launch's
    observation beside it; "Leo quit football" as an update of Leo's allergy, with his football club
    beside it). Else an update that announces a change stands when the candidate names something of
    it ("I moved from Paris to Berlin" of "I live in Paris") or is its nearest candidate by cosine
    ("I started a new job at Globex" of "I work at Acme"), but for the move below; so does a
    ``same`` of its nearest, which :func:`checked_decisions` makes the update it is ("Since April
    2026 Ravi Desai does my books" the same as "My accountant is Gillian Marsh", 0.37). A fact that
    announces no change and shares no telling word with the candidate is ``new`` without asking
    unless the candidate is its nearest by cosine: with no word shared, the cosine is the only sign
    of a link ("Runbooks live in the ops wiki" of "The ops standup is at 09:30", sharing only the
    scope's name, is one a small model confirms; "The Atlas code lives in the internal GitLab" of
    the second-nearest Go backend, too). Without embeddings there is no nearest, so such a pick is
    always new; a paraphrase that shares no word but is the nearest is asked. A fact that announces
    a change, pointed at a candidate it names nothing of (no telling word shared; its nearest or
    not) while exactly one other candidate names something of it (none of a change's measures
    another property of it: :func:`pick_candidates`), gets the same kind of decision on that one, as
    an announced change stands on one word ("I'm settled in Berlin now, living in Kreuzberg" as an
    update of "My sister Anna lives in Vienna", with the residence's "... I moved from Paris to
    Berlin" beside it; "As of March 2026 the late evening moves to Tuesdays" as an update of the
    drugs wholesaler, its nearest by MiniLM, with the late surgery beside it): a word named is a
    surer sign than the cosine of texts that share none. Else a change called the ``same`` as a
    candidate it has no link to is ``new`` without asking too: a change restates nothing it names
    nothing of ("I started a new job at Globex" as the same as "I go running every Sunday morning",
    shown every observation of the pass as it is near none)."""
    assert decision.target is not None
    question = found.question(ref)
    others = _others_sharing(found, question, decision.target, STRONG_LINK)
    if len(others) == 1:
        return Decision(decision.kind, others[0])
    shared = _shared(found, ref, decision.target)
    if not announces_change(question.fact.text):
        unseen = shared == 0 and decision.target != _nearest(found, question)
        return Decision(NEW) if unseen else None
    linked = _change_links(found, question, decision.target)
    if shared == 0:  # no link, or only the cosine's
        named = _others_sharing(found, question, decision.target, 1)
        if len(named) == 1:
            return Decision(decision.kind, named[0])
    if linked and (decision.kind == UPDATE or decision.target == _nearest(found, question)):
        return decision
    return Decision(NEW) if decision.kind == SAME and not linked else None


def _others_sharing(found: Candidates, question: Question, target: str, words: int) -> list[str]:
    """The candidates of ``question`` but ``target`` that share ``words`` telling words or more
    with its fact."""
    ref = question.fact.ref
    return [
        c.ref
        for c in question.candidates
        if c.ref != target and _shared(found, ref, c.ref) >= words
    ]


def _change_links(found: Candidates, question: Question, target: str) -> bool:
    """Whether a fact that announces a change is linked to candidate ``target``: it names
    something of it (one telling word) or is the fact's nearest by cosine."""
    return _shared(found, question.fact.ref, target) >= 1 or target == _nearest(found, question)


def _nearest(found: Candidates, question: Question) -> str | None:
    """The fact's nearest text by cosine (:attr:`Candidates.nearest`), which may be no candidate
    shown it; None without embeddings."""
    return found.nearest.get(question.fact.ref)


def local_decisions(found: Candidates, options: NarrowOptions) -> dict[str, Decision]:
    """The decisions of the offline consolidator: the nearest candidate that is near enough is
    the same subject: ``same`` when it already says everything the fact says (or is nearly the
    same vector), else ``update``. None near enough: ``new``.

    With vectors, near enough is ``local_cosine``; or ``local_pair_cosine`` with two telling
    words shared ("Because of my peanut allergy I carry an EpiPen" of "I have a severe peanut
    allergy"); or, for a fact that announces a change, one telling word ("I moved from Paris to
    Berlin" of "I live in Paris") or being its nearest candidate ("I started a new job at
    Globex" of "I work at Acme"), as a model's update stands (:func:`stronger`). Words alone do
    not link then: "The billing service is written in Kotlin" and "Lena owns the billing
    service" are mostly the same words and two subjects (in ops-team's ``billing`` scope, one
    telling word shared, 0.58 apart). Without vectors, near enough is the
    v1 offline policy's word overlap (``local_lexical``)."""
    decisions: dict[str, Decision] = {}
    for question in found.questions:
        ref = question.fact.ref
        cosines = ref in found.by_cosine
        near: list[tuple[float, Shown]] = []
        change = announces_change(question.fact.text)
        for candidate in question.candidates:
            score = found.nearness.get((ref, candidate.ref), 0.0)
            if cosines:
                telling = _shared(found, ref, candidate.ref)
                linked = (
                    score >= options.local_cosine
                    or (telling >= STRONG_LINK and score >= options.local_pair_cosine)
                    or (change and _change_links(found, question, candidate.ref))
                )
            else:
                linked = (
                    offline.similarity(question.fact.text, candidate.text) >= options.local_lexical
                )
            if linked and not measures_other(question.fact.text, candidate.text):
                near.append((score, candidate))
        if not near:
            decisions[ref] = Decision(NEW)
            continue
        score, best = max(near, key=lambda pair: pair[0])
        if says_all(best.text, question.fact.text) or (
            cosines and score >= options.local_same_cosine
        ):
            decisions[ref] = Decision(SAME, best.ref)
        else:
            decisions[ref] = Decision(UPDATE, best.ref)
    return decisions


def made_stale(found: Candidates, decisions: Mapping[str, Decision]) -> dict[str, list[str]]:
    """The observations each fact's change ends beside the one it updates, by fact ref.

    A fact that states the value it replaces (:func:`changes`: "I moved from Paris to Berlin
    last week") and updates an observation that states that value ends every other observation
    among its candidates that states it too and none of the new value ("My flat in Paris is
    close to the Canal Saint-Martin", kept apart from "I live in Paris, in the 11th
    arrondissement" by an earlier pass): left standing, it would say only the old state. Such
    an observation is folded into the updated one (:func:`assemble`). One that a fact of the
    pass restates or updates itself is left to that fact; with a model, each is confirmed by
    the yes/no question first, as "I moved from Paris to Berlin" ends nothing of "My sister
    Anna lives in Paris"."""
    targeted = {d.target for d in decisions.values() if d.kind != NEW and d.target is not None}
    stale: dict[str, list[str]] = {}
    claimed: set[str] = set()
    for question in found.questions:
        decision = decisions.get(question.fact.ref)
        if decision is None or decision.kind == NEW or decision.target is None:
            continue
        updated = value_stems(candidate_text(question, decision.target) or "")
        for candidate in question.candidates:
            if (
                not candidate.ref.startswith("o")
                or candidate.ref in targeted
                or candidate.ref in claimed
            ):
                continue
            if any(old <= updated for old in ended_values(question.fact.text, candidate.text)):
                stale.setdefault(question.fact.ref, []).append(candidate.ref)
                claimed.add(candidate.ref)
    return stale


def bridged(
    found: Candidates,
    decisions: Mapping[str, Decision],
    absorbed: Mapping[str, Sequence[str]],
    options: NarrowOptions,
) -> dict[str, list[str]]:
    """The observations each fact may show to be one with the observation it joins, by fact ref.

    A fact that restates or updates an observation (``same``/``update``) and has another
    observation among its candidates may bridge the two: an earlier pass left two wordings of one
    thing apart ("The farm shop is unstaffed on weekdays and runs on an honesty box" and "From
    Monday to Friday nobody serves; customers pay into the trust tin by the door", 0.39 apart by
    MiniLM), and a third wording is near both ("Weekday sales in the shop are self-service, paid
    through the honesty box": 0.63 and 0.53). Whether the two are one is a question of their
    own: with a model, the yes/no question of the fact and the other observation, then of the
    two observations; without one, :func:`locally_linked` of the fact. One answered yes is
    merged into the observation the fact joins. Not asked of a change, whose other candidates
    are :func:`made_stale`'s, nor of what measures another property of the fact, nor of an
    observation a fact of the pass points at or that ``absorbed`` (by fact ref) already folds,
    nor of one further from the fact than ``options.bridge_cosine``. Without embeddings none
    is asked: word stems link many weak candidates, and the 0.5B model said yes to both
    questions of enough of them to mix one observation more on five banks of six
    (docs/quality.md, "Two observations a fact bridges")."""
    targeted = {d.target for d in decisions.values() if d.kind != NEW and d.target is not None}
    claimed = {ref for refs in absorbed.values() for ref in refs}
    asked: dict[str, list[str]] = {}
    for question in found.questions:
        decision = decisions.get(question.fact.ref)
        if decision is None or decision.kind == NEW or not (decision.target or "").startswith("o"):
            continue
        fact = question.fact.text
        if announces_change(fact):
            continue
        for candidate in question.candidates:
            ref = candidate.ref
            far = (
                question.fact.ref not in found.by_cosine
                or found.nearness.get((question.fact.ref, ref), 0.0) < options.bridge_cosine
            )
            if (
                not ref.startswith("o")
                or ref in targeted
                or ref in claimed
                or far
                or measures_other(fact, candidate.text)
            ):
                continue
            asked.setdefault(question.fact.ref, []).append(ref)
            claimed.add(ref)
    return asked


def locally_linked(found: Candidates, ref: str, target: str, options: NarrowOptions) -> bool:
    """Whether the offline consolidator links fact ``ref`` to candidate ``target`` by their
    cosine, as :func:`local_decisions` links a fact to the candidate it joins."""
    question = found.question(ref)
    if measures_other(question.fact.text, candidate_text(question, target) or ""):
        return False
    score = found.nearness.get((ref, target), 0.0)
    telling = _shared(found, ref, target)
    return score >= options.local_cosine or (
        telling >= STRONG_LINK and score >= options.local_pair_cosine
    )


def checked_decisions(found: Candidates, decisions: Mapping[str, Decision]) -> dict[str, Decision]:
    """``decisions`` as the engine applies them: a ``same`` whose candidate does not already
    say all the fact says is an ``update``, so that a change the model took for a restatement
    still reaches the text (the rewrite's guards keep it honest)."""
    checked = dict(decisions)
    for question in found.questions:
        decision = decisions.get(question.fact.ref)
        if decision is None or decision.kind != SAME:
            continue
        if not says_all(candidate_text(question, decision.target) or "", question.fact.text):
            checked[question.fact.ref] = Decision(UPDATE, decision.target)
    return checked


# --- assembly -----------------------------------------------------------------------------


@dataclass
class Group:
    """One observation the pass writes: an existing one (``observation``) or one it creates
    from its first fact; the facts cited on it, and those that change its text."""

    observation: Item | None
    first: Item | None = None  # the fact a created observation starts from
    cited: list[Item] = field(default_factory=list)
    updating: list[Item] = field(default_factory=list)
    # Observations a change of ``updating`` ends (:func:`made_stale`), folded into this one.
    absorbed: list[Item] = field(default_factory=list)

    @property
    def observations(self) -> list[Item]:
        """The existing observations the group writes: its own, then those it absorbs."""
        own = [self.observation] if self.observation is not None else []
        return [*own, *self.absorbed]

    @property
    def base(self) -> Shown:
        """The text the group starts from, as a rewrite is shown it: with the texts it absorbs
        as sentences of its own."""
        origin = self.observation if self.observation is not None else self.first
        assert origin is not None
        if not self.absorbed:
            return origin.shown()
        text = " ".join(_sentence(item.text) for item in (origin, *self.absorbed))
        return Shown(origin.ref, text, origin.at)


def assemble(
    inputs: PassInputs,
    decisions: Mapping[str, Decision],
    stale: Mapping[str, Sequence[str]] | None = None,
) -> list[Group]:
    """The observations the decisions make, in the order they are first touched; a fact without
    a decision is new. A fact that is ``same``/``update`` of an earlier fact joins whatever
    observation that fact went to. The observations a fact's change ends (``stale``, by fact
    ref: :func:`made_stale`) are absorbed by the group the fact joins."""
    groups: list[Group] = []
    of_observation: dict[str, Group] = {}
    of_fact: dict[str, Group] = {}
    for fact in inputs.facts:
        decision = decisions.get(fact.ref, Decision(NEW))
        if decision.kind == NEW or decision.target is None:
            group = Group(observation=None, first=fact)
            groups.append(group)
        elif decision.target.startswith("f"):
            group = of_fact[decision.target]
        elif decision.target in of_observation:
            group = of_observation[decision.target]
        else:
            group = Group(observation=inputs.item(decision.target))
            of_observation[decision.target] = group
            groups.append(group)
        group.cited.append(fact)
        if decision.kind == UPDATE:
            group.updating.append(fact)
        group.absorbed.extend(inputs.item(ref) for ref in (stale or {}).get(fact.ref, ()))
        of_fact[fact.ref] = group
    return groups


def to_plan(inputs: PassInputs, groups: Sequence[Group], texts: Mapping[int, str]) -> PassPlan:
    """The pass plan of ``groups``, each with its new text if ``texts`` has one (by position)
    else its base text. Observations that end with the same text are one: a merge (into the
    first existing one), or a create folded into the existing one — also into a recalled
    observation no fact touched. A group that absorbs observations merges them into its own."""
    by_text: dict[str, list[tuple[Group, str]]] = {}
    for position, group in enumerate(groups):
        text = texts.get(position, group.base.text)
        by_text.setdefault(_normalized(text), []).append((group, text))
    touched = {o.ref for g in groups for o in g.observations}
    for observation in inputs.observations:
        same = by_text.get(_normalized(observation.text))
        if observation.ref not in touched and same and all(not g.observations for g, _ in same):
            same.insert(0, (Group(observation=observation), observation.text))
            touched.add(observation.ref)
    creates: list[CreateAction] = []
    updates: list[UpdateAction] = []
    merges: list[MergeAction] = []
    for same in by_text.values():
        ids = tuple(dict.fromkeys(o.id for g, _ in same for o in g.observations))
        text = same[0][1]
        memory_ids = tuple(dict.fromkeys(f.id for g, _ in same for f in g.cited))
        if not ids:
            creates.append(CreateAction(text, memory_ids))
        elif len(ids) == 1:
            updates.append(UpdateAction(ids[0], text, memory_ids))
        else:
            merges.append(MergeAction(ids, text, memory_ids))
    return PassPlan(tuple(creates), tuple(updates), tuple(merges))


# --- guards -------------------------------------------------------------------------------

# Words a rewrite may add to say how states follow each other.
_CONNECTIVES = frozenset(
    [
        "previously",
        "now",
        "since",
        "until",
        "later",
        "then",
        "earlier",
        "currently",
        "current",
        "longer",
        "still",
        "used",
        "instead",
        "formerly",
        "former",
        "also",
        "date",
        "today",
        "new",
        "prior",
        "moved",
        "changed",
        "change",
        "updated",
        "update",
        "anymore",
        "replaced",
        "switched",
        "started",
        "stopped",
        "became",
        "become",
        # A month is named by a text or a date the rewrite was given, as a number is
        # (:func:`_date_words`): "changed to April" of facts that name March alone is an invented
        # change. But "may", which a rewrite may write as a verb.
        "may",
    ]
)
_CONNECTIVE_STEMS = frozenset(_stem(word) for word in _CONNECTIVES | _MONTH_WORDS)
_DIGITS = re.compile(r"\d+")
# Below this share of a text's content words found in the rewrite, it was not kept.
MIN_KEPT = 0.6


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def says_all(text: str, fact: str) -> bool:
    """Whether ``text`` already says what ``fact`` says: contains it, or all its content words."""
    if _normalized(fact).rstrip(".!?") in _normalized(text):
        return True
    return _stems(fact) <= _stems(text)


def restates(text: str, fact: str) -> bool:
    """Whether ``text`` and ``fact`` say the same in the same words: equal, or the same stems."""
    return _normalized(text) == _normalized(fact) or _stems(text) == _stems(fact)


def _share_kept(source: str, text: str) -> float:
    wanted = _stems(source)
    return len(wanted & _stems(text)) / len(wanted) if wanted else 1.0


def _date_words(at: str | None) -> set[str]:
    """The words a text may take from the ISO date ``at``: its numbers, and its month's names
    ("2025-11-26" gives "November 26, 2025" and "26 Nov 2025")."""
    if not at:
        return set()
    numbers = _DIGITS.findall(at[:10])
    words = {*numbers, *(n.lstrip("0") for n in numbers if n.lstrip("0"))}
    if len(numbers) >= 2 and 1 <= int(numbers[1]) <= 12:
        words.update(_MONTH_NAMES[int(numbers[1]) - 1])
    return words


# How a text says that one state replaced another: "from A to B", "B instead of A", "replaced A
# with B". Each side is cut at a clause's end (a dot between digits ends none: "£2.60"); the
# words nearest the connective are the value. A from-to's old value holds no other "from": in
# "From March 2026 the rent rises from £900 to £950" it is £900, not what the opening says.
_CLAUSE = r"(?:[^,.;:!?()]|(?<=\d)\.(?=\d))"
_FROM_TO = re.compile(
    rf"\bfrom\s+((?:(?!\bfrom\b){_CLAUSE}){{1,60}}?)\s+to\s+({_CLAUSE}{{1,60}})", re.I
)
_CHANGE_PATTERNS = (
    (_FROM_TO, False),
    (re.compile(rf"({_CLAUSE}{{1,60}}?)\s+instead\s+of\s+({_CLAUSE}{{1,60}})", re.I), True),
    (re.compile(rf"\breplaced\s+({_CLAUSE}{{1,60}}?)\s+with\s+({_CLAUSE}{{1,60}})", re.I), False),
)
# A point of time as :func:`_value_words` gives it, and what makes a run of such points a time
# (a bare number is a count as often: "from 900 to 950").
_TIME_MARK = re.compile(
    "|".join([*sorted(_MONTH_WORDS, key=len, reverse=True), *_WEEKDAYS, r"\d+[ap]m", "pm", "noon"])
)
_TIME_POINT = re.compile(rf"\d+(?:st|nd|rd|th)?|{_TIME_MARK.pattern}")
# A word of change by its stem, as a span's preceding verb may say it: "moves" as "moved".
_CHANGE_STEMS = frozenset(_stem(word) for word in CHANGE_WORDS)
_VALUE_WORDS = 3
_VALUE_WORD = re.compile(r"\d+(?:\.\d+)+|[^\W_]+")


def _value_words(text: str) -> list[str]:
    """``text``'s words as a value is read: lower-cased, stop words left out, one-letter words
    kept ("5 mg")."""
    return [w for w in _VALUE_WORD.findall(text.lower()) if w not in offline.STOP_WORDS]


def _value(words: str, *, last: bool) -> frozenset[str]:
    found = _value_words(words)
    return frozenset(found[-_VALUE_WORDS:] if last else found[:_VALUE_WORDS])


def _span(text: str, match: re.Match[str]) -> bool:
    """Whether "from A to B" in ``text`` is the span of a time, not a change: "from 17 to 19
    October", "From Monday to Friday nobody serves", "Ruth now works from 9am to 5pm". Read as
    a change, such a span moved a fact onto, or ended, an observation naming its first day
    (:func:`onto_old_value`, :func:`made_stale`). After a word of change (by its stem, so
    "moves" as "moved": :data:`CHANGE_WORDS`) it is one all the same: "The Lisbon trip moved
    from 10 May to 14 June"."""
    before = list(
        itertools.takewhile(_TIME_POINT.fullmatch, reversed(_value_words(match.group(1))))
    )
    after = list(itertools.takewhile(_TIME_POINT.fullmatch, _value_words(match.group(2))))
    if not (before and after and any(map(_TIME_MARK.fullmatch, before + after))):
        return False
    preceding = _VALUE_WORD.findall(text[: match.start()].lower())[-1:]
    return not any(_stem(word) in _CHANGE_STEMS for word in preceding)


def _opens(text: str, match: re.Match[str]) -> bool:
    """Whether ``match``'s "from" is the first word of ``text``."""
    return not _VALUE_WORD.search(text[: match.start()])


def changes(text: str) -> list[tuple[frozenset[str], frozenset[str]]]:
    """The state changes ``text`` states, as (the old value's words, the new value's words):
    "moved from 10 May to 14 June" gives ({10, may}, {14, june}). A from-to that opens a text
    saying from when it holds (:data:`_FROM_WHEN`) says when, not an old value: "From 1
    February 2026 a standard consult goes up to £53" replaces no value it names."""
    found = []
    opens_when = bool(_FROM_WHEN.match(text))
    for pattern, new_first in _CHANGE_PATTERNS:
        for match in pattern.finditer(text):
            if pattern is _FROM_TO and (_span(text, match) or (opens_when and _opens(text, match))):
                continue
            first = _value(match.group(1), last=True)
            second = _value(match.group(2), last=False)
            found.append((second, first) if new_first else (first, second))
    return found


def value_stems(text: str) -> frozenset[str]:
    """The stems of ``text``'s words as :func:`changes` reads a value (:func:`_value_words`)."""
    return frozenset(map(_stem, _value_words(text)))


def ended_values(change: str, text: str) -> list[frozenset[str]]:
    """The values ``change`` replaces (:func:`changes`) that ``text`` states with none of what
    tells the new value from the old, as crude stems: "I moved from Paris to Berlin" of "My
    flat in Paris is close to the Canal Saint-Martin" gives [{paris}]; of "My flat in Paris is
    sublet while I look for one in Berlin", nothing. The words both values share do not count
    against the text: "raised my amlodipine dose from 5 mg to 10 mg" ends {5, mg} of "I take 5
    mg of amlodipine every morning", which says "mg" as the new value does."""
    own = value_stems(text)
    found = []
    for old, new in changes(change):
        old_stems = frozenset(map(_stem, old))
        new_only = frozenset(map(_stem, new)) - old_stems
        if old_stems and old_stems <= own and own.isdisjoint(new_only):
            found.append(old_stems)
    return found


def turns_round(fact: str, text: str) -> bool:
    """Whether ``text`` states a change of ``fact`` the other way round: the fact says "now
    ends on 6 January instead of 3 January" and the text "now ends on 3 January instead of 6
    January". Only what tells the two values apart is compared (6 and 3, not January)."""
    for old, new in changes(fact):
        for said_old, said_new in changes(text):
            if (said_new - said_old) & (old - new) and (said_old - said_new) & (new - old):
                return True
    return False


def rewrite_problems(
    old: Shown, facts: Sequence[Shown], text: str, *, old_is_fact: bool = False
) -> list[str]:
    """What is wrong with ``text`` as the rewrite of ``old`` by ``facts``: a fact it does not
    mention, the observation's content dropped, words found in none of them (invented: a month
    or a number no text or date gave included), a change stated the other way round, the newest
    fact's words in another tense.

    The facts' dates may be named; ``old.at`` only when ``old_is_fact`` (the first fact of an
    observation the pass creates). An existing observation's ``updated_at`` is when the service
    last wrote it, which no memory said: "my last day there is 27 November 2026" was the day of
    the run."""
    problems = []
    for fact in facts:
        if _share_kept(fact.text, text) < MIN_KEPT:
            problems.append(f"the text does not say what fact {fact.ref} says: {fact.text!r}")
        elif turns_round(fact.text, text):
            problems.append(
                f"the text states the change of fact {fact.ref} the other way round: {fact.text!r}"
            )
    if _share_kept(old.text, text) < MIN_KEPT:
        problems.append(f"the text drops what the observation said: {old.text!r}")
    allowed = set(_stems(old.text)) | _CONNECTIVES
    if old_is_fact:
        allowed |= _date_words(old.at)
    for fact in facts:
        allowed |= _stems(fact.text) | _date_words(fact.at)
    invented = sorted(
        word
        for word in offline.content_words(text)
        if _stem(word) not in allowed and word not in allowed
    )
    if invented:
        problems.append(
            "the text adds words found in neither the observation nor the facts: "
            + ", ".join(invented)
        )
    *older, newest = sorted(facts, key=lambda f: f.at or "")
    retensed = other_tense(text, newest.text, [old.text, *(f.text for f in older)])
    if retensed:
        problems.append(
            f"the text puts words of the newest fact {newest.ref} in another tense: "
            + ", ".join(retensed)
        )
    return problems


def _tense(word: str) -> str:
    """What a word's ending says of its time: "ed" (joined), "ing" (ending), else ""."""
    if len(word) > 4 and word.endswith("ed"):
        return "ed"
    if len(word) > 5 and word.endswith("ing"):
        return "ing"
    return ""


def other_tense(text: str, newest: str, older: Sequence[str]) -> list[str]:
    """The words of ``text`` that only the ``newest`` fact gives, with another ending of time
    than it gives them: "now joins the swimming club" for "Leo quit football and joined the
    swimming club", "now ending on 6 January" for "now ends on 6 January". The newest fact
    tells the state as it is now, and the stems guard passes a changed tense. Words the older
    texts give too may change tense ("Anna lived in Berlin" once she moved), and so may the
    words that order states ("replacing")."""
    before = frozenset().union(*(_stems(text) for text in older))
    forms: dict[str, set[str]] = {}
    for word in offline.content_words(newest):
        forms.setdefault(_stem(word), set()).add(_tense(word))
    return sorted(
        {
            word
            for word in offline.content_words(text)
            if (stem := _stem(word)) in forms
            and stem not in before
            and stem not in _CONNECTIVE_STEMS
            and _tense(word) not in forms[stem]
        }
    )


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text if text.endswith((".", "!", "?")) else f"{text}."


def join(old: Shown, facts: Sequence[Shown]) -> str:
    """The deterministic rewrite: the old text, then each fact it does not already say as a
    sentence of its own, dated, oldest first so that the newest state reads last."""
    text = _sentence(old.text)
    for fact in sorted(facts, key=lambda f: f.at or ""):
        if says_all(text, fact.text):
            continue
        sentence = _sentence(fact.text)
        text = f"{text} As of {fact.at[:10]}: {sentence}" if fact.at else f"{text} {sentence}"
    while len(text) > MAX_OBSERVATION_CHARS and ". " in text:
        text = text.split(". ", 1)[1]  # the oldest sentences go first
    return text[:MAX_OBSERVATION_CHARS]


# --- the offline policy over the v2 wire (served by ``consolidation fake-llm``) -------------


def offline_answer(request: Mapping[str, Any]) -> dict[str, Any]:
    """Answer a parsed v2 user object with the lexical offline policy; always valid."""
    if request.get("task") == DECIDE:
        answer: dict[str, Any] = {}
        for fact in request.get("facts") or []:
            text = str(fact.get("text") or "")
            candidates = [c for c in fact.get("candidates") or [] if isinstance(c, dict)]
            scored = sorted(
                ((offline.similarity(text, str(c.get("text") or "")), c) for c in candidates),
                key=lambda pair: -pair[0],
            )
            if not scored or scored[0][0] < offline.SIMILARITY_THRESHOLD:
                answer[fact["ref"]] = NEW
                continue
            best = scored[0][1]
            kind = SAME if says_all(str(best.get("text") or ""), text) else UPDATE
            answer[fact["ref"]] = f"{kind}:{best['ref']}"
        return answer
    if request.get("task") == REWRITE:
        observation = request.get("observation") or {}
        old = Shown("o", str(observation.get("text") or ""), observation.get("updated_at"))
        facts = [
            Shown(str(f.get("ref")), str(f.get("text") or ""), f.get("occurred_at"))
            for f in request.get("facts") or []
        ]
        return {"text": join(old, facts)}
    if request.get("task") == CONFIRM:
        observation = str((request.get("observation") or {}).get("text") or "")
        fact = str((request.get("fact") or {}).get("text") or "")
        near = offline.similarity(fact, observation) >= offline.SIMILARITY_THRESHOLD
        return {"same_subject": YES if near else NO}
    raise ValueError(f"unknown v2 task {request.get('task')!r}")


def narrow_options(settings: Settings) -> NarrowOptions:
    """The options the ``CONSOLIDATION_LLM_V2_*`` settings ask for."""
    return NarrowOptions(
        candidates=settings.llm_v2_candidates,
        cosine_floor=settings.llm_v2_cosine_floor,
        lexical_floor=settings.llm_v2_lexical_floor,
        facts_per_call=settings.llm_v2_facts_per_call,
    )
