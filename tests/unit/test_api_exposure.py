"""`serve` refuses an API without a key on an address other people can reach."""

from __future__ import annotations

import pytest

from consolidation.errors import ConfigError
from consolidation.service import check_api_exposure
from consolidation.settings import load_settings


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_needs_no_key(host: str) -> None:
    check_api_exposure(load_settings(http_host=host))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "api.example.internal"])
def test_any_other_address_without_a_key_is_refused_naming_both_ways_out(host: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_api_exposure(load_settings(http_host=host))
    message = str(refused.value)
    assert host in message
    assert "CONSOLIDATION_API_KEY" in message
    assert "CONSOLIDATION_ALLOW_UNAUTHENTICATED" in message


def test_a_key_or_an_explicit_allowance_opens_any_address() -> None:
    check_api_exposure(load_settings(http_host="0.0.0.0", api_key="k"))
    check_api_exposure(load_settings(http_host="0.0.0.0", allow_unauthenticated=True))
