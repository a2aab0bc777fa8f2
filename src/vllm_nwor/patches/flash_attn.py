"""FLASH_ATTN patches (CUDA): staging fused into the KV update, attention through scratch blocks.

In a staged verify step:

- before the first layer, one launch plans the step's scratch blocks
  (:mod:`vllm_nwor.kernels.scratch`): a copy of vLLM's block table in which each drafting
  request's last blocks are scratch blocks that the scheduler never hands out, and the committed
  tokens sharing the first of them copied there for every layer;
- ``do_kv_cache_update``, per layer: one Triton launch in place of ``reshape_and_cache_flash``.
  Draft rows go to the staging buffer, every other row to the cache, byte for byte as vLLM writes
  them; every row of a drafting request also goes to its scratch slot;
- ``forward``, per layer: vLLM's own FlashAttention call, over that block table. It sees the
  committed prefix and the step's chunk; no draft is in a block the scheduler gave a request.

After rejection sampling, one Triton launch commits every layer's accepted drafts.

CUDA graphs: vLLM's FULL graphs for batches of more than one token per request are captured
with this staged path (``NworInterceptor.stage_for_graph``). Everything it reads is a device
buffer at a fixed address (the rows to stage, vLLM's slot mapping, block table, sequence lengths
and query starts, the staging buffer, the scratch table and slots), so a verify batch replays a
FULL graph as it does without NWOR, and a step that is not staged replays the same graph with
every row written and vLLM's own blocks in the table (docs/gpu.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import vllm.v1.attention.backends.flash_attn as fa
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.config import NworConfigError
from vllm_nwor.kernels.commit_kv import Verdict, cache_offsets, commit_kv
from vllm_nwor.kernels.scratch import plan_scratch, scratch_blocks
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


class Scratch:
    """The scratch blocks of one engine's target layers (see :mod:`vllm_nwor.kernels.scratch`).

    The table and the row slots are allocated once (the table when the first staged call shows
    vLLM's block table width), so CUDA graphs read them at fixed addresses.
    """

    def __init__(self, first_layer: str, key_caches: list[torch.Tensor],
                 value_caches: list[torch.Tensor], offsets: tuple[torch.Tensor, torch.Tensor],
                 max_num_seqs: int, num_spec_tokens: int, max_rows: int) -> None:
        num_blocks, block_size = key_caches[0].shape[:2]
        self.per_request, total = scratch_blocks(max_num_seqs, num_spec_tokens, block_size)
        if total >= num_blocks:
            raise NworConfigError(
                f"'nwor': true needs {total} scratch KV blocks (max_num_seqs={max_num_seqs}, "
                f"num_speculative_tokens={num_spec_tokens}, block_size={block_size}); the cache "
                f"has {num_blocks}")
        self.base = num_blocks - total  # the engine core kept these from the scheduler
        self.first_layer = first_layer  # whose forward-context metadata the plan reads
        self.caches = (key_caches, value_caches, offsets)
        self.max_num_seqs = max_num_seqs
        device = key_caches[0].device
        self.row_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.table = torch.zeros((max_num_seqs, 0), dtype=torch.int32, device=device)
        self._for: Any = None
        self._metadata: Any = None

    def plan(self, row_stage_index: torch.Tensor) -> None:
        """Plans this step's scratch blocks; called in the first layer's KV update."""
        metadata = get_forward_context().attn_metadata
        md = metadata.get(self.first_layer) if isinstance(metadata, dict) else None
        if md is None:
            raise ValueError("no attention metadata for the first target layer (micro-batches "
                             "are not supported)")
        width = md.block_table.shape[1]
        if self.table.shape[1] == 0:  # vLLM's block table keeps its width: allocated once
            self.table = torch.zeros((self.max_num_seqs, width), dtype=torch.int32,
                                     device=self.row_slots.device)
        elif self.table.shape[1] != width:  # captured graphs read this table: never moved
            raise ValueError(f"vLLM's block table is {width} blocks wide, the scratch table "
                             f"{self.table.shape[1]}")
        key_caches, value_caches, offsets = self.caches
        plan_scratch(md.block_table, md.query_start_loc, md.seq_lens, row_stage_index,
                     self.table, self.row_slots, key_caches, value_caches, offsets, self.base,
                     self.per_request)

    def metadata(self, attn_metadata):
        """``attn_metadata`` with the scratch table as its block table, made once per step."""
        if self._for is not attn_metadata:
            rows = attn_metadata.block_table.shape[0]
            self._metadata = copy.copy(attn_metadata)  # as vLLM's update_block_table does
            self._metadata.block_table = self.table[:rows]
            self._for = attn_metadata
        return self._metadata


class FlashAttnBackend:
    name = "FLASH_ATTN"

    def __init__(self) -> None:
        self.scratch: Scratch | None = None

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

    def layer_state(self, layer) -> None:
        return None

    def fused_ops(self, layers: list, buffer: StagingBuffer, max_num_seqs: int,
                  num_spec_tokens: int, max_rows: int) -> tuple[StageFn, CommitFn]:
        """One launch per step to plan the scratch blocks, one per layer to stage, one per
        step to commit.

        The layouts are checked once here; the hot paths then skip the wrappers' checks.
        """
        caches = [_split_cache(layer.impl, layer.kv_cache) for layer in layers]
        key_caches = [k for k, _ in caches]
        value_caches = [v for _, v in caches]
        offsets = cache_offsets(key_caches, value_caches)
        scratch = self.scratch = Scratch(layers[0].layer_name, key_caches, value_caches, offsets,
                                         max_num_seqs, num_spec_tokens, max_rows)
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
            if layer_idx == 0:
                scratch.plan(row_stage_index)
            views = staged[layer_idx] if buf is buffer else (buf.key[layer_idx],
                                                             buf.value[layer_idx])
            first_time = layer_idx not in checked
            stage_kv(key, value, key_caches[layer_idx], value_caches[layer_idx], slot_mapping,
                     row_stage_index, *views, buf.slot_mapping, scratch.row_slots,
                     checked=first_time)
            checked.add(layer_idx)

        def commit(buf: StagingBuffer, verdict: Verdict) -> None:
            commit_kv(buf.key, buf.value, buf.slot_mapping[: buf.num_tokens], key_caches,
                      value_caches, offsets, checked=False, verdict=verdict)

        return stage, commit

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = (window - 1, 0)  # FlashAttentionImpl's form of a causal window


BACKEND = FlashAttnBackend()


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if staged_binding(layer, attn_metadata) is not None:
            attn_metadata = BACKEND.scratch.metadata(attn_metadata)  # type: ignore[union-attr]
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       *args, **kwargs)

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
        why="In a staged verify step: vLLM's own attention over a block table in which each "
        "drafting request's last blocks are scratch blocks holding the step's chunk.",
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
