"""The dashboard's pure parts: chart geometry, the request window, the backlog walk, escaping."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry, Counter

from consolidation.ui.charts import HEIGHT, PAD_BOTTOM, PAD_TOP, chart
from consolidation.ui.health import SAMPLE_EVERY_S, RequestWindow
from consolidation.ui.pages import Chrome, highlight, render
from consolidation.ui.reads import Activity


@pytest.mark.parametrize(("peak", "top"), [(0, 1), (1, 1), (3, 5), (7, 10), (11, 20), (480, 500)])
def test_a_chart_is_scaled_to_a_round_top(peak: int, top: int) -> None:
    c = chart("throughput", "Consolidated", "memories/min", [0, peak])
    assert c.top == top
    assert c.bars[-1].height == pytest.approx(
        (HEIGHT - PAD_TOP - PAD_BOTTOM) * peak / top, abs=0.01
    )
    assert c.bars[0].height == 0 and c.bars[0].minutes_ago == 1 and c.bars[-1].minutes_ago == 0


def test_a_chart_keeps_its_values_in_order_and_draws_every_point() -> None:
    c = chart("backlog", "Backlog", "pending", [5, 3, 0, 8])
    assert (c.latest, c.peak, c.total, c.minutes) == (8, 8, 16, 4)
    assert len(c.line.split()) == 4 and len(c.area.split()) == 6
    xs = [float(p.split(",")[0]) for p in c.line.split()]
    assert xs == sorted(xs)


def test_the_backlog_is_walked_back_from_the_pending_count_by_the_minutes_events() -> None:
    a = Activity(
        until=datetime.now(UTC),
        minutes=4,
        created=(0, 10, 0, 2),
        consolidated=(0, 0, 4, 1),
        failed=(0, 0, 1, 0),
        pending_now=6,
    )
    # end of minute 3: 6; minute 2: 6 - 2 + 1 = 5; minute 1: 5 + 5 = 10; minute 0: 10 - 10 = 0.
    assert a.backlog() == (0, 10, 5, 6)


def test_the_request_window_reports_the_difference_over_its_real_span() -> None:
    registry = CollectorRegistry()
    counter = Counter("requests", "test", ["outcome"], registry=registry)
    now = [1000.0]
    window = RequestWindow(counter, window_s=60, clock=lambda: now[0])
    counter.labels("ok").inc(3)
    now[0] += 30
    first = window.requests(("ok", "transient"))
    assert first.by_outcome == {"ok": 3, "transient": 0} and first.span_s == 30
    counter.labels("transient").inc(2)
    for _ in range(12):  # a page rendered every few seconds, for a minute
        now[0] += SAMPLE_EVERY_S
        window.requests()
    later = window.requests(("ok", "transient"))
    assert later.by_outcome == {"ok": 0, "transient": 2}
    assert later.span_s == 60  # from the sample taken just before the two failures
    assert (later.total, later.failing) == (2, 2)


def test_highlight_marks_matches_and_escapes_the_rest() -> None:
    assert str(highlight("a <b> A", "a")) == "<mark>a</mark> &lt;b&gt; <mark>A</mark>"
    assert str(highlight("1+1 <", "1+1")) == "<mark>1+1</mark> &lt;"
    assert str(highlight("<i>", None)) == "&lt;i&gt;"


def test_a_page_escapes_what_it_is_given_once() -> None:
    chrome = Chrome(static={"ui.css": "/c", "ui.js": "/j"}, signed_in=False, now=datetime.now(UTC))
    page = render("message.html", chrome, title="<b>t</b>", text='"x" & <y>')
    assert "<h1>&lt;b&gt;t&lt;/b&gt;</h1>" in page
    assert "&#34;x&#34; &amp; &lt;y&gt;" in page and "&amp;lt;" not in page
