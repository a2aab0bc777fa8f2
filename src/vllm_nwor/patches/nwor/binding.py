"""What the model runner and the attention backends share: a target layer's binding to the
interceptor, the backend protocol, and the KV-write wrapper every backend installs.

The runner (:mod:`~vllm_nwor.patches.nwor.model_runner`) binds layers and picks a backend; the
backends (:mod:`~vllm_nwor.patches.nwor.cpu_attn`, :mod:`~vllm_nwor.patches.nwor.flash_attn`)
read the bindings. Both import this module; neither imports the other's side back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention.backend import AttentionType

from vllm_nwor.config import NworConfigError, unsupported_kv_cache_dtype
from vllm_nwor.nwor.interceptor import NworInterceptor
from vllm_nwor.nwor.kv_staging import CommitFn, StageFn, WriteBackFn

INTERCEPTOR_ATTR = "_nwor_interceptor"
"""Set on the runner: its :class:`NworInterceptor`, or None when NWOR is off."""

BINDING_ATTR = "_nwor_binding"
"""Set on each target ``Attention`` layer: its :class:`LayerBinding`."""

@dataclass(frozen=True)
class LayerBinding:
    """What a target layer's patched backend needs: the step's interceptor and its own index."""

    interceptor: NworInterceptor
    layer_idx: int
    backend_state: Any = None


class NworBackend(Protocol):
    """How NWOR drives one attention backend (one implementation per supported backend)."""

    name: str

    def handles(self, impl: Any) -> bool: ...

    def check(self, layer: Attention) -> None:
        """Raises :class:`NworConfigError` for layer features the backend path cannot serve."""

    def plain_write(self, layer: Attention, key, value, slot_mapping) -> None:
        """vLLM's own KV write for ``layer``."""

    def layer_state(self, layer: Attention) -> Any:
        """Per-layer data the patched attention needs (for example a cache layout)."""

    def fused_ops(
        self, layers: list[Attention], max_num_seqs: int, num_spec_tokens: int, max_rows: int,
    ) -> tuple[StageFn | None, CommitFn | None, WriteBackFn | None]:
        """Fused stage, commit and write-back, or Nones to use the interceptor's generic
        versions. The limits are the engine's: requests and drafts per request, rows per
        step."""

    def window_attention(self, impl: Any, window: int) -> None:
        """Makes ``impl`` attend to the last ``window`` tokens (draft context window)."""


def refuse_unsupported(backend: str, layer: Attention, *more: str | None) -> None:
    """A backend's start-up check: raises :class:`NworConfigError` naming every feature of
    ``layer`` that NWOR on ``backend`` cannot serve, those no backend serves and then ``more``
    (the backend's own findings, None for each that is fine)."""
    impl = layer.impl
    unsupported = [u for u in (
        f"attn_type={impl.attn_type}" if impl.attn_type != AttentionType.DECODER else None,
        "ALiBi" if impl.alibi_slopes is not None else None,
        f"logits_soft_cap={impl.logits_soft_cap}" if impl.logits_soft_cap else None,
        "attention sinks" if impl.sinks is not None else None,
        unsupported_kv_cache_dtype(impl.kv_cache_dtype),
        *more,
    ) if u]
    if unsupported:
        raise NworConfigError(f"'nwor': true on {backend} does not support "
                              f"{', '.join(unsupported)} (layer {layer.layer_name})")


def staged_binding(layer: Attention, attn_metadata: Any) -> LayerBinding | None:
    """The layer's binding when its attention must take the staged path, else None."""
    binding: LayerBinding | None = getattr(layer, BINDING_ATTR, None)
    if binding is None or attn_metadata is None:
        return None
    interceptor = binding.interceptor
    if interceptor.is_staged(binding.layer_idx) or _stages_in_graph(interceptor, attn_metadata):
        return binding
    return None


def _stages_in_graph(interceptor: NworInterceptor, attn_metadata: Any) -> bool:
    return interceptor.stages_in_graph(getattr(attn_metadata, "max_query_len", 1))


def _layer_metadata(layer: Attention) -> Any:
    """The forward context's attention metadata for ``layer`` (None with micro-batches)."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(layer.layer_name) if isinstance(metadata, dict) else None


def wrap_kv_cache_update(do_kv_cache_update):
    """A backend's ``do_kv_cache_update``: a bound layer's write goes to the interceptor during
    a verify step, and to the graph's staged path while vLLM captures batches that may verify;
    every other call (draft-model layers, other steps) is vLLM's own."""

    def wrapper(self, layer, key, value, kv_cache, slot_mapping):
        binding: LayerBinding | None = getattr(layer, BINDING_ATTR, None)
        if binding is not None:
            interceptor = binding.interceptor
            if interceptor.active:
                return interceptor.stage(binding.layer_idx, key, value, slot_mapping)
            # capturing first: no forward-context lookup per layer outside graph capture
            if interceptor.capturing and _stages_in_graph(interceptor, _layer_metadata(layer)):
                return interceptor.stage_for_graph(binding.layer_idx, key, value, slot_mapping)
        return do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)

    return wrapper


def wrap_capture_model(capture_model):
    """A model runner's ``capture_model`` (V1 or V2): while vLLM warms up and captures its CUDA
    graphs, bound layers called with more than one token per request take the staged path."""

    def wrapper(self, *args, **kwargs):
        interceptor = interceptor_of(self)
        if interceptor is None:
            return capture_model(self, *args, **kwargs)
        interceptor.capturing = True
        try:
            return capture_model(self, *args, **kwargs)
        finally:
            interceptor.capturing = False

    return wrapper


def interceptor_of(runner: Any) -> NworInterceptor | None:
    """The runner's interceptor: None when NWOR is off (or before its KV cache exists)."""
    return getattr(runner, INTERCEPTOR_ATTR, None)
