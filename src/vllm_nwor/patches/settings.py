"""The plugin's config, parsed once and carried on vLLM's config object.

``EngineArgs.create_engine_config`` (:mod:`~vllm_nwor.patches.engine_args`) parses and validates
the plugin's keys once, in the process that builds the engine config, and attaches the
:class:`~vllm_nwor.config.NworConfig` to the ``VllmConfig`` it returns. That object (and so the
parsed config) is what the engine core and the workers receive, pickled with it. The keys also
stay in ``additional_config``, validated, for vLLM's config hash and for a ``VllmConfig`` made
without ``EngineArgs``: there :func:`plugin_config` builds the config from them once and
attaches it.
"""

from __future__ import annotations

from typing import Any

from vllm_nwor.config import NworConfig, config_from_additional

CONFIG_ATTR = "nwor_config"
"""Set on the ``VllmConfig``: its parsed :class:`NworConfig`."""


def attach(vllm_config: Any, config: NworConfig) -> None:
    """Carries ``config`` (parsed from ``vllm_config``'s keys) on ``vllm_config``."""
    vars(vllm_config)[CONFIG_ATTR] = config


def plugin_config(vllm_config: Any) -> NworConfig:
    """The plugin's config of ``vllm_config``: the one attached at start-up."""
    config = vars(vllm_config).get(CONFIG_ATTR)
    if config is None:  # a VllmConfig made without EngineArgs, or a copy made by replace()
        config = config_from_additional(vllm_config.additional_config)
        attach(vllm_config, config)
    return config
