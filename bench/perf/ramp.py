"""How long a process's first LLM calls take to get going with ``LLM_RESPONSE_FORMAT=auto``.

    python -m bench.perf.ramp [--calls 8] [--latency-ms 100] [--repeats 5]

N passes start together on a fresh client (as the groups of a ``serve`` start or a
``replay`` do) against the fake LLM at a fixed latency, once with a server that accepts
``json_schema`` (``openai``) and once with one that refuses it (``llama-cpp-python``). Reported,
median over the repeats: when the Nth pass's request (with the form that was answered) reached
the server, and when all N answers were back, both from the start of the passes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from consolidation.llm import prompts
from consolidation.llm.client import HTTPConsolidator
from consolidation.logs import configure_logging
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer


def _chat(index: int) -> prompts.Chat:
    request = prompts.build_request(
        "bank",
        (f"s{index}",),
        None,
        [prompts.FactInput(uuid.UUID(int=index + 1), f"fact number {index}", (f"s{index}",), None)],
        [],
    )
    return prompts.pass_chat(request)


async def _once(url: str, calls: int) -> tuple[float, float]:
    client = HTTPConsolidator(base_url=url, model="bench", max_concurrent=calls)
    try:
        started = time.monotonic()
        await asyncio.gather(*(client.complete(_chat(i)) for i in range(calls)))
        done = time.monotonic() - started
    finally:
        await client.aclose()
    return started, done


async def _measure(dialect: str, calls: int, latency_ms: float, repeats: int) -> dict[str, float]:
    last_sent: list[float] = []
    all_done: list[float] = []
    with FakeLLMServer(FakeLLMConfig(dialect=dialect, latency_ms=latency_ms)) as fake:
        for _ in range(repeats):
            fake.reset()
            started, done = await _once(fake.url, calls)
            answered = [c for c in fake.stats()["calls"] if c["status"] == 200]
            # The fake runs in this process: its `started` is on the same monotonic clock.
            last_sent.append(max(c["started"] for c in answered) - started)
            all_done.append(done)
    return {
        "nth_sent_ms": statistics.median(last_sent) * 1000,
        "all_answered_ms": statistics.median(all_done) * 1000,
    }


async def main(calls: int, latency_ms: float, repeats: int) -> None:
    print(f"{calls} first calls at once, fake latency {latency_ms:g} ms, median of {repeats}")
    print(f"{'server':<18} {'Nth request sent':>17} {'all answered':>13}")
    for dialect in ("openai", "llama-cpp-python"):
        figures = await _measure(dialect, calls, latency_ms, repeats)
        print(
            f"{dialect:<18} {figures['nth_sent_ms']:>14.1f} ms "
            f"{figures['all_answered_ms']:>10.1f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    configure_logging("console", "WARNING")
    asyncio.run(main(args.calls, args.latency_ms, args.repeats))
