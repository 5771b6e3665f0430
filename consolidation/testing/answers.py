"""What the fake answers a chat request: the v1 or v2 content of the offline policy with the
poison markers, thinking, token bound and padding applied, the other envelopes, and how each
dialect refuses a response format or token field it does not take."""

from __future__ import annotations

from typing import Any

import orjson

from consolidation.llm import narrow, offline, prompts_v2
from consolidation.llm.client import estimate_tokens
from consolidation.testing.config import FakeLLMConfig, _Plan
from consolidation.testing.requests import _Parsed

POISON_MARKER = "[[poison]]"
BADJSON_MARKER = "[[badjson]]"
TRUNCATE_MARKER = "[[truncate]]"
EMPTY_MARKER = "[[empty]]"
ANSWER_MARKER = "[[answer]]"
REPAIRABLE_MARKER = "[[repairable]]"


_THINKING = (
    "<think>\nThe facts and observations are listed; I answer with one JSON object.\n</think>\n\n"
)
_REASONING = "The facts and observations are listed; I answer with one JSON object."
_UNINSTRUCTED = "Thank you for the facts! What would you like me to do with them?"
_HTML_PAGE = (
    "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1>"
    "</center><hr><center>nginx</center></body></html>"
)
# What llama-cpp-python 0.3.x answers to {"type": "json_schema", ...}: its pydantic request model
# accepts only text and json_object, and the validation error surfaces as a 500.
_LLAMA_CPP_PYTHON_REFUSAL = (
    "[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), "
    "'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema', "
    "'ctx': {'expected': \"'text' or 'json_object'\"}}]"
)


# What OpenAI answers a reasoning model (o-series, gpt-5) sent max_tokens.
_OPENAI_MAX_TOKENS_REFUSAL = orjson.dumps(
    {
        "error": {
            "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
            "Use 'max_completion_tokens' instead.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "unsupported_parameter",
        }
    }
).decode()


def _refusal(dialect: str, parsed: _Parsed) -> _Plan | None:
    """How ``dialect`` refuses the request's response_format or token bound, if it does."""
    if dialect == "openai-reasoning" and parsed.token_field == "max_tokens":
        return _Plan(status=400, body=_OPENAI_MAX_TOKENS_REFUSAL)
    if parsed.response_format == "json_schema":
        if dialect == "llama-cpp-python":
            return _Plan(
                status=500,
                body=orjson.dumps(
                    {
                        "error": {
                            "message": _LLAMA_CPP_PYTHON_REFUSAL,
                            "type": "internal_server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ).decode(),
            )
        if dialect in ("no-schema", "json-object-only"):
            return _Plan(
                status=400,
                body="response_format type 'json_schema' is not supported; use 'json_object'",
            )
    if parsed.response_format == "json_object" and parsed.schema and dialect == "json-object-only":
        return _Plan(
            status=400, body="Unrecognized request argument supplied: response_format.schema"
        )
    return None


def _answer_content(parsed: _Parsed, config: FakeLLMConfig) -> tuple[str, str, int]:
    """The assistant content, finish_reason and completion tokens for a request, poison
    markers, thinking, ``max_tokens`` and padding applied."""
    texts = "\n".join(parsed.fact_texts)
    for text in parsed.fact_texts:
        if ANSWER_MARKER in text:
            content = text.split(ANSWER_MARKER, 1)[1]
            return content, "stop", estimate_tokens(content)
    if config.drop_system and not parsed.instructed_user:
        # The template dropped the instructions: the model never learnt what to answer.
        content = _UNINSTRUCTED
    elif BADJSON_MARKER in texts:
        content = "this is not json"
    elif EMPTY_MARKER in texts:
        content = ""
    else:
        if POISON_MARKER in texts or (REPAIRABLE_MARKER in texts and not parsed.repair):
            answer: dict[str, Any] = {
                "creates": [
                    {
                        "text": "An observation citing a fact that does not exist.",
                        "facts": ["f9999"],
                    }
                ],
                "updates": [],
                "merges": [],
            }
        else:
            assert parsed.user is not None
            if prompts_v2.is_v2_request(parsed.user):
                answer = narrow.offline_answer(parsed.user)
            else:
                answer = offline.consolidate(parsed.user)
        content = orjson.dumps(answer).decode()
    if config.think:
        content = _THINKING + content
    tokens = estimate_tokens(content)
    limit = parsed.max_tokens
    if config.honour_max_tokens and limit is not None and tokens > limit:
        return content[: limit * 4], "length", limit
    if config.pad_bytes > 0 and content.endswith("}"):
        # Whitespace before the closing brace keeps the answer valid JSON of the wanted size.
        content = content[:-1] + " " * config.pad_bytes + "}"
    if TRUNCATE_MARKER in texts:
        return content[: len(content) // 2], "length", tokens // 2
    return content, "stop", tokens
