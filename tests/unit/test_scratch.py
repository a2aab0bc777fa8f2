"""The scratch-block plan's reference (what the GPU kernel is tested against), on the CPU."""

from __future__ import annotations

import pytest
import torch

from vllm_nwor.kernels.scratch import plan_scratch, scratch_blocks

BLOCK, HEADS, DIM = 4, 2, 8


@pytest.mark.parametrize("max_num_seqs,k,block_size,want", [
    (256, 4, 16, (2, 512)),  # 5 query rows span at most 2 blocks of 16
    (4, 16, 16, (2, 8)),     # 17 rows: 2 blocks at most
    (3, 17, 16, (3, 9)),     # 18 rows: 3 blocks
    (1, 1, 1, (2, 2)),
])
def test_each_batch_row_gets_the_blocks_its_query_rows_can_span(max_num_seqs, k, block_size,
                                                                 want):
    assert scratch_blocks(max_num_seqs, k, block_size) == want


def test_plan_redirects_drafting_requests_to_their_scratch_blocks_and_copies_the_tail():
    # Request 0: 6 committed tokens, 3 query rows of which 2 drafts (positions 6, 7, 8: blocks
    # 1 and 2). Request 1: a decode without drafts. Request 2: a padded request of a graph.
    per_request, total = scratch_blocks(3, 2, BLOCK)
    base = 16
    block_table = torch.tensor([[3, 5, 7, 0], [9, 10, 0, 0], [0, 0, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4, 4], dtype=torch.int32)
    seq_lens = torch.tensor([9, 6, 0], dtype=torch.int32)
    stage_index = torch.tensor([-1, 0, 1, -1])
    cache = torch.randn(base + total, BLOCK, HEADS, DIM)
    before = cache.clone()
    table = torch.full((4, 4), -5, dtype=torch.int32)
    row_slots = torch.full((6,), -9, dtype=torch.int64)
    plan_scratch(block_table, qsl, seq_lens, stage_index, table, row_slots, [cache], [cache],
                 (torch.zeros(1), torch.zeros(1)), base, per_request)
    first = base  # batch row 0's scratch blocks: 16, 17
    assert table[0].tolist() == [3, first, first + 1, 0]
    assert table[1].tolist() == block_table[1].tolist()
    assert table[2].tolist() == block_table[2].tolist()
    assert table[3].tolist() == [-5] * 4  # past the batch: untouched
    assert row_slots.tolist() == [first * BLOCK + 2, first * BLOCK + 3, (first + 1) * BLOCK, -1,
                                  -9, -9]
    # Positions 4 and 5 (committed, in block 5) now also sit in scratch block 16.
    assert torch.equal(cache[first, :2], before[5, :2])
    changed = (cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [first], "only the scratch block is written"
