"""PerfLog arithmetic and serialization."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consolidation.perf import PerfLog

_INT_FIELDS = [f.name for f in fields(PerfLog) if isinstance(f.default, int)]
_FLOAT_FIELDS = [f.name for f in fields(PerfLog) if isinstance(f.default, float)]


@st.composite
def perf_logs(draw: st.DrawFn) -> PerfLog:
    values: dict[str, int | float] = {
        name: draw(st.integers(min_value=0, max_value=10**9)) for name in _INT_FIELDS
    }
    for name in _FLOAT_FIELDS:
        values[name] = draw(st.floats(min_value=0, max_value=1e6, allow_nan=False))
    return PerfLog(**values)  # type: ignore[arg-type]


def _assert_equal(left: PerfLog, right: PerfLog) -> None:
    for name in _INT_FIELDS:
        assert getattr(left, name) == getattr(right, name), name
    for name in _FLOAT_FIELDS:
        assert math.isclose(getattr(left, name), getattr(right, name), rel_tol=1e-9), name


def test_every_field_is_a_number_with_a_zero_default() -> None:
    assert set(_INT_FIELDS) | set(_FLOAT_FIELDS) == {f.name for f in fields(PerfLog)}
    assert all(value == 0 for value in PerfLog().to_dict().values())


@given(perf_logs(), perf_logs())
def test_iadd_adds_every_field_and_returns_self(a: PerfLog, b: PerfLog) -> None:
    before = replace(a)
    total = a
    total += b
    assert total is a
    for f in fields(PerfLog):
        assert getattr(a, f.name) == getattr(before, f.name) + getattr(b, f.name)


@given(perf_logs(), perf_logs(), perf_logs())
def test_addition_is_associative(a: PerfLog, b: PerfLog, c: PerfLog) -> None:
    _assert_equal((a + b) + c, a + (b + c))


@given(perf_logs(), perf_logs())
def test_add_returns_a_new_log_and_leaves_operands_alone(a: PerfLog, b: PerfLog) -> None:
    a_before, b_before = a.to_dict(), b.to_dict()
    total = a + b
    assert total is not a and total is not b
    assert a.to_dict() == a_before and b.to_dict() == b_before


@given(st.lists(perf_logs(), max_size=20))
def test_summing_batches_loses_no_counts(logs: list[PerfLog]) -> None:
    total = PerfLog()
    for log in logs:
        total += log
    for name in _INT_FIELDS:
        assert getattr(total, name) == sum(getattr(log, name) for log in logs)


def test_iadd_rejects_other_types() -> None:
    log = PerfLog()
    with pytest.raises(TypeError):
        log += 1  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "action", ["created", "updated", "merged", "multiple", "skipped", "failed"]
)
def test_count_action_increments_the_named_field(action: str) -> None:
    log = PerfLog()
    log.count_action(action)
    log.count_action(action)
    assert getattr(log, action) == 2
    assert sum(v for k, v in log.to_dict().items() if k != action) == 0


@pytest.mark.parametrize("action", ["memories", "created ", "", "splits"])
def test_count_action_rejects_unknown_actions(action: str) -> None:
    with pytest.raises(ValueError):
        PerfLog().count_action(action)


def test_to_dict_rounds_timings_to_six_decimals() -> None:
    log = PerfLog(llm_s=1.23456789, memories=3)
    assert log.to_dict()["llm_s"] == 1.234568
    assert log.to_dict()["memories"] == 3


@given(perf_logs())
def test_to_dict_from_dict_round_trips(log: PerfLog) -> None:
    again = PerfLog.from_dict(log.to_dict())
    for name in _INT_FIELDS:
        assert getattr(again, name) == getattr(log, name)
    for name in _FLOAT_FIELDS:
        assert getattr(again, name) == pytest.approx(getattr(log, name), abs=1e-6)
    assert PerfLog.from_dict(again.to_dict()) == again


def test_from_dict_ignores_unknown_keys_and_defaults_missing_ones() -> None:
    log = PerfLog.from_dict({"created": 2, "llm_s": 1, "from_the_future": "x"})
    assert log == PerfLog(created=2, llm_s=1.0)
    assert isinstance(log.llm_s, float)


@pytest.mark.parametrize("value", ["3", None, True, 1.5])
def test_from_dict_rejects_non_numbers(value: object) -> None:
    with pytest.raises(TypeError):
        PerfLog.from_dict({"created": value})
