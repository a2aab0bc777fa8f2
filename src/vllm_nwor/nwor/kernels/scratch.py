"""Scratch blocks: where a staged verify step's rows wait for the verdict.

NWOR keeps the last :func:`scratch_blocks` blocks of every layer's paged cache out of the
scheduler's hands. Batch row ``i`` owns the ``per_request`` blocks from ``base + i *
per_request``. In a verify step, a request with drafts (its last row is staged) is *drafting*.
Its *scratch span* is its blocks from the one holding its first draft onward:

- vLLM's own KV write puts each of its rows in the scratch span in its scratch blocks, not in
  its own blocks: the write goes through ``write_slots``, vLLM's slot mapping with those rows'
  slots replaced. Its rows before the span (its last sampled token when that token ends a block,
  or prompt rows) and the rows of other requests keep their slots. So the write is vLLM's one
  launch per layer, unchanged.
- Rows before the span are written in the forward, as vLLM writes them, because the scheduler
  may already treat their blocks as full: it hashes a block for prefix caching once the request's
  known tokens fill it, and a request admitted in the same step may read it. A block the span
  starts in holds a draft, so no request but this one can read it before the commit.
- FlashAttention reads it through a block table in which its span's blocks are its scratch
  blocks. Those hold, for every layer, the committed tokens that share the first such block
  (copied here) and the step's own rows: the chunk is visible, and no draft is written to a
  block the scheduler gave a request.
- After rejection sampling, :func:`~vllm_nwor.nwor.kernels.commit_kv.commit_kv` copies its accepted
  rows in the span (those before its drafts, and its accepted drafts) from the scratch blocks to
  their own slots, ``commit_slots`` (-1 for every other row).

:func:`plan_scratch` is one launch per step, before the first layer's KV update. For every
request it writes its row of ``table`` (vLLM's ``block_table`` with those entries replaced) and
its rows' ``write_slots`` and ``commit_slots``, and for every layer copies the committed tokens
of the first replaced block. Everything it reads is a device buffer, so a CUDA graph replays it
with the step's values.
"""

from __future__ import annotations

import torch

from vllm_nwor.config import NworConfigError
from vllm_nwor.nwor.kernels._common import (
    HAS_TRITON,
    Launcher,
    check,
    next_power_of_2,
    tl,
    triton,
    use_triton,
)


def scratch_blocks(max_num_seqs: int, num_spec_tokens: int, block_size: int) -> tuple[int, int]:
    """``(per_request, total)``: a request's query rows (at most ``num_spec_tokens + 1``) span at
    most ``1 + ceil(num_spec_tokens / block_size)`` blocks; every batch row has its own."""
    per_request = 1 + -(-num_spec_tokens // block_size)
    return per_request, max_num_seqs * per_request


def scratch_base(num_blocks: int, max_num_seqs: int, num_spec_tokens: int,
                 block_size: int) -> tuple[int, int]:
    """``(per_request, base)`` in a cache of ``num_blocks``: the scratch blocks are its last
    ones, from ``base`` (the engine core kept them from the scheduler)."""
    per_request, total = scratch_blocks(max_num_seqs, num_spec_tokens, block_size)
    if total >= num_blocks:
        raise NworConfigError(
            f"'nwor': true needs {total} scratch KV blocks (max_num_seqs={max_num_seqs}, "
            f"num_speculative_tokens={num_spec_tokens}, block_size={block_size}); the cache "
            f"has {num_blocks}")
    return per_request, num_blocks - total


def _request_plan(qsl, seq_lens, row_stage_index, req, width, block_size, per_request):
    """``(drafting, start, p0, lo, hi)`` for request ``req`` (the reference's scalar version):
    its first row's position ``p0`` and its scratch span, blocks ``lo`` (its first draft's) to
    ``hi``. A request whose drafts span more blocks than it owns in scratch (never, with at most
    ``k`` drafts) is not drafting: vLLM's write puts its rows in its own blocks."""
    start, end = int(qsl[req]), int(qsl[req + 1])
    q = end - start
    seq = int(seq_lens[req])
    p0 = seq - q
    index = row_stage_index[start:min(end, row_stage_index.shape[0])]
    drafts = int((index >= 0).sum())  # a request's drafts are its last rows
    staged = q > 0 and end <= row_stage_index.shape[0] and int(row_stage_index[end - 1]) >= 0
    lo, hi = (seq - drafts) // block_size, (seq - 1) // block_size
    drafting = staged and p0 >= 0 and hi < width and hi - lo < per_request
    return drafting, start, p0, lo, hi


def plan_scratch_reference(block_table, qsl, seq_lens, row_stage_index, slot_mapping, table,
                           write_slots, commit_slots, key_caches, value_caches, base,
                           per_request) -> None:
    num_reqs, width = block_table.shape
    block_size = key_caches[0].shape[1]
    n = slot_mapping.shape[0]
    tail = int(qsl[num_reqs])
    write_slots[tail:n] = slot_mapping[tail:n]  # rows past the batch (a graph's padding)
    commit_slots[tail:n] = -1
    for req in range(num_reqs):
        drafting, start, p0, lo, hi = _request_plan(qsl, seq_lens, row_stage_index, req, width,
                                                    block_size, per_request)
        first = base + req * per_request
        row = block_table[req].clone()
        q = int(qsl[req + 1]) - start
        if drafting:
            row[lo:hi + 1] = torch.arange(first, first + hi - lo + 1, dtype=row.dtype)
        table[req, :width] = row
        pos = torch.arange(p0, p0 + q, device=write_slots.device)
        slots = (first + pos // block_size - lo) * block_size + pos % block_size
        own = slot_mapping[start:start + q].long()
        in_span = (pos >= lo * block_size) & drafting
        write_slots[start:start + q] = torch.where(in_span, slots, own)
        commit_slots[start:start + q] = torch.where(in_span, own, -1)
        src = int(block_table[req, lo]) if drafting else -1
        if drafting and 0 <= src < base:
            tail = p0 - lo * block_size  # committed tokens before the span's first row
            for caches in (key_caches, value_caches):
                for cache in caches:
                    cache[first, :max(tail, 0)] = cache[src, :max(tail, 0)]


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_stage_rows", "num_rows"])
    def _plan_scratch_kernel(
        block_table_ptr, bt_stride, table_ptr, table_stride, width,
        qsl_ptr, seq_lens_ptr, stage_index_ptr, num_stage_rows, slot_ptr, num_rows,
        write_slots_ptr, commit_slots_ptr,
        cache_base_ptr, key_offsets_ptr, value_offsets_ptr,
        cache_stride_b, cache_stride_o, cache_stride_h,
        base, per_request, block_size,
        NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        req = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        start = tl.load(qsl_ptr + req).to(tl.int64)
        q = tl.load(qsl_ptr + req + 1).to(tl.int64) - start
        seq = tl.load(seq_lens_ptr + req).to(tl.int64)
        last = start + q - 1
        staged = tl.load(stage_index_ptr + last, mask=(q > 0) & (last < num_stage_rows),
                         other=-1) >= 0
        p0 = seq - q
        # A request's drafts are its last rows; counted only for a staged request.
        drafts = tl.zeros([], tl.int64)
        for r0 in range(0, tl.where(staged, q, 0), BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            index = tl.load(stage_index_ptr + start + r,
                            mask=(r < q) & (start + r < num_stage_rows), other=-1)
            drafts += tl.sum((index >= 0).to(tl.int64))
        lo = (seq - drafts) // block_size  # the scratch span: its first draft's block on
        hi = (seq - 1) // block_size
        drafting = staged & (p0 >= 0) & (hi < width) & (hi - lo < per_request)
        first = base + req * per_request
        if (layer == 0) & (req == 0):  # rows past the batch (a graph's padding): vLLM's slots
            tail = tl.load(qsl_ptr + tl.num_programs(0)).to(tl.int64)
            for r0 in range(tail, num_rows, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                past = r < num_rows
                tl.store(write_slots_ptr + r, tl.load(slot_ptr + r, mask=past), mask=past)
                tl.store(commit_slots_ptr + r, tl.full([BLOCK_R], -1, tl.int64), mask=past)
        if layer == 0:
            for w0 in range(0, width, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                ok = w < width
                block = tl.load(block_table_ptr + req * bt_stride + w, mask=ok)
                mine = drafting & (w >= lo) & (w <= hi)
                block = tl.where(mine, (first + w - lo).to(block.dtype), block)
                tl.store(table_ptr + req * table_stride + w, block, mask=ok)
            for r0 in range(0, q, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                pos = p0 + r
                scratch = (first + pos // block_size - lo) * block_size + pos % block_size
                own = tl.load(slot_ptr + start + r, mask=r < q).to(tl.int64)
                in_span = drafting & (pos >= lo * block_size)
                tl.store(write_slots_ptr + start + r, tl.where(in_span, scratch, own),
                         mask=r < q)
                tl.store(commit_slots_ptr + start + r, tl.where(in_span, own, -1), mask=r < q)
        if drafting:
            src = tl.load(block_table_ptr + req * bt_stride + lo).to(tl.int64)
            if (src >= 0) & (src < base):
                tail = p0 - lo * block_size  # committed tokens before the span's first row
                key_offset = tl.load(key_offsets_ptr + layer)
                value_offset = tl.load(value_offsets_ptr + layer)
                t = tl.arange(0, BLOCK_T)[:, None, None]
                h = tl.arange(0, BLOCK_H)[None, :, None]
                d = tl.arange(0, BLOCK_D)[None, None, :]
                inner = h * cache_stride_h + d
                for t0 in range(0, tail, BLOCK_T):
                    mask = (t0 + t < tail) & (h < NUM_HEADS) & (d < HEAD_SIZE)
                    offset = (t0 + t) * cache_stride_o + inner
                    from_ = src * cache_stride_b + offset
                    to = first * cache_stride_b + offset
                    k = tl.load(cache_base_ptr + key_offset + from_, mask=mask)
                    v = tl.load(cache_base_ptr + value_offset + from_, mask=mask)
                    tl.store(cache_base_ptr + key_offset + to, k, mask=mask)
                    tl.store(cache_base_ptr + value_offset + to, v, mask=mask)

    _PLAN = Launcher(_plan_scratch_kernel, num_warps=4)


def plan_scratch(
    block_table: torch.Tensor,
    qsl: torch.Tensor,
    seq_lens: torch.Tensor,
    row_stage_index: torch.Tensor,
    slot_mapping: torch.Tensor,
    table: torch.Tensor,
    write_slots: torch.Tensor,
    commit_slots: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    offsets: tuple[torch.Tensor, torch.Tensor],
    base: int,
    per_request: int,
) -> None:
    """Plans a step's scratch blocks and copies the committed tails (see module docstring).

    Shapes: block_table ``[R, W]`` int32 (vLLM's); qsl ``[R + 1]`` and seq_lens ``[>= R]``
    int32; row_stage_index ``[<= n]``; slot_mapping ``[n]`` (vLLM's, ``n >= qsl[R]``); table
    ``[>= R, >= W]`` int32; write_slots and commit_slots ``[>= n]`` int64; the caches as
    :func:`~vllm_nwor.nwor.kernels.commit_kv.commit_kv` takes them, with
    ``offsets`` from :func:`~vllm_nwor.nwor.kernels.commit_kv.cache_offsets`.
    """
    num_reqs, width = block_table.shape
    num_rows = slot_mapping.shape[0]
    check(write_slots.shape[0] >= num_rows and commit_slots.shape[0] >= num_rows,
          f"{num_rows} rows exceed the plan's slots ({write_slots.shape[0]}, "
          f"{commit_slots.shape[0]})")
    check(num_reqs <= table.shape[0] and width <= table.shape[1],
          f"block table {tuple(block_table.shape)} exceeds the scratch table "
          f"{tuple(table.shape)}")
    check(base + num_reqs * per_request <= key_caches[0].shape[0],
          f"{num_reqs} requests' scratch blocks from block {base} exceed the cache's "
          f"{key_caches[0].shape[0]} blocks")
    if num_reqs == 0:
        return
    if not use_triton(block_table):
        plan_scratch_reference(block_table, qsl, seq_lens, row_stage_index, slot_mapping, table,
                               write_slots, commit_slots, key_caches, value_caches, base,
                               per_request)
        return
    first = key_caches[0]
    _, block_size, num_heads, head_size = first.shape
    strides = (block_table.stride(0), table.stride(0), first.stride(0), first.stride(1),
               first.stride(2))
    # num_stage_rows and num_rows are not specialized; every other integer is fixed for an engine.
    spec = (block_table.dtype, qsl.dtype, seq_lens.dtype, row_stage_index.dtype,
            slot_mapping.dtype, first.dtype, strides, width, base, per_request, block_size,
            num_heads, head_size, row_stage_index.shape[0] > 0x7FFFFFFF, num_rows > 0x7FFFFFFF)
    _PLAN((num_reqs, len(key_caches), 1), spec, (
        block_table, strides[0], table, strides[1], width,
        qsl, seq_lens, row_stage_index, row_stage_index.shape[0], slot_mapping, num_rows,
        write_slots, commit_slots,
        first, offsets[0], offsets[1], *strides[2:],
        base, per_request, block_size,
        num_heads, head_size, next_power_of_2(num_heads),
        next_power_of_2(head_size), 64, 16, 4,
    ))
