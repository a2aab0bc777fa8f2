"""Config patch: the plugin's keys inside ``--speculative-config``, validated at start-up.

It runs in the process that builds the engine config (the ``LLM`` caller or ``vllm serve``'s API
server), before any engine process starts, so a bad key or an unsupported setup fails there.
"""

from __future__ import annotations

from typing import Any

from vllm.engine.arg_utils import EngineArgs

from vllm_nwor._logging import get_logger
from vllm_nwor.config import (
    NworConfig,
    NworConfigError,
    config_from_additional,
    merge_plugin_settings,
    split_plugin_keys,
)
from vllm_nwor.patches._patch import Patch

logger = get_logger(__name__)


def take_plugin_keys(engine_args: EngineArgs) -> NworConfig:
    """Moves the plugin's keys from the speculative config into ``additional_config``.

    The additional config is left exactly as it was when no plugin key is given anywhere.
    """
    speculative = engine_args.speculative_config
    additional: Any = engine_args.additional_config
    from_speculative: dict[str, Any] = {}
    if isinstance(speculative, dict):
        from_speculative, rest = split_plugin_keys(speculative)
        if from_speculative:
            engine_args.speculative_config = rest or None
    if additional is None:
        additional = {}
    if not isinstance(additional, dict):
        if from_speculative:
            raise NworConfigError(
                "vllm-nwor keys were given in speculative_config, but additional_config is a "
                f"{type(additional).__name__}, not a dict, so they cannot be carried to the engine"
            )
        return NworConfig()
    from_additional, others = split_plugin_keys(additional)
    NworConfig.from_dict(from_speculative, where="speculative_config")
    NworConfig.from_dict(from_additional, where="additional_config")
    settings = merge_plugin_settings(from_speculative, from_additional)
    if not settings:
        return NworConfig()
    config = NworConfig.from_dict(settings)
    engine_args.additional_config = {**others, **config.to_dict()}
    return config


def check_engine_config(vllm_config: Any) -> None:
    """Refuses setups the plugin cannot serve, naming the setting and what is allowed."""
    config = config_from_additional(vllm_config.additional_config)
    if config.nwor_telemetry and vllm_config.speculative_config is None:
        raise NworConfigError(
            "'nwor_telemetry': true needs speculative decoding; set a 'method' and "
            "'num_speculative_tokens' in --speculative-config"
        )
    if not config.nwor:
        return
    if vllm_config.speculative_config is None:
        raise NworConfigError(
            "'nwor': true needs speculative decoding; set a 'method' (for example "
            "\"ngram\" or \"draft_model\") and 'num_speculative_tokens' in --speculative-config"
        )
    if vllm_config.use_v2_model_runner:
        method = vllm_config.speculative_config.method
        raise NworConfigError(
            f"'nwor': true needs vLLM's V1 model runner, but speculative method {method!r} "
            "runs on the V2 runner here; set VLLM_USE_V2_MODEL_RUNNER=0 (supported methods: "
            "ngram, draft_model)"
        )
    if vllm_config.kv_transfer_config is not None:
        raise NworConfigError(
            "'nwor': true cannot be combined with --kv-transfer-config: connectors save each "
            "layer's KV right after attention, before NWOR commits the accepted drafts"
        )
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise NworConfigError(
            "'nwor': true supports pipeline_parallel_size=1 only, got "
            f"{vllm_config.parallel_config.pipeline_parallel_size}"
        )


def log_activation(vllm_config: Any) -> None:
    """The plugin's one INFO line, when a config switches a feature on."""
    config = config_from_additional(vllm_config.additional_config)
    if not config.enabled:
        return
    import vllm

    import vllm_nwor
    from vllm_nwor.patches import all_patches

    logger.info(
        "vllm-nwor %s on vLLM %s: nwor %s, telemetry %s (%d patches)",
        vllm_nwor.__version__, vllm.__version__, "on" if config.nwor else "off",
        "on" if config.telemetry else "off", len(all_patches()),
    )


def _wrap_create_engine_config(create_engine_config):
    def wrapper(self, *args, **kwargs):
        take_plugin_keys(self)
        vllm_config = create_engine_config(self, *args, **kwargs)
        check_engine_config(vllm_config)
        log_activation(vllm_config)
        return vllm_config

    return wrapper


PATCHES = [
    Patch(
        EngineArgs,
        "create_engine_config",
        _wrap_create_engine_config,
        why="vLLM's SpeculativeConfig forbids extra keys: move the plugin's keys to "
        "additional_config before it validates, then check the finished VllmConfig, in the "
        "front-end process. Retired by an extension namespace in SpeculativeConfig.",
    ),
]
