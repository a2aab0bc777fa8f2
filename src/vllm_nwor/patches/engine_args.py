"""Config patch: the plugin's keys inside ``--speculative-config``, validated at start-up.

It runs in the process that builds the engine config (the ``LLM`` caller or ``vllm serve``'s API
server), before any engine process starts, so a bad key or an unsupported setup fails there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from vllm_nwor._logging import get_logger
from vllm_nwor.config import (
    PLUGIN_KEYS,
    NworConfig,
    NworConfigError,
    merge_plugin_settings,
    split_plugin_keys,
    unsupported_kv_cache_dtype,
)
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.draft_window import lift_draft_limits
from vllm_nwor.patches.settings import attach

logger = get_logger(__name__)


def _speculative_config_keys() -> frozenset[str]:
    """vLLM's own ``SpeculativeConfig`` fields: never claimed as near-misses of ours."""
    from vllm.config import SpeculativeConfig

    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig))


def take_plugin_keys(engine_args: EngineArgs) -> NworConfig:
    """Moves the plugin's keys from the speculative config into ``additional_config``.

    The additional config is left exactly as it was when no plugin key is given anywhere.
    """
    speculative = engine_args.speculative_config
    additional: Any = engine_args.additional_config
    from_speculative: dict[str, Any] = {}
    if isinstance(speculative, dict):
        from_speculative, rest = split_plugin_keys(speculative, _speculative_config_keys())
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
    config = NworConfig(**settings)  # (each source's keys validated above)
    engine_args.additional_config = {**others, **config.to_dict()}
    return config


V1_RUNNER_ONLY = frozenset({"draft_context_window"})
"""The plugin's keys that need vLLM's V1 model runner (the rest serve the V2 runner too)."""


def check_engine_config(vllm_config: Any, config: NworConfig) -> None:
    """Refuses setups the plugin cannot serve, naming the setting and what is allowed
    (``config``: the plugin's, parsed by :func:`take_plugin_keys`)."""
    defaults = NworConfig().to_dict()
    given = {k: v for k, v in config.to_dict().items() if v != defaults[k]}
    if given.get("nwor_telemetry") is False:  # switches nothing on
        del given["nwor_telemetry"]
    if not given:
        return
    features = ", ".join(f"'{key}': {value!r}" for key, value in given.items())
    tuning = [key for key in given if key.startswith("scv_")]
    if tuning and config.scv == "off":
        raise NworConfigError(
            f"{', '.join(repr(k) for k in tuning)} set, but 'scv' is 'off'; set 'scv' to "
            "'fixed' or 'adaptive', or drop them"
        )
    speculative = vllm_config.speculative_config
    if speculative is None:
        raise NworConfigError(
            f"{features} needs speculative decoding; set a 'method' (for example "
            "\"ngram\" or \"draft_model\") and 'num_speculative_tokens' in --speculative-config"
        )
    # NWOR, SCV and telemetry serve both runners (telemetry reads the scheduler's numbers).
    v1_only = ", ".join(f"'{k}': {v!r}" for k, v in given.items() if k in V1_RUNNER_ONLY)
    if vllm_config.use_v2_model_runner and v1_only:
        raise NworConfigError(
            f"{v1_only} needs vLLM's V1 model runner, but speculative method "
            f"{speculative.method!r} runs on the V2 runner here; set "
            "VLLM_USE_V2_MODEL_RUNNER=0 (on the V1 runner: ngram, draft_model, eagle, eagle3, "
            "mtp), or leave them out on the V2 runner"
        )
    # vLLM's adaptive verification (V2) trims each request's drafts on the GPU after the host
    # has planned the step: it and SCV would both choose verify lengths, and NWOR would stage
    # rows by the host's plan.
    adaptive = [k for k in ("nwor", "scv") if k in given]
    if getattr(speculative, "enable_adaptive_verification", False) and adaptive:
        raise NworConfigError(
            f"{', '.join(f'{k!r}: {given[k]!r}' for k in adaptive)} cannot be combined with "
            "'enable_adaptive_verification': true (vLLM's own choice of verify lengths); "
            "allowed: one of them"
        )
    k = speculative.num_speculative_tokens
    if config.scv_chunk_size is not None and config.scv_chunk_size > k:
        raise NworConfigError(
            f"'scv_chunk_size' is {config.scv_chunk_size}, but num_speculative_tokens is {k}; "
            f"allowed: 1 to {k}"
        )
    if config.draft_context_window is not None:
        lift_draft_limits(vllm_config, config.draft_context_window)
    if not config.nwor:
        return
    if vllm_config.kv_transfer_config is not None:
        raise NworConfigError(
            "'nwor': true cannot be combined with --kv-transfer-config: connectors save each "
            "layer's KV right after attention, before NWOR commits the accepted drafts"
        )
    refused = unsupported_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
    if refused is not None:
        raise NworConfigError(f"'nwor': true does not support {refused}")
    refused = unsupported_parallelism(vllm_config.parallel_config)
    if refused is not None:
        raise NworConfigError(f"'nwor': true {refused}")
    refused = unsupported_compilation(vllm_config.compilation_config)
    if refused is not None:
        raise NworConfigError(f"'nwor': true does not support {refused}")


def unsupported_parallelism(parallel_config: Any) -> str | None:
    """What of ``parallel_config`` NWOR cannot serve, or None.

    Under tensor parallelism every rank stages and commits its own KV heads from the first
    rank's verdict, broadcast after rejection sampling (``patches/nwor/model_runner.py``), on
    any platform NWOR runs on (``tests/engine/test_tensor_parallel.py`` on vLLM's CPU engine,
    ``tests/gpu/test_tensor_parallel_gpu.py`` on two GPUs with FLASH_ATTN, CUDA graphs and custom
    all-reduce). Pipeline stages would need the last stage's verdict before their commit, and
    data-parallel replicas each have their own scheduler: neither is verified, both are refused."""
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        size = getattr(parallel_config, key, 1)
        if size != 1:
            return f"supports {key}=1 only, got {size}: not verified; allowed: 1"
    return None


def unsupported_compilation(compilation_config: Any) -> str | None:
    """What of ``compilation_config`` NWOR cannot serve, or None.

    NWOR must see every target layer's KV write in Python, or replay a FULL graph it captured
    with its staged path. With piecewise CUDA graphs, vLLM keeps the KV write out of the
    captured pieces only when ``vllm::unified_kv_cache_update`` is a splitting op, which is its
    default without Inductor graph partition. Otherwise a piece captured with vLLM's plain write
    would replay it in a verify step while attention reads the scratch blocks."""
    from vllm.config import CompilationMode

    if compilation_config.mode != CompilationMode.VLLM_COMPILE:
        return None
    mode = compilation_config.cudagraph_mode
    if mode is None or not mode.has_piecewise_cudagraphs():
        return None
    if compilation_config.use_inductor_graph_partition:
        return (f"use_inductor_graph_partition=True with cudagraph_mode={mode.name} (the KV "
                "write is captured inside piecewise CUDA graphs); allowed: "
                "use_inductor_graph_partition=False, or cudagraph_mode FULL or NONE")
    if "vllm::unified_kv_cache_update" not in (compilation_config.splitting_ops or []):
        return (f"splitting_ops={compilation_config.splitting_ops!r} with cudagraph_mode="
                f"{mode.name}: 'vllm::unified_kv_cache_update' must be a splitting op (vLLM's "
                "default when splitting_ops is not set), or cudagraph_mode FULL or NONE")
    return None


def ask_for_request_metrics(vllm_config: Any, config: NworConfig) -> None:
    """With telemetry on, vLLM's own per-request speculative-decoding metrics
    (``--per-request-spec-decode-metrics``) at ``detailed``, the drafts accepted in every
    step, where the level is vLLM's default (none)."""
    observability = vllm_config.observability_config
    if (config.telemetry and vllm_config.speculative_config is not None
            and observability.per_request_spec_decode_metrics == "none"):
        observability.per_request_spec_decode_metrics = "detailed"


def log_activation(config: NworConfig) -> None:
    """The plugin's one INFO line, when a config switches a feature on."""
    if not config.enabled:
        return
    import vllm

    import vllm_nwor
    from vllm_nwor.patches import all_patches

    window = config.draft_context_window
    logger.info(
        "vllm-nwor %s on vLLM %s: nwor %s, scv %s, draft context window %s, telemetry %s "
        "(%d patches)",
        vllm_nwor.__version__, vllm.__version__, "on" if config.nwor else "off", config.scv,
        "off" if window is None else window, "on" if config.telemetry else "off",
        len(all_patches()),
    )


def _wrap_create_engine_config(create_engine_config):
    def wrapper(self, *args, **kwargs):
        config = take_plugin_keys(self)  # the one parse of the plugin's keys
        vllm_config = create_engine_config(self, *args, **kwargs)
        attach(vllm_config, config)
        check_engine_config(vllm_config, config)
        ask_for_request_metrics(vllm_config, config)
        log_activation(config)
        return vllm_config

    return wrapper


def _wrap_compute_hash(compute_hash):
    """vLLM's config hash without the plugin's keys.

    vLLM keys its torch.compile cache (and Inductor's, kernel choices included) by this hash.
    Nothing the plugin does is inside the compiled graph: the KV write and attention are
    splitting ops that run outside it (:func:`unsupported_compilation` refuses the setups where
    they would not), and what the plugin changes in vLLM's own config (CUDA graph sizes for
    SCV) is hashed by vLLM as usual. So the plugin's keys leave the hash, and an engine with
    the plugin on compiles to, and loads, the same artifacts as one with it off: the same
    kernels. Two separate compiles can choose different Inductor kernels, whose rounding
    differs (``tp2_wide_prompts_8b_ngram`` in docs/equivalence.md)."""
    def wrapper(self, *args, **kwargs):
        additional = self.additional_config
        if not isinstance(additional, dict) or not any(k in additional for k in PLUGIN_KEYS):
            return compute_hash(self, *args, **kwargs)
        self.additional_config = {k: v for k, v in additional.items() if k not in PLUGIN_KEYS}
        try:
            return compute_hash(self, *args, **kwargs)
        finally:
            self.additional_config = additional

    return wrapper


PATCHES = [
    Patch(
        VllmConfig,
        "compute_hash",
        _wrap_compute_hash,
        why="vLLM's config hash keys its compile cache; the plugin's keys change nothing "
        "compiled, so they stay out of it and the plugin shares vLLM's compiled kernels. "
        "Retired by a way for additional_config entries to opt out of the hash.",
    ),
    Patch(
        EngineArgs,
        "create_engine_config",
        _wrap_create_engine_config,
        why="vLLM's SpeculativeConfig forbids extra keys: move the plugin's keys to "
        "additional_config before it validates, then check the finished VllmConfig, in the "
        "front-end process. Retired by an extension namespace in SpeculativeConfig.",
    ),
]
