"""Runner patches: bind NWOR to the target model's layers, begin each verify step, commit.

vLLM's V1 ``GPUModelRunner`` (which ``CPUModelRunner`` subclasses; on a GPU vLLM 0.32 runs it
only with ``VLLM_USE_V2_MODEL_RUNNER=0``) goes through, per step::

    execute_model:  _prepare_inputs  -> target forward (every layer: KV write, attention)
    sample_tokens:  _sample (rejection sampling)  -> drafter  -> bookkeeping

The plugin begins the verify step when ``_prepare_inputs`` has placed the drafts, and commits
right after ``_sample``: after the verdict and before the drafter runs. The benchmark feature of
per-request synthetic acceptance (``patches/synthetic.py``) hooks ``_sample`` before NWOR, so
its thinned verdict is the one every consumer (NWOR, the drafter, the scheduler) sees.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor._logging import get_logger
from vllm_nwor.config import NworConfigError
from vllm_nwor.nwor.interceptor import NworInterceptor
from vllm_nwor.nwor.kv_staging import StagedLayers
from vllm_nwor.nwor.verify_step import IndexUploader
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.nwor import cpu_attn, flash_attn
from vllm_nwor.patches.nwor.binding import (
    BINDING_ATTR,
    INTERCEPTOR_ATTR,
    LayerBinding,
    NworBackend,
    interceptor_of,
    wrap_capture_model,
)
from vllm_nwor.patches.settings import plugin_config
from vllm_nwor.patches.shared import one_verdict

logger = get_logger(__name__)


def _backends() -> list[NworBackend]:
    """A new instance of every backend: an engine's backend state is its own, never shared
    with another engine in the same process."""
    return [cpu_attn.CpuAttnBackend(), flash_attn.FlashAttnBackend()]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """A model's attention layers that write their own KV cache, in model order."""
    return [
        module
        for module in model.modules()
        if isinstance(module, Attention) and module.kv_sharing_target_layer_name is None
    ]


def bind(runner: GPUModelRunner, profiling: bool = False) -> NworInterceptor | None:
    """Builds the interceptor and binds it to every target layer (a no-op when NWOR is off).

    ``profiling``: the KV cache is vLLM's minimal one, on which it measures CUDA graphs' memory
    and which it then discards. It has no room for NWOR's scratch blocks, so NWOR stays unbound
    until the real cache exists."""
    config = plugin_config(runner.vllm_config)
    setattr(runner, INTERCEPTOR_ATTR, None)
    if not config.nwor or profiling:
        return None
    layers = attention_layers(runner.get_model())
    if not layers:
        raise NworConfigError("'nwor': true found no attention layers in the target model")
    backend = backend_for(layers[0])
    for layer in layers:
        backend.check(layer)
    _check_one_kv_cache_group(runner, layers)

    first = layers[0]
    head_size, num_kv_heads = first.impl.head_size, first.impl.num_kv_heads
    kv_dtype = first.kv_cache.dtype
    spec = runner.vllm_config.speculative_config
    sched = runner.vllm_config.scheduler_config
    max_tokens = min(sched.max_num_seqs * spec.num_speculative_tokens, sched.max_num_batched_tokens)

    def plain_write(layer_idx: int, key, value, slot_mapping) -> None:
        backend.plain_write(layers[layer_idx], key, value, slot_mapping)

    stage_fn, commit_fn, write_back = backend.fused_ops(
        layers, sched.max_num_seqs, spec.num_speculative_tokens, sched.max_num_batched_tokens)
    device = first.kv_cache.device
    interceptor = NworInterceptor(
        StagedLayers(len(layers), max_tokens),
        plain_write,
        stage_fn=stage_fn,
        commit_fn=commit_fn,
        write_back=write_back,
        kv_bytes_per_token=len(layers) * 2 * num_kv_heads * head_size * kv_dtype.itemsize,
        # Four index arrays, each padded to an even length (_step_indices).
        uploader=IndexUploader(3 * max_tokens + sched.max_num_batched_tokens + 4, device),
        device=device,
    )
    for idx, layer in enumerate(layers):
        setattr(layer, BINDING_ATTR, LayerBinding(interceptor, idx, backend.layer_state(layer)))
    setattr(runner, INTERCEPTOR_ATTR, interceptor)
    logger.info(
        "NWOR active: %d target layers on %s, staging up to %d draft tokens per verify step",
        len(layers), backend.name, max_tokens,
    )
    return interceptor


def backend_for(layer: Attention) -> NworBackend:
    """The NWOR backend that serves this layer's attention implementation; refuses others."""
    backends = _backends()
    for backend in backends:
        if backend.handles(layer.impl):
            return backend
    supported = ", ".join(b.name for b in backends)
    raise NworConfigError(
        f"'nwor': true does not support the attention backend {type(layer.impl).__name__} "
        f"(layer {layer.layer_name}); supported backends: {supported}"
    )


def _check_one_kv_cache_group(runner: GPUModelRunner, layers: list[Attention]) -> None:
    names = {layer.layer_name for layer in layers}
    groups = [
        gid
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups)
        if names.intersection(group.layer_names)
    ]
    if len(groups) != 1:
        raise NworConfigError(
            f"'nwor': true needs all target attention layers in one KV cache group (one slot "
            f"mapping); this model spreads them over {len(groups)} groups"
        )


def _wrap_initialize_kv_cache(initialize_kv_cache):
    def wrapper(self, kv_cache_config, is_profiling: bool = False, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling=is_profiling, **kwargs)
        bind(self, profiling=is_profiling)

    return wrapper


def begin_verify_step(interceptor: NworInterceptor, num_draft_tokens, query_start_loc,
                      device, num_scheduled_tokens) -> None:
    """Begins the step from the batch's draft counts (None: no drafts), query start locations
    and scheduled tokens per request (host, batch order), for either runner. A step that is not
    staged but has requests of more than one token may replay a FULL graph captured with the
    staged path: it writes every row."""
    if not interceptor.begin_batch(num_draft_tokens, query_start_loc, device) and \
            len(num_scheduled_tokens) and num_scheduled_tokens.max() > 1:
        interceptor.unstage_rows(int(num_scheduled_tokens.sum()))


def _wrap_prepare_inputs(prepare_inputs):
    def wrapper(self, scheduler_output, num_scheduled_tokens):
        prepared = prepare_inputs(self, scheduler_output, num_scheduled_tokens)
        spec_decode_metadata = prepared[1]  # (logits_indices, spec_decode_metadata, max sampled)
        interceptor = interceptor_of(self)
        if interceptor is not None:
            num_reqs = self.input_batch.num_reqs
            drafts = None if spec_decode_metadata is None else \
                spec_decode_metadata.num_draft_tokens
            begin_verify_step(interceptor, drafts, self.query_start_loc.np[: num_reqs + 1],
                              self.device, num_scheduled_tokens)
        return prepared

    return wrapper


def _wrap_sample(sample):
    def wrapper(self, logits, spec_decode_metadata):
        sampler_output = sample(self, logits, spec_decode_metadata)
        if spec_decode_metadata is None:
            return sampler_output
        interceptor = interceptor_of(self)
        if interceptor is not None:  # the same verdict on every rank: one collective
            one_verdict(sampler_output)
        if interceptor is not None and interceptor.step is not None:
            interceptor.commit(sampler_output.sampled_token_ids)
        return sampler_output

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "initialize_kv_cache",
        _wrap_initialize_kv_cache,
        why="Once the KV cache tensors exist, bind the interceptor to the target model's "
        "attention layers (draft-model layers stay unbound). Retired by a runner hook for KV "
        "write interception.",
    ),
    Patch(
        GPUModelRunner,
        "_prepare_inputs",
        _wrap_prepare_inputs,
        why="Begin the verify step once, for all layers, when the drafts' batch rows are known.",
    ),
    Patch(
        GPUModelRunner,
        "_sample",
        _wrap_sample,
        why="Commit the accepted drafts right after rejection sampling, before the drafter "
        "runs. Its only caller is sample_tokens.",
    ),
    Patch(
        GPUModelRunner,
        "capture_model",
        wrap_capture_model,
        why="While vLLM warms up and captures its CUDA graphs, bound layers called with more "
        "than one token per request take the staged path, so FULL graphs of verify batches "
        "stage drafts (NworInterceptor.stage_for_graph).",
    ),
]
