"""Commit: every layer's accepted staged tokens into the paged cache, in one launch.

``slots[t]`` is staged token ``t``'s slot, or -1 when its draft was rejected (nothing written).
Token ``t`` of layer ``l`` goes to ``key_caches[l]`` / ``value_caches[l]`` at block
``slot // block_size``, offset ``slot % block_size``: the bytes vLLM writes for an unquantized
cache. All layers share one slot mapping; each writes into its own cache.

With a :class:`Verdict` the kernel also reads which drafts were accepted from the rejection
sampler's output itself and counts them, so a step's commit is this one launch (the verdict
as separate tensor ops was six more launches and their host work, on a host-bound step).

The kernel reaches the layers' separate cache tensors through element offsets from layer 0's
key cache, so one launch covers all layers; the wrapper checks that every cache has the same
shape, strides and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

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

PLACEHOLDER_TOKEN_ID = -1
"""Rejected positions in the rejection sampler's output (vLLM's ``PLACEHOLDER_TOKEN_ID``)."""


class Verdict(NamedTuple):
    """Which staged tokens were accepted, as the rejection sampler left it on the device.

    Staged token ``t`` is draft ``token_pos[t]`` of batch row ``token_req[t]``; it was accepted
    exactly when the sampler emitted a token after it: ``sampled_token_ids[token_req[t],
    token_pos[t] + 1] != -1``. ``committed`` (an int64 scalar) is increased by the number of
    accepted tokens.
    """

    sampled_token_ids: torch.Tensor
    token_req: torch.Tensor
    token_pos: torch.Tensor
    committed: torch.Tensor

    def accepted(self) -> torch.Tensor:
        """A bool per staged token (a few tensor ops; the kernel reads it inline)."""
        return self.sampled_token_ids[self.token_req, self.token_pos + 1] != PLACEHOLDER_TOKEN_ID

    def keep(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` with the rejected tokens' set to -1, as tensor ops (what the kernel does
        inline); the accepted tokens are counted into ``committed``."""
        accepted = self.accepted()
        self.committed.add_(accepted.sum())
        return torch.where(accepted, slots, -1)


def commit_kv_reference(
    staged_key: torch.Tensor,
    staged_value: torch.Tensor,
    slots: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    verdict: Verdict | None = None,
) -> None:
    if verdict is not None:
        slots = verdict.keep(slots)
    keep = slots >= 0
    slot = slots[keep].long()
    block_size = key_caches[0].shape[1]
    blocks, offsets = slot // block_size, slot % block_size
    n = slots.shape[0]
    for layer, key_cache in enumerate(key_caches):
        key_cache[blocks, offsets] = staged_key[layer, :n][keep]
        value_caches[layer][blocks, offsets] = staged_value[layer, :n][keep]


if HAS_TRITON:

    @triton.jit
    def _commit_kv_kernel(
        staged_key_ptr, staged_value_ptr, slot_ptr, cache_base_ptr,
        key_offsets_ptr, value_offsets_ptr, block_size,
        staged_stride_l, staged_stride_t, staged_stride_h,
        cache_stride_b, cache_stride_o, cache_stride_h,
        sampled_ptr, sampled_stride, token_req_ptr, token_pos_ptr, committed_ptr,
        NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, VERDICT: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if VERDICT:
            req = tl.load(token_req_ptr + token).to(tl.int64)
            pos = tl.load(token_pos_ptr + token).to(tl.int64)
            after = tl.load(sampled_ptr + req * sampled_stride + pos + 1)
            if after == -1:  # PLACEHOLDER_TOKEN_ID: the draft was rejected
                return
            if layer == 0:
                tl.atomic_add(committed_ptr, 1)
        if slot < 0:
            return
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_SIZE)
        src = layer * staged_stride_l + token * staged_stride_t + h * staged_stride_h + d
        k = tl.load(staged_key_ptr + src, mask=mask)
        v = tl.load(staged_value_ptr + src, mask=mask)
        within = (slot // block_size) * cache_stride_b + (slot % block_size) * cache_stride_o
        within += h * cache_stride_h + d
        key_offset = tl.load(key_offsets_ptr + layer)
        value_offset = tl.load(value_offsets_ptr + layer)
        tl.store(cache_base_ptr + key_offset + within, k, mask=mask)
        tl.store(cache_base_ptr + value_offset + within, v, mask=mask)

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


def commit_kv(
    staged_key: torch.Tensor,
    staged_value: torch.Tensor,
    slots: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    checked: bool = True,
    verdict: Verdict | None = None,
) -> None:
    """Checks the layout, then writes accepted tokens of all layers (see module docstring).

    ``checked=False`` skips the checks, for hot paths whose layout was checked once. With a
    ``verdict`` only its accepted tokens are written (``slots`` may then be the step's whole
    slot mapping), and they are counted into ``verdict.committed``.

    Shapes: staged_key/value ``[L, >= T, H, D]`` contiguous; slots ``[T]`` int64;
    key/value_caches: L tensors ``[blocks, block_size, H, D]`` with identical shapes and strides.
    ``offsets`` may be precomputed with :func:`cache_offsets` (it is fixed for an engine).
    """
    num_layers, _, num_heads, head_size = staged_key.shape
    num_tokens = slots.shape[0]
    first = key_caches[0]
    if checked:
        _check(staged_key, staged_value, slots, key_caches, value_caches, verdict)
    if num_tokens == 0:
        return
    if not use_triton(staged_key):
        commit_kv_reference(staged_key, staged_value, slots, key_caches, value_caches, verdict)
        return
    key_offsets, value_offsets = offsets or cache_offsets(key_caches, value_caches)
    sampled, token_req, token_pos, committed = verdict or (slots, slots, slots, slots)
    block_size = first.shape[1]
    strides = (staged_key.stride(0), staged_key.stride(1), staged_key.stride(2),
               first.stride(0), first.stride(1), first.stride(2), sampled.stride(0))
    spec = (staged_key.dtype, first.dtype, slots.dtype, sampled.dtype, token_req.dtype,
            block_size, strides, num_heads, head_size, verdict is not None)
    _COMMIT((num_tokens, num_layers, 1), spec, (
        staged_key, staged_value, slots, first, key_offsets, value_offsets, block_size,
        *strides[:6], sampled, strides[6], token_req, token_pos, committed,
        num_heads, head_size, next_power_of_2(num_heads),
        next_power_of_2(head_size), verdict is not None,
    ))


def _check(staged_key, staged_value, slots, key_caches, value_caches, verdict) -> None:
    num_layers, _, num_heads, head_size = staged_key.shape
    num_tokens = slots.shape[0]
    check_shape("staged_value", staged_value, tuple(staged_key.shape))
    check(staged_key.shape[1] >= num_tokens,
          f"slots has {num_tokens} tokens, the buffer holds {staged_key.shape[1]}")
    check(staged_key.is_contiguous() and staged_value.is_contiguous(),
          "staged_key/staged_value must be contiguous")
    check_dtype("slots", slots, torch.int64)
    check(len(key_caches) == num_layers and len(value_caches) == num_layers,
          f"{len(key_caches)} key / {len(value_caches)} value caches for {num_layers} layers")
    first = key_caches[0]
    check_shape("key_caches[0]", first, (None, None, num_heads, head_size))
    for i, cache in enumerate([*key_caches, *value_caches]):
        name = f"cache {i}"
        check(cache.shape == first.shape and cache.stride() == first.stride(),
              f"{name} has shape {tuple(cache.shape)} strides {cache.stride()}, expected "
              f"{tuple(first.shape)} strides {first.stride()} like key_caches[0]")
        check_dtype(name, cache, staged_key.dtype)
        check_inner_contiguous(name, cache)
    check_same_device(staged_key=staged_key, staged_value=staged_value, slots=slots,
                      cache=first)
    if verdict is not None:
        sampled = verdict.sampled_token_ids
        check(sampled.dim() == 2 and sampled.stride(1) == 1,
              f"sampled_token_ids must be 2-D with contiguous rows, got shape "
              f"{tuple(sampled.shape)} strides {tuple(sampled.stride())}")
        check_shape("token_req", verdict.token_req, (num_tokens,))
        check_shape("token_pos", verdict.token_pos, (num_tokens,))
        check_shape("committed", verdict.committed, ())
        check_dtype("committed", verdict.committed, torch.int64)
        check_same_device(slots=slots, sampled_token_ids=sampled, token_req=verdict.token_req,
                          token_pos=verdict.token_pos, committed=verdict.committed)
