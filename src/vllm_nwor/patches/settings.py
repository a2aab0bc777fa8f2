"""The plugin's config, parsed once and handed to every patch that needs it.

``EngineArgs.create_engine_config`` (:mod:`~vllm_nwor.patches.engine_args`) parses and validates
the plugin's keys once, in the process that builds the engine config, leaves them in
``additional_config`` validated and canonical (every key, for the engine's other processes,
which receive the ``VllmConfig`` pickled; vLLM's config hash leaves them out), and registers
the parsed :class:`~vllm_nwor.config.NworConfig` for that ``VllmConfig`` here.
:func:`plugin_config` hands out the registered one; for a ``VllmConfig`` it has not seen (in
another process, or a copy vLLM made) it builds the config from ``additional_config`` once and
keeps it.

Nothing is set on vLLM's objects: vLLM copies its configs field by field, and an attribute that
is not a field breaks those copies.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm_nwor.config import NworConfig, config_from_additional

_parsed: dict[int, tuple[weakref.ref, NworConfig]] = {}


def attach(vllm_config: Any, config: NworConfig) -> None:
    """Registers ``config`` (parsed from ``vllm_config``'s keys) for ``vllm_config``."""
    key = id(vllm_config)
    try:
        ref = weakref.ref(vllm_config, lambda _: _parsed.pop(key, None))
    except TypeError:  # (an object that takes no weak reference, such as a test's namespace)
        return
    _parsed[key] = (ref, config)


def plugin_config(vllm_config: Any) -> NworConfig:
    """The plugin's config of ``vllm_config``: the one registered at start-up."""
    entry = _parsed.get(id(vllm_config))
    if entry is not None and entry[0]() is vllm_config:
        return entry[1]
    config = config_from_additional(vllm_config.additional_config)
    attach(vllm_config, config)
    return config
