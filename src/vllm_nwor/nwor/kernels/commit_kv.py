"""Commit: every layer's accepted rows, from the scratch blocks to their slots, in one launch.

In a staged verify step vLLM's own KV write puts every row of a drafting request in that
request's scratch blocks instead of its own (:mod:`.scratch`): the scratch blocks are the staging
area. After rejection sampling, row ``r`` with ``dst_slots[r] >= 0`` is copied, in every layer,
from the cache at slot ``src_slots[r]`` to the cache at slot ``dst_slots[r]`` (block ``slot //
block_size``, offset ``slot % block_size``): the bytes vLLM would have written there, since they
are the bytes vLLM's write put in the scratch block. A row that holds a draft (``row_stage_index[r]
>= 0``) is copied only if the draft was accepted; the request's other rows (its last sampled
token) always are. All layers share the slots; each copies within its own cache.

The kernel reads which drafts were accepted from the rejection sampler's output itself and
counts them, so a step's commit is this one launch (the verdict as separate tensor ops was six
more launches and their host work, on a host-bound step).

The kernel reaches the layers' separate cache tensors through element offsets from layer 0's
key cache, so one launch covers all layers; the caller checks once that every cache has the same
shape, strides and dtype (:func:`cache_offsets`, :func:`check_caches`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from vllm_nwor.nwor.kernels._common import (
    HAS_TRITON,
    Launcher,
    check,
    check_dtype,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)

PLACEHOLDER_TOKEN_ID = -1
"""Rejected positions in the rejection sampler's output (vLLM's ``PLACEHOLDER_TOKEN_ID``)."""


class Verdict(NamedTuple):
    """Which staged tokens were accepted, as the rejection sampler left it on the device.

    Staged token ``t`` is draft ``token_pos[t]`` of batch row ``token_req[t]``; it was accepted
    exactly when the sampler emitted a token after it: ``sampled_token_ids[token_req[t],
    token_pos[t] + 1] != -1``. ``row_stage_index[r]`` is the staged token in the step's row
    ``r``, or -1. ``committed`` (an int64 scalar) is increased by the number of accepted tokens.
    """

    sampled_token_ids: torch.Tensor
    token_req: torch.Tensor
    token_pos: torch.Tensor
    committed: torch.Tensor
    row_stage_index: torch.Tensor

    def accepted(self) -> torch.Tensor:
        """A bool per staged token (a few tensor ops; the kernel reads it inline)."""
        return self.sampled_token_ids[self.token_req, self.token_pos + 1] != PLACEHOLDER_TOKEN_ID

    def keep(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` (one per staged token) with the rejected tokens' set to -1, as tensor ops.
        Counts nothing: the caller calls :meth:`count` once the writes are done."""
        return torch.where(self.accepted(), slots, -1)

    def keep_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` (one per row of the step) with the rows of rejected drafts set to -1, as
        the kernel decides inline. Counts nothing (see :meth:`count`)."""
        n = slots.shape[0]
        index = self.row_stage_index[:n].long()
        staged = index >= 0
        accepted = self.accepted()
        rejected = staged & ~accepted[index.clamp(min=0)] if accepted.numel() else staged
        return torch.where(rejected, -1, slots)

    def count(self) -> None:
        """Adds the accepted tokens to ``committed``: once per commit, after its writes, so
        that a commit redone after an error counts them once."""
        self.committed.add_(self.accepted().sum())


Write = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(layer, key, value, slots)``: writes rows of K/V at ``slots`` (-1: skipped), as vLLM's
``reshape_and_cache_flash`` does."""


def copy_rows_reference(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    layers: Sequence[int] | None = None,
    write: Write | None = None,
) -> None:
    """Row ``r`` of each of ``layers`` (all by default) from slot ``src_slots[r]`` to
    ``dst_slots[r]`` where that is not -1, through ``write`` (a direct store by default)."""
    block_size = key_caches[0].shape[1]
    src = src_slots.long().clamp(min=0)
    blocks, offsets = src // block_size, src % block_size
    dst = dst_slots.long()
    for layer in range(len(key_caches)) if layers is None else layers:
        key = key_caches[layer][blocks, offsets]
        value = value_caches[layer][blocks, offsets]
        if write is not None:
            write(layer, key, value, dst)
            continue
        keep = dst >= 0
        to = dst[keep]
        key_caches[layer][to // block_size, to % block_size] = key[keep]
        value_caches[layer][to // block_size, to % block_size] = value[keep]


def commit_kv_reference(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    verdict: Verdict | None = None,
) -> None:
    if verdict is not None:
        dst_slots = verdict.keep_rows(dst_slots)
    copy_rows_reference(key_caches, value_caches, src_slots, dst_slots)
    if verdict is not None:
        verdict.count()


if HAS_TRITON:

    @triton.jit
    def _commit_kv_kernel(
        cache_base_ptr, key_offsets_ptr, value_offsets_ptr, src_ptr, dst_ptr, block_size,
        cache_stride_b, cache_stride_o, cache_stride_h,
        stage_index_ptr, sampled_ptr, sampled_stride, token_req_ptr, token_pos_ptr,
        committed_ptr,
        NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VERDICT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        if VERDICT:
            token = tl.load(stage_index_ptr + row).to(tl.int64)
            if token >= 0:  # a draft: copied only if accepted
                req = tl.load(token_req_ptr + token).to(tl.int64)
                pos = tl.load(token_pos_ptr + token).to(tl.int64)
                after = tl.load(sampled_ptr + req * sampled_stride + pos + 1)
                if after == -1:  # PLACEHOLDER_TOKEN_ID: the draft was rejected
                    return
                if layer == 0:
                    tl.atomic_add(committed_ptr, 1)
        dst = tl.load(dst_ptr + row).to(tl.int64)
        if dst < 0:
            return
        src = tl.load(src_ptr + row).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_SIZE)
        inner = h * cache_stride_h + d
        from_ = (src // block_size) * cache_stride_b + (src % block_size) * cache_stride_o + inner
        to = (dst // block_size) * cache_stride_b + (dst % block_size) * cache_stride_o + inner
        key_offset = tl.load(key_offsets_ptr + layer)
        value_offset = tl.load(value_offsets_ptr + layer)
        k = tl.load(cache_base_ptr + key_offset + from_, mask=mask)
        v = tl.load(cache_base_ptr + value_offset + from_, mask=mask)
        tl.store(cache_base_ptr + key_offset + to, k, mask=mask)
        tl.store(cache_base_ptr + value_offset + to, v, mask=mask)

    _COMMIT = Launcher(_commit_kv_kernel)


def cache_offsets(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets of every layer's key and value cache from ``key_caches[0]``."""
    base = key_caches[0].data_ptr()
    itemsize = key_caches[0].element_size()

    def offsets(caches: Sequence[torch.Tensor]) -> torch.Tensor:
        deltas = [c.data_ptr() - base for c in caches]
        check(all(delta % itemsize == 0 for delta in deltas),
              "KV caches are not aligned to their element size")
        return torch.tensor([delta // itemsize for delta in deltas], dtype=torch.int64,
                            device=key_caches[0].device)

    return offsets(key_caches), offsets(value_caches)


class CommitKV:
    """:func:`commit_kv` for one set of caches: their checks, offsets and layout once, then per
    call only the step's rows and verdict. A verify step's commit runs on the host path of every
    step, so it does no more there than build the launch's arguments (ScratchStaging)."""

    def __init__(self, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                 offsets: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 checked: bool = True) -> None:
        if checked:
            check_caches(key_caches, value_caches)
        self.key_caches, self.value_caches = key_caches, value_caches
        first = self.first = key_caches[0]
        self.triton = use_triton(first)
        _, block_size, num_heads, head_size = first.shape
        self.offsets = (offsets or cache_offsets(key_caches, value_caches)) if self.triton \
            else None
        self._layout = (block_size, *first.stride()[:3])
        self._sizes = (num_heads, head_size, next_power_of_2(num_heads),
                       next_power_of_2(head_size))
        self._key = (first.dtype, block_size, first.stride()[:3], num_heads, head_size)
        self._grid_y = len(key_caches)

    def __call__(self, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                 verdict: Verdict | None = None, *, checked: bool = True) -> None:
        if checked:
            _check(self.first, src_slots, dst_slots, verdict)
        num_rows = dst_slots.shape[0]
        if num_rows == 0:
            return
        if not self.triton:
            commit_kv_reference(self.key_caches, self.value_caches, src_slots, dst_slots, verdict)
            return
        if verdict is None:
            sampled = token_req = token_pos = committed = index = dst_slots
        else:
            sampled, token_req, token_pos, committed, index = verdict
        stride = sampled.stride(0)
        key = (*self._key, dst_slots.dtype, src_slots.dtype, sampled.dtype, token_req.dtype,
               index.dtype, stride, verdict is not None)
        _COMMIT((num_rows, self._grid_y, 1), key, (
            self.first, *self.offsets, src_slots, dst_slots, *self._layout, index, sampled,
            stride, token_req, token_pos, committed, *self._sizes, verdict is not None,
        ))


def commit_kv(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    checked: bool = True,
    verdict: Verdict | None = None,
) -> None:
    """Checks the layout, then copies the step's committed rows in all layers (see module
    docstring). :class:`CommitKV` does the same with the caches' work done once.

    ``checked=False`` skips the checks. Without a ``verdict`` every row with a destination is
    copied.

    Shapes: key/value_caches: L tensors ``[blocks, block_size, H, D]`` with identical shapes and
    strides; src_slots and dst_slots ``[n]`` int64, one per row of the step; with a verdict,
    its ``row_stage_index`` has at least ``n`` entries. ``offsets`` may be precomputed with
    :func:`cache_offsets` (it is fixed for an engine).
    """
    CommitKV(key_caches, value_caches, offsets, checked=checked)(
        src_slots, dst_slots, verdict, checked=checked)


def check_caches(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor]
                 ) -> None:
    """One launch reaches every layer's cache through layer 0's layout: all must share it."""
    check(len(key_caches) == len(value_caches) and len(key_caches) > 0,
          f"{len(key_caches)} key / {len(value_caches)} value caches")
    first = key_caches[0]
    check(first.dim() == 4, f"key_caches[0] has shape {tuple(first.shape)}, expected "
          "[blocks, block_size, heads, head_size]")
    for i, cache in enumerate([*key_caches, *value_caches]):
        name = f"cache {i}"
        check(cache.shape == first.shape and cache.stride() == first.stride(),
              f"{name} has shape {tuple(cache.shape)} strides {cache.stride()}, expected "
              f"{tuple(first.shape)} strides {first.stride()} like key_caches[0]")
        check_dtype(name, cache, first.dtype)
        check_inner_contiguous(name, cache)
    check_same_device(**{f"cache {i}": c for i, c in enumerate([*key_caches, *value_caches])})


def _check(first, src_slots, dst_slots, verdict) -> None:
    num_rows = dst_slots.shape[0]
    check_shape("src_slots", src_slots, (num_rows,))
    check_dtype("src_slots", src_slots, torch.int64)
    check_dtype("dst_slots", dst_slots, torch.int64)
    check_same_device(src_slots=src_slots, dst_slots=dst_slots, cache=first)
    if verdict is not None:
        sampled = verdict.sampled_token_ids
        check(sampled.dim() == 2 and sampled.stride(1) == 1,
              f"sampled_token_ids must be 2-D with contiguous rows, got shape "
              f"{tuple(sampled.shape)} strides {tuple(sampled.stride())}")
        check(verdict.row_stage_index.dim() == 1
              and verdict.row_stage_index.shape[0] >= num_rows,
              f"row_stage_index has shape {tuple(verdict.row_stage_index.shape)}, expected at "
              f"least ({num_rows},)")
        check_shape("token_pos", verdict.token_pos, tuple(verdict.token_req.shape))
        check_shape("committed", verdict.committed, ())
        check_dtype("committed", verdict.committed, torch.int64)
        check_same_device(dst_slots=dst_slots, sampled_token_ids=sampled,
                          token_req=verdict.token_req, token_pos=verdict.token_pos,
                          committed=verdict.committed, row_stage_index=verdict.row_stage_index)
