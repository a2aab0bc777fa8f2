"""Causal attention over a verify step's chunk, merged into the prefix attention, in one launch.

FlashAttention has already written ``out`` with each row's attention over the committed prefix
(the cache before this step, every token visible) and ``prefix_lse`` with its log-sum-exp. This
kernel adds the chunk: causal attention over the step's own rows of ``key``/``value`` (so staged
drafts are seen without being in the cache), then combines the two by log-sum-exp in place.

A prefix LSE of +inf, -inf or NaN means "no prefix keys" (FlashAttention reports +inf for rows
with ``seqused_k == 0``); such rows take the chunk attention alone.
"""

from __future__ import annotations

import torch

from vllm_nwor.attention import attention_with_lse, merge_attn_states
from vllm_nwor.kernels._common import (
    HAS_TRITON,
    Launcher,
    check,
    check_dtype,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    tl,
    triton,
    use_triton,
)


def chunk_attention_merge_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    prefix_lse: torch.Tensor,
    scale: float,
) -> None:
    del max_query_len  # the reference reads lengths from query_start_loc
    bounds = query_start_loc.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device)
        chunk_out, chunk_lse = attention_with_lse(
            query[start:end], key[start:end], value[start:end], causal.tril(), scale
        )
        lse = prefix_lse[:, start:end].transpose(0, 1).float()
        lse = torch.where(torch.isfinite(lse), lse, float("-inf"))
        prefix_out = out[start:end].float().nan_to_num(0.0)
        merged = merge_attn_states(prefix_out, lse, chunk_out, chunk_lse)
        out[start:end] = merged.to(out.dtype)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["lse_stride_h"])  # the step's padded token count
    def _chunk_attention_merge_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, qsl_ptr, scale,
        q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
        o_stride_t, o_stride_h, lse_stride_h, lse_stride_t,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        req = tl.program_id(0)
        m_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        start = tl.load(qsl_ptr + req).to(tl.int64)
        q_len = (tl.load(qsl_ptr + req + 1) - tl.load(qsl_ptr + req)).to(tl.int32)
        if m_block * BLOCK_M >= q_len:
            return
        # Each of the BLOCK_M query rows is expanded over the GROUP query heads of this KV head.
        vr = tl.arange(0, BLOCK_M * GROUP_PAD)
        local_row = m_block * BLOCK_M + vr // GROUP_PAD
        g = vr % GROUP_PAD
        head = kv_head * GROUP + g
        row_ok = (local_row < q_len) & (g < GROUP)
        row = start + local_row
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_SIZE
        io_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + row[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=io_mask, other=0.0)
        # The prefix's output and LSE are loaded before the chunk's loop, so their latency
        # overlaps the chunk's work instead of following it (a verify chunk is one tile or two).
        out_offs = row[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
        prefix_out = tl.load(out_ptr + out_offs, mask=io_mask, other=0.0)
        prefix_lse = tl.load(lse_ptr + head * lse_stride_h + row * lse_stride_t,
                             mask=row_ok, other=float("-inf"))

        log2e: tl.constexpr = 1.4426950408889634
        qk_scale = scale * log2e
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        kv_end = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
        for n0 in range(0, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            k_row = start + n
            k = tl.load(k_ptr + k_row[None, :] * k_stride_t + kv_head * k_stride_h + d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_ptr + k_row[:, None] * v_stride_t + kv_head * v_stride_h + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # beside k: one wait
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * qk_scale
            visible = (n[None, :] <= local_row[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # Every valid row sees at least itself, so l_i > 0 there.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        chunk_out = acc / l_safe[:, None]
        ln2: tl.constexpr = 0.6931471805599453
        chunk_lse = m_i * ln2 + tl.log(l_safe)
        empty = (prefix_lse == float("inf")) | (prefix_lse != prefix_lse)
        prefix_lse = tl.where(empty, float("-inf"), prefix_lse)
        top = tl.maximum(prefix_lse, chunk_lse)
        w_prefix = tl.exp(prefix_lse - top)
        w_chunk = tl.exp(chunk_lse - top)
        total = w_prefix + w_chunk
        prefix_part = tl.where(w_prefix[:, None] > 0,
                               prefix_out.to(tl.float32) * (w_prefix / total)[:, None],
                               0.0)
        merged = prefix_part + chunk_out * (w_chunk / total)[:, None]
        tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=io_mask)

    _MERGE = Launcher(_chunk_attention_merge_kernel, num_warps=4)


def _tile_sizes(group: int, head_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, GROUP_PAD, BLOCK_N): about 64 expanded rows per tile, 32 for head_size 256."""
    group_pad = triton.next_power_of_2(group)
    rows = 32 if head_size > 128 else 64
    block_m = max(1, rows // group_pad)
    return block_m, group_pad, 16 if head_size > 128 else 32


def chunk_attention_merge(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    prefix_lse: torch.Tensor,
    scale: float,
    *,
    checked: bool = True,
) -> None:
    """Checks the layout, then merges the chunk attention into ``out`` (see module docstring).

    ``checked=False`` skips the checks, for hot paths whose layout was checked once.

    Shapes: query ``[N, Hq, D]``; key/value ``[N, Hkv, D]``; query_start_loc ``[B + 1]`` int32;
    out ``[>= N, Hq, D]`` holding the prefix attention; prefix_lse ``[Hq, >= N]`` float32.
    """
    num_rows, num_q_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if checked:
        _check(query, key, value, query_start_loc, out, prefix_lse)
    num_reqs = query_start_loc.shape[0] - 1
    if num_rows == 0 or num_reqs <= 0:
        return
    if not use_triton(query):
        chunk_attention_merge_reference(query, key, value, query_start_loc, max_query_len, out,
                                        prefix_lse, scale)
        return
    group = num_q_heads // num_kv_heads
    block_m, group_pad, block_n = _tile_sizes(group, head_size)
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_kv_heads)
    strides = (query.stride(0), query.stride(1), key.stride(0), key.stride(1),
               value.stride(0), value.stride(1), out.stride(0), out.stride(1))
    lse_stride_h, lse_stride_t = prefix_lse.stride()
    ieee = query.dtype == torch.float32
    # lse_stride_h is not specialized: only its width is part of the key.
    spec = (query.dtype, query_start_loc.dtype, type(scale), strides,
            lse_stride_h > 0x7FFFFFFF, lse_stride_t, group, head_size)
    _MERGE(grid, spec, (
        query, key, value, out, prefix_lse, query_start_loc, scale, *strides,
        lse_stride_h, lse_stride_t, group, group_pad, head_size, block_m, block_n,
        triton.next_power_of_2(head_size), ieee,
    ))


def _check(query, key, value, query_start_loc, out, prefix_lse) -> None:
    num_rows, num_q_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    check(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
          f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    check_shape("key", key, (None, num_kv_heads, head_size))
    check(key.shape[0] >= num_rows, f"key has {key.shape[0]} rows, query {num_rows}")
    check_shape("value", value, tuple(key.shape))
    check_shape("out", out, (None, num_q_heads, head_size))
    check(out.shape[0] >= num_rows, f"out has {out.shape[0]} rows, query {num_rows}")
    check_shape("prefix_lse", prefix_lse, (num_q_heads, None))
    check(prefix_lse.shape[1] >= num_rows, f"prefix_lse covers {prefix_lse.shape[1]} rows")
    check_dtype("prefix_lse", prefix_lse, torch.float32)
    check_dtype("query_start_loc", query_start_loc, torch.int32)
    for name, t in (("key", key), ("value", value), ("out", out)):
        check_dtype(name, t, query.dtype)
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        check_inner_contiguous(name, t)
    check(head_size >= 16, f"head_size {head_size} is below 16")
    check_same_device(query=query, key=key, value=value, query_start_loc=query_start_loc,
                      out=out, prefix_lse=prefix_lse)
