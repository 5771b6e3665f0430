"""The fleet benchmark's pure parts: percentiles, freshness with pending memories, and the
verdict on where scaling stops."""

from __future__ import annotations

import dataclasses

import pytest

from bench.perf.fleet import Load, freshness, in_flight_mean, limits, percentile, verdict


def test_percentile_is_the_nearest_rank_value() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.95) == 95.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([7.0], 0.99) == 7.0


def test_freshness_without_pending_memories_is_exact() -> None:
    fresh = freshness([float(v) for v in range(1, 101)], [])
    assert (fresh.p50_s, fresh.p95_s, fresh.p99_s) == (50.0, 95.0, 99.0)
    assert fresh.lower_bound == (False, False, False)
    assert (fresh.memories, fresh.pending) == (100, 0)


def test_a_percentile_reaching_pending_memories_is_a_lower_bound_at_least_their_age() -> None:
    # 90 consolidated within 1-90 s, 10 still pending aged 5 s: they rank above all the others.
    fresh = freshness([float(v) for v in range(1, 91)], [5.0] * 10)
    assert fresh.p50_s == 50.0 and not fresh.lower_bound[0]
    assert fresh.lower_bound[1] and fresh.lower_bound[2]
    assert fresh.p95_s >= 90.0
    assert fresh.pending == 10


def test_freshness_of_nothing_is_nan() -> None:
    fresh = freshness([], [])
    assert fresh.memories == 0
    assert fresh.p50_s != fresh.p50_s  # NaN


def test_in_flight_mean_counts_only_the_window() -> None:
    calls = [(0.0, 10.0), (5.0, 15.0), (20.0, 30.0)]
    assert in_flight_mean(calls, 0.0, 10.0) == pytest.approx(1.5)
    assert in_flight_mean(calls, 10.0, 20.0) == pytest.approx(0.5)
    assert in_flight_mean(calls, 5.0, 5.0) == 0.0


IDLE = Load(
    offered_per_s=5.0,
    throughput_per_s=5.0,
    llm_in_flight_mean=2.0,
    llm_in_flight_max=6,
    llm_cap=16,
    operations_mean=3.0,
    operation_slots=16,
    connections_max=12,
    connections_left=70,
    postgres_cores=0.05,
    cores=2,
)


def test_a_fleet_that_keeps_up_with_room_everywhere_says_so() -> None:
    assert limits(IDLE) == []
    assert verdict(IDLE) == "keeps up"


def test_a_saturated_llm_cap_that_falls_behind_is_where_scaling_stops() -> None:
    load = dataclasses.replace(
        IDLE, throughput_per_s=2.0, llm_in_flight_mean=3.9, llm_in_flight_max=4, llm_cap=4
    )
    assert verdict(load) == "stops at LLM cap"


def test_a_cap_reached_once_but_idle_on_average_is_not_a_limit() -> None:
    load = dataclasses.replace(IDLE, llm_in_flight_mean=1.0, llm_in_flight_max=4, llm_cap=4)
    assert limits(load) == []


def test_limits_are_ordered_by_how_saturated_they_are() -> None:
    load = dataclasses.replace(
        IDLE,
        throughput_per_s=2.0,
        llm_in_flight_mean=3.2,
        llm_in_flight_max=4,
        llm_cap=4,
        operations_mean=4.0,
        operation_slots=4,
    )
    assert limits(load) == ["operation slots", "LLM cap"]


def test_connections_and_postgres_cpu_are_limits_near_their_ceiling() -> None:
    load = dataclasses.replace(IDLE, throughput_per_s=3.0, connections_max=65, postgres_cores=1.5)
    assert limits(load) == ["connections", "Postgres CPU"]
    assert verdict(load) == "stops at connections, Postgres CPU"


def test_keeping_up_with_a_busy_resource_names_it() -> None:
    load = dataclasses.replace(IDLE, postgres_cores=1.2)
    assert verdict(load) == "keeps up (Postgres CPU busy)"


def test_falling_behind_with_nothing_saturated_is_latency_bound() -> None:
    load = dataclasses.replace(IDLE, throughput_per_s=1.0)
    assert verdict(load) == "stops: no resource saturated (latency-bound)"
