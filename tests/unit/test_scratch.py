"""The scratch-block plan's reference (what the GPU kernel is tested against), on the CPU."""

from __future__ import annotations

import pytest
import torch

from vllm_nwor.nwor.kernels.scratch import plan_scratch, scratch_blocks

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
    slot_mapping = torch.tensor([30, 31, 32, 41, -1])  # vLLM's, padded by a graph to 5 rows
    write_slots = torch.full((6,), -9, dtype=torch.int64)
    commit_slots = torch.full((6,), -9, dtype=torch.int64)
    plan_scratch(block_table, qsl, seq_lens, stage_index, slot_mapping, table, write_slots,
                 commit_slots, [cache], [cache], (torch.zeros(1), torch.zeros(1)), base,
                 per_request)
    first = base  # batch row 0's scratch blocks: 16, 17
    assert table[0].tolist() == [3, first, first + 1, 0]
    assert table[1].tolist() == block_table[1].tolist()
    assert table[2].tolist() == block_table[2].tolist()
    assert table[3].tolist() == [-5] * 4  # past the batch: untouched
    # Request 0's rows go to its scratch blocks, and are committed to their own slots; request
    # 1's and the padding row keep vLLM's slots and are not committed; past the rows, untouched.
    assert write_slots.tolist() == [first * BLOCK + 2, first * BLOCK + 3, (first + 1) * BLOCK,
                                    41, -1, -9]
    assert commit_slots.tolist() == [30, 31, 32, -1, -1, -9]
    # Positions 4 and 5 (committed, in block 5) now also sit in scratch block 16.
    assert torch.equal(cache[first, :2], before[5, :2])
    changed = (cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [first], "only the scratch block is written"


def test_a_last_sampled_token_that_ends_a_block_is_written_to_its_own_slot_in_the_forward():
    # Request 0: 7 committed tokens; its last sampled token (position 7) ends block 1, its two
    # drafts (8, 9) are in block 2. The scheduler hashed block 1 when it scheduled the step
    # (prefix caching), so a request admitted in the same step may read position 7 in this
    # forward: it must be written there, not kept in scratch until the commit. Request 1: 5
    # prompt rows before its drafts (a request resumed after preemption), in blocks 0 and 1.
    per_request, total = scratch_blocks(2, 2, BLOCK)
    base = 16
    block_table = torch.tensor([[3, 5, 7, 0], [9, 10, 11, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 10], dtype=torch.int32)
    seq_lens = torch.tensor([10, 10], dtype=torch.int32)
    stage_index = torch.tensor([-1, 0, 1, -1, -1, -1, -1, -1, 2, 3])
    slot_mapping = torch.tensor([23, 28, 29, 39, 40, 41, 42, 43, 44, 45])
    cache = torch.randn(base + total, BLOCK, HEADS, DIM)
    before = cache.clone()
    table = torch.zeros((2, 4), dtype=torch.int32)
    write_slots = torch.full((10,), -9, dtype=torch.int64)
    commit_slots = torch.full((10,), -9, dtype=torch.int64)
    plan_scratch(block_table, qsl, seq_lens, stage_index, slot_mapping, table, write_slots,
                 commit_slots, [cache], [cache], (torch.zeros(1), torch.zeros(1)), base,
                 per_request)
    first0, first1 = base, base + per_request
    assert table.tolist() == [[3, 5, first0, 0], [9, 10, first1, 0]]
    assert write_slots.tolist() == [23, first0 * BLOCK, first0 * BLOCK + 1,
                                    39, 40, 41, 42, 43, first1 * BLOCK, first1 * BLOCK + 1]
    assert commit_slots.tolist() == [-1, 28, 29, -1, -1, -1, -1, -1, 44, 45]
    assert torch.equal(cache, before), "no committed token shares a scratch block"


# -- the engine core keeps the scratch blocks from the scheduler --------------------------------


def _engine_config(num_blocks, max_num_seqs=8, k=4, max_model_len=256, nwor=True):
    from types import SimpleNamespace

    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        additional_config={"nwor": nwor},
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=num_blocks),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )
    return vllm_config, SimpleNamespace(num_blocks=num_blocks)


@pytest.fixture
def engine_core():
    from vllm_nwor.patches.nwor import engine_core

    return engine_core


def test_the_scheduler_gets_the_cache_less_the_scratch_blocks(engine_core):
    vllm_config, kv_cache_config = _engine_config(100)
    initialize = engine_core._wrap_initialize_kv_caches(lambda self, config: kv_cache_config)
    assert initialize(None, vllm_config).num_blocks == 100 - 8 * 2
    assert vllm_config.cache_config.num_gpu_blocks == 84
    off_config, off_kv = _engine_config(100, nwor=False)
    assert engine_core._wrap_initialize_kv_caches(lambda self, c: off_kv)(None, off_config) \
        .num_blocks == 100


def test_too_small_a_cache_fails_at_start_up_naming_the_numbers(engine_core):
    vllm_config, kv_cache_config = _engine_config(30, max_model_len=256)  # 16 kept, 14 < 16
    initialize = engine_core._wrap_initialize_kv_caches(lambda self, config: kv_cache_config)
    from vllm_nwor.config import NworConfigError

    with pytest.raises(NworConfigError, match=r"keeps 16 KV blocks.*leaves 14.*needs \(16\)"):
        initialize(None, vllm_config)
