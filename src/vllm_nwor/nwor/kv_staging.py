"""Where a verify step's draft K/V wait for the verdict.

- :class:`StagingBuffer`: the drafts' K/V for every target layer, with the one slot mapping all
  layers commit through.
- :data:`StageFn`, :data:`CommitFn`, :data:`WriteBackFn`: a backend's fused stage, commit and
  write-back, which may keep the drafts elsewhere; :class:`ScratchStaging` keeps them in scratch
  KV blocks (FLASH_ATTN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from vllm_nwor.nwor.kernels.commit_kv import (
    CommitKV,
    Verdict,
    Write,
    cache_offsets,
    check_caches,
    copy_rows_reference,
)
from vllm_nwor.nwor.kernels.scratch import plan_scratch, scratch_base
from vllm_nwor.nwor.verify_step import StagingOverflow

PAD_SLOT_ID = -1
"""A slot of -1 means "do not write" (vLLM's ``PAD_SLOT_ID``)."""

CommitFn = Callable[["StagingBuffer", Verdict], None]
"""Writes the staged tokens the verdict accepted, of every layer, and adds their count to
``verdict.committed``. If it raises, it has counted nothing: the interceptor then commits
through vLLM's write path (which rewrites any layer already written with the same bytes)."""

StageFn = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "StagingBuffer"], None
]
"""A backend's fused stage: ``(layer_idx, key, value, slot_mapping, row_stage_index, buffer)``.

Keeps the drafts (rows ``r`` with ``row_stage_index[r] >= 0``) of ``key``/``value``, and may
keep the other rows of their requests, out of the blocks the scheduler gave those requests
until the commit, and writes the rows it does not keep through ``slot_mapping`` exactly as
vLLM's own write would. A row whose slot is -1 (padding) is neither kept nor written. Where it
keeps them is the backend's: the drafts in ``buffer`` (``buffer.key[layer_idx]``,
``buffer.value[layer_idx]`` and ``buffer.slot_mapping``, at their index), or anywhere, with a
:data:`WriteBackFn` (FLASH_ATTN: :class:`ScratchStaging`).
"""

WriteBackFn = Callable[[Sequence[int], int, "Verdict | None"], None]
"""For a fused stage that keeps drafts outside the staging buffer: ``(layers, num_rows,
verdict)`` writes, through vLLM's write path, what the stage kept out of the cache for
``layers`` in the step's ``num_rows`` rows: the rows the verdict accepted (counting the accepted
drafts into ``verdict.committed``), or without a verdict every row, as vLLM would have written
them. Every fallback goes through it."""


class StagingBuffer:
    """K/V of one verify step's draft tokens for every target layer, plus one slot mapping.

    Slots are per token, not per layer: every layer commits through the same ``slot_mapping``.
    Tokens are addressed explicitly (``start`` index), so layers may stage in any order and
    staging the same tokens twice overwrites them. Which (layer, token) pairs hold data is
    tracked on the host, so checking it costs no device sync.
    """

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        holds_kv: bool = True,
    ) -> None:
        if num_layers < 1 or max_tokens < 1:
            raise ValueError(
                f"StagingBuffer needs num_layers >= 1 and max_tokens >= 1, "
                f"got num_layers={num_layers}, max_tokens={max_tokens}"
            )
        # holds_kv=False: a fused stage keeps the drafts elsewhere (WriteBackFn); the buffer
        # then only tracks the step (its K/V take no memory).
        shape = (num_layers, max_tokens, num_kv_heads, head_size) if holds_kv else \
            (num_layers, max_tokens, 0, 0)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self._staged = np.zeros((num_layers, max_tokens), dtype=bool)  # by stage()
        self._dirty = False  # whether stage() stored a token since the last reset
        self._complete = [False] * num_layers  # by mark_staged(): a list, cheap per layer
        self.num_tokens = 0

    @property
    def num_layers(self) -> int:
        return self.key.shape[0]

    @property
    def max_tokens(self) -> int:
        return self.key.shape[1]

    def reset(self, num_tokens: int) -> None:
        """Starts a verify step of ``num_tokens`` tokens. Called once per step, never per layer."""
        if not 0 <= num_tokens <= self.max_tokens:
            raise StagingOverflow(
                f"{num_tokens} draft tokens do not fit a staging buffer of {self.max_tokens}"
            )
        if self._dirty:  # a fused stage (mark_staged) never sets _staged
            self._staged[:] = False
            self._dirty = False
        self._complete = [False] * self.num_layers
        self.num_tokens = num_tokens

    def set_slots(self, slot_mapping: torch.Tensor) -> None:
        """Records the step's slots (one per staged token, shared by all layers)."""
        if slot_mapping.shape != (self.num_tokens,):
            raise ValueError(
                f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({self.num_tokens},)"
            )
        self.slot_mapping[: self.num_tokens].copy_(slot_mapping)

    def stage(self, layer_idx: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores tokens ``[start, start + len(key))`` of layer ``layer_idx``."""
        n = key.shape[0]
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} is outside [0, {self.num_layers})")
        if start < 0 or start + n > self.num_tokens:
            raise IndexError(
                f"tokens [{start}, {start + n}) are outside the step's [0, {self.num_tokens})"
            )
        if key.shape != value.shape or key.shape[1:] != self.key.shape[2:]:
            raise ValueError(
                f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the staged "
                f"[tokens, heads, head_size] = [n, {self.key.shape[2]}, {self.key.shape[3]}]"
            )
        self.key[layer_idx, start : start + n].copy_(key)
        self.value[layer_idx, start : start + n].copy_(value)
        self._staged[layer_idx, start : start + n] = True
        self._dirty = self._dirty or n > 0

    def mark_staged(self, layer_idx: int) -> None:
        """Records that a fused stage filled every token of ``layer_idx`` (see ``StageFn``)."""
        self._complete[layer_idx] = True

    def is_staged(self, layer_idx: int) -> bool:
        """Whether every token of the step is staged for ``layer_idx``."""
        return self._complete[layer_idx] or bool(self._staged[layer_idx, : self.num_tokens].all())

    def is_complete(self) -> bool:
        """Whether every token of the step is staged for every layer."""
        if all(self._complete):
            return True
        return bool(self._filled().all()) if self._dirty else self.num_tokens == 0

    def holds_data(self) -> bool:
        """Whether any layer holds a staged token of the step (no array work)."""
        return self.num_tokens > 0 and (self._dirty or any(self._complete))

    def layers_with_data(self) -> list[int]:
        """Layers holding at least one staged token of the step."""
        return np.flatnonzero(self._filled().any(axis=1)).tolist()

    def _filled(self) -> np.ndarray:
        """``[layers, num_tokens]``: which staged tokens hold data."""
        complete = np.array(self._complete)[:, None]
        return self._staged[:, : self.num_tokens] | complete & (self.num_tokens > 0)

    def staged_slots(self, layer_idx: int) -> torch.Tensor:
        """The step's slot mapping with the tokens ``layer_idx`` has not staged set to -1."""
        n = self.num_tokens
        if self.is_staged(layer_idx):
            return self.slot_mapping[:n]
        mask = torch.from_numpy(self._staged[layer_idx, :n].copy()).to(self.slot_mapping.device)
        return torch.where(mask, self.slot_mapping[:n], PAD_SLOT_ID)

    def chunk(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged K/V of ``layer_idx``: ``[num_tokens, num_kv_heads, head_size]`` each."""
        n = self.num_tokens
        return self.key[layer_idx, :n], self.value[layer_idx, :n]


StepMetadata = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""The step's ``(block_table, query_start_loc, seq_lens)`` on the device, as the backend's
attention metadata holds them."""


class ScratchStaging:
    """A fused stage, commit and write-back through scratch blocks (:mod:`vllm_nwor.nwor.kernels.
    scratch`), for caches laid out ``[blocks, block_size, heads, head_size]`` per layer.

    - ``stage``: in the first layer, one launch plans the step; in every layer, ``write``
      (vLLM's own KV write) through the plan's ``write_slots``, which send each drafting
      request's rows to its scratch blocks. Nothing is staged in the :class:`StagingBuffer`.
    - ``commit``: one launch copies every layer's accepted rows to their own slots.
    - ``write_back``: ``write`` again, of the rows read back from the scratch blocks (every
      fallback).

    The plan's table and slots are allocated once (the table when the first staged call shows
    the block table's width), so CUDA graphs read them at fixed addresses. ``write(layer_idx,
    key, value, slots)`` must skip slot -1, as vLLM's write does.
    """

    def __init__(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                 write: Write, metadata: StepMetadata, max_num_seqs: int, num_spec_tokens: int,
                 max_rows: int) -> None:
        check_caches(key_caches, value_caches)
        num_blocks, block_size = key_caches[0].shape[:2]
        self.per_request, self.base = scratch_base(num_blocks, max_num_seqs, num_spec_tokens,
                                                   block_size)
        self.key_caches, self.value_caches = key_caches, value_caches
        self.offsets = cache_offsets(key_caches, value_caches)
        self._commit = CommitKV(key_caches, value_caches, self.offsets, checked=False)
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # commit's slots by rows
        self.write, self.step_metadata = write, metadata
        self.max_num_seqs = max_num_seqs
        device = key_caches[0].device
        self.write_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.commit_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.table = torch.zeros((max_num_seqs, 0), dtype=torch.int32, device=device)
        self.slots = self.write_slots[:0]  # the planned step's write slots, one per row
        self.planned_for: torch.Tensor | None = None  # that step's slot mapping
        # Compiles the commit before any step: one row with nowhere to go (nothing written).
        none = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._commit(none, none, Verdict(none.view(1, 1), none, none, none[0].clone(), none),
                     checked=False)

    def ops(self) -> tuple[StageFn, CommitFn, WriteBackFn]:
        return self.stage, self.commit, self.write_back

    def plan(self, row_stage_index: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Plans this step's scratch blocks (one launch)."""
        block_table, qsl, seq_lens = self.step_metadata()
        width = block_table.shape[1]
        if self.table.shape[1] == 0:  # the block table keeps its width: allocated once
            self.table = torch.zeros((self.max_num_seqs, width), dtype=torch.int32,
                                     device=self.write_slots.device)
        elif self.table.shape[1] != width:  # captured graphs read this table: never moved
            raise ValueError(f"the block table is {width} blocks wide, the scratch table "
                             f"{self.table.shape[1]}")
        self.planned_for = None
        plan_scratch(block_table, qsl, seq_lens, row_stage_index, slot_mapping, self.table,
                     self.write_slots, self.commit_slots, self.key_caches, self.value_caches,
                     self.offsets, self.base, self.per_request)
        self.slots = self.write_slots[: slot_mapping.shape[0]]
        self.planned_for = slot_mapping

    def stage(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, row_stage_index: torch.Tensor,
              buffer: StagingBuffer) -> None:
        if layer_idx == 0:
            self.plan(row_stage_index, slot_mapping)
        elif slot_mapping is not self.planned_for:
            raise ValueError(f"layer {layer_idx} stages a step the first layer did not plan")
        self.write(layer_idx, key, value, self.slots)

    def commit(self, buffer: StagingBuffer, verdict: Verdict) -> None:
        n = verdict.row_stage_index.shape[0]  # the step's rows (a graph pads past them)
        rows = self._rows.get(n)
        if rows is None:  # views made once per row count: decode batches repeat theirs
            rows = self._rows[n] = (self.write_slots[:n], self.commit_slots[:n])
        self._commit(*rows, verdict, checked=False)

    def write_back(self, layers: Sequence[int], num_rows: int, verdict: Verdict | None) -> None:
        dst = self.commit_slots[:num_rows]
        if verdict is not None:
            dst = verdict.keep_rows(dst)
        copy_rows_reference(self.key_caches, self.value_caches, self.write_slots[:num_rows],
                            dst, layers, self.write)
        if verdict is not None:
            verdict.count()
