"""Small charts over time as geometry for an inline SVG (templates/macros.html draws it). Pure.

Drawn on the server: nothing is loaded from elsewhere and nothing runs in the browser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 360
HEIGHT = 96
PAD_TOP = 6
PAD_BOTTOM = 4


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int
    minutes_ago: int


@dataclass(frozen=True)
class Chart:
    """One series, oldest value first, one value a minute."""

    key: str  # a stable name for tests and CSS
    title: str
    unit: str
    values: tuple[int, ...]
    top: int  # the value the chart's height stands for
    bars: tuple[Bar, ...]
    line: str  # SVG polyline points of the same values
    area: str  # SVG polygon points: the line closed down to the baseline
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def latest(self) -> int:
        return self.values[-1] if self.values else 0

    @property
    def peak(self) -> int:
        return max(self.values, default=0)

    @property
    def total(self) -> int:
        return sum(self.values)

    @property
    def minutes(self) -> int:
        return len(self.values)


def chart(key: str, title: str, unit: str, values: Sequence[int]) -> Chart:
    """Scale ``values`` to the chart's box (a flat zero line when all are zero)."""
    values = tuple(values)
    n = max(1, len(values))
    top = _nice_top(max(values, default=0))
    usable = HEIGHT - PAD_TOP - PAD_BOTTOM
    step = WIDTH / n
    bars = []
    points = []
    for i, value in enumerate(values):
        h = usable * value / top
        y = HEIGHT - PAD_BOTTOM - h
        bars.append(
            Bar(
                x=round(i * step + step * 0.1, 2),
                y=round(y, 2),
                width=round(step * 0.8, 2),
                height=round(h, 2),
                value=value,
                minutes_ago=n - 1 - i,
            )
        )
        points.append(f"{round(i * step + step / 2, 2)},{round(y, 2)}")
    base = HEIGHT - PAD_BOTTOM
    area = ""
    if points:
        first_x = points[0].split(",")[0]
        last_x = points[-1].split(",")[0]
        area = f"{first_x},{base} " + " ".join(points) + f" {last_x},{base}"
    return Chart(key, title, unit, values, top, tuple(bars), " ".join(points), area)


def _nice_top(peak: int) -> int:
    """The smallest of 1, 2, 5 × 10^k that is at least ``peak`` (so a gridline reads well)."""
    top = 1
    while True:
        for factor in (1, 2, 5):
            if top * factor >= peak:
                return top * factor
        top *= 10
