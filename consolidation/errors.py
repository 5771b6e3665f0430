"""Typed exceptions. Each is raised where the problem is found and handled in one place."""

from __future__ import annotations

from collections.abc import Sequence


class ConsolidationError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(ConsolidationError):
    """A setting is missing or invalid; the message names the variable."""


class ValidationError(ConsolidationError):
    """Input (a memory, a request) does not satisfy the contract.

    ``problems`` lists every reason, each a short human sentence.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class LLMError(ConsolidationError):
    """Base class for problems talking to the LLM."""


class TransientLLMError(LLMError):
    """Timeouts, 408/429/5xx, connection errors: retried, then the operation fails (and is retried
    later). Never marks memories failed."""


class InvalidLLMOutput(LLMError):
    """The LLM answered, but the answer is unusable (not JSON, schema violation, unknown ref,
    truncated, HTTP 400/422). The pass is retried once, then its batch is split.

    ``answer`` is the assistant content when there was one, ``problems`` what is wrong with it
    (short sentences) and ``truncated`` whether ``max_tokens`` cut it off: the retry sends them
    back to the model so it can correct itself. ``prompt_tokens`` / ``completion_tokens`` are what
    the server reported it spent on the unusable answer (0 when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        answer: str | None = None,
        problems: Sequence[str] = (),
        truncated: bool = False,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        super().__init__(message)
        self.answer = answer
        self.problems = tuple(problems)
        self.truncated = truncated
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


class LLMConfigError(LLMError):
    """401/403/404 from the LLM endpoint, or a refused ``response_format``: the configuration is
    wrong; fail the operation at once."""


class LeaseLost(ConsolidationError):
    """The operation is no longer ours (fence check failed): stop and write nothing more."""


class OperationCancelled(ConsolidationError):
    """A cancel was requested for the running operation."""


class NotFound(ConsolidationError):
    """The named bank, operation or object does not exist."""


class NotCancellable(ConsolidationError):
    """The operation cannot be cancelled (a forget: what was asked to be forgotten must go)."""
