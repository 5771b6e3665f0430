"""The dashboard's pages: Jinja2 templates (templates/, autoescaped) and the filters they use. Pure.

Every value reaches the HTML through the template engine's escaping; markup is written only in
templates, never built in Python strings, so nothing can be escaped twice or not at all. The
pages carry no inline script or style, so the Content-Security-Policy of routes.py forbids both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from markupsafe import Markup, escape

from consolidation import __version__
from consolidation.perf import PerfLog
from consolidation.queue import TERMINAL, Operation

STATUSES = ("pending", "running", "completed", "failed", "cancelled")
EVERY_SCOPE = "*"  # what the observations filter sends for "every scope" (no scope parameter)


@dataclass(frozen=True)
class Chrome:
    """What every page shows around its content."""

    static: dict[str, str]  # file name → versioned URL
    signed_in: bool  # an API key is set and this browser holds the session cookie
    now: datetime


def bank_url(bank_id: str, *parts: str, **query: str | None) -> str:
    path = "/ui/banks/" + quote(bank_id, safe="") + "".join(f"/{p}" for p in parts)
    return with_query(path, **query)


def operation_url(operation_id: object) -> str:
    return f"/ui/operations/{operation_id}"


def with_query(path: str, **query: str | None) -> str:
    given = {k: v for k, v in query.items() if v is not None}
    return f"{path}?{urlencode(given)}" if given else path


def render(template: str, chrome: Chrome, **context: Any) -> str:
    """The page ``template`` (a file of templates/) with ``context`` and the frame's ``chrome``."""
    return _ENV.get_template(template).render(chrome=chrome, now=chrome.now, **context)


# --- filters ---------------------------------------------------------------------------------


def age(seconds: float) -> str:
    """45 s, 12 min, 3 h 05 min, 2 d 4 h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{max(0.0, seconds):.1f} s" if s < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def ago(then: datetime, now: datetime) -> str:
    seconds = (now - then).total_seconds()
    return "just now" if seconds < 1 else f"{age(seconds)} ago"


def iso(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.isoformat(timespec="seconds").replace("+00:00", "Z")


def when(value: datetime) -> str:
    """2026-11-23 15:21:00 UTC"""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def highlight(text: str, query: str | None) -> Markup:
    """``text`` escaped, with each case-insensitive occurrence of ``query`` in ``<mark>``."""
    if not query:
        return escape(text)
    parts = re.split(f"({re.escape(query)})", text, flags=re.IGNORECASE)
    return Markup("").join(
        Markup("<mark>{}</mark>").format(p) if i % 2 else escape(p) for i, p in enumerate(parts)
    )


# --- what the templates ask of an operation -----------------------------------------------------


def perf_of(result: dict[str, Any] | None) -> PerfLog | None:
    """The operation's merged PerfLog from ``operations.result`` (None before it has one)."""
    raw = (result or {}).get("perf")
    if not isinstance(raw, dict):
        return None
    try:
        return PerfLog.from_dict(raw)
    except TypeError:
        return None


def percent(processed: int, total: int) -> int:
    return 100 if total <= 0 else min(100, round(100 * processed / total))


def live(status: str) -> bool:
    return status not in TERMINAL


def result_counts(result: dict[str, Any] | None) -> list[tuple[str, int]]:
    """The operation-level counts of ``operations.result`` that are present, in a fixed order."""
    found = [(key, (result or {}).get(key)) for key in _RESULT_COUNTS]
    return [(key, n) for key, n in found if isinstance(n, int) and not isinstance(n, bool)]


def consolidation_body(op: Operation) -> str:
    """The JSON body that asks for a consolidation like ``op`` (its scopes, if it had any)."""
    return json.dumps({} if op.scope_filter is None else {"scopes": op.scope_filter})


def segment(value: str) -> str:
    """``value`` as one percent-encoded URL path segment."""
    return quote(value, safe="")


def scope_text(scope: Sequence[str]) -> str:
    """A scope as the observations filter's ``scope`` parameter spells it."""
    return ",".join(scope)


_RESULT_COUNTS = ("waves", "processed", "consolidated", "failed", "recovered", "slices")

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("consolidation.ui", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters.update(
    age=age,
    ago=ago,
    iso=iso,
    when=when,
    clip=clip,
    highlight=highlight,
    scope_text=scope_text,
    segment=segment,
)
_ENV.globals.update(
    version=__version__,
    statuses=STATUSES,
    every_scope=EVERY_SCOPE,
    bank_url=bank_url,
    operation_url=operation_url,
    with_query=with_query,
    perf_of=perf_of,
    percent=percent,
    plural=plural,
    live=live,
    result_counts=result_counts,
    consolidation_body=consolidation_body,
)
