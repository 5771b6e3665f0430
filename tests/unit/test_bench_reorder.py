"""``python -m bench.realmodel.reorder``: logged decide requests asked again, reversed."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.realmodel import reorder
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer

RATION = "Since November 2025 we buy the sow and weaner ration from Corran Feeds."
VACCINE = "Heptavac for the ewes goes in a month ahead of lambing."
OLD_FEED = "We get our pig nuts from Darwell Mills."


def _results(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    entry = {"fact": RATION, "candidates": [VACCINE, OLD_FEED], "decision": "new"}
    lines = [
        b"not json: a line of the replay's own output",
        orjson.dumps({"event": "v2_decisions", "decisions": [entry]}),
    ]
    (logs / "quality-20261129T142228Z-smallholding-replay.log").write_bytes(b"\n".join(lines))
    memory = {"text": RATION, "tags": ["animals"], "occurred_at": "2025-11-05T16:30:00Z"}
    (logs / "quality-20261129T142228Z-smallholding-bank.jsonl").write_bytes(orjson.dumps(memory))
    return tmp_path


def test_a_logged_fact_is_found_with_its_bank_tags_and_candidates(tmp_path: Path) -> None:
    (found,) = reorder.find(_results(tmp_path), ["sow and weaner"])
    assert found == reorder.Logged("smallholding", ("animals",), RATION, (VACCINE, OLD_FEED))
    with pytest.raises(ValueError, match=r"contains \['Kestrel'\]"):
        reorder.find(tmp_path, ["Kestrel"])


def test_each_fact_is_asked_as_logged_then_reversed_and_a_moved_pick_is_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = _results(tmp_path)
    with FakeLLMServer(FakeLLMConfig(record_messages=True)) as fake:
        fake.control(
            script=[{"content": '{"f1": "update:o1"}'}, {"content": '{"f1": "update:o2"}'}]
        )
        argv = [str(results), "--fact", "sow and weaner", "--base-url", fake.url]
        assert reorder.main(argv) == 0
        calls = fake.stats()["calls"]
    shown = [
        [c["text"] for c in orjson.loads(call["messages"][1][1])["facts"][0]["candidates"]]
        for call in calls
    ]
    assert shown == [[VACCINE, OLD_FEED], [OLD_FEED, VACCINE]]
    out = capsys.readouterr().out
    assert f"{RATION} (2 candidates): moved" in out
    assert f"as logged: update {VACCINE}" in out and f"reversed:  update {OLD_FEED}" in out


def test_an_unlogged_fact_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        reorder.main([str(_results(tmp_path)), "--fact", "Kestrel", "--base-url", "http://x/v1"])
    assert exit_.value.code == 2
    assert "no logged fact" in capsys.readouterr().err
