"""The plugin's config is parsed once and handed out for its vLLM config object
(``patches/settings.py``); a config made without ``EngineArgs`` is parsed once, then kept."""

from __future__ import annotations

import pytest

from vllm_nwor.config import NworConfig, NworConfigError
from vllm_nwor.patches import settings


class SimpleNamespace:
    """A stand-in for ``VllmConfig`` (a plain object with a ``__dict__``, weakly referable)."""

    def __init__(self, **fields) -> None:
        vars(self).update(fields)


def test_the_attached_config_is_handed_out_as_is():
    config = NworConfig(nwor=True, scv="adaptive")
    vllm_config = SimpleNamespace(additional_config={"nwor": False})  # (not read)
    settings.attach(vllm_config, config)
    assert settings.plugin_config(vllm_config) is config


def test_without_one_attached_the_keys_are_parsed_once(monkeypatch):
    vllm_config = SimpleNamespace(additional_config={"nwor": True, "other": 1})
    first = settings.plugin_config(vllm_config)
    assert first.nwor and first.scv == "off"
    monkeypatch.setattr(settings, "config_from_additional",
                        lambda *_: pytest.fail("parsed again"))
    assert settings.plugin_config(vllm_config) is first


def test_nothing_is_set_on_the_vllm_config():
    vllm_config = SimpleNamespace(additional_config={"nwor": True})
    settings.plugin_config(vllm_config)
    assert vars(vllm_config) == {"additional_config": {"nwor": True}}


def test_a_bad_key_without_engine_args_still_fails_naming_it():
    with pytest.raises(NworConfigError, match="'scv' must be one of"):
        settings.plugin_config(SimpleNamespace(additional_config={"scv": "sometimes"}))
