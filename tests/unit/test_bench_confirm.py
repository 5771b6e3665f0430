"""``python -m bench.realmodel.confirm``: the labelled pairs, and the questions it sends."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from bench.quality.banks import DEFAULT_BANK_FILES, load_quality_bank
from bench.realmodel import confirm
from consolidation.llm.prompts_v2 import CONFIRM_PROMPT
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer

LANE_BANK = load_quality_bank(DEFAULT_BANK_FILES[0])
HOME = "I live in Paris, in the 11th arrondissement."
JOB = "I work as an accountant at Acme Corp."
GLOBEX = "I started a new job as a data analyst at Globex."


def _kinds(pairs: list[confirm.Pair]) -> dict[tuple[str, str], str]:
    return {(p.observation, p.fact): p.kind for p in pairs}


def test_the_pairs_come_from_the_labels() -> None:
    kinds = _kinds(confirm.pairs(LANE_BANK))
    assert kinds[HOME, "My flat in Paris is close to the Canal Saint-Martin."] == "same label"
    assert kinds["My sister Anna lives in Vienna.", "Anna, my sister, is based in Vienna."] == (
        "same label"
    )
    # Single facts have no later fact of their own label; labels kept apart are hard negatives.
    assert "same label" in kinds.values() and "hard negative" in kinds.values()
    assert all(p.want == (p.kind == "same label") for p in confirm.pairs(LANE_BANK))
    changes = _kinds(confirm.change_pairs(LANE_BANK))
    assert changes[JOB, GLOBEX] == "change of it"
    assert changes["I have a cat named Miso.", GLOBEX] == "change of another"
    # Only labels of its scope told before it: not Linux (told later), not the Atlas project.
    assert ("I use Linux on my computer at home.", GLOBEX) not in changes
    assert ("The Atlas backend is written in Go.", GLOBEX) not in changes


@pytest.mark.parametrize("variant", [False, True])
def test_each_pair_is_asked_as_the_engine_asks_it_or_as_the_variant(
    variant: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--bank", "realmodel", "--set", "changes"]
    argv += ["--change-instructions"] if variant else []
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        assert confirm.main([*argv, "--base-url", fake.url, "--llm-model", "fake"]) == 0
        calls = fake.stats()["calls"]
    asked = confirm.change_pairs(LANE_BANK)
    assert len(calls) == len(asked)
    for call, pair in zip(calls, asked, strict=True):
        system, user = call["messages"][0][1], orjson.loads(call["messages"][1][1])
        assert (user["task"], user["fact"]["text"]) == ("confirm", pair.fact)
        # Every fact of this set announces a change.
        assert system == (confirm.CHANGE_INSTRUCTIONS if variant else CONFIRM_PROMPT)
    table = capsys.readouterr().out
    counted = re.findall(r"^realmodel\s+(change of (?:it|another))\s+(\d+)/(\d+)", table, re.M)
    assert {kind: int(n) for kind, _, n in counted} == {"change of it": 5, "change of another": 56}


def test_an_unknown_bank_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        confirm.main(["--bank", "nowhere", "--base-url", "http://127.0.0.1:9/v1"])
    assert exit_.value.code == 2
    assert "unknown bank(s) ['nowhere']" in capsys.readouterr().err


def test_without_the_lane_it_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        confirm.main(["--cache-dir", str(tmp_path), "--bank", "realmodel"])
    assert exit_.value.code == 2
    assert "run `python -m bench realmodel` once first" in capsys.readouterr().err
