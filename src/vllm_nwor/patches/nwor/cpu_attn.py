"""CPU_ATTN patches: vLLM's own CPU attention over scratch blocks in a staged verify step.

vLLM 0.32's CPU backend writes a decoder layer's KV in ``do_kv_cache_update`` only (its
``forward`` writes for encoder attention alone). In a staged verify step:

- ``do_kv_cache_update``, per layer: the interceptor stages the drafts' K/V (its buffer) and
  writes every other row with vLLM's write, to its own slot;
- ``forward``, per layer: each drafting request's blocks from the one holding its first draft
  onward are copied to its scratch blocks (blocks the engine core keeps from the scheduler,
  :func:`~vllm_nwor.nwor.kernels.scratch.scratch_blocks`), its drafts are written there with
  vLLM's write, and vLLM's own attention kernel runs over a copy of the block table in which
  those blocks are the scratch blocks. It reads the same K/V at the same positions as without
  NWOR, through the same kernel; no draft reaches a block the scheduler gave a request.

After rejection sampling the interceptor writes each layer's accepted drafts from its buffer to
their own slots, with vLLM's write. The block copy is whole blocks of vLLM's cache tensor, so it
does not depend on the layout vLLM's CPU kernels give a block.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import vllm.v1.attention.backends.cpu_attn as cpu_attn_backend
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_nwor._logging import get_logger
from vllm_nwor.nwor.counters import FallbackReason
from vllm_nwor.nwor.kernels.scratch import scratch_base
from vllm_nwor.nwor.verify_step import VerifyStep
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.nwor.binding import (
    refuse_unsupported,
    staged_binding,
    wrap_kv_cache_update,
)

logger = get_logger(__name__)


def _cache_writer(layer):
    """vLLM's ``do_kv_cache_update`` of a decoder layer, with its views of the layer's cache
    made once here rather than in every call (host time in every layer of every step)."""
    impl, kv_cache = layer.impl, layer.kv_cache
    num_blocks, num_kv_heads, block_size, _ = kv_cache.size()
    key_cache, value_cache = kv_cache.view(
        (num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)

    def write(key, value, slot_mapping) -> None:
        cpu_attn_backend.ops.cpu_attn_reshape_and_cache(  # what do_kv_cache_update calls
            key, value, key_cache, value_cache, slot_mapping, layer.isa,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype)

    return write


class CpuScratch:
    """One engine's scratch blocks on the CPU, and each staged step's plan for them, made once
    per step (host arrays; the CPU has no graphs to replay)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 num_spec_tokens: int) -> None:
        self.per_request, self.base = scratch_base(num_blocks, max_num_seqs, num_spec_tokens,
                                                   block_size)
        self.block_size = block_size
        self._for: Any = None  # the metadata the plan below was made for
        self._metadata: Any = None  # it, with the scratch table as its block table
        self._src = self._dst = self._slots = torch.empty(0, dtype=torch.int64)

    def plan(self, attn_metadata, step: VerifyStep) -> None:
        """The step's block copies, draft slots and block table, once per step."""
        if self._for is attn_metadata:
            return
        bs, per = self.block_size, self.per_request
        counts = np.asarray(step.num_draft_tokens, dtype=np.int64)
        num_reqs = len(counts)
        seq = attn_metadata.seq_lens[:num_reqs].numpy().astype(np.int64)
        lo = (seq - counts) // bs  # the block of each request's first draft
        hi = (seq - 1) // bs  # and of its last
        drafting = counts > 0
        if np.any(hi[drafting] - lo[drafting] >= per):
            raise ValueError("a request's drafts span more blocks than it has scratch blocks")
        table = attn_metadata.block_table.clone()
        own = table.numpy()
        reqs = np.flatnonzero(drafting)
        src, dst = [], []
        for j in range(per):
            r = reqs[lo[reqs] + j <= hi[reqs]]
            src.append(own[r, lo[r] + j].astype(np.int64))
            dst.append(self.base + r * per + j)
            own[r, lo[r] + j] = dst[-1]
        token_req = step.token_req.numpy()
        position = seq[token_req] - counts[token_req] + step.token_pos.numpy()
        block = self.base + token_req * per + position // bs - lo[token_req]
        self._src = torch.from_numpy(np.concatenate(src))
        self._dst = torch.from_numpy(np.concatenate(dst))
        self._slots = torch.from_numpy(block * bs + position % bs)
        self._metadata = copy.copy(attn_metadata)  # as vLLM's update_block_table does
        self._metadata.block_table = table
        self._for = attn_metadata

    def through_scratch(self, write, kv_cache, drafts, attn_metadata, step: VerifyStep):
        """Fills a layer's scratch blocks (``drafts``: its staged K and V; ``write``: vLLM's
        write into its cache); the metadata vLLM's attention reads them by."""
        self.plan(attn_metadata, step)
        kv_cache.index_copy_(0, self._dst, kv_cache.index_select(0, self._src))
        write(*drafts, self._slots)
        return self._metadata


class CpuAttnBackend:
    name = "CPU_ATTN"

    def __init__(self) -> None:
        self.scratch: CpuScratch | None = None
        self._writers: dict[str, Any] = {}  # by layer name

    def handles(self, impl: Any) -> bool:
        return isinstance(impl, CPUAttentionBackendImpl)

    def check(self, layer) -> None:
        impl = layer.impl
        refuse_unsupported(
            self.name, layer,
            f"sliding_window={impl.sliding_window}" if impl.sliding_window != -1 else None,
        )

    def plain_write(self, layer, key, value, slot_mapping) -> None:
        self._writers[layer.layer_name](key, value, slot_mapping)  # made by fused_ops

    def layer_state(self, layer) -> tuple[CpuScratch | None, Any]:
        return self.scratch, self._writers.get(layer.layer_name)  # made by fused_ops first

    def fused_ops(self, layers, max_num_seqs, num_spec_tokens, max_rows
                  ) -> tuple[None, None, None]:
        num_blocks, _, block_size, _ = layers[0].kv_cache.shape
        self.scratch = CpuScratch(num_blocks, block_size, max_num_seqs, num_spec_tokens)
        self._writers = {layer.layer_name: _cache_writer(layer) for layer in layers}
        return None, None, None  # the interceptor's generic stage and commit: vLLM's write

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = window  # CPUAttentionBackendImpl keeps vLLM's per-layer value


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        binding = staged_binding(layer, attn_metadata)
        if binding is not None:
            interceptor = binding.interceptor
            scratch, write = binding.backend_state
            try:
                attn_metadata = scratch.through_scratch(
                    write, kv_cache, interceptor.buffer.chunk(binding.layer_idx), attn_metadata,
                    interceptor.step)
            except Exception:
                logger.exception("NWOR: verify attention through scratch blocks failed; "
                                 "vLLM writes the step")
                interceptor.discard(FallbackReason.STAGE_ERROR)  # every staged draft written
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        CPUAttentionBackendImpl,
        "do_kv_cache_update",
        wrap_kv_cache_update,
        why="Route a bound target layer's KV write through the interceptor during a verify "
        "step: drafts staged, other rows written by vLLM. Draft-model layers are unbound and "
        "untouched.",
    ),
    Patch(
        CPUAttentionBackendImpl,
        "forward",
        _wrap_forward,
        why="In a staged verify step: vLLM's own attention over a block table in which each "
        "drafting request's last blocks are scratch blocks holding its committed tokens and "
        "the step's chunk.",
    ),
]
