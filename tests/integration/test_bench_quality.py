"""The quality benchmark against its oracle: ``python -m bench quality --oracle`` over every
bank, real Postgres, real ``consolidation ingest`` and ``replay`` processes. A perfect model's
answers must come out of the pipeline as a perfect set of observations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from bench.quality.banks import load_banks
from bench.quality.judge import shortfalls

ROOT = Path(__file__).resolve().parents[2]


def test_the_oracle_run_scores_100_percent_on_every_bank(pg_admin_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLIDATION_")}
    command = [sys.executable, "-m", "bench", "quality", "--oracle"]
    command += ["--database-url", pg_admin_url, "--results-dir", str(tmp_path)]
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
        not_ok = {n: v["verdict"] for n, v in judgement["labels"].items() if v["verdict"] != "ok"}
        assert shortfalls(judgement) == [], (name, not_ok, judgement["unsupported"])
        assert judgement["duplicate_labels"] and judgement["state_changes"], name
        assert judgement["hard_negative_pairs"], name
        assert bank["figures"]["first_try_valid_fraction"] == 1.0, name
        assert bank["figures"]["llm_calls"] > 1, name
        # The prompt split, from the oracle's transcript, shares out the usage it reported.
        split = bank["tokens"]
        assert split["prompt_tokens"] == bank["figures"]["prompt_tokens"], name
        assert split["requests"] == bank["figures"]["llm_calls"], name
        assert sum(split["prompt_per_memory_by_part"].values()) > 0, name
    assert "the pipeline falls short" not in run.stdout.decode()
    assert run.returncode == 0, run.stderr.decode()[-3000:]
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
    assert "the pipeline falls short" not in again.stdout.decode()
