"""The staging core of NWOR (No-Write-On-Reject). Pure torch: nothing here imports vLLM.

Terms used throughout the package:

verify step
    One forward of the target model in which at least one request carries draft tokens.
draft row
    A row of the step's flattened token batch that holds a draft token. As in vLLM, the drafts
    of request ``i`` are its last ``num_draft_tokens[i]`` scheduled tokens; the rows before them
    (the request's last sampled token, or prompt tokens) are not drafts.
staged
    A draft row whose K/V sits in the :class:`StagingBuffer` instead of the paged KV cache.
chunk
    One request's rows in one verify step: its last sampled token and its drafts (or a prompt
    chunk, for a request without drafts). Verify attention sees the chunk from the layer's own
    key/value inputs, so staged drafts are visible without being in the cache.
committed
    A staged token whose draft rejection sampling accepted. Its K/V is written to the paged KV
    cache for every layer, through the one slot mapping all layers share.
rejected
    A staged token whose draft was rejected. Its K/V never reaches the paged KV cache.
fallback
    The step takes vLLM's plain write path for every token that must be in the cache. Counted by
    :class:`FallbackReason`. A fallback never loses an accepted token's K/V.

The :class:`NworInterceptor` decides *once per verify step, for all layers at once*, whether the
step is staged. Its lifecycle is::

    begin(step) -> stage(layer) for every target layer -> commit(sampled) | discard(reason)

FULL CUDA graphs (a backend with a fused stage): while vLLM captures its graphs, a layer called
with more than one token per request takes the staged path with no step begun
(:meth:`NworInterceptor.stage_for_graph`). The captured stage reads which rows to stage from a
device buffer at a fixed address (:meth:`IndexUploader.rows`), which every step fills before the
graph replays: the step's own indices when it is staged, -1 (write every row) when it is not.
Replaying such a graph runs no Python in the layers, so a step begun and committed with no layer
seen staging is a graph replay, and the graph staged every layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

from vllm_nwor._logging import get_logger
from vllm_nwor.config import NworConfigError
from vllm_nwor.nwor.counters import FallbackReason, NworCounters
from vllm_nwor.nwor.kernels.commit_kv import (
    CommitKV,
    Verdict,
    Write,
    cache_offsets,
    check_caches,
    copy_rows_reference,
)
from vllm_nwor.nwor.kernels.scratch import plan_scratch, scratch_blocks
from vllm_nwor.nwor.verify_step import IndexUploader, StagingOverflow, VerifyStep

logger = get_logger(__name__)

PAD_SLOT_ID = -1
"""A slot of -1 means "do not write" (vLLM's ``PAD_SLOT_ID``)."""

PlainWrite = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""vLLM's own KV write for one target layer: ``(layer_idx, key, value, slot_mapping)``."""

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


def _real(tensor: torch.Tensor) -> bool:
    """Not a fake or meta tensor (tracing, compile). A plain ``torch.Tensor`` is checked first:
    that is every call of a step that runs."""
    if type(tensor) is torch.Tensor:
        return not tensor.is_meta
    return not (is_fake(tensor) or tensor.is_meta)


class _Fallback(Exception):
    def __init__(self, reason: FallbackReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class NworInterceptor:
    """Routes the target model's KV writes during verify steps: stage, then commit or fall back.

    Args:
        buffer: where draft K/V wait for the verdict.
        plain_write: vLLM's own write path for one layer. Every fallback goes through it.
        commit_fn: writes all layers' accepted tokens at once. Defaults to ``plain_write`` for
            each layer in turn. If it raises, the commit is redone with ``plain_write``.
        stage_fn: a backend's fused stage (one launch per layer). Defaults to gathering the
            draft rows into the buffer and writing the rest with ``plain_write``.
        kv_bytes_per_token: bytes one token's K and V take in the paged cache, all target layers.
        uploader: carries each step's indices to the device (see :class:`IndexUploader`).
        write_back: how fallbacks write what a fused stage kept outside ``buffer``. Defaults to
            ``plain_write`` from the buffer.
    """

    def __init__(
        self,
        buffer: StagingBuffer,
        plain_write: PlainWrite,
        commit_fn: CommitFn | None = None,
        stage_fn: StageFn | None = None,
        *,
        kv_bytes_per_token: int,
        uploader: IndexUploader | None = None,
        write_back: WriteBackFn | None = None,
    ) -> None:
        self.buffer = buffer
        self.write_back = write_back
        self.uploader = uploader
        self.plain_write = plain_write
        self.commit_fn = commit_fn or self._commit_with_plain_writes
        self.stage_fn = stage_fn
        self.kv_bytes_per_token = kv_bytes_per_token
        self._step: VerifyStep | None = None
        self._failed = False
        self._slot_source: torch.Tensor | None = None
        self._direct_slots: torch.Tensor | None = None
        self._steps = 0
        self._tokens_staged = 0
        self._committed = torch.zeros((), dtype=torch.int64, device=buffer.key.device)
        self._fallbacks: Counter[str] = Counter()
        self.capturing = False  # set by the runner while vLLM captures its CUDA graphs
        self.graph_staging = False  # a captured CUDA graph holds the staged path
        self.graph_steps = 0  # staged steps that replayed such a graph

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def step(self) -> VerifyStep | None:
        """The verify step being staged, if any."""
        return self._step

    @property
    def active(self) -> bool:
        return self._step is not None

    def begin(self, step: VerifyStep | None) -> bool:
        """Decides, once for all layers, whether this step is staged. ``None``: no drafts."""
        if self._step is not None:
            self.discard(FallbackReason.NO_COMMIT)
        if step is None:
            return False
        if step.num_tokens > self.buffer.max_tokens:
            self._fallbacks[FallbackReason.OVERFLOW.value] += 1
            return False
        self.buffer.reset(step.num_tokens)
        self._step = step
        self._failed = False
        self._slot_source = None
        self._direct_slots = None
        return True

    def begin_batch(self, num_draft_tokens: Sequence[int] | None,
                    query_start_loc: Sequence[int] | np.ndarray,
                    device: torch.device | str) -> bool:
        """Builds the step from the batch's draft counts and query start locations (host; None:
        no drafts) and begins it. A step that cannot be built is not staged: every row takes
        vLLM's write (``stage_error``), as after any staging error."""
        step = None
        if num_draft_tokens is not None:
            try:
                step = VerifyStep.from_batch(num_draft_tokens, query_start_loc, device,
                                             self.uploader)
            except Exception:
                logger.exception("NWOR: building the verify step failed; vLLM writes it")
                self.begin(None)
                self._fallbacks[FallbackReason.STAGE_ERROR.value] += 1
                return False
        return self.begin(step)

    def stage(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Takes layer ``layer_idx``'s KV write: draft rows are staged, the rest written.

        Called in every layer of a verify step that runs outside CUDA graphs, so it does little
        on the host: no NVTX range (the commit has one) and one frame to the stage."""
        if self._step is None:
            raise RuntimeError("NworInterceptor.stage() called outside a verify step")
        if self._failed:
            self.plain_write(layer_idx, key, value, slot_mapping)
            return
        try:
            self._stage(layer_idx, key, value, slot_mapping)
        except _Fallback as fallback:
            reason = fallback.reason
        except Exception:
            logger.exception("NWOR: staging layer %d failed; falling back", layer_idx)
            reason = FallbackReason.STAGE_ERROR
        else:
            return
        self._fall_back(reason)
        self.plain_write(layer_idx, key, value, slot_mapping)

    def is_staged(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s drafts are staged, so its attention must not read
        this step's rows from the cache. False outside a step and after a fallback."""
        return self._step is not None and not self._failed and self.buffer.is_staged(layer_idx)

    def commit(self, sampled_token_ids: torch.Tensor) -> None:
        """Writes the accepted staged tokens of every layer; rejected ones are dropped.

        ``sampled_token_ids`` is the rejection sampler's output, ``[num_reqs, max_spec_len +
        1]`` with rejected positions ``-1`` (see :meth:`VerifyStep.verdict`); the verdict is
        read from it on the device. It opens no NVTX range: the range and its frame cost
        host time in every step. Nsight shows the commit as its
        kernel, ``_commit_kv_kernel``.
        """
        step, self._step = self._step, None
        if step is None or self._failed:
            return
        buffer = self.buffer
        if not buffer.is_complete():
            if not self._replayed_graph():
                self._fallbacks[FallbackReason.INCOMPLETE.value] += 1
                self._write_all_staged(step)
                return
            self.graph_steps += 1  # the commit reads every layer's buffer, marked or not
        verdict = step.verdict(sampled_token_ids, self._committed)
        try:
            self.commit_fn(buffer, verdict)
        except Exception:
            logger.exception("NWOR: commit failed; committing through vLLM's write path")
            self._fallbacks[FallbackReason.COMMIT_ERROR.value] += 1
            # If vLLM's own write fails too, the error propagates: the engine stops rather than
            # run on a cache that lacks accepted tokens.
            self._commit_with_plain_writes(buffer, verdict)
        self._steps += 1
        self._tokens_staged += buffer.num_tokens

    def discard(self, reason: FallbackReason) -> None:
        """Ends the step without a verdict. Staged drafts are written as vLLM would write them.

        Without a verdict the rejected share is unknown, so every staged token is written:
        nothing that may be accepted is lost.
        """
        if self._step is None:
            return
        self._fallbacks[reason.value] += 1
        if not self._failed:
            self._write_all_staged(self._step)
        self._step = None

    # -- FULL CUDA graphs (see the module docstring) -------------------------------------------

    def stages_in_graph(self, max_query_len: int) -> bool:
        """Whether a layer call during graph capture (or its warm-up) takes the staged path: a
        batch of more than one token per request, which a verify step may replay."""
        return (self.capturing and self._step is None and self.stage_fn is not None
                and self.uploader is not None and max_query_len > 1)

    def stage_for_graph(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The fused stage as a graph captures it, reading the rows to stage at replay time.

        In warm-ups and capture vLLM's slot mapping is all -1, so nothing is written here."""
        assert self.stage_fn is not None and self.uploader is not None  # stages_in_graph
        rows = self.uploader.rows(slot_mapping.shape[0])
        self.stage_fn(layer_idx, key, value, slot_mapping, rows, self.buffer)
        if key.is_cuda and torch.cuda.is_current_stream_capturing():
            self.graph_staging = True

    def unstage_rows(self, num_rows: int) -> None:
        """Makes a step that is not staged write all of its ``num_rows`` rows, should it replay a
        graph captured with the staged path."""
        if self.graph_staging and self.uploader is not None and num_rows > 0:
            self.uploader.rows(num_rows).fill_(-1)

    # -- counters ----------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Zeroes the counters (after vLLM's start-up warm-up steps, which no scheduler saw)."""
        self._steps = self._tokens_staged = self.graph_steps = 0
        self._committed.zero_()
        self._fallbacks.clear()

    def counters(self) -> NworCounters:
        """A snapshot (reads one device scalar)."""
        committed = int(self._committed.item())
        rejected = self._tokens_staged - committed
        return NworCounters(
            verify_steps_staged=self._steps,
            tokens_staged=self._tokens_staged,
            tokens_committed=committed,
            tokens_rejected=rejected,
            kv_bytes_not_written=rejected * self.kv_bytes_per_token,
            fallbacks=dict(self._fallbacks),
        )

    # -- internals ---------------------------------------------------------------------------

    def _stage(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Stages the layer's draft rows and writes the rest, or raises ``_Fallback``."""
        if not (_real(key) and _real(value) and _real(slot_mapping)):
            raise _Fallback(FallbackReason.FAKE_TENSOR)
        step = self._step
        assert step is not None
        if self._slot_source is None:
            self._slot_source = slot_mapping  # first layer: the slot mapping all layers share
        elif slot_mapping is not self._slot_source:
            raise _Fallback(FallbackReason.SLOT_MAPPING)
        if self.stage_fn is not None:
            self.stage_fn(layer_idx, key, value, slot_mapping, step.row_stage_index, self.buffer)
            self.buffer.mark_staged(layer_idx)
            return
        rows = step.draft_rows
        if self._direct_slots is None:
            direct = slot_mapping.clone()
            direct[rows] = PAD_SLOT_ID
            self.buffer.set_slots(slot_mapping[rows])
            self._direct_slots = direct
        self.buffer.stage(layer_idx, 0, key[rows], value[rows])
        self.plain_write(layer_idx, key, value, self._direct_slots)

    def _fall_back(self, reason: FallbackReason) -> None:
        """All-or-nothing: every layer staged so far gets vLLM's write of all its drafts now."""
        logger.debug("NWOR: verify step falls back (%s)", reason.value)
        self._fallbacks[reason.value] += 1
        assert self._step is not None  # stage() checked it
        self._write_all_staged(self._step)
        self._failed = True

    def _replayed_graph(self) -> bool:
        """Whether the step replayed a FULL graph captured with the staged path: no layer ran
        Python, and such a graph stages every layer."""
        return self.graph_staging and not self.buffer.holds_data()

    def _write_all_staged(self, step: VerifyStep) -> None:
        buffer = self.buffer
        if self.write_back is not None:
            # A replayed graph staged every layer. (A step is begun in the same execute_model
            # call as its forward, so after a replayed graph the plan written back is the
            # step's own.)
            layers = (range(buffer.num_layers) if self._replayed_graph()
                      else buffer.layers_with_data())
            self.write_back(layers, step.row_stage_index.shape[0], None)
            return
        for layer_idx in buffer.layers_with_data():
            key, value = buffer.chunk(layer_idx)
            self.plain_write(layer_idx, key, value, buffer.staged_slots(layer_idx))

    def _commit_with_plain_writes(self, buffer: StagingBuffer, verdict: Verdict) -> None:
        if self.write_back is not None:
            self.write_back(range(buffer.num_layers), verdict.row_stage_index.shape[0], verdict)
            return
        slots = verdict.keep(buffer.slot_mapping[: buffer.num_tokens])
        for layer_idx in range(buffer.num_layers):
            key, value = buffer.chunk(layer_idx)
            self.plain_write(layer_idx, key, value, slots)
        verdict.count()  # after the writes: a commit redone after an error counts once


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
        self.per_request, total = scratch_blocks(max_num_seqs, num_spec_tokens, block_size)
        if total >= num_blocks:
            raise NworConfigError(
                f"'nwor': true needs {total} scratch KV blocks (max_num_seqs={max_num_seqs}, "
                f"num_speculative_tokens={num_spec_tokens}, block_size={block_size}); the cache "
                f"has {num_blocks}")
        self.base = num_blocks - total  # the engine core kept these from the scheduler
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
