"""FLASH_ATTN patches (CUDA): staging fused into the KV update, FA prefix + Triton chunk, commit.

In a staged verify step, for each bound target layer:

- ``do_kv_cache_update``: one Triton launch in place of ``reshape_and_cache_flash``. Draft rows
  go to the staging buffer, every other row to the cache, byte for byte as vLLM writes them.
- ``forward``: FlashAttention over the committed prefix (``seqused_k = seq_len - query_len``,
  non-causal, with its log-sum-exp) written straight into ``output``, then one Triton launch that
  adds causal attention over the step's own rows and merges the two in place.

After rejection sampling, one Triton launch commits every layer's accepted drafts.

CUDA graphs: vLLM's FULL graphs for batches of more than one token per request are captured
with this staged path (``NworInterceptor.stage_for_graph``). Everything it reads is a device
buffer at a fixed address (the rows to stage, vLLM's slot mapping, sequence lengths and query
starts, the staging buffer), so a verify batch replays a FULL graph as it does without NWOR, and
a step that is not staged replays the same graph with every row written (docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import torch
import vllm.v1.attention.backends.flash_attn as fa
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.config import NworConfigError
from vllm_nwor.kernels.chunk_attention import chunk_attention_merge
from vllm_nwor.kernels.commit_kv import Verdict, cache_offsets, commit_kv
from vllm_nwor.kernels.stage_kv import stage_kv
from vllm_nwor.patches._patch import Patch, original
from vllm_nwor.patches.model_runner import (
    INTERCEPTOR_ATTR,
    staged_binding,
    wrap_kv_cache_update,
)
from vllm_nwor.staging import CommitFn, StageFn, StagingBuffer


def _split_cache(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLASH_ATTN's (B, H, N, 2D) cache as key and value views of shape (B, N, H, D)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return key_cache, value_cache


class _CacheViews:
    """A layer's cache as the staged attention reads it, kept from step to step: the views
    (split, strides made canonical as vLLM's forward makes them) are taken again only when
    the layer is called with another cache tensor."""

    __slots__ = ("kv_cache", "views")

    def __init__(self) -> None:
        self.kv_cache: torch.Tensor | None = None
        self.views: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def of(self, impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache is not self.kv_cache:
            key_cache, value_cache = _split_cache(impl, kv_cache)
            self.views = (fa.canonicalize_singleton_dim_strides(key_cache),
                          fa.canonicalize_singleton_dim_strides(value_cache))
            self.kv_cache = kv_cache
        return self.views


class FlashAttnBackend:
    name = "FLASH_ATTN"

    def __init__(self) -> None:
        self._prefix_for: Any = None
        self._prefix_shapes: tuple = ()
        self._prefix: tuple[torch.Tensor, torch.Tensor | None] = (torch.empty(0), None)

    def handles(self, impl: Any) -> bool:
        return isinstance(impl, fa.FlashAttentionImpl)

    def check(self, layer) -> None:
        impl = layer.impl
        unsupported = []
        if impl.attn_type != AttentionType.DECODER:
            unsupported.append(f"attn_type={impl.attn_type}")
        if impl.sliding_window not in (None, (-1, -1)):
            unsupported.append(f"sliding_window={impl.sliding_window}")
        if impl.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if impl.logits_soft_cap:
            unsupported.append(f"logits_soft_cap={impl.logits_soft_cap}")
        if impl.sinks is not None:
            unsupported.append("attention sinks")
        if impl.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
            unsupported.append(
                f"kv_cache_dtype={impl.kv_cache_dtype!r} (allowed: 'auto', 'bfloat16', "
                "'float16'; an fp8 commit would have to reproduce vLLM's quantization)"
            )
        if getattr(impl, "dcp_world_size", 1) > 1:
            unsupported.append(f"decode context parallel size {impl.dcp_world_size}")
        if unsupported:
            raise NworConfigError(
                f"'nwor': true on FLASH_ATTN does not support {', '.join(unsupported)} "
                f"(layer {layer.layer_name})"
            )

    def plain_write(self, layer, key, value, slot_mapping) -> None:
        original(fa.FlashAttentionImpl.do_kv_cache_update)(
            layer.impl, layer, key, value, layer.kv_cache, slot_mapping
        )

    def layer_state(self, layer) -> _CacheViews:
        return _CacheViews()

    def fused_ops(self, layers: list, buffer: StagingBuffer) -> tuple[StageFn, CommitFn]:
        """One Triton launch per layer for staging, one per step for the commit.

        The layouts are checked once here; the hot paths then skip the wrappers' checks.
        """
        caches = [_split_cache(layer.impl, layer.kv_cache) for layer in layers]
        key_caches = [k for k, _ in caches]
        value_caches = [v for _, v in caches]
        offsets = cache_offsets(key_caches, value_caches)
        # Checks the layouts, and compiles the commit before any step: one token, rejected
        # (nothing is written or counted).
        device = buffer.key.device
        one = torch.zeros(1, dtype=torch.int64, device=device)
        rejected = Verdict(torch.full((1, 2), -1, dtype=torch.int32, device=device), one, one,
                           torch.zeros((), dtype=torch.int64, device=device))
        commit_kv(buffer.key, buffer.value, buffer.slot_mapping[:1], key_caches, value_caches,
                  offsets, verdict=rejected)
        staged = [(buffer.key[i], buffer.value[i]) for i in range(len(layers))]
        checked: set[int] = set()

        def stage(layer_idx, key, value, slot_mapping, row_stage_index, buf) -> None:
            views = staged[layer_idx] if buf is buffer else (buf.key[layer_idx],
                                                             buf.value[layer_idx])
            first_time = layer_idx not in checked
            stage_kv(key, value, key_caches[layer_idx], value_caches[layer_idx], slot_mapping,
                     row_stage_index, *views, buf.slot_mapping, checked=first_time)
            checked.add(layer_idx)

        def commit(buf: StagingBuffer, verdict: Verdict) -> None:
            commit_kv(buf.key, buf.value, buf.slot_mapping[: buf.num_tokens], key_caches,
                      value_caches, offsets, checked=False, verdict=verdict)

        return stage, commit

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = (window - 1, 0)  # FlashAttentionImpl's form of a causal window

    def prefix(self, impl, attn_metadata, query: torch.Tensor, key_cache: torch.Tensor):
        """The prefix call's ``seqused_k`` (``seq_len - query_len``, committed tokens per
        request) and FA3 scheduler metadata: computed by the step's first staged layer and
        shared by all, as vLLM shares its own. Without the metadata, FA3 would launch
        ``prepare_varlen_num_blocks`` inside every layer's call. In a FULL graph this is
        captured with the first layer, so a replay recomputes both from the step's inputs."""
        shapes = (query.shape[1:], key_cache.shape[1:3])  # heads and head size, block size
        if self._prefix_for is not attn_metadata or self._prefix_shapes != shapes:
            qsl = attn_metadata.query_start_loc
            num_reqs = qsl.shape[0] - 1
            prefix_lens = attn_metadata.seq_lens[:num_reqs] - (qsl[1:] - qsl[:-1])
            metadata = None
            if impl.vllm_flash_attn_version == 3 and not envs.VLLM_BATCH_INVARIANT:
                metadata = fa.get_scheduler_metadata(
                    batch_size=num_reqs,
                    max_seqlen_q=attn_metadata.max_query_len,
                    max_seqlen_k=attn_metadata.max_seq_len,
                    num_heads_q=query.shape[1],
                    num_heads_kv=key_cache.shape[2],
                    headdim=query.shape[2],
                    cache_seqlens=prefix_lens,
                    qkv_dtype=key_cache.dtype,
                    cu_seqlens_q=qsl,
                    page_size=key_cache.shape[1],
                    causal=False,
                    num_splits=attn_metadata.max_num_splits,
                )
            self._prefix = (prefix_lens, metadata)
            self._prefix_for, self._prefix_shapes = attn_metadata, shapes
        return self._prefix


BACKEND = FlashAttnBackend()


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        binding = staged_binding(layer, attn_metadata)
        if binding is None:
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                           *args, **kwargs)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = binding.backend_state.of(self, kv_cache)
        query_start_loc = attn_metadata.query_start_loc
        prefix_lens, scheduler_metadata = BACKEND.prefix(self, attn_metadata, query, key_cache)
        _, prefix_lse = fa.flash_attn_varlen_func(
            q=query[:n],
            k=key_cache,
            v=value_cache,
            out=output[:n],
            cu_seqlens_q=query_start_loc,
            max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=prefix_lens,
            max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale,
            causal=False,
            block_table=attn_metadata.block_table,
            fa_version=self.vllm_flash_attn_version,
            scheduler_metadata=scheduler_metadata,
            num_splits=attn_metadata.max_num_splits,  # as vLLM's own call: fixed in FULL graphs
            return_softmax_lse=True,
        )
        chunk_attention_merge(query[:n], key[:n], value[:n], query_start_loc,
                              attn_metadata.max_query_len, output, prefix_lse, self.scale,
                              checked=False)
        return output

    return wrapper


def _wrap_capture_model(capture_model):
    def wrapper(self, *args, **kwargs):
        interceptor = getattr(self, INTERCEPTOR_ATTR, None)
        if interceptor is None:
            return capture_model(self, *args, **kwargs)
        interceptor.capturing = True
        try:
            return capture_model(self, *args, **kwargs)
        finally:
            interceptor.capturing = False

    return wrapper


PATCHES = [
    Patch(
        fa.FlashAttentionImpl,
        "do_kv_cache_update",
        wrap_kv_cache_update,
        why="Route a bound target layer's KV write through the interceptor during a verify "
        "step (fused stage kernel). Draft-model layers are unbound and untouched.",
    ),
    Patch(
        fa.FlashAttentionImpl,
        "forward",
        _wrap_forward,
        why="In a staged verify step: FA over the committed prefix with LSE, then one Triton "
        "launch for the step's chunk and the merge.",
    ),
    Patch(
        GPUModelRunner,
        "capture_model",
        _wrap_capture_model,
        why="While vLLM warms up and captures its CUDA graphs, bound layers called with more "
        "than one token per request take the staged path, so FULL graphs of verify batches "
        "stage drafts (NworInterceptor.stage_for_graph).",
    ),
]
