"""Log lines reach stderr whole: one write() per line, never a line and its newline apart."""

from __future__ import annotations

import subprocess
import sys

import orjson

# Runs in a process of its own: configure_logging sets process-wide state (handlers, hooks).
_SCRIPT = """
import logging, sys, orjson, structlog

class Recording:
    def __init__(self):
        self.writes = []
    def write(self, text):
        self.writes.append(text)
        return len(text)
    def flush(self):
        pass
    def isatty(self):
        return False

recording = sys.stderr = Recording()
from consolidation.logs import configure_logging
configure_logging("json", "INFO")
structlog.get_logger("consolidation.engine").info("batch", memories=8, text="a\\nb")
logging.getLogger("asyncpg").warning("a library's warning")
sys.stdout.write(orjson.dumps(recording.writes).decode())
"""


def test_every_log_line_is_written_with_its_newline_in_one_call() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, check=True, timeout=60
    )
    writes = orjson.loads(done.stdout)
    # structlog's event and the stdlib logger's warning, each one JSON object and its newline.
    assert len(writes) == 2, writes
    for write in writes:
        assert write.endswith("\n") and write.count("\n") == 1, write
    assert orjson.loads(writes[0])["event"] == "batch"
    assert orjson.loads(writes[1])["event"] == "a library's warning"
