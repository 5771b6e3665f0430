"""Settings come only from CONSOLIDATION_* variables and bad values name the variable."""

from __future__ import annotations

import pytest

from consolidation.errors import ConfigError
from consolidation.settings import load_settings


def test_defaults_need_no_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONSOLIDATION_DATABASE_URL", "CONSOLIDATION_LLM_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings()
    assert settings.database_url is None and settings.llm_base_url is None
    assert settings.wave_size == 200 and settings.llm_batch_size == 8
    assert settings.wave_lookahead == 800
    assert settings.group_parallelism == 8 and settings.llm_max_concurrent == 16
    assert settings.llm_response_format == "auto" and settings.llm_system_role == "system"
    assert settings.llm_max_tokens == 4096 and settings.llm_retry_budget_s is None


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSOLIDATION_WAVE_SIZE", "50")
    monkeypatch.setenv("CONSOLIDATION_LLM_BASE_URL", "http://127.0.0.1:9/v1/")
    monkeypatch.setenv("CONSOLIDATION_LOG_LEVEL", "debug")
    settings = load_settings()
    assert settings.wave_size == 50
    assert settings.llm_base_url == "http://127.0.0.1:9/v1"
    assert settings.log_level == "DEBUG"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CONSOLIDATION_WAVE_SIZE", "zero"),
        ("CONSOLIDATION_GROUP_PARALLELISM", "0"),
        ("CONSOLIDATION_DATABASE_URL", "mysql://x"),
        ("CONSOLIDATION_DATABASE_URL", "postgresql://app@db:port/app"),
        ("CONSOLIDATION_DATABASE_WAIT_S", "-1"),
        ("CONSOLIDATION_LOG_FORMAT", "xml"),
        ("CONSOLIDATION_LEASE_S", "-1"),
        ("CONSOLIDATION_EVENT_LOOP", "trio"),
        ("CONSOLIDATION_LLM_RESPONSE_FORMAT", "text"),
        ("CONSOLIDATION_LLM_SYSTEM_ROLE", "assistant"),
        ("CONSOLIDATION_LLM_MAX_TOKENS", "0"),
        ("CONSOLIDATION_LLM_RETRY_BUDGET_S", "0"),
    ],
)
def test_a_bad_value_raises_a_one_line_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as excinfo:
        load_settings()
    message = str(excinfo.value)
    assert name in message and "\n" not in message


def test_a_retry_budget_shorter_than_the_timeout_names_both_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONSOLIDATION_LLM_TIMEOUT_S", "30")
    monkeypatch.setenv("CONSOLIDATION_LLM_RETRY_BUDGET_S", "20")
    with pytest.raises(ConfigError) as excinfo:
        load_settings()
    message = str(excinfo.value)
    assert "CONSOLIDATION_LLM_RETRY_BUDGET_S (20)" in message
    assert "CONSOLIDATION_LLM_TIMEOUT_S (30)" in message and "\n" not in message


def test_the_lifecycle_settings_have_their_defaults_and_zero_turns_them_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings()
    assert settings.sweep_interval_s == 60 and settings.operation_slice_s == 10
    monkeypatch.setenv("CONSOLIDATION_SWEEP_INTERVAL_S", "0")
    monkeypatch.setenv("CONSOLIDATION_OPERATION_SLICE_S", "0")
    off = load_settings()
    assert off.sweep_interval_s == 0 and off.operation_slice_s == 0
    monkeypatch.setenv("CONSOLIDATION_SWEEP_INTERVAL_S", "-1")
    with pytest.raises(ConfigError, match="CONSOLIDATION_SWEEP_INTERVAL_S"):
        load_settings()
