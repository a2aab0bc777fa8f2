"""Where a verify step's draft K/V wait for the verdict.

- :data:`StageFn`, :data:`CommitFn`, :data:`WriteBackFn`: a backend's fused stage, commit and
  write-back, which keep the drafts out of the requests' blocks; :class:`ScratchStaging` keeps
  them in scratch KV blocks (FLASH_ATTN), ``CpuScratch`` likewise on the CPU
  (``patches/nwor/cpu_attn.py``).
- :class:`StagedLayers`: which target layers have staged the step in progress.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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

CommitFn = Callable[[Verdict], None]
"""Writes the staged tokens the verdict accepted, of every layer, and adds their count to
``verdict.committed``. If it raises, it has counted nothing: the interceptor then commits
through the :data:`WriteBackFn` (which rewrites any row already written with the same bytes)."""

StageFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""A backend's fused stage: ``(layer_idx, key, value, slot_mapping, row_stage_index)``.

Keeps the drafts (rows ``r`` with ``row_stage_index[r] >= 0``) of ``key``/``value``, and may
keep the other rows of their requests, out of the blocks the scheduler gave those requests
until the commit, and writes the rows it does not keep through ``slot_mapping`` exactly as
vLLM's own write would. A row whose slot is -1 (padding) is neither kept nor written.
"""

WriteBackFn = Callable[[Sequence[int], int, "Verdict | None"], None]
"""``(layers, num_rows, verdict)`` writes, through vLLM's write path, what the stage kept out
of the cache for ``layers`` in the step's ``num_rows`` rows: the rows the verdict accepted
(counting the accepted drafts into ``verdict.committed``), or without a verdict every row, as
vLLM would have written them. Every fallback goes through it."""


class StagedLayers:
    """Which target layers have staged the verify step in progress, on the host (checking it
    costs no device sync), and the most draft tokens a step may stage."""

    def __init__(self, num_layers: int, max_tokens: int) -> None:
        if num_layers < 1 or max_tokens < 1:
            raise ValueError(
                f"StagedLayers needs num_layers >= 1 and max_tokens >= 1, "
                f"got num_layers={num_layers}, max_tokens={max_tokens}"
            )
        self.num_layers, self.max_tokens = num_layers, max_tokens
        self._staged = [False] * num_layers  # a list: cheap per layer
        self.num_tokens = 0

    def reset(self, num_tokens: int) -> None:
        """Starts a verify step of ``num_tokens`` draft tokens. Once per step, never per layer."""
        if not 0 <= num_tokens <= self.max_tokens:
            raise StagingOverflow(
                f"{num_tokens} draft tokens exceed the {self.max_tokens} a step may stage"
            )
        self._staged = [False] * self.num_layers
        self.num_tokens = num_tokens

    def mark_staged(self, layer_idx: int) -> None:
        """Records that the stage took every row of ``layer_idx`` (see :data:`StageFn`)."""
        self._staged[layer_idx] = True

    def is_staged(self, layer_idx: int) -> bool:
        return self._staged[layer_idx]

    def is_complete(self) -> bool:
        """Whether every layer staged the step (a step without drafts trivially)."""
        return self.num_tokens == 0 or all(self._staged)

    def holds_data(self) -> bool:
        """Whether any layer staged a draft token of the step."""
        return self.num_tokens > 0 and any(self._staged)

    def layers_with_data(self) -> list[int]:
        """The layers that staged the step's draft tokens."""
        if self.num_tokens == 0:
            return []
        return [layer for layer, staged in enumerate(self._staged) if staged]


StepMetadata = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""The step's ``(block_table, query_start_loc, seq_lens)`` on the device, as the backend's
attention metadata holds them."""


class ScratchStaging:
    """A fused stage, commit and write-back through scratch blocks (:mod:`vllm_nwor.nwor.kernels.
    scratch`), for caches laid out ``[blocks, block_size, heads, head_size]`` per layer.

    - ``stage``: in the first layer, one launch plans the step; in every layer, ``write``
      (vLLM's own KV write) through the plan's ``write_slots``, which send each drafting
      request's rows to its scratch blocks.
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
              slot_mapping: torch.Tensor, row_stage_index: torch.Tensor) -> None:
        if layer_idx == 0:
            self.plan(row_stage_index, slot_mapping)
        elif slot_mapping is not self.planned_for:
            raise ValueError(f"layer {layer_idx} stages a step the first layer did not plan")
        self.write(layer_idx, key, value, self.slots)

    def commit(self, verdict: Verdict) -> None:
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
