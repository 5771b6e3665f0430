"""The realistic-latency benchmark's bound and its split of the calls' span (pure)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.infra import logical_calls
from bench.perf.plan import PlanTracker
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


def test_a_hedge_copy_makes_one_call_with_its_first_that_ends_at_the_earlier_answer() -> None:
    calls: list[dict[str, Any]] = [
        # A first request, aborted once its copy (same scope and facts, sent while it was in
        # flight) was answered.
        {"started": 0.0, "ended": 5.0, "status": None, "scope": ["a"], "fact_texts": ["x"]},
        {"started": 3.0, "ended": 4.0, "status": 200, "scope": ["a"], "fact_texts": ["x"]},
        # A retry after a failure: sent after its request ended, so a call of its own.
        {"started": 6.0, "ended": 7.0, "status": 503, "scope": ["a"], "fact_texts": ["y"]},
        {"started": 7.5, "ended": 8.0, "status": 200, "scope": ["a"], "fact_texts": ["y"]},
        # Another scope at the same time: never merged.
        {"started": 3.0, "ended": 4.5, "status": 200, "scope": ["b"], "fact_texts": ["x"]},
    ]
    assert logical_calls(calls) == [
        (0.0, 4.0, ["a"]),
        (3.0, 4.5, ["b"]),
        (6.0, 7.0, ["a"]),
        (7.5, 8.0, ["a"]),
    ]


def test_a_request_and_its_copy_that_both_failed_end_at_the_later_end() -> None:
    calls: list[dict[str, Any]] = [
        {"started": 0.0, "ended": 5.0, "status": 503, "scope": ["a"], "fact_texts": ["x"]},
        {"started": 3.0, "ended": 6.0, "status": None, "scope": ["a"], "fact_texts": ["x"]},
    ]
    assert logical_calls(calls) == [(0.0, 6.0, ["a"])]


def test_scopes_an_engine_group_passed_together_make_one_chain() -> None:
    # "a" and "a,x" were passed by one engine group (a memory wrote both): their calls run one
    # after another, so the chain is 3 s, longer than the total over the slots.
    calls = [(0.0, 1.0, ["a"]), (1.0, 2.0, ["a", "x"]), (2.0, 3.0, ["a"]), (0.0, 1.0, ["b"])]
    alone = observed(calls, slots=2)
    assert alone.longest_chain_s == pytest.approx(2.0)
    linked = observed(calls, slots=2, scope_chains={"a": "a", "a,x": "a", "b": "b"})
    assert linked.longest_chain_s == pytest.approx(3.0)
    assert linked.longest_chain_scope == "a"
    assert linked.bound_s == pytest.approx(3.0)


def test_the_plan_tracker_links_the_scopes_one_group_passed() -> None:
    tracker = PlanTracker(batch_size=2)
    wave = [
        SimpleNamespace(scopes=(("a",), ("a", "x")), journaled=()),
        SimpleNamespace(scopes=(("b",),), journaled=()),
    ]
    tracker.add_wave(wave)
    chains = tracker.scope_chains()
    assert chains["a"] == chains["a,x"] != chains["b"]
