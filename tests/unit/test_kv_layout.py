"""Reading K/V back from a paged cache whose in-block layout is learned from the write op."""

from __future__ import annotations

import pytest
import torch

from tests.support.kv_layout import PagedKVLayout

H, BS, D = 2, 16, 8


def transposed_key_write(key, value, cache, slots):
    """A layout like vLLM's AVX-512 CPU cache: per (block, head) a [D, BS] key tile, [BS, D] V."""
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, off = divmod(slot, BS)
        tile = cache[block].view(H, 2, BS * D)
        tile[:, 0].view(H, D, BS)[:, :, off] = key[t]
        tile[:, 1].view(H, BS, D)[:, off, :] = value[t]


def pair_packed_write(key, value, cache, slots):
    """A VNNI-like layout: pairs of dims interleaved across tokens, heads innermost."""
    for t, slot in enumerate(slots.tolist()):
        block, off = divmod(slot, BS)
        flat = cache[block].view(2, D // 2, BS, 2, H)
        flat[0, :, off, :, :] = key[t].T.reshape(D // 2, 2, H)
        flat[1, :, off, :, :] = value[t].T.reshape(D // 2, 2, H)


@pytest.mark.parametrize("write", [transposed_key_write, pair_packed_write])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_reads_back_exactly_what_was_written(write, dtype):
    layout = PagedKVLayout.probe(write, (1, H, BS, 2 * D), BS, H, D, dtype)
    cache = torch.zeros(6, H, BS, 2 * D, dtype=dtype)
    key = torch.randn(40, H, D).to(dtype)
    value = torch.randn(40, H, D).to(dtype)
    block_ids = torch.tensor([4, 1, 5])
    slots = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in block_ids.tolist()])[:40]
    write(key, value, cache, slots)
    got_key, got_value = layout.gather(cache, block_ids, 37)
    assert torch.equal(got_key, key[:37]) and torch.equal(got_value, value[:37])


def test_a_write_that_does_not_place_each_element_once_is_refused():
    def quantizing_write(key, value, cache, slots):
        transposed_key_write((key / 4).round(), value, cache, slots)

    with pytest.raises(ValueError, match="exactly once"):
        PagedKVLayout.probe(quantizing_write, (1, H, BS, 2 * D), BS, H, D, torch.float32)
