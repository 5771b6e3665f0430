"""``python -m bench.realmodel.probe`` without the lane's venv and model: a clear error."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.realmodel import probe
from consolidation.llm.prompts_v2 import CHANGE_CONFIRM_PROMPT, CONFIRM_PROMPT
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer


def test_the_probe_without_the_lane_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--cache-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "run `python -m bench realmodel` once first" in capsys.readouterr().err


async def test_the_probe_asks_the_pair_it_is_given_after_each_request() -> None:
    with FakeLLMServer(FakeLLMConfig()) as fake:
        for fact, observation, answer in (
            ("I live in Paris.", "I live in Paris.", "yes"),
            ("I live in Paris.", "My sister Anna plays chess.", "no"),
        ):
            question = probe.pair_question(fact, observation)
            answers = await probe.probe(fake.url, "fake", question)
            assert [situation for situation, _ in answers] == [s for s, _ in probe.BEFORE]
            assert {orjson.loads(said)["same_subject"] for _, said in answers} == {answer}


def test_of_change_without_a_pair_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--of-change"])
    assert exit_.value.code == 2
    assert "--of-change asks a --pair" in capsys.readouterr().err


def test_a_pair_is_asked_as_a_pick_or_as_what_a_change_ends() -> None:
    fact, observation = "I moved from Paris to Berlin.", "My flat in Paris is small."
    assert probe.pair_question(fact, observation).system == CONFIRM_PROMPT
    asked = probe.pair_question(fact, observation, of_change=True)
    assert asked.system == CHANGE_CONFIRM_PROMPT
    assert orjson.loads(asked.user)["fact"]["text"] == fact
