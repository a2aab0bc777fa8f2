"""The KV update of a staged verify step: draft rows to the staging buffer, the rest to the cache.

One launch per layer, in place of vLLM's ``reshape_and_cache_flash``. Row ``r`` of the step:

- ``slot_mapping[r] < 0`` (padding): nothing is staged or written.
- ``row_stage_index[r] >= 0``: a draft. Its K/V go to ``staged_key/value[row_stage_index[r]]``
  and its slot to ``staged_slots[row_stage_index[r]]``; the paged cache is not touched.
- otherwise: K/V are copied to the cache at block ``slot // block_size``, offset
  ``slot % block_size``: the bytes vLLM writes for an unquantized cache.
- and in either case, when ``scratch_slots[r] >= 0``, K/V are also copied to the cache at that
  slot: a scratch block, where verify attention reads the step's chunk (:mod:`.scratch`).

Rows at or beyond ``len(row_stage_index)`` are treated as not staged. Padding rows are skipped
before their stage index is read, so a CUDA graph padded past the step's rows may read stale
indices there.
"""

from __future__ import annotations

import torch

from vllm_nwor.kernels._common import (
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


def stage_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    row_stage_index: torch.Tensor,
    staged_key: torch.Tensor,
    staged_value: torch.Tensor,
    staged_slots: torch.Tensor,
    scratch_slots: torch.Tensor,
) -> None:
    n = slot_mapping.shape[0]
    stage_index = torch.full((n,), -1, dtype=torch.int64, device=key.device)
    m = min(n, row_stage_index.shape[0])
    stage_index[:m] = row_stage_index[:m].long()
    staged = (stage_index >= 0) & (slot_mapping >= 0)
    idx = stage_index[staged]
    staged_key[idx] = key[:n][staged]
    staged_value[idx] = value[:n][staged]
    staged_slots[idx] = slot_mapping[staged].long()
    block_size = key_cache.shape[1]

    def write(rows: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, offsets] = key[:n][rows]
        value_cache[blocks, offsets] = value[:n][rows]

    direct = (~staged) & (slot_mapping >= 0)
    write(direct, slot_mapping[direct].long())
    scratch = scratch_slots[:n].long()
    to_scratch = (scratch >= 0) & (slot_mapping >= 0)
    write(to_scratch, scratch[to_scratch])


if HAS_TRITON:

    @triton.jit
    def _write_at_slot(key_cache_ptr, value_cache_ptr, slot, block_size, kc_stride_b, kc_stride_o,
                       kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h, h, d, k, v, mask):
        """One row's K/V into the cache at ``slot``, as vLLM lays it out."""
        block = slot // block_size
        offset = slot % block_size
        k_dst = block * kc_stride_b + offset * kc_stride_o + h * kc_stride_h + d
        v_dst = block * vc_stride_b + offset * vc_stride_o + h * vc_stride_h + d
        tl.store(key_cache_ptr + k_dst, k, mask=mask)
        tl.store(value_cache_ptr + v_dst, v, mask=mask)

    @triton.jit(do_not_specialize=["num_stage_rows"])
    def _stage_kv_kernel(
        key_ptr, value_ptr, key_cache_ptr, value_cache_ptr,
        slot_ptr, stage_index_ptr, staged_key_ptr, staged_value_ptr, staged_slot_ptr,
        scratch_slot_ptr, num_stage_rows, block_size,
        key_stride_t, key_stride_h, value_stride_t, value_stride_h,
        kc_stride_b, kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
        staged_stride_t, staged_stride_h,
        NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot < 0:
            return
        index = tl.load(stage_index_ptr + row, mask=row < num_stage_rows, other=-1).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_SIZE)
        k = tl.load(key_ptr + row * key_stride_t + h * key_stride_h + d, mask=mask)
        v = tl.load(value_ptr + row * value_stride_t + h * value_stride_h + d, mask=mask)
        if index >= 0:
            dst = index * staged_stride_t + h * staged_stride_h + d
            tl.store(staged_key_ptr + dst, k, mask=mask)
            tl.store(staged_value_ptr + dst, v, mask=mask)
            tl.store(staged_slot_ptr + index, slot)
        else:
            _write_at_slot(key_cache_ptr, value_cache_ptr, slot, block_size, kc_stride_b,
                           kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
                           h, d, k, v, mask)
        scratch = tl.load(scratch_slot_ptr + row).to(tl.int64)
        if scratch >= 0:
            _write_at_slot(key_cache_ptr, value_cache_ptr, scratch, block_size, kc_stride_b,
                           kc_stride_o, kc_stride_h, vc_stride_b, vc_stride_o, vc_stride_h,
                           h, d, k, v, mask)

    _STAGE = Launcher(_stage_kv_kernel)


def stage_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    row_stage_index: torch.Tensor,
    staged_key: torch.Tensor,
    staged_value: torch.Tensor,
    staged_slots: torch.Tensor,
    scratch_slots: torch.Tensor,
    *,
    checked: bool = True,
) -> None:
    """Checks the layout, then stages draft rows and writes the rest (see module docstring).

    ``checked=False`` skips the checks, for hot paths whose layout was checked once.

    Shapes: key/value ``[>= n, H, D]``; key/value_cache ``[blocks, block_size, H, D]`` (any
    strides, head_size contiguous); slot_mapping ``[n]`` int; row_stage_index ``[<= n]`` int;
    staged_key/value ``[T, H, D]`` contiguous; staged_slots ``[T]`` int64; scratch_slots
    ``[>= n]`` int64.
    """
    n = slot_mapping.shape[0]
    num_heads, head_size = key.shape[1], key.shape[2]
    if checked:
        _check(key, value, key_cache, value_cache, slot_mapping, row_stage_index, staged_key,
               staged_value, staged_slots, scratch_slots)
    if n == 0:
        return
    if not use_triton(key):
        stage_kv_reference(key, value, key_cache, value_cache, slot_mapping, row_stage_index,
                           staged_key, staged_value, staged_slots, scratch_slots)
        return
    num_stage_rows = row_stage_index.shape[0]
    strides = (*key.stride()[:2], *value.stride()[:2], *key_cache.stride()[:3],
               *value_cache.stride()[:3], *staged_key.stride()[:2])
    block_size = key_cache.shape[1]
    # num_stage_rows is not specialized: only its width is part of the key.
    spec = (key.dtype, slot_mapping.dtype, row_stage_index.dtype, scratch_slots.dtype,
            block_size, num_heads, head_size, num_stage_rows > 0x7FFFFFFF, strides)
    _STAGE((n, 1, 1), spec, (
        key, value, key_cache, value_cache,
        slot_mapping, row_stage_index, staged_key, staged_value, staged_slots, scratch_slots,
        num_stage_rows, block_size, *strides,
        num_heads, head_size, next_power_of_2(num_heads),
        next_power_of_2(head_size),
    ))


def _check(key, value, key_cache, value_cache, slot_mapping, row_stage_index, staged_key,
           staged_value, staged_slots, scratch_slots) -> None:
    n = slot_mapping.shape[0]
    num_heads, head_size = key.shape[1], key.shape[2]
    check_shape("key", key, (None, num_heads, head_size))
    check(key.shape[0] >= n, f"key has {key.shape[0]} rows, slot_mapping {n}")
    check_shape("value", value, tuple(key.shape))
    check_shape("key_cache", key_cache, (None, None, num_heads, head_size))
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_shape("staged_key", staged_key, (None, num_heads, head_size))
    check_shape("staged_value", staged_value, tuple(staged_key.shape))
    check_shape("staged_slots", staged_slots, (staged_key.shape[0],))
    check(row_stage_index.dim() == 1, f"row_stage_index has shape {tuple(row_stage_index.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("staged_key", staged_key), ("staged_value", staged_value)):
        check_dtype(name, t, key.dtype)
    check_dtype("value", value, key.dtype)
    check_dtype("slot_mapping", slot_mapping, torch.int32, torch.int64)
    check_dtype("row_stage_index", row_stage_index, torch.int32, torch.int64)
    check_dtype("staged_slots", staged_slots, torch.int64)
    check_dtype("scratch_slots", scratch_slots, torch.int64)
    check(scratch_slots.dim() == 1 and scratch_slots.shape[0] >= n,
          f"scratch_slots has shape {tuple(scratch_slots.shape)}, expected at least ({n},)")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        check_inner_contiguous(name, t)
    check(staged_key.is_contiguous() and staged_value.is_contiguous(),
          "staged_key/staged_value must be contiguous")
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping, row_stage_index=row_stage_index,
                      staged_key=staged_key, staged_value=staged_value,
                      staged_slots=staged_slots, scratch_slots=scratch_slots)
