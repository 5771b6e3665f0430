"""``python -m bench.realmodel.probe`` without the lane's venv and model: a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.realmodel import probe


def test_the_probe_without_the_lane_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--cache-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "run `python -m bench realmodel` once first" in capsys.readouterr().err
