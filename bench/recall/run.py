"""Recall quality: is the observation a new fact should update (its *twin*) among what the pass
is shown? Full text alone against hybrid (full text + cosine, fused), with a real embedding model
on CPU (all-MiniLM-L6-v2, bench/recall/minilm.py) behind an OpenAI-compatible ``/v1/embeddings``.

    python -m bench recall                  # the labelled set of bench/data/recall_cases.json
    python -m bench recall --regenerate     # write that set again from bench/recall/data.py

Every recall goes through ``store.recall``, the statement the engine runs (the production SQL
functions ``consolidation_recall`` and ``consolidation_recall_hybrid_v1``), on a Postgres with
pgvector: ``BENCH_DATABASE_URL``'s server when it has the extension, else the embedded one. The
texts are embedded through ``HTTPEmbedder``, the service's own client. Figures:

- twin recall@k, k = 5, 10, 20 (the recall limit), per kind of case (paraphrase, lexical,
  hard_negative), for passes of one fact and of eight facts of one scope (``LLM_BATCH_SIZE``'s
  default, all their twins competing for the same k places);
- for hard negatives, how often a decoy (the twin with one number, name or date changed) is
  ranked above the twin;
- ``cosine``: the hybrid function given no text, i.e. the vector ranking alone, and a sweep of
  the fusion (``rrf`` at several constants and full-text weights, ``interleave``) — the
  measurements behind the default, ``interleave``.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from bench.infra import pgvector_server, with_database
from bench.recall import data as recall_data
from consolidation import db, store
from consolidation.llm.embeddings import HTTPEmbedder

BANK = "recall-bench"
KS = (5, 10, 20)
BATCHES = (1, 8)
RRF_SWEEP = (10, 30, 60, 100)
LEXICAL_WEIGHTS = (1.0, 0.5, 0.25)
MODES = ("full_text", "hybrid", "cosine")
TARGETS = {"hybrid_paraphrase_recall_at_20": 0.95, "hybrid_minus_full_text_paraphrase_at_20": 0.25}

Log = Callable[[str], None]


async def _embed_all(embedder: HTTPEmbedder, texts: Sequence[str], log: Log) -> dict[str, str]:
    vectors: dict[str, str] = {}
    unique = sorted(set(texts))
    started = time.perf_counter()
    for start in range(0, len(unique), 64):
        chunk = unique[start : start + 64]
        for text, vector in zip(chunk, await embedder.embed(chunk), strict=True):
            assert vector is not None, text
            vectors[text] = vector
    seconds = time.perf_counter() - started
    log(f"  embedded {len(unique)} texts in {seconds:.1f}s ({len(unique) / seconds:.0f}/s)")
    return vectors


async def _load(conn: asyncpg.Connection, data: dict[str, Any], vectors: dict[str, str]) -> None:
    """The scopes' observations, each with its vector and an updated_at spread over a year."""
    rng = random.Random(recall_data.SEED)
    now = datetime.now(UTC)
    await conn.execute("INSERT INTO banks (id) VALUES ($1)", BANK)
    rows = []
    for scope in data["scopes"]:
        for text in scope["observations"]:
            rows.append(
                (
                    uuid.uuid5(uuid.NAMESPACE_URL, f"{scope['scope']}/{text}"),
                    BANK,
                    [scope["scope"]],
                    text,
                    now - timedelta(minutes=rng.randrange(525_600)),
                    vectors[text],
                )
            )
    await conn.executemany(
        "INSERT INTO observations (id, bank_id, scope, text, updated_at, embedding,"
        " embedding_version) VALUES ($1, $2, $3, $4, $5, $6::vector, 1)",
        rows,
    )
    await conn.execute("ANALYZE observations")


def _passes(cases: Sequence[dict[str, Any]], batch: int) -> list[list[dict[str, Any]]]:
    """Cases grouped into passes: consecutive cases of one scope, ``batch`` at a time."""
    by_scope: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        by_scope.setdefault(case["scope"], []).append(case)
    out: list[list[dict[str, Any]]] = []
    for members in by_scope.values():
        out.extend(members[i : i + batch] for i in range(0, len(members), batch))
    return out


async def _recall(
    conn: asyncpg.Connection,
    mode: str,
    group: Sequence[dict[str, Any]],
    limit: int,
    vectors: dict[str, str],
    fusion: tuple[str, int, float] | None = None,
) -> list[str]:
    """The texts recalled for ``group``'s facts. ``fusion`` (mode, RRF constant, full-text
    weight) calls the hybrid function with other fusion parameters than its defaults."""
    scope = (group[0]["scope"],)
    facts = [c["fact"] for c in group]
    fact_vectors = [vectors[f] for f in facts]
    if fusion is not None:
        rows = await conn.fetch(
            store.RECALL_HYBRID.replace("$5)", "$5, $6, $7, $8)"),
            BANK,
            list(scope),
            limit,
            facts,
            fact_vectors,
            *fusion,
        )
        return [r["obs_text"] for r in rows]
    if mode == "full_text":
        recalled = await store.recall(conn, BANK, scope, facts, limit)
    elif mode == "hybrid":
        recalled = await store.recall(conn, BANK, scope, facts, limit, fact_vectors)
    else:
        recalled = await store.recall(conn, BANK, scope, [""] * len(facts), limit, fact_vectors)
    return [o.text for o in recalled]


async def _measure(
    conn: asyncpg.Connection, cases: Sequence[dict[str, Any]], vectors: dict[str, str]
) -> dict[str, Any]:
    kinds = sorted({c["kind"] for c in cases})
    results: dict[str, Any] = {}
    for batch in BATCHES:
        passes = _passes(cases, batch)
        for mode in MODES:
            for k in KS:
                found: dict[str, list[bool]] = {kind: [] for kind in kinds}
                decoy_first: list[bool] = []
                for group in passes:
                    recalled = await _recall(conn, mode, group, k, vectors)
                    for case in group:
                        hit = case["twin"] in recalled
                        found[case["kind"]].append(hit)
                        if case["decoys"] and hit:
                            twin_at = recalled.index(case["twin"])
                            decoy_first.append(any(d in recalled[:twin_at] for d in case["decoys"]))
                key = f"batch{batch}"
                for kind, outcomes in found.items():
                    results.setdefault(key, {}).setdefault(kind, {}).setdefault(mode, {})[
                        f"recall_at_{k}"
                    ] = sum(outcomes) / len(outcomes)
                if decoy_first:
                    results[key]["hard_negative"][mode][f"decoy_above_twin_at_{k}"] = sum(
                        decoy_first
                    ) / len(decoy_first)
    sweep: dict[str, Any] = {}
    fusions = (
        [("rrf", k, 1.0) for k in RRF_SWEEP]
        + [("rrf", 60, w) for w in LEXICAL_WEIGHTS if w != 1.0]
        + [("interleave", 60, w) for w in LEXICAL_WEIGHTS]
    )
    for batch in BATCHES:
        for how, rrf_k, weight in fusions:
            for limit in KS:
                hits: dict[str, list[bool]] = {kind: [] for kind in kinds}
                for group in _passes(cases, batch):
                    recalled = await _recall(
                        conn, "hybrid", group, limit, vectors, (how, rrf_k, weight)
                    )
                    for case in group:
                        hits[case["kind"]].append(case["twin"] in recalled)
                sweep[f"batch{batch}_{how}_rrf{rrf_k}_w{weight:g}_at{limit}"] = {
                    kind: sum(v) / len(v) for kind, v in hits.items()
                }
    results["fusion_sweep"] = sweep
    return results


async def _recall_time(
    conn: asyncpg.Connection, cases: Sequence[dict[str, Any]], vectors: dict[str, str]
) -> dict[str, float]:
    """Mean milliseconds per recall statement (passes of 8 facts, limit 20) in each mode."""
    passes = _passes(cases, 8)
    out: dict[str, float] = {}
    for mode in ("full_text", "hybrid"):
        started = time.perf_counter()
        repeats = 5
        for _ in range(repeats):
            for group in passes:
                await _recall(conn, mode, group, 20, vectors)
        out[mode] = 1000 * (time.perf_counter() - started) / (repeats * len(passes))
    return out


async def run(admin_url: str, log: Log = print) -> dict[str, Any]:
    """The whole benchmark; returns its figures (see the module docstring)."""
    from bench.recall import minilm

    data = recall_data.load()
    cases = data["cases"]
    log(f"recall: {len(cases)} cases in {len(data['scopes'])} scopes")
    texts = [o for s in data["scopes"] for o in s["observations"]] + [c["fact"] for c in cases]
    model = minilm.MiniLM()
    reference = minilm.check(model)
    log(f"  all-MiniLM-L6-v2 reference similarities: max error {reference['max_abs_error']:.5f}")
    if not reference["ok"]:
        raise RuntimeError(f"the numpy forward pass disagrees with the reference: {reference}")
    with minilm.ModelServer(model) as server:
        embedder = HTTPEmbedder(base_url=server.url, model=minilm.MODEL_NAME, timeout_s=600)
        try:
            vectors = await _embed_all(embedder, texts, log)
        finally:
            await embedder.aclose()
    async with pgvector_server(admin_url, log) as server_url:
        name = f"bench_recall_{uuid.uuid4().hex[:8]}"
        admin = await asyncpg.connect(server_url)
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = with_database(server_url, name)
        try:
            db.migrate_sync(url)
            conn = await db.connect(url)
            try:
                await _load(conn, data, vectors)
                results = await _measure(conn, cases, vectors)
                results["recall_ms_per_pass"] = await _recall_time(conn, cases, vectors)
                results["postgres"] = await conn.fetchval("SHOW server_version")
            finally:
                await conn.close()
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.close()
    results["reference"] = reference
    results["cases"] = {
        kind: sum(1 for c in cases if c["kind"] == kind)
        for kind in sorted({c["kind"] for c in cases})
    }
    results["scope_sizes"] = [len(s["observations"]) for s in data["scopes"]]
    para = results["batch1"]["paraphrase"]
    results["targets"] = {
        "hybrid_paraphrase_recall_at_20": para["hybrid"]["recall_at_20"],
        "hybrid_minus_full_text_paraphrase_at_20": para["hybrid"]["recall_at_20"]
        - para["full_text"]["recall_at_20"],
    }
    results["targets_met"] = all(results["targets"][k] >= v for k, v in TARGETS.items())
    return results


def render(results: dict[str, Any]) -> str:
    """Markdown tables of the figures."""
    lines = []
    for batch in BATCHES:
        key = f"batch{batch}"
        lines.append(f"Passes of {batch} fact{'s' if batch > 1 else ''} (twin recall@k):")
        lines.append("")
        lines.append("| cases | mode | @5 | @10 | @20 |")
        lines.append("|---|---|---:|---:|---:|")
        for kind, modes in results[key].items():
            count = results["cases"][kind]
            for mode in MODES:
                row = modes[mode]
                cells = " | ".join(f"{row[f'recall_at_{k}']:.3f}" for k in KS)
                lines.append(f"| {kind} ({count}) | {mode} | {cells} |")
        hard = results[key]["hard_negative"]
        decoys = ", ".join(
            f"{mode} {hard[mode].get('decoy_above_twin_at_20', 0.0):.2f}" for mode in MODES
        )
        lines.append("")
        lines.append(f"Hard negatives, a decoy ranked above its recalled twin (@20): {decoys}.")
        lines.append("")
    lines.append(
        "Fusion parameters (hybrid twin recall, paraphrase / lexical / hard_negative; "
        "k = RRF constant, w = weight of the full-text ranking):"
    )
    lines.append("")
    lines.append("| passes | fusion | @5 | @10 | @20 |")
    lines.append("|---|---|---|---|---|")
    sweep = results["fusion_sweep"]
    for batch in BATCHES:
        for key in sorted({k.rsplit("_at", 1)[0] for k in sweep if k.startswith(f"batch{batch}_")}):
            _, how, rrf, weight = key.split("_")
            fusion_cells = []
            for limit in KS:
                row = sweep[f"{key}_at{limit}"]
                fusion_cells.append(
                    f"{row['paraphrase']:.3f} / {row['lexical']:.3f} / {row['hard_negative']:.3f}"
                )
            lines.append(
                f"| {batch} | {how}, k={rrf[3:]}, w={weight[1:]} | "
                + " | ".join(fusion_cells)
                + " |"
            )
    t = results["recall_ms_per_pass"]
    lines.append("")
    lines.append(
        f"Recall statement, 8 facts, limit 20: full text {t['full_text']:.2f} ms, "
        f"hybrid {t['hybrid']:.2f} ms per pass (PostgreSQL {results['postgres']})."
    )
    return "\n".join(lines)
