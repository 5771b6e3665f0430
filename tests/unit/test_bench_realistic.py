"""The realistic-latency benchmark's bound and its split of the calls' span (pure)."""

from __future__ import annotations

import pytest

from bench.perf.realistic import observed


def test_the_bound_is_the_total_over_the_slots_when_no_chain_is_longer() -> None:
    calls = [(0.0, 1.0, ["a"]), (0.0, 1.0, ["b"]), (1.0, 2.0, ["c"]), (1.0, 2.0, ["d"])]
    seen = observed(calls, slots=2)
    assert seen.bound_s == pytest.approx(2.0)
    assert seen.full_s == pytest.approx(2.0)
    assert seen.tail_s == seen.idle_s == seen.underfilled_s == 0


def test_a_long_chain_of_one_scope_is_the_bound_and_its_end_is_the_tail() -> None:
    calls = [(0.0, 1.0, ["a"]), (1.0, 2.0, ["a"]), (2.0, 3.0, ["a"]), (0.0, 1.0, ["b"])]
    seen = observed(calls, slots=2)
    assert seen.longest_chain_s == pytest.approx(3.0)
    assert seen.longest_chain_scope == "a"
    assert seen.bound_s == pytest.approx(3.0)
    assert seen.full_s == pytest.approx(1.0)
    assert seen.tail_s == pytest.approx(2.0)


def test_gaps_between_calls_count_as_idle_and_lone_calls_before_the_last_full_as_underfilled() -> (
    None
):
    calls = [(0.0, 1.0, ["a"]), (1.5, 2.5, ["b"]), (1.5, 2.5, ["c"])]
    seen = observed(calls, slots=2)
    assert seen.underfilled_s == pytest.approx(1.0)
    assert seen.idle_s == pytest.approx(0.5)
    assert seen.full_s == pytest.approx(1.0)
