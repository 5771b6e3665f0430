"""Configuration: the one place the environment is read (``CONSOLIDATION_*`` variables)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from consolidation.errors import ConfigError

ENV_PREFIX = "CONSOLIDATION_"


def default_data_dir(euid: int | None = None, home: Path | None = None) -> Path:
    """``~/.local/share/consolidation``; as root ``/var/lib/consolidation``, unless the former
    already holds a database. The embedded Postgres cannot run as root, and pgserver then opens
    every directory above its data to other users: under /var/lib that is nothing new, under
    the home directory it would expose root's home (docs/reliability.md)."""
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
    in_home = (Path.home() if home is None else home) / ".local" / "share" / "consolidation"
    if euid == 0 and not (in_home / "pgdata" / "PG_VERSION").exists():
        return Path("/var/lib/consolidation")
    return in_home


class Settings(BaseSettings):
    """Every setting of DESIGN §8. Defaults run a single machine with no configuration at all."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    database_url: str | None = Field(
        default=None, description="Postgres URL; unset starts an embedded Postgres under DATA_DIR."
    )
    database_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="At start-up, how long to retry a database that refuses or does not answer.",
    )
    data_dir: Path = Field(
        default_factory=lambda: default_data_dir(),
        description="Where the embedded Postgres keeps its files.",
    )

    llm_base_url: str | None = Field(
        default=None, description="OpenAI-compatible base URL; unset uses the offline consolidator."
    )
    llm_api_key: SecretStr | None = None
    llm_model: str = "gpt-4o-mini"
    llm_timeout_s: float = Field(default=60.0, gt=0, description="Per request.")
    llm_max_retries: int = Field(default=4, ge=0, le=20)
    llm_retry_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="Longest one LLM call may take across its retries; unset: 2 × LLM_TIMEOUT_S.",
    )
    llm_max_concurrent: int = Field(default=16, ge=1, le=1024)
    llm_response_format: Literal["auto", "json_schema", "json_object"] = Field(
        default="auto",
        description="auto: json_schema, else json_object with a schema, else json_object.",
    )
    llm_max_tokens: int = Field(
        default=4096, ge=64, le=1_000_000, description="Cap on the max_tokens of every request."
    )
    llm_system_role: Literal["system", "user"] = Field(
        default="system",
        description="user: instructions open the user message (templates that drop system).",
    )
    llm_contract: Literal["v1", "v2"] = Field(
        default="v1",
        description="v1: one call per pass answers creates/updates/merges (DESIGN §3); v2: the "
        "engine narrows each fact to its nearest candidates and asks new/same/update, then one "
        "rewrite per updated observation (docs/architecture.md).",
    )
    llm_v2_facts_per_call: int = Field(
        default=1,
        ge=1,
        le=256,
        description="v2: facts decided by one call (1 measured best with a 1.5B model).",
    )
    llm_v2_candidates: int = Field(
        default=2, ge=1, le=16, description="v2: nearest observations (and earlier facts) per fact."
    )
    llm_v2_cosine_floor: float = Field(
        default=0.4, ge=-1, le=1, description="v2 with embeddings: no candidate below this cosine."
    )
    llm_v2_lexical_floor: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="v2 without embeddings: no candidate below this word overlap.",
    )
    llm_hedge_quantile: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="Send a second copy of an LLM request still unanswered after this quantile "
        "of recent latencies (0.95, say), into a spare LLM_MAX_CONCURRENT slot only; the first "
        "answer wins. Unset: never (copies cost tokens).",
    )
    llm_backoff_base_s: float = Field(default=0.5, ge=0)
    llm_backoff_max_s: float = Field(default=30.0, ge=0)

    embeddings_base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL of an embeddings endpoint; unset: full-text "
        "recall only.",
    )
    embeddings_model: str = "text-embedding-3-small"
    embeddings_api_key: SecretStr | None = None
    embeddings_dimensions: int | None = Field(
        default=None,
        ge=1,
        le=16_000,
        description="Vector dimension (sent as `dimensions`); unset: the endpoint's first answer.",
    )

    group_parallelism: int = Field(default=8, ge=1, le=1024)
    wave_size: int = Field(default=200, ge=1, le=100_000)
    # With many small tag groups a wave holds one or two memories of most groups, and each of
    # their batches pays for the whole instructions: the memories read ahead fill them.
    wave_lookahead: int = Field(
        default=800,
        ge=0,
        le=1_000_000,
        description="Pending memories read beyond a wave so that its tag groups' last batches "
        "can be filled with their next memories (0: a wave is wave_size memories).",
    )
    llm_batch_size: int = Field(default=8, ge=1, le=256)
    recall_limit: int = Field(default=20, ge=0, le=1000)
    mission: str | None = Field(
        default=None, description="Optional text telling the LLM what the bank is for."
    )

    worker_concurrency: int = Field(default=4, ge=1, le=256)
    lease_s: float = Field(default=30.0, gt=0)
    poll_interval_s: float = Field(default=2.0, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    max_attempts: int = Field(default=5, ge=1, le=100)
    retry_backoff_s: float = Field(default=5.0, ge=0)
    sweep_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="How often one worker of the fleet enqueues a consolidation for every bank "
        "with pending memories and no operation; 0 disables the sweeper.",
    )
    operation_slice_s: float = Field(
        default=10.0,
        ge=0,
        description="A running operation yields its worker slot at a wave boundary after this "
        "long when other operations wait; 0 never yields.",
    )
    bank_token_budget: int | None = Field(
        default=None,
        ge=0,
        description="Prompt and completion tokens a bank may use in any rolling 24 hours; unset "
        "= no limit. A bank's own budget (PUT /v1/banks/{bank_id}/token-budget) overrides it. An "
        "operation over it pauses at a batch boundary and resumes when the window frees enough.",
    )

    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    api_key: SecretStr | None = None
    allow_unauthenticated: bool = Field(
        default=False,
        description="Serve the API without CONSOLIDATION_API_KEY on an address other than "
        "loopback; without it `serve` refuses to start there.",
    )
    auto_consolidate: bool = True

    log_format: Literal["json", "console"] | None = Field(
        default=None, description="json or console; unset picks console on a terminal."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto", description="auto uses uvloop when it is installed, else asyncio."
    )

    @model_validator(mode="after")
    def _budget_covers_one_request(self) -> Settings:
        if self.llm_retry_budget_s is not None and self.llm_retry_budget_s < self.llm_timeout_s:
            raise ValueError(
                f"CONSOLIDATION_LLM_RETRY_BUDGET_S ({self.llm_retry_budget_s:g}) must be at least "
                f"CONSOLIDATION_LLM_TIMEOUT_S ({self.llm_timeout_s:g})"
            )
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator(
        "database_url",
        "llm_base_url",
        "mission",
        "api_key",
        "llm_api_key",
        "embeddings_base_url",
        "embeddings_api_key",
        "embeddings_dimensions",
        mode="before",
    )
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgres://", "postgresql://")):
            raise ValueError("must be a postgresql:// URL")
        try:
            _ = urlsplit(value or "").port
        except ValueError:
            raise ValueError("the port must be a number from 0 to 65535") from None
        return value

    @field_validator("llm_base_url", "embeddings_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/") if value else value


def load_settings(**overrides: object) -> Settings:
    """Read and validate the environment; a bad value raises ConfigError naming the variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:  # a rule across settings names its variables itself
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            problems.append(f"{ENV_PREFIX}{str(err['loc'][0]).upper()}: {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
