"""The lane's ``--fresh-context`` launcher: llama_cpp.server with every prompt evaluated from an
empty context. Run by a real Python process against a stand-in ``llama_cpp`` package that
records what the server would do (llama-cpp-python itself is only in the lane's venv)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.realmodel.server import FRESH_CONTEXT_LAUNCHER, LlamaServer

# The stand-in keeps the previous prompt as llama-cpp-python does, and reports how many of a
# prompt's tokens it would take from it instead of evaluating them.
STAND_IN = """
class Llama:
    def __init__(self):
        self.kept = []
    def reset(self):
        self.kept = []
    def generate(self, tokens, *args, **kwargs):
        reused = 0
        for a, b in zip(self.kept, tokens):
            if a != b:
                break
            reused += 1
        self.kept = list(tokens)
        print("generate", kwargs.get("temp"), "reused", reused)
        yield from ()
"""
SERVER_MAIN = """
import sys
import llama_cpp
print("argv", *sys.argv[1:])
model = llama_cpp.Llama()
for prompt in ([1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 9]):
    list(model.generate(prompt, temp=0.0))
"""


def _stand_in(root: Path) -> Path:
    (root / "llama_cpp" / "server").mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text(STAND_IN)
    (root / "llama_cpp" / "server" / "__init__.py").write_text("")
    (root / "llama_cpp" / "server" / "__main__.py").write_text(SERVER_MAIN)
    return root


def _serve(root: Path, *command: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, *command, "--model", "m.gguf", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def test_the_server_reuses_a_shared_prefix_and_the_fresh_context_launcher_does_not(
    tmp_path: Path,
) -> None:
    root = _stand_in(tmp_path)
    assert _serve(root, "-m", "llama_cpp.server") == [
        "argv --model m.gguf --port 1",
        "generate 0.0 reused 0",
        "generate 0.0 reused 3",
        "generate 0.0 reused 4",
    ]
    assert _serve(root, "-c", FRESH_CONTEXT_LAUNCHER) == [
        "argv --model m.gguf --port 1",
        "generate 0.0 reused 0",
        "generate 0.0 reused 0",
        "generate 0.0 reused 0",
    ]


def test_the_lane_server_runs_the_launcher_only_when_asked(tmp_path: Path) -> None:
    def command(**fresh: bool) -> list[str]:
        server = LlamaServer(
            Path("/venv/bin/python"),
            Path("m.gguf"),
            alias="m",
            n_ctx=8192,
            threads=2,
            chat_format=None,
            extra_args=(),
            log_path=tmp_path / "server.log",
            **fresh,
        )
        return server.command[:3]

    assert command() == ["/venv/bin/python", "-m", "llama_cpp.server"]
    assert command(fresh_context=True) == ["/venv/bin/python", "-c", FRESH_CONTEXT_LAUNCHER]
