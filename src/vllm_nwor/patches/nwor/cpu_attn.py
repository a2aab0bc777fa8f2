"""CPU_ATTN patches: vLLM's own KV write and attention through scratch blocks in a verify step.

vLLM 0.32's CPU backend writes a decoder layer's KV in ``do_kv_cache_update`` only (its
``forward`` writes for encoder attention alone). The scratch span and the slots are those of
FLASH_ATTN (:mod:`vllm_nwor.nwor.kernels.scratch`); what differs is that the CPU kernels' block
layout depends on the ISA, so blocks and rows are moved only by vLLM's own write or whole. In a
staged verify step:

- ``do_kv_cache_update``, in the first layer: the plan, on the host, and a whole-block copy of
  the first block of each drafting request's span (its blocks from the one holding its first
  draft onward) to its scratch block (blocks the engine core keeps from the scheduler), for all
  layers at once, so the scratch block holds the committed tokens that share it;
- ``do_kv_cache_update``, per layer: the rows in the spans (drafts, and a last sampled token
  that shares a span's first block) are copied out of the layer's K/V for the commit; then
  vLLM's write of every row, through ``write_slots``, which send the spans' rows to the scratch
  blocks;
- ``forward``, per layer: vLLM's own attention kernel over a copy of the block table in which
  each span's blocks are its scratch blocks. It reads the same K/V at the same positions as
  without NWOR; no draft reaches a block the scheduler gave a request.

After rejection sampling the commit writes each layer's accepted kept rows (copied aside) to
their own slots with vLLM's write; every fallback writes all of them.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import vllm.v1.attention.backends.cpu_attn as cpu_attn_backend
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_nwor._logging import get_logger
from vllm_nwor.config import NworConfigError
from vllm_nwor.nwor.counters import FallbackReason
from vllm_nwor.nwor.kernels.commit_kv import PLACEHOLDER_TOKEN_ID, Verdict
from vllm_nwor.nwor.kernels.scratch import scratch_base
from vllm_nwor.nwor.kv_staging import CommitFn, StageFn, WriteBackFn
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


def _all_layers(caches: list[torch.Tensor]) -> torch.Tensor:
    """The layers' caches as one ``[layers, blocks, ...]`` view: vLLM places a cache group's
    layers in one allocation, at one stride apart (``vllm.v1.worker.utils.allocate_kv_cache``),
    so one copy moves a block in every layer."""
    first = caches[0]
    gaps = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(caches)} or {0}
    gap = gaps.pop()
    if (gaps or gap < 0 or gap % first.element_size()
            or any(c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                   or c.shape != first.shape or c.stride() != first.stride() for c in caches)):
        raise NworConfigError("'nwor': true on CPU_ATTN needs the target layers' KV caches "
                              "in one allocation, equally spaced (as vLLM allocates them)")
    return first.as_strided((len(caches), *first.shape),
                            (gap // first.element_size(), *first.stride()))


def _index(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))  # faster than torch.tensor


class CpuScratch:
    """One engine's scratch blocks on the CPU: the fused stage, commit and write-back
    (:data:`~vllm_nwor.nwor.kv_staging.StageFn` and its kin) and the step's block table. The
    step's plan is host arrays, made in the first layer (the CPU has no graphs to replay)."""

    def __init__(self, layers: list, writers: list, max_num_seqs: int,
                 num_spec_tokens: int) -> None:
        num_blocks, _, block_size, _ = layers[0].kv_cache.shape
        self.per_request, self.base = scratch_base(num_blocks, max_num_seqs, num_spec_tokens,
                                                   block_size)
        self.block_size = block_size
        self.first_layer = layers[0].layer_name  # whose forward-context metadata the plan reads
        self.num_layers = len(layers)
        self.caches = _all_layers([layer.kv_cache for layer in layers])
        self.writers = writers
        # each layer's K and V of the step's kept rows, [rows, heads, head_size]
        self.kept: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layers)
        self.planned_for: torch.Tensor | None = None  # the planned step's slot mapping
        self._for: Any = None  # the attention metadata the plan was made from
        self._metadata: Any = None  # it, with the scratch table as its block table
        empty = torch.empty(0, dtype=torch.int64)
        self._rows = self.write_slots = empty
        # each kept row's own slot, request and verdict column (0: not a draft)
        self._kept_at: tuple[list[int], list[int], list[int]] = ([], [], [])

    def ops(self) -> tuple[StageFn, CommitFn, WriteBackFn]:
        return self.stage, self.commit, self.write_back

    def plan(self, slot_mapping: torch.Tensor, row_stage_index: torch.Tensor) -> None:
        """The step's block copies, kept rows, slots and block table. A loop over the batch's
        requests in Python lists: on a few dozen rows, each numpy or torch op costs more host
        time than the work."""
        self.planned_for = None
        metadata = get_forward_context().attn_metadata
        md = metadata.get(self.first_layer) if isinstance(metadata, dict) else None
        if md is None:
            raise ValueError("no attention metadata for the first target layer")
        bs, per = self.block_size, self.per_request
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        stage_index, slots = row_stage_index.tolist(), slot_mapping.tolist()
        table = md.block_table.numpy().copy()
        write_slots = slot_mapping.numpy().copy()
        src, dst, rows, kept_slots, kept_req, kept_draft = [], [], [], [], [], []
        for req in range(len(qsl) - 1):
            start, end = qsl[req], qsl[req + 1]
            drafts = sum(1 for i in stage_index[start:end] if i >= 0)  # its last rows
            if not drafts:
                continue
            seq, q = seq_lens[req], end - start
            lo, hi = (seq - drafts) // bs, (seq - 1) // bs  # its first draft's block, last's
            if hi - lo >= per:
                raise ValueError(f"request {req}'s drafts span {hi - lo + 1} blocks, more "
                                 f"than its {per} scratch blocks")
            first = self.base + req * per
            src.append(int(table[req, lo]))  # its later span blocks hold only this step's rows
            dst.append(first)
            table[req, lo:hi + 1] = range(first, first + hi - lo + 1)
            p0 = seq - q  # its first row's position
            for offset in range(max(lo * bs - p0, 0), q):  # its rows in the span
                row, pos = start + offset, p0 + offset
                if slots[row] < 0:
                    continue
                rows.append(row)
                write_slots[row] = (first + pos // bs - lo) * bs + pos % bs
                kept_slots.append(slots[row])
                kept_req.append(req)
                # a draft's column in the sampler's output that says it was accepted, else 0
                kept_draft.append(max(offset - (q - drafts) + 1, 0))
        for block, scratch in zip(src, dst, strict=True):  # a few: faster than index ops
            self.caches.select(1, scratch).copy_(self.caches.select(1, block))
        self._rows = _index(rows)
        self.write_slots = torch.from_numpy(write_slots)
        self._kept_at = (kept_slots, kept_req, kept_draft)
        self._metadata = copy.copy(md)  # as vLLM's update_block_table does
        self._metadata.block_table = torch.from_numpy(table)
        self._for = md
        self.planned_for = slot_mapping

    def stage(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, row_stage_index: torch.Tensor) -> None:
        if layer_idx == 0:
            self.plan(slot_mapping, row_stage_index)
        elif slot_mapping is not self.planned_for:
            raise ValueError(f"layer {layer_idx} stages a step the first layer did not plan")
        self.kept[layer_idx] = (key.index_select(0, self._rows),
                                value.index_select(0, self._rows))
        self.writers[layer_idx](key, value, self.write_slots)

    def metadata(self, attn_metadata):
        """The planned step's attention metadata with the scratch table as its block table."""
        if attn_metadata is not self._for:
            raise ValueError("a layer's attention metadata is not the one the step was planned "
                             "from")
        return self._metadata

    def commit(self, verdict: Verdict) -> None:
        self.write_back(range(self.num_layers), verdict.row_stage_index.shape[0], verdict)

    def write_back(self, layers: Sequence[int], num_rows: int, verdict: Verdict | None) -> None:
        """The kept rows of ``layers`` to their own slots with vLLM's write: those the verdict
        accepted (then counted into ``verdict.committed``), or all of them. The verdict is
        read on the host, as :meth:`Verdict.keep_rows` and :meth:`Verdict.count` define it."""
        kept_slots, kept_req, kept_draft = self._kept_at
        if verdict is not None:
            sampled = verdict.sampled_token_ids.tolist()
            kept_slots = [-1 if draft and sampled[req][draft] == PLACEHOLDER_TOKEN_ID else slot
                          for slot, req, draft in zip(kept_slots, kept_req, kept_draft,
                                                      strict=True)]
        slots = _index(kept_slots)
        for layer_idx in layers:
            self.writers[layer_idx](*self.kept[layer_idx], slots)
        if verdict is not None:
            verdict.committed.add_(sum(
                sampled[req][pos + 1] != PLACEHOLDER_TOKEN_ID
                for req, pos in zip(verdict.token_req.tolist(), verdict.token_pos.tolist(),
                                    strict=True)))


class CpuAttnBackend:
    name = "CPU_ATTN"

    def __init__(self) -> None:
        self.scratch: CpuScratch | None = None
        self._writers: dict[str, Any] = {}  # by layer name, made by fused_ops

    def handles(self, impl: Any) -> bool:
        return isinstance(impl, CPUAttentionBackendImpl)

    def check(self, layer) -> None:
        impl = layer.impl
        refuse_unsupported(
            self.name, layer,
            f"sliding_window={impl.sliding_window}" if impl.sliding_window != -1 else None,
        )

    def plain_write(self, layer, key, value, slot_mapping) -> None:
        self._writers[layer.layer_name](key, value, slot_mapping)

    def layer_state(self, layer) -> CpuScratch | None:
        return self.scratch  # made by fused_ops, which bind() calls first

    def fused_ops(self, layers, max_num_seqs, num_spec_tokens, max_rows
                  ) -> tuple[StageFn, CommitFn, WriteBackFn]:
        self._writers = {layer.layer_name: _cache_writer(layer) for layer in layers}
        self.scratch = CpuScratch(layers, [self._writers[layer.layer_name] for layer in layers],
                                  max_num_seqs, num_spec_tokens)
        return self.scratch.ops()

    def window_attention(self, impl, window: int) -> None:
        impl.sliding_window = window  # CPUAttentionBackendImpl keeps vLLM's per-layer value


def _wrap_forward(forward):
    def wrapper(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        binding = staged_binding(layer, attn_metadata)
        if binding is not None:
            try:
                attn_metadata = binding.backend_state.metadata(attn_metadata)
            except Exception:
                logger.exception("NWOR: verify attention through scratch blocks failed; "
                                 "vLLM writes the step")
                binding.interceptor.discard(FallbackReason.STAGE_ERROR)  # all kept rows written
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                       *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        CPUAttentionBackendImpl,
        "do_kv_cache_update",
        wrap_kv_cache_update,
        why="Route a bound target layer's KV write through the interceptor during a verify "
        "step (vLLM's own write, through slots that keep drafting requests' rows in scratch "
        "blocks until the commit). Draft-model layers are unbound and untouched.",
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
