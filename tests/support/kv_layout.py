"""Reading K/V back out of a paged KV cache whose in-block layout is private to a backend.

vLLM's CPU attention stores a block differently per instruction set (the key tile is transposed
for AVX-512, packed for AMX, ...). Rather than copy those layouts, :meth:`PagedKVLayout.probe`
learns one from the backend's own write op: it writes tokens whose values encode their
``(token, head, dim)`` coordinates into a scratch block and reads where each landed. Any layout
that places every element exactly once (all unquantized caches) is read back bit-exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

BlockWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(key, value, kv_cache, slot_mapping)``: the backend's write into ``kv_cache``."""

_DIGIT_BITS = 4  # base-16 digits are exact in every float dtype, bf16 and fp16 included


class PagedKVLayout:
    """Maps ``(token, head, dim)`` within a block to element offsets in the block's storage."""

    def __init__(self, key_index: torch.Tensor, value_index: torch.Tensor, block_size: int,
                 num_kv_heads: int, head_size: int) -> None:
        self.key_index = key_index
        self.value_index = value_index
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    @classmethod
    def probe(
        cls,
        write: BlockWrite,
        cache_shape: tuple[int, ...],
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
    ) -> PagedKVLayout:
        """Learns the layout by writing coordinate-coded tokens into a one-block cache.

        ``cache_shape`` is the shape of one block of the real cache (leading block dim of 1).

        Raises:
            ValueError: the write does not place each element exactly once (for example a
                quantizing cache), so the cache cannot be read back exactly.
        """
        numel = block_size * num_kv_heads * head_size  # per K (and per V)
        ids = torch.arange(2 * numel)
        num_digits = max(1, math.ceil(math.log2(2 * numel) / _DIGIT_BITS))
        cache = torch.empty(cache_shape, dtype=dtype)
        found = torch.zeros(cache.numel(), dtype=torch.int64)
        written = torch.ones(cache.numel(), dtype=torch.bool)
        slots = torch.arange(block_size, dtype=torch.int64)
        tokens_shape = (block_size, num_kv_heads, head_size)
        for p in range(num_digits):
            digits = ((ids >> (_DIGIT_BITS * p)) & ((1 << _DIGIT_BITS) - 1)).to(dtype)
            cache.fill_(-1)
            key, value = digits[:numel].view(tokens_shape), digits[numel:].view(tokens_shape)
            write(key, value, cache, slots)
            flat = cache.reshape(-1).to(torch.int64)
            written &= flat >= 0
            found += flat.clamp(min=0) << (_DIGIT_BITS * p)
        offsets = torch.nonzero(written).flatten()
        owners = found[offsets]
        index = torch.full((2 * numel,), -1, dtype=torch.int64)
        index[owners] = offsets
        if len(offsets) != 2 * numel or bool((index < 0).any()):
            raise ValueError(
                "the KV cache write does not store each K/V element exactly once "
                f"({len(offsets)} element slots hold data for {2 * numel} elements); "
                "it cannot be read back exactly"
            )
        return cls(index[:numel], index[numel:], block_size, num_kv_heads, head_size)

    def gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` tokens' K and V stored in ``block_ids`` (in order).

        Returns ``key, value`` of shape ``[num_tokens, num_kv_heads, head_size]``.
        """
        num_blocks = -(-num_tokens // self.block_size)
        blocks = kv_cache.view(kv_cache.shape[0], -1)[block_ids[:num_blocks].long()]
        shape = (num_blocks * self.block_size, self.num_kv_heads, self.head_size)
        key = blocks[:, self.key_index].view(shape)[:num_tokens]
        value = blocks[:, self.value_index].view(shape)[:num_tokens]
        return key, value
