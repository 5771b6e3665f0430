"""Write scopes of a memory, grouping of a wave (union-find over scopes), batching. Pure.

A *scope* is a sorted, de-duplicated tuple of tags; ``()`` is the bank-wide shared scope. In the
database a scope is ``text[]`` (``memory_scopes``, ``observations``, ``consolidation_outcomes``)
and a list of scopes a JSON array of tag arrays (``operations.scope_filter``); a tuple is sent as
either as it is, and :func:`scope_from_db` / :func:`scopes_from_db` read them back.
Groups returned by :func:`partition` never share a scope, which is what lets the engine run
them concurrently without locks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import combinations
from typing import TypeVar

from consolidation.errors import ValidationError

Scope = tuple[str, ...]

MAX_COMBINATION_TAGS = 6
MAX_TAGS = 32
MAX_TAG_CHARS = 128

_MODES = ("combined", "per_tag", "all_combinations", "shared")

T = TypeVar("T")


def normalize_scope(tags: Iterable[str]) -> Scope:
    """The canonical form of a tag collection: sorted, without duplicates."""
    return tuple(sorted(set(tags)))


def scope_from_db(value: Sequence[str]) -> Scope:
    """A scope read from a ``text[]`` column."""
    return tuple(value)


def scopes_from_db(value: Iterable[Sequence[str]] | None) -> tuple[Scope, ...]:
    """Scopes read from a JSON array of tag arrays (None is none), sorted and de-duplicated."""
    return tuple(sorted({tuple(scope) for scope in value or ()}))


def tag_problem(tag: object) -> str | None:
    """Why ``tag`` is not a valid tag, or None. The one rule for tags everywhere.

    Control characters are refused: U+001F separates tags in stored scope keys, and U+0000
    cannot be stored by Postgres at all.
    """
    if not isinstance(tag, str):
        return f"must be a string, not {type(tag).__name__}"
    if not tag.strip():
        return "must not be empty"
    if len(tag) > MAX_TAG_CHARS:
        return f"is longer than {MAX_TAG_CHARS} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        return "must not contain control characters"
    return None


def observation_scopes_problems(value: object, tags: Sequence[str]) -> list[str]:
    """Every reason why ``value`` is not a valid ``observation_scopes`` for a memory with ``tags``.

    An empty list means valid: ``None``, one of the mode names, or a non-empty list of tag lists.
    """
    if value is None:
        return []
    if isinstance(value, str):
        if value not in _MODES:
            allowed = ", ".join(repr(m) for m in _MODES)
            return [f"observation_scopes {value!r} is not one of {allowed} or a list of tag lists"]
        distinct = len(set(tags))
        if value == "all_combinations" and distinct > MAX_COMBINATION_TAGS:
            return [
                f"observation_scopes 'all_combinations' allows at most {MAX_COMBINATION_TAGS} "
                f"distinct tags, the memory has {distinct}"
            ]
        return []
    if not isinstance(value, list | tuple):
        return [
            "observation_scopes must be null, a mode name or a list of tag lists, "
            f"not {type(value).__name__}"
        ]
    if not value:
        return ["observation_scopes must not be an empty list (use 'shared' for the shared scope)"]
    problems: list[str] = []
    for i, scope in enumerate(value):
        where = f"observation_scopes[{i}]"
        if not isinstance(scope, list | tuple):
            problems.append(f"{where} must be a list of tags, not {type(scope).__name__}")
            continue
        if len(set(map(str, scope))) > MAX_TAGS:
            problems.append(f"{where} has more than {MAX_TAGS} distinct tags")
        for j, tag in enumerate(scope):
            problem = tag_problem(tag)
            if problem:
                problems.append(f"{where}[{j}] {problem}")
    return problems


def write_scopes(tags: Sequence[str], observation_scopes: object) -> tuple[Scope, ...]:
    """The scopes a memory writes to (DESIGN §1), de-duplicated and sorted.

    Raises :class:`ValidationError` when ``observation_scopes`` is invalid for these tags.
    """
    problems = observation_scopes_problems(observation_scopes, tags)
    if problems:
        raise ValidationError("invalid observation_scopes: " + "; ".join(problems), problems)
    distinct = normalize_scope(tags)
    scopes: Iterable[Scope]
    if observation_scopes is None or observation_scopes == "combined":
        scopes = (distinct,)
    elif observation_scopes == "shared":
        scopes = ((),)
    elif observation_scopes == "per_tag":
        scopes = [(tag,) for tag in distinct] or [()]
    elif observation_scopes == "all_combinations":
        scopes = [
            combo for size in range(1, len(distinct) + 1) for combo in combinations(distinct, size)
        ] or [()]
    else:
        assert isinstance(observation_scopes, list | tuple)  # guaranteed by the problems check
        scopes = (normalize_scope(scope) for scope in observation_scopes)
    return tuple(sorted(set(scopes)))


def partition(items: Sequence[T], scopes_of: Callable[[T], Iterable[Scope]]) -> list[list[T]]:
    """Group items whose scopes overlap, transitively (union-find, O(n α(n))).

    Every item lands in exactly one group and no scope appears in two groups. Groups are
    ordered by the position of their first item and keep input order inside, so the result
    depends only on the input.
    """
    parent = list(range(len(items)))
    size = [1] * len(items)

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:  # path compression keeps later finds near O(1)
            parent[i], i = root, parent[i]
        return root

    owner: dict[Scope, int] = {}
    for index, item in enumerate(items):
        for scope in scopes_of(item):
            first = owner.setdefault(scope, index)
            if first == index:
                continue
            a, b = find(first), find(index)
            if a != b:
                if size[a] < size[b]:
                    a, b = b, a
                parent[b] = a
                size[a] += size[b]

    slot_of_root: dict[int, int] = {}
    groups: list[list[T]] = []
    for index, item in enumerate(items):
        root = find(index)
        slot = slot_of_root.get(root)
        if slot is None:
            slot_of_root[root] = slot = len(groups)
            groups.append([])
        groups[slot].append(item)
    return groups


def batched(items: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive chunks of at most ``size`` items, in order; ``size`` must be at least 1."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, got {size}")
    return [list(items[start : start + size]) for start in range(0, len(items), size)]
