"""The start-up version check (no vLLM needed)."""

import pytest

from vllm_nwor.plugin import (
    SKIP_VERSION_CHECK_ENV,
    SUPPORTED_VLLM_VERSION,
    UnsupportedVllmVersion,
    check_vllm_version,
)


def test_supported_version_passes():
    check_vllm_version(SUPPORTED_VLLM_VERSION)


def test_other_versions_are_refused_with_a_clear_message(monkeypatch):
    monkeypatch.delenv(SKIP_VERSION_CHECK_ENV, raising=False)
    with pytest.raises(UnsupportedVllmVersion) as err:
        check_vllm_version("0.33.0")
    message = str(err.value)
    assert "0.33.0" in message and SUPPORTED_VLLM_VERSION in message
    assert SKIP_VERSION_CHECK_ENV in message


def test_the_override_lets_other_versions_through(monkeypatch):
    monkeypatch.setenv(SKIP_VERSION_CHECK_ENV, "1")
    check_vllm_version("0.33.0")
