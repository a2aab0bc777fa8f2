"""CPU_ATTN patches: staged KV writes and chunk-verify attention on vLLM's CPU backend.

vLLM 0.32's CPU backend writes a decoder layer's KV in ``do_kv_cache_update`` only (its
``forward`` writes for encoder attention alone). In a staged verify step both are intercepted:
``do_kv_cache_update`` hands the write to the interceptor (drafts staged, other rows written), and
``forward`` computes attention over the committed prefix merged with the step's chunk itself,
without calling vLLM's. Every other call goes to vLLM unchanged.

The CPU attention kernel returns no log-sum-exp, so the staged step's attention is the PyTorch
reference in :mod:`vllm_nwor.nwor.attention`, reading the cache through a layout learned from the
backend's own write op (:mod:`vllm_nwor.nwor.kv_layout`).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_nwor.nwor.attention import chunk_verify_attention
from vllm_nwor.nwor.kv_layout import PagedKVLayout
from vllm_nwor.patches._patch import Patch, original
from vllm_nwor.patches.nwor.binding import (
    refuse_unsupported,
    staged_binding,
    wrap_kv_cache_update,
)


def _vllm_do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping) -> None:
    original(CPUAttentionBackendImpl.do_kv_cache_update)(
        impl, layer, key, value, kv_cache, slot_mapping
    )


class CpuAttnBackend:
    name = "CPU_ATTN"

    def __init__(self) -> None:
        self._layouts: dict[tuple, PagedKVLayout] = {}

    def handles(self, impl: Any) -> bool:
        return isinstance(impl, CPUAttentionBackendImpl)

    def check(self, layer) -> None:
        impl = layer.impl
        refuse_unsupported(
            self.name, layer,
            f"sliding_window={impl.sliding_window}" if impl.sliding_window != -1 else None,
        )

    def plain_write(self, layer, key, value, slot_mapping) -> None:
        _vllm_do_kv_cache_update(layer.impl, layer, key, value, layer.kv_cache, slot_mapping)

    def layer_state(self, layer) -> PagedKVLayout:
        impl, cache = layer.impl, layer.kv_cache
        _, num_kv_heads, block_size, _ = cache.shape
        key = (layer.isa, cache.dtype, block_size, num_kv_heads, impl.head_size)
        if key not in self._layouts:

            def write(k, v, block, slots):
                _vllm_do_kv_cache_update(impl, layer, k, v, block, slots)

            self._layouts[key] = PagedKVLayout.probe(
                write, (1, *cache.shape[1:]), block_size, num_kv_heads, impl.head_size, cache.dtype
            )
        return self._layouts[key]

    def fused_ops(self, layers, max_num_seqs, num_spec_tokens, max_rows
                  ) -> tuple[None, None, None]:
        return None, None, None  # the interceptor's generic stage and commit use vLLM's CPU op

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = window  # CPUAttentionBackendImpl keeps vLLM's per-layer value


BACKEND = CpuAttnBackend()


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        binding = staged_binding(layer, attn_metadata)
        if binding is None:
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                           *args, **kwargs)
        layout: PagedKVLayout = binding.backend_state
        block_table = attn_metadata.block_table
        query_start_loc = attn_metadata.query_start_loc.tolist()
        num_reqs = len(query_start_loc) - 1

        def read_prefix(req: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
            return layout.gather(kv_cache, block_table[req], num_tokens)

        n = attn_metadata.num_actual_tokens
        chunk_verify_attention(
            query[:n],
            key[:n],
            value[:n],
            query_start_loc,
            attn_metadata.seq_lens[:num_reqs].tolist(),
            read_prefix,
            self.scale,
            output,
        )
        return output

    return wrapper


PATCHES = [
    Patch(
        CPUAttentionBackendImpl,
        "do_kv_cache_update",
        wrap_kv_cache_update,
        why="Route a bound target layer's KV write through the interceptor during a verify "
        "step. Draft-model layers are unbound and untouched.",
    ),
    Patch(
        CPUAttentionBackendImpl,
        "forward",
        _wrap_forward,
        why="In a staged verify step: attention over the cache prefix and the staged chunk "
        "(the CPU kernel returns no log-sum-exp to merge them). Retired by a kernel that does.",
    ),
]
