"""The quality judge: what the observations of one run are worth against a bank's labels, and
the trivial baselines every figure is printed beside. Pure.

The lane's judge (:func:`bench.realmodel.report.judge`) decides duplicates, state changes,
singles and mixing; this one adds hard negatives merged, unsupported content, skipped memories
and the observation count a perfect answer has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.quality.banks import QualityBank
from bench.realmodel.report import ObservationSeen, judge

# Function words, and the few words a faithful rewrite needs to tell history ("used to live in
# Paris, now in Berlin"): neither is content a model could invent.
_STOPWORD_TEXT = """
    a about above after again against all also am an and any are as at be because been before
    being below between both but by can could did do does doing done down during each either
    every few for from further had has have having he her here hers herself him himself his how
    i if in into is it its itself just me more most my myself no nor not now of off on once only
    or other our ours ourselves out over own same she should so some such than that the their
    theirs them themselves then there these they this those through to too under until up upon
    very was we were what when where which while who whom why will with would you your yours
    yourself yourselves user users person people someone currently previously formerly earlier
    later since still used usually instead anymore longer prior recently originally
    changed change changes moved now today already yet per via
"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())
_WORD = re.compile(r"[^\W_]+")


def content_words(text: str) -> list[str]:
    """The words of ``text`` that carry content: no function words, numbers kept."""
    words = _WORD.findall(text.lower())
    return [w for w in words if w not in _STOPWORDS and (len(w) > 2 or any(c.isdigit() for c in w))]


def stem(word: str) -> str:
    # A crude stem is enough to accept "drinks"/"drink" and "allergy"/"allergic" and still
    # catch a city, a name or a number that no source gave.
    if any(c.isdigit() for c in word):
        return word
    return word.rstrip("s")[:5] or word


_MONTHS_TEXT = (
    "January February March April May June July August September October November December"
)
_MONTHS = _MONTHS_TEXT.split()


def date_words(occurred_at: str | None) -> str:
    """The words a text may take from a memory's ``occurred_at``: "As of 2025-11-18: …" or "on
    November 18, 2025" say when the memory's event happened, which the memory did tell."""
    if not occurred_at or len(occurred_at) < 10:
        return ""
    year, month, day = occurred_at[:10].split("-")
    name = _MONTHS[int(month) - 1] if month.isdigit() and 1 <= int(month) <= 12 else ""
    return f"{year} {month} {day} {month.lstrip('0')} {day.lstrip('0')} {name}"


def unsupported_words(text: str, supports: Iterable[str]) -> list[str]:
    """Content words of ``text`` found in none of ``supports`` (sorted, each once)."""
    known = {stem(w) for s in supports for w in content_words(s)}
    return sorted({w for w in content_words(text) if stem(w) not in known})


@dataclass(frozen=True)
class StoredObservation:
    """An observation as a run left it, with what it may draw on."""

    scope: tuple[str, ...]
    text: str
    sources: tuple[str, ...]  # memory keys
    prior_texts: tuple[str, ...] = ()  # texts it replaced (updates) or absorbed (merges)


@dataclass(frozen=True)
class MemoryFate:
    """What the run did with one memory of the bank."""

    key: str
    actions: tuple[str, ...]  # consolidation_outcomes.action, one per write scope
    failed_reason: str | None
    consolidated: bool
    skip_reason: str | None = None  # when the outcome row says why


def judge_quality(
    qbank: QualityBank,
    observations: Sequence[StoredObservation],
    fates: Sequence[MemoryFate] | None = None,
) -> dict[str, Any]:
    """Every metric of one run on one bank. ``fates`` None is a baseline (nothing skipped)."""
    bank = qbank.bank
    base = judge(bank, [ObservationSeen(o.scope, o.text, o.sources) for o in observations])
    label_of = {m.key: m.label for m in bank.memories}
    text_of = {m.key: f"{m.text} {date_words(m.occurred_at)}" for m in bank.memories}
    merged_negatives = []
    unsupported = []
    for obs in observations:
        labels = {label_of[k] for k in obs.sources if k in label_of}
        merged_negatives += [
            {"labels": list(pair), "text": obs.text}
            for pair in qbank.hard_negatives
            if set(pair) <= labels
        ]
        supports = [text_of.get(k, "") for k in obs.sources] + list(obs.prior_texts)
        words = unsupported_words(obs.text, supports)
        if words:
            unsupported.append({"text": obs.text, "words": words})
    skipped = []
    failed = []
    pending = []
    for fate in fates or ():
        entry = {"key": fate.key, "label": label_of.get(fate.key)}
        if fate.failed_reason is not None or (not fate.consolidated and fate.actions == ()):
            if fate.failed_reason is not None:
                failed.append({**entry, "reason": fate.failed_reason})
            else:
                pending.append(entry)
        elif "skipped" in fate.actions:
            skipped.append(
                {**entry, "reason": fate.skip_reason or "no action of the answer cited it"}
            )
    return {
        **base,
        "perfect_observations": qbank.perfect_observations,
        "hard_negative_pairs": len(qbank.hard_negatives),
        # Pairs, not observations: a pile copied into several observations merges a pair once.
        "hard_negatives_merged": len({tuple(sorted(m["labels"])) for m in merged_negatives}),
        "hard_negatives_merged_detail": merged_negatives,
        "unsupported_observations": len(unsupported),
        "unsupported": unsupported,
        "skipped_memories": len(skipped),
        "skipped": skipped,
        "failed_memories": len(failed),
        "failed": failed,
        "unconsolidated_memories": len(pending),
        "unconsolidated": pending,
    }


def shortfalls(j: Mapping[str, Any]) -> list[str]:
    """Where a judgement falls short of a perfect answer (empty: 100 % on every metric)."""
    checks = [
        ("duplicate groups collapsed", j["duplicate_labels_collapsed"], j["duplicate_labels"]),
        ("state changes captured", j["state_changes_captured"], j["state_changes"]),
        ("stale observations", j["stale_observations"], 0),
        ("singles kept", j["facts_kept"], j["facts"]),
        ("observations mixing labels", j["observations_mixing_labels"], 0),
        ("hard negatives merged", j["hard_negatives_merged"], 0),
        ("unsupported observations", j["unsupported_observations"], 0),
        ("skipped memories", j["skipped_memories"], 0),
        ("failed memories", j["failed_memories"], 0),
        ("unconsolidated memories", j["unconsolidated_memories"], 0),
        ("observations", j["observations"], j["perfect_observations"]),
        ("memories cited", j["memories_cited"], j["memories"]),
    ]
    return [f"{name}: {got}, perfect {want}" for name, got, want in checks if got != want]


def baselines(qbank: QualityBank) -> dict[str, dict[str, Any]]:
    """The two trivial answers every run is compared with: one observation per memory, and one
    per scope (all of a scope's memories in one text)."""
    memories = qbank.bank.memories
    per_memory = [StoredObservation(m.tags, m.text, (m.key,)) for m in memories]
    scopes: dict[tuple[str, ...], list[Any]] = {}
    for m in memories:
        scopes.setdefault(tuple(sorted(set(m.tags))), []).append(m)
    per_scope = [
        StoredObservation(scope, " ".join(m.text for m in ms), tuple(m.key for m in ms))
        for scope, ms in scopes.items()
    ]
    return {
        "one per memory": judge_quality(qbank, per_memory),
        "one per scope": judge_quality(qbank, per_scope),
    }
