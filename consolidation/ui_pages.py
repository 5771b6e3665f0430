"""The dashboard's HTML, rendered on the server from what store.py and queue.py return. Pure.

Every value from the database goes through :func:`h` (HTML escaping); the pages carry no inline
script or style, so the Content-Security-Policy of ui.py can forbid both.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

from consolidation import __version__
from consolidation.queue import TERMINAL, Operation
from consolidation.scopes import Scope
from consolidation.store import BankRow, BankStats, FailedMemory, MemoryText, ObservationRow

STATUSES = ("pending", "running", "completed", "failed", "cancelled")


@dataclass(frozen=True)
class Chrome:
    """What every page shows around its content."""

    static: dict[str, str]  # file name → versioned URL
    signed_in: bool  # an API key is set and this browser holds the session cookie
    now: datetime


def h(value: object) -> str:
    """Escape for HTML text and attribute values."""
    return html.escape(str(value), quote=True)


def bank_url(bank_id: str, *parts: str, **query: str | None) -> str:
    path = "/ui/banks/" + quote(bank_id, safe="") + "".join(f"/{p}" for p in parts)
    return with_query(path, **query)


def with_query(path: str, **query: str | None) -> str:
    given = {k: v for k, v in query.items() if v is not None}
    return f"{path}?{urlencode(given)}" if given else path


# --- the frame -------------------------------------------------------------------------------


def page(
    chrome: Chrome,
    title: str,
    body: str,
    *,
    active: str = "",
    refresh_ms: int = 0,
) -> str:
    """A whole document; ``refresh_ms`` > 0 makes ui.js reload <main> from the server."""
    nav = "".join(
        f'<a href="{href}"{" aria-current=page" if key == active else ""}>{label}</a>'
        for key, href, label in (
            ("banks", "/ui", "Banks"),
            ("operations", "/ui/operations", "Operations"),
        )
    )
    sign_out = (
        '<form method="post" action="/ui/logout" class="signout">'
        '<button type="submit" class="link">Sign out</button></form>'
        if chrome.signed_in
        else ""
    )
    refresh = f' data-refresh="{refresh_ms}"' if refresh_ms > 0 else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{h(title)} · consolidation</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{h(chrome.static["ui.css"])}">
<script src="{h(chrome.static["ui.js"])}" defer></script>
</head>
<body>
<header class="top">
<a class="brand" href="/ui">consolidation</a>
<nav>{nav}</nav>
<span class="spacer"></span>
<span class="version">v{h(__version__)}</span>
{sign_out}
</header>
<main id="main"{refresh}>
{body}
</main>
<div id="flash" role="status" aria-live="polite"></div>
<dialog id="confirm">
<form method="dialog">
<p class="message"></p>
<div class="buttons">
<button value="keep" class="secondary" autofocus>Keep it</button>
<button value="confirm" class="danger" id="confirm-yes">Confirm</button>
</div>
</form>
</dialog>
</body>
</html>
"""


def message_page(chrome: Chrome, title: str, text: str) -> str:
    """An error or notice in the frame (unknown bank, bad parameter)."""
    return page(chrome, title, f'<h1>{h(title)}</h1><p class="notice">{h(text)}</p>')


def login_page(static: dict[str, str], *, next_url: str, problem: str | None) -> str:
    error = f'<p class="error" role="alert">{h(problem)}</p>' if problem else ""
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sign in · consolidation</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{h(static["ui.css"])}">
</head>
<body class="login">
<form method="post" action="/ui/login" class="card login-card">
<h1>consolidation</h1>
<p>This service has an API key (<code>CONSOLIDATION_API_KEY</code>). Enter it once; this browser
keeps a session cookie that only this dashboard can use.</p>
{error}
<label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="{h(next_url)}">
<button type="submit">Sign in</button>
</form>
</body>
</html>
"""


# --- banks ---------------------------------------------------------------------------------


def banks_page(chrome: Chrome, banks: Sequence[BankRow], next_url: str | None) -> str:
    if not banks:
        body = (
            "<h1>Banks</h1><p class=notice>No banks yet. Ingest memories with "
            "<code>POST /v1/banks/{bank_id}/memories</code> or "
            "<code>consolidation ingest BANK FILE.jsonl</code>.</p>"
        )
        return page(chrome, "Banks", body, active="banks", refresh_ms=5000)
    rows = "".join(
        f"""<tr data-bank="{h(b.id)}">
<td><a href="{h(bank_url(b.id))}">{h(b.id)}</a></td>
<td class="num">{b.stats.pending}</td>
<td class="num">{b.stats.consolidated}</td>
<td class="num">{_failed_count(b.id, b.stats.failed)}</td>
<td class="num">{b.stats.observations}</td>
<td class="num">{_age(b.stats.oldest_pending_age_s)}</td>
</tr>"""
        for b in banks
    )
    body = f"""<h1>Banks</h1>
<table class="grid banks">
<thead><tr><th>Bank</th><th class="num">Pending</th><th class="num">Consolidated</th>
<th class="num">Failed</th><th class="num">Observations</th>
<th class="num" title="Age of the oldest pending memory">Backlog age</th></tr></thead>
<tbody>{rows}</tbody>
</table>
{_next_link(next_url)}"""
    return page(chrome, "Banks", body, active="banks", refresh_ms=5000)


def _failed_count(bank_id: str, failed: int) -> str:
    if not failed:
        return "0"
    return f'<a class="bad" href="{h(bank_url(bank_id))}#failed">{failed}</a>'


# --- operations ----------------------------------------------------------------------------


def operations_page(
    chrome: Chrome,
    operations: Sequence[Operation],
    *,
    bank_id: str | None,
    status: str | None,
    next_url: str | None,
) -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if s == status else ""}>{s}</option>' for s in STATUSES
    )
    filters = f"""<form class="filters" method="get" action="/ui/operations">
<label>Bank <input name="bank_id" value="{h(bank_id or "")}" placeholder="any"></label>
<label>Status <select name="status"><option value="">any</option>{options}</select></label>
<button type="submit" class="secondary">Filter</button>
</form>"""
    body = f"""<h1>Operations</h1>
{filters}
{operations_table(chrome.now, operations)}
{_next_link(next_url)}"""
    return page(chrome, "Operations", body, active="operations", refresh_ms=2000)


def operations_table(now: datetime, operations: Sequence[Operation]) -> str:
    if not operations:
        return '<p class="notice">No operations.</p>'
    rows = "".join(_operation_row(now, op) for op in operations)
    return f"""<table class="grid operations">
<thead><tr><th>Operation</th><th>Bank</th><th>Status</th><th>Progress</th>
<th class="num">Attempt</th><th>Created</th><th class="num">Duration</th><th>Error</th>
<th></th></tr></thead>
<tbody>{rows}</tbody>
</table>"""


def _operation_row(now: datetime, op: Operation) -> str:
    short = str(op.id)[:8]
    scope = ""
    if op.scope_filter is not None:
        scope = f'<div class="scope">scopes {h(", ".join(_scope_label(s) for s in op.scope_filter))}</div>'
    action = ""
    if op.status not in TERMINAL:
        if op.cancel_requested_at is not None:
            action = '<span class="muted">cancel requested</span>'
        else:
            action = (
                f'<button type="button" class="danger small" data-kind="cancel" '
                f'data-action="POST /v1/operations/{op.id}/cancel" '
                f'data-confirm="Cancel operation {short} of bank {h(op.bank_id)}? Work already '
                f'applied stays; the rest of its memories stay pending." '
                f'data-confirm-label="Cancel operation">Cancel</button>'
            )
    error = _error_cell(now, op)
    return f"""<tr data-operation="{op.id}" data-status="{h(op.status)}">
<td><code title="{op.id}">{short}</code>{scope}</td>
<td><a href="{h(bank_url(op.bank_id))}">{h(op.bank_id)}</a></td>
<td><span class="badge {h(op.status)}">{h(op.status)}</span></td>
<td>{_progress(op)}</td>
<td class="num">{op.attempt}/{op.max_attempts}</td>
<td><time datetime="{_iso(op.created_at)}" title="{_iso(op.created_at)}">{_ago(now, op.created_at)}</time></td>
<td class="num">{_duration(now, op)}</td>
<td class="error-cell">{error}</td>
<td class="actions">{action}</td>
</tr>"""


def _error_cell(now: datetime, op: Operation) -> str:
    """The final error of an ended operation; while one is live, its latest attempt's error (kept
    while the next attempt waits) and when a pending one's next attempt is due."""
    if op.status in TERMINAL:
        text = op.error
        if not text:
            return ""
        return f'<span title="{h(text)}">{h(_clip(text, 80))}</span>'
    parts = []
    if op.last_error:
        when = ""
        if op.last_error_at is not None:
            when = (
                f' <time class="muted" datetime="{_iso(op.last_error_at)}">'
                f"{_ago(now, op.last_error_at)}</time>"
            )
        parts.append(
            f'<span class="last-error" title="{h(op.last_error)}">'
            f"{h(_clip(op.last_error, 80))}</span>{when}"
        )
    if op.status == "pending" and op.run_after > now:
        parts.append(
            f'<div class="next-attempt muted">next attempt in '
            f'<time datetime="{_iso(op.run_after)}" title="{_when(op.run_after)}">'
            f"{_age((op.run_after - now).total_seconds())}</time></div>"
        )
    return "".join(parts)


def _progress(op: Operation) -> str:
    progress: dict[str, Any] = op.progress or {}
    total = progress.get("total")
    processed = progress.get("processed")
    if not isinstance(total, int) or not isinstance(processed, int):
        return '<span class="muted">—</span>'
    percent = 100 if total <= 0 else min(100, round(100 * processed / total))
    failed = progress.get("failed") or 0
    failed_note = f' · <span class="bad">{failed} failed</span>' if failed else ""
    return f"""<div class="progress" data-processed="{processed}" data-total="{total}">
<progress max="100" value="{percent}">{percent}%</progress>
<span class="progress-text">{processed} / {total}{failed_note}</span>
</div>"""


def _duration(now: datetime, op: Operation) -> str:
    if op.started_at is None:
        return '<span class="muted">—</span>'
    end = op.finished_at or now
    return _age((end - op.started_at).total_seconds())


# --- one bank ------------------------------------------------------------------------------


def bank_page(
    chrome: Chrome,
    bank_id: str,
    stats: BankStats,
    operations: Sequence[Operation],
    failed: Sequence[FailedMemory],
    failed_next_url: str | None,
    scopes: Sequence[tuple[Scope, int]],
) -> str:
    cards = "".join(
        f'<div class="stat{" " + cls if cls else ""}"><span class="label">{label}</span>'
        f'<span class="value" data-stat="{key}">{value}</span></div>'
        for key, label, value, cls in (
            ("pending", "Pending", stats.pending, ""),
            ("consolidated", "Consolidated", stats.consolidated, ""),
            ("failed", "Failed", stats.failed, "bad" if stats.failed else ""),
            ("observations", "Observations", stats.observations, ""),
            ("oldest_pending_age_s", "Backlog age", _age(stats.oldest_pending_age_s), ""),
        )
    )
    consolidate = (
        f'<button type="button" class="secondary" data-kind="consolidate" '
        f'data-action="POST /v1/banks/{h(quote(bank_id, safe=""))}/consolidations">'
        "Consolidate now</button>"
    )
    all_ops = with_query("/ui/operations", bank_id=bank_id)
    body = f"""<p class="crumbs"><a href="/ui">Banks</a> /</p>
<div class="title-row"><h1>{h(bank_id)}</h1>{consolidate}</div>
<div class="stats">{cards}</div>
<section>
<h2>Recent operations <a class="more" href="{h(all_ops)}">all →</a></h2>
{operations_table(chrome.now, operations)}
</section>
{_failed_section(bank_id, stats.failed, failed, failed_next_url)}
{_scopes_section(bank_id, scopes)}"""
    return page(chrome, bank_id, body, active="banks", refresh_ms=3000)


def _failed_section(
    bank_id: str, count: int, failed: Sequence[FailedMemory], next_url: str | None
) -> str:
    if not failed:
        return '<section id="failed"><h2>Failed memories</h2><p class="notice">None.</p></section>'
    recover = (
        f'<button type="button" data-kind="recover" '
        f'data-action="POST /v1/banks/{h(quote(bank_id, safe=""))}/memories/recover" '
        f'data-confirm="Retry {_count(count, "failed memory", "failed memories")} of bank '
        f"{h(bank_id)}? Their failed markers are cleared so that the next consolidation takes "
        f'them again." '
        f'data-confirm-label="Recover" data-confirm-style="primary">'
        f"Recover {count} failed</button>"
    )
    rows = "".join(
        f"""<tr data-memory="{m.id}">
<td class="text">{h(m.text)}<div class="muted"><code title="{m.id}">{str(m.id)[:8]}</code>{_tags(m.tags)}</div></td>
<td class="reason">{h(m.reason) if m.reason else '<span class="muted">not recorded</span>'}</td>
<td><time datetime="{_iso(m.failed_at)}">{_when(m.failed_at)}</time></td>
</tr>"""
        for m in failed
    )
    return f"""<section id="failed">
<div class="title-row"><h2>Failed memories ({count})</h2>{recover}</div>
<table class="grid failed">
<thead><tr><th>Memory</th><th>Why it failed</th><th>Failed at</th></tr></thead>
<tbody>{rows}</tbody>
</table>
{_next_link(next_url)}
</section>"""


def _scopes_section(bank_id: str, scopes: Sequence[tuple[Scope, int]]) -> str:
    if not scopes:
        return '<section><h2>Observations</h2><p class="notice">None yet.</p></section>'
    items = "".join(
        f'<li><a href="{h(bank_url(bank_id, "observations", scope=",".join(scope)))}">'
        f"{_scope_label(scope)}</a> <span class=muted>{n}</span></li>"
        for scope, n in scopes
    )
    everything = h(bank_url(bank_id, "observations"))
    return f"""<section>
<h2>Observations by scope <a class="more" href="{everything}">all →</a></h2>
<ul class="scopes">{items}</ul>
</section>"""


# --- observations --------------------------------------------------------------------------


def observations_page(
    chrome: Chrome,
    bank_id: str,
    scope: Scope | None,
    observations: Sequence[ObservationRow],
    sources: dict[Any, MemoryText],
    next_url: str | None,
) -> str:
    which = "every scope" if scope is None else f"scope {_scope_label(scope)}"
    cards = "".join(_observation_card(o, sources) for o in observations)
    if not cards:
        cards = '<p class="notice">No observations in this scope.</p>'
    body = f"""<p class="crumbs"><a href="/ui">Banks</a> / <a href="{h(bank_url(bank_id))}">{h(bank_id)}</a> /</p>
<h1>Observations <span class="muted">· {which}</span></h1>
<div class="observations">{cards}</div>
{_next_link(next_url)}"""
    return page(chrome, f"Observations of {bank_id}", body, active="banks")


def _observation_card(o: ObservationRow, sources: dict[Any, MemoryText]) -> str:
    items = []
    for memory_id in o.source_memory_ids:
        memory = sources.get(memory_id)
        if memory is None:
            items.append(f'<li class="muted"><code>{str(memory_id)[:8]}</code> (gone)</li>')
            continue
        items.append(
            f'<li><code title="{memory_id}">{str(memory_id)[:8]}</code> {h(memory.text)}'
            f"{_tags(memory.tags)}</li>"
        )
    return f"""<article class="card observation" data-observation="{o.id}">
<p class="text">{h(o.text)}</p>
<p class="muted">{_scope_label(o.scope)} · version {o.version} · updated
<time datetime="{_iso(o.updated_at)}">{_when(o.updated_at)}</time></p>
<details open><summary>{len(o.source_memory_ids)} source memories</summary>
<ul class="sources">{"".join(items)}</ul></details>
</article>"""


# --- small pieces --------------------------------------------------------------------------


def _scope_label(scope: Iterable[str]) -> str:
    tags = list(scope)
    if not tags:
        return '<span class="tag shared">shared</span>'
    return "".join(f'<span class="tag">{h(t)}</span>' for t in tags)


def _tags(tags: Sequence[str]) -> str:
    return "".join(f' <span class="tag">{h(t)}</span>' for t in tags)


def _next_link(url: str | None) -> str:
    return f'<p class="pager"><a href="{h(url)}">Next page →</a></p>' if url else ""


def _iso(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.isoformat(timespec="seconds").replace("+00:00", "Z")


def _when(value: datetime) -> str:
    """2026-11-23 15:21:00 UTC"""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(now: datetime, then: datetime) -> str:
    seconds = (now - then).total_seconds()
    return "just now" if seconds < 1 else f"{_age(seconds)} ago"


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _age(seconds: float | None) -> str:
    """45 s, 12 min, 3 h 05 min, 2 d 4 h; — for none."""
    if seconds is None:
        return '<span class="muted">—</span>'
    s = max(0, int(seconds))
    if s < 60:
        return f"{max(0.0, seconds):.1f} s" if s < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
