"""``python -m bench.realmodel.confirm``: the labelled pairs, and the questions it sends."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from bench.quality.banks import DEFAULT_BANK_FILES, load_quality_bank
from bench.realmodel import confirm
from bench.realmodel.server import DEFAULT_MODEL, FRESH_CONTEXT_LAUNCHER, MODELS
from consolidation.llm.prompts_v2 import CHANGE_CONFIRM_PROMPT, CONFIRM_PROMPT
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
        assert system == (CHANGE_CONFIRM_PROMPT if variant else CONFIRM_PROMPT)
    table = capsys.readouterr().out
    counted = re.findall(r"^realmodel\s+(change of (?:it|another))\s+(\d+)/(\d+)", table, re.M)
    assert {kind: int(n) for kind, _, n in counted} == {"change of it": 5, "change of another": 56}


def test_the_ends_set_pairs_a_change_with_what_states_its_old_value_and_other_labels() -> None:
    kinds = _kinds(confirm.ends_pairs(LANE_BANK))
    moved = "I moved from Paris to Berlin last week."
    flat = "My flat in Paris is close to the Canal Saint-Martin."
    assert kinds[HOME, moved] == kinds[flat, moved] == "states its old value"
    assert kinds[JOB, moved] == "change of another"
    # Only facts that say which value they replace: the Globex job names no old value.
    assert all(fact != GLOBEX for _, fact in kinds)
    assert all(p.want == (p.kind == "states its old value") for p in confirm.ends_pairs(LANE_BANK))


def test_the_ends_set_is_asked_as_the_engine_asks_what_a_change_ends() -> None:
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        argv = ["--bank", "realmodel", "--set", "ends", "--base-url", fake.url]
        assert confirm.main(argv) == 0
        calls = fake.stats()["calls"]
    assert len(calls) == len(confirm.ends_pairs(LANE_BANK))
    assert {call["messages"][0][1] for call in calls} == {CHANGE_CONFIRM_PROMPT}


def test_every_pair_is_asked_with_the_instructions_given(tmp_path: Path) -> None:
    instructions = tmp_path / "variant.txt"
    instructions.write_text("Answer yes or no.")
    argv = ["--bank", "realmodel", "--set", "ends", "--instructions", str(instructions)]
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        assert confirm.main([*argv, "--base-url", fake.url, "--llm-model", "fake"]) == 0
        calls = fake.stats()["calls"]
    assert len(calls) == len(confirm.ends_pairs(LANE_BANK))
    assert {call["messages"][0][1] for call in calls} == {"Answer yes or no."}


def test_unreadable_instructions_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        confirm.main(["--instructions", str(tmp_path / "missing.txt"), "--base-url", "x"])
    assert exit_.value.code == 2
    assert "cannot read --instructions" in capsys.readouterr().err


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


@pytest.mark.parametrize("fresh", [False, True])
def test_the_lane_server_is_started_fresh_only_when_asked(
    fresh: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A stand-in for the lane's venv python that writes down how it was started, then exits.
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\nexit 3\n')
    python.chmod(0o755)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / MODELS[DEFAULT_MODEL].filename).write_bytes(b"")
    argv = ["--cache-dir", str(tmp_path), "--bank", "realmodel"]
    with pytest.raises(RuntimeError, match="exited with 3"):
        confirm.main([*argv, "--fresh-context"] if fresh else argv)
    started = (tmp_path / "confirm-server.log").read_text()
    if fresh:
        assert started.startswith(f"-c\n{FRESH_CONTEXT_LAUNCHER}")
    else:
        assert started.startswith("-m\nllama_cpp.server\n--model\n")


def test_named_subjects_are_asked_with_their_variant_and_room_to_name_them(
    tmp_path: Path,
) -> None:
    out = tmp_path / "answers.json"
    argv = ["--bank", "realmodel", "--set", "ends", "--name-subjects", "--json", str(out)]
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        assert confirm.main([*argv, "--base-url", fake.url, "--llm-model", "fake"]) == 0
        calls = fake.stats()["calls"]
    asked = confirm.ends_pairs(LANE_BANK)
    assert len(calls) == len(asked)
    variant = (confirm.VARIANTS / "confirm-name-subjects.txt").read_text()
    assert {call["messages"][0][1] for call in calls} == {variant}
    assert {call["max_tokens"] for call in calls} == {confirm.NAMED_MAX_TOKENS}
    assert list(confirm.NAMED["properties"])[-1] == "same_subject"  # named before the verdict
    rows = orjson.loads(out.read_bytes())
    assert [row["fact"] for row in rows] == [pair.fact for pair in asked]
    assert all(orjson.loads(row["said"])["same_subject"] in ("yes", "no") for row in rows)


def test_subjects_alone_asks_each_text_once_and_says_yes_when_the_kinds_share_a_word(
    capsys: pytest.CaptureFixture[str],
) -> None:
    asked = confirm.ends_pairs(LANE_BANK)
    texts = list(dict.fromkeys(t for pair in asked for t in (pair.fact, pair.observation)))
    # A made-up word of its own for every text but the Paris ones, which share "home city".
    own = (f"zzq{a}{b}" for a in "abcdefghij" for b in "abcdefghij")
    kinds = {t: "home city" if "Paris" in t else next(own) for t in texts}
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        fake.control(
            script=[{"content": orjson.dumps({"about": kinds[t]}).decode()} for t in texts]
        )
        argv = ["--bank", "realmodel", "--set", "ends", "--subjects-alone", "--base-url", fake.url]
        assert confirm.main(argv) == 0
        calls = fake.stats()["calls"]
    # Each distinct text once, on its own, with the variant's instructions.
    assert [orjson.loads(call["messages"][1][1])["text"] for call in calls] == texts
    variant = (confirm.VARIANTS / "subject-alone.txt").read_text()
    assert {call["messages"][0][1] for call in calls} == {variant}
    table = capsys.readouterr().out
    counted = re.findall(
        r"^realmodel\s+(states its old value|change of another)\s+(\d+)/(\d+)", table, re.M
    )
    # The two Paris observations share "home city" with the move; no other kind shares a word.
    assert {kind: (int(n), int(of)) for kind, n, of in counted} == {
        "states its old value": (2, 2),
        "change of another": (len(asked) - 2, len(asked) - 2),
    }


def test_the_two_subject_variants_are_one_or_the_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        confirm.main(["--name-subjects", "--subjects-alone", "--base-url", "http://127.0.0.1:9/v1"])
    assert exit_.value.code == 2
    assert "give one" in capsys.readouterr().err
