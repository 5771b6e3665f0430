"""``python -m bench realistic``: the schedule against latencies shaped like a real model server's.

The fake answers after a lognormal latency (median 1 s, p99 8 s by default: a heavy tail), so
what limits the engine is what limits it with a real model: a slow call holding a slot, and a
scope whose calls must run one after another. The bound is computed from the latencies the calls
really had (the fake records each call's start and end): the calls' total service time over the
concurrency, or the longest chain, whichever is longer — no wave barriers. A chain is what must
run one after another: a scope's calls, and those of the scopes an engine group passed together
(a memory that writes several scopes links them; DESIGN §2 keeps a group's passes in order).
Efficiency = bound / measured wall time. Two configurations: 8 group slots (the groups bind),
and 16 group slots under ``LLM_MAX_CONCURRENT`` 8 (the process-wide cap binds); each without and
with hedged requests (``LLM_HEDGE_QUANTILE``, :mod:`consolidation.llm.hedge`). With hedging, a
call is the first request and its copy together, from the first's start to the earlier answer
(:func:`bench.infra.logical_calls`): the latency the engine waited.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.perf.scenarios import DEFAULT_BANK, BankOptions, Bench, Scenario, Sizes, _median

TARGET_EFFICIENCY = 0.95
MEDIAN_MS = 1000
P99_MS = 8000
HEDGE_QUANTILE = 0.9


@dataclass(frozen=True)
class Observed:
    """What the calls of one run allowed, and where the rest of the wall time went."""

    bound_s: float
    total_service_s: float
    longest_chain_s: float
    longest_chain_scope: str
    full_s: float  # every slot busy
    underfilled_s: float  # some slots idle while calls were still to come
    tail_s: float  # after the last moment every slot was busy: stragglers and chains
    idle_s: float  # no call in flight at all (start-up, recall and apply between calls)


def observed(
    intervals: Sequence[tuple[float, float, Sequence[str]]],
    slots: int,
    scope_chains: Mapping[str, str] | None = None,
) -> Observed:
    """The bound and the split of the calls' span for calls given as (start, end, scope).

    A chain is the calls of scopes that must run one after another: those an engine group of
    some wave passed together (``scope_chains``, each scope to the scope naming its chain, as
    :meth:`bench.perf.plan.PlanTracker.scope_chains` gives them), else each scope alone."""
    chain_of = scope_chains or {}
    chains: dict[str, float] = defaultdict(float)
    for start, end, scope in intervals:
        key = ",".join(scope)
        chains[chain_of.get(key, key)] += end - start
    total = sum(end - start for start, end, _ in intervals)
    scope, chain = max(chains.items(), key=lambda kv: kv[1], default=("", 0.0))
    events = sorted([(s, 1) for s, _, _ in intervals] + [(e, -1) for _, e, _ in intervals])
    spans: list[tuple[float, float, int]] = []  # (from, to, calls in flight)
    in_flight = 0
    for (at, change), (nxt, _) in itertools.pairwise(events):
        in_flight += change
        if nxt > at:
            spans.append((at, nxt, in_flight))
    last_full = max((to for _, to, k in spans if k >= slots), default=None)
    full = underfilled = tail = idle = 0.0
    for start, end, k in spans:
        length = end - start
        if k == 0:
            idle += length
        elif k >= slots:
            full += length
        elif last_full is None or start >= last_full:
            tail += length
        else:
            underfilled += length
    return Observed(
        bound_s=max(total / slots, chain),
        total_service_s=total,
        longest_chain_s=chain,
        longest_chain_scope=scope,
        full_s=full,
        underfilled_s=underfilled,
        tail_s=tail,
        idle_s=idle,
    )


def _configurations(
    bank: BankOptions,
    sizes: Sizes,
    loop: str,
    median_ms: float,
    p99_ms: float,
    hedge_quantile: float = HEDGE_QUANTILE,
) -> list[Scenario]:
    shape = bank.shape(sizes.efficiency_memories)
    fake_args = ("--latency-median-ms", f"{median_ms:g}", "--latency-p99-ms", f"{p99_ms:g}")
    return [
        Scenario(
            f"realistic-{label}",
            shape,
            latency_ms=0,
            loop=loop,
            settings={"wave_size": bank.wave_size, **settings},
            fake_args=fake_args,
        )
        for label, settings in (
            ("p8", {"group_parallelism": 8}),
            ("p8-hedged", {"group_parallelism": 8, "llm_hedge_quantile": hedge_quantile}),
            ("p16-cap8", {"group_parallelism": 16, "llm_max_concurrent": 8}),
            (
                "p16-cap8-hedged",
                {
                    "group_parallelism": 16,
                    "llm_max_concurrent": 8,
                    "llm_hedge_quantile": hedge_quantile,
                },
            ),
        )
    ]


async def realistic(
    bench: Bench,
    sizes: Sizes,
    loop: str = "asyncio",
    bank: BankOptions = DEFAULT_BANK,
    median_ms: float = MEDIAN_MS,
    p99_ms: float = P99_MS,
    hedge_quantile: float = HEDGE_QUANTILE,
) -> dict[str, Any]:
    """Every configuration, ``sizes.efficiency_repeats`` runs each, interleaved."""
    scenarios = _configurations(bank, sizes, loop, median_ms, p99_ms, hedge_quantile)
    bench.log(
        f"realistic: {scenarios[0].shape.memories} memories, {bank.groups} groups, lognormal "
        f"latency median {median_ms:g} ms p99 {p99_ms:g} ms; P8, and P16 under a cap of 8, "
        f"each without and with hedging at the {hedge_quantile:g} quantile"
    )
    runs: dict[str, list[dict[str, Any]]] = {s.label: [] for s in scenarios}
    for repeat in range(sizes.efficiency_repeats):
        for configuration in scenarios:
            # Each run draws other latencies; within a run, every configuration gives each
            # request the same one (the fake draws per request body), so they compare call
            # for call.
            seed = ("--seed", str(repeat + 1))
            scenario = dataclasses.replace(
                configuration, fake_args=(*configuration.fake_args, *seed)
            )
            with bench.fake(scenario) as fake:
                record = await bench.run(scenario, fake, repeat=repeat + 1)
            seen = observed(
                record.pop("call_intervals"), scenario.concurrency, record.pop("scope_chains")
            )
            record["observed"] = seen.__dict__
            record["efficiency_observed"] = seen.bound_s / record["wall_s"]
            runs[scenario.label].append(record)
    summary = {}
    for label, records in runs.items():
        summary[label] = {
            "efficiency": _median([r["efficiency_observed"] for r in records]),
            "efficiencies": [round(r["efficiency_observed"], 3) for r in records],
            "wall_s": _median([r["wall_s"] for r in records]),
            "bound_s": _median([r["observed"]["bound_s"] for r in records]),
            **{
                key: _median([r["observed"][key] for r in records])
                for key in ("full_s", "underfilled_s", "tail_s", "idle_s", "longest_chain_s")
            },
            "fake_max_in_flight": max(r["fake_max_in_flight"] for r in records),
            "llm_calls": _median([r["llm_calls"] for r in records]),
            "fake_requests": _median([r["fake_requests"] for r in records]),
        }
    return {
        "median_ms": median_ms,
        "p99_ms": p99_ms,
        "hedge_quantile": hedge_quantile,
        "target": TARGET_EFFICIENCY,
        "summary": summary,
        "runs": runs,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        f"realistic latency (lognormal, median {results['median_ms']:g} ms, p99 "
        f"{results['p99_ms']:g} ms); bound from the calls' own times, no wave barriers; "
        f"hedged: LLM_HEDGE_QUANTILE={results.get('hedge_quantile', HEDGE_QUANTILE):g}",
        "",
        "| configuration | efficiency (median; runs) | target | wall s | bound s | all slots "
        "busy s | some idle s | tail s | none in flight s | longest chain s | requests per call |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in results["summary"].items():
        met = "met" if s["efficiency"] >= results["target"] else "not met"
        runs = ", ".join(f"{e:.3f}" for e in s["efficiencies"])
        lines.append(
            f"| {label} | **{s['efficiency']:.3f}** ({runs}) | ≥ {results['target']} ({met}) | "
            f"{s['wall_s']:.1f} | {s['bound_s']:.1f} | {s['full_s']:.1f} | "
            f"{s['underfilled_s']:.1f} | {s['tail_s']:.1f} | {s['idle_s']:.1f} | "
            f"{s['longest_chain_s']:.1f} | {_per_call(s)} |"
        )
    return "\n".join(lines)


def _per_call(summary: dict[str, Any]) -> str:
    """HTTP requests the fake answered or saw aborted per LLM call of the engine (a hedge's
    copies, and retries, make it more than 1)."""
    calls, requests = summary.get("llm_calls"), summary.get("fake_requests")
    return f"{requests / calls:.3f}" if calls and requests else "–"
