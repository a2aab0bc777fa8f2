"""FLASH_ATTN patches (CUDA): vLLM's own KV write into scratch blocks, attention through them.

In a staged verify step:

- before the first layer, one launch plans the step's scratch blocks
  (:mod:`vllm_nwor.nwor.kernels.scratch`): the slots through which each drafting request's rows
  go to its scratch blocks (blocks the scheduler never hands out) instead of its own, a copy of
  vLLM's block table in which its last blocks are those scratch blocks, and the committed tokens
  sharing the first of them copied there for every layer;
- ``do_kv_cache_update``, per layer: vLLM's own ``reshape_and_cache_flash``, through those slots.
  No launch is added, and no row of a drafting request reaches a block the scheduler gave it;
- ``forward``, per layer: vLLM's own FlashAttention call, over the plan's block table. It sees
  the committed prefix and the step's chunk.

After rejection sampling, one Triton launch copies every layer's accepted rows (each drafting
request's last sampled token and accepted drafts) from the scratch blocks to their own slots.

CUDA graphs: vLLM's FULL graphs for batches of more than one token per request are captured
with this staged path (``NworInterceptor.stage_for_graph``). Everything it reads is a device
buffer at a fixed address (the rows to stage, vLLM's slot mapping, block table, sequence lengths
and query starts, the plan's slots and table), so a verify batch replays a FULL graph as it does
without NWOR, and a step that is not staged replays the same graph with vLLM's own slots and
blocks in the plan (docs/gpu.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import vllm.v1.attention.backends.flash_attn as fa
from vllm.forward_context import get_forward_context

from vllm_nwor.nwor.kv_staging import CommitFn, ScratchStaging, StageFn, WriteBackFn
from vllm_nwor.patches._patch import Patch, original
from vllm_nwor.patches.nwor.binding import (
    refuse_unsupported,
    staged_binding,
    wrap_kv_cache_update,
)


def _split_cache(impl, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FLASH_ATTN's (B, H, N, 2D) cache as key and value views of shape (B, N, H, D)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return key_cache, value_cache


class ScratchMetadata:
    """FLASH_ATTN's side of :class:`ScratchStaging`: the step's metadata from vLLM's forward
    context, and that metadata with the scratch table as its block table."""

    def __init__(self, first_layer: str) -> None:
        self.first_layer = first_layer  # whose forward-context metadata the plan reads
        self.staging: ScratchStaging | None = None
        self._for: Any = None
        self._metadata: Any = None

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        metadata = get_forward_context().attn_metadata
        md = metadata.get(self.first_layer) if isinstance(metadata, dict) else None
        if md is None:
            raise ValueError("no attention metadata for the first target layer (micro-batches "
                             "are not supported)")
        return md.block_table, md.query_start_loc, md.seq_lens

    def metadata(self, attn_metadata):
        """``attn_metadata`` with the scratch table as its block table, made once per step."""
        if self._for is not attn_metadata:
            rows = attn_metadata.block_table.shape[0]
            self._metadata = copy.copy(attn_metadata)  # as vLLM's update_block_table does
            self._metadata.block_table = self.staging.table[:rows]  # type: ignore[union-attr]
            self._for = attn_metadata
        return self._metadata


class FlashAttnBackend:
    """One per engine (``model_runner.bind`` makes it): its scratch staging is that engine's,
    and reaches the layers' attention through their bindings."""

    name = "FLASH_ATTN"

    def __init__(self) -> None:
        self.scratch: ScratchMetadata | None = None

    def handles(self, impl: Any) -> bool:
        return isinstance(impl, fa.FlashAttentionImpl)

    def check(self, layer) -> None:
        impl = layer.impl
        refuse_unsupported(
            self.name, layer,
            f"sliding_window={impl.sliding_window}"
            if impl.sliding_window not in (None, (-1, -1)) else None,
            f"decode context parallel size {impl.dcp_world_size}"
            if getattr(impl, "dcp_world_size", 1) > 1 else None,
        )

    def plain_write(self, layer, key, value, slot_mapping) -> None:
        original(fa.FlashAttentionImpl.do_kv_cache_update)(
            layer.impl, layer, key, value, layer.kv_cache, slot_mapping
        )

    def layer_state(self, layer) -> ScratchMetadata | None:
        return self.scratch  # made by fused_ops, which bind() calls first

    def fused_ops(self, layers: list, max_num_seqs: int, num_spec_tokens: int,
                  max_rows: int) -> tuple[StageFn, CommitFn, WriteBackFn]:
        """One launch per step to plan the scratch blocks, vLLM's own write per layer, one
        launch per step to commit (:class:`ScratchStaging`); fallbacks write back through
        vLLM's write. The layouts are checked once here."""
        caches = [_split_cache(layer.impl, layer.kv_cache) for layer in layers]
        key_caches = [k for k, _ in caches]
        value_caches = [v for _, v in caches]
        write_op = fa.reshape_and_cache_flash  # what do_kv_cache_update calls, per layer

        def write(layer_idx, key, value, slot_mapping) -> None:
            """vLLM's do_kv_cache_update of a decoder layer, with its cache views made once
            here rather than per call (host time in every layer outside CUDA graphs)."""
            layer = layers[layer_idx]
            write_op(key, value, key_caches[layer_idx], value_caches[layer_idx], slot_mapping,
                     layer.impl.kv_cache_dtype, layer._k_scale, layer._v_scale)

        scratch = self.scratch = ScratchMetadata(layers[0].layer_name)
        scratch.staging = ScratchStaging(key_caches, value_caches, write, scratch.step,
                                         max_num_seqs, num_spec_tokens, max_rows)
        return scratch.staging.ops()

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = (window - 1, 0)  # FlashAttentionImpl's form of a causal window


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        binding = staged_binding(layer, attn_metadata)
        if binding is not None:
            attn_metadata = binding.backend_state.metadata(attn_metadata)
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        fa.FlashAttentionImpl,
        "do_kv_cache_update",
        wrap_kv_cache_update,
        why="Route a bound target layer's KV write through the interceptor during a verify "
        "step (vLLM's own write, through slots that keep drafting requests' rows in scratch "
        "blocks until the commit). Draft-model layers are unbound and untouched.",
    ),
    Patch(
        fa.FlashAttentionImpl,
        "forward",
        _wrap_forward,
        why="In a staged verify step: vLLM's own attention over a block table in which each "
        "drafting request's last blocks are scratch blocks holding the step's chunk.",
    ),
]
