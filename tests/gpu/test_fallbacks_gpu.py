"""Fallbacks with the fused GPU kernels: each goes to vLLM's plain write path, counted by reason.

The interceptor drives FLASH_ATTN's fused ops (``ScratchStaging``: the real plan and commit
kernels) over paged caches laid out like FLASH_ATTN's; ``plain_write`` plays
``reshape_and_cache_flash`` (a PyTorch store at each slot, skipping -1).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from test_kernels import SENTINEL, layer_caches, rows

from vllm_nwor.nwor.interceptor import NworInterceptor
from vllm_nwor.nwor.kernels.scratch import scratch_blocks
from vllm_nwor.nwor.kv_staging import ScratchStaging, StagedLayers
from vllm_nwor.nwor.verify_step import VerifyStep

pytestmark = pytest.mark.interpretable

LAYERS, HEADS, HEAD_SIZE, BLOCK = 3, 2, 64, 16
NUM_DRAFTS, QSL = [2, 0, 3], [0, 3, 7, 11]
DRAFT_ROWS = [1, 2, 8, 9, 10]
OWN_BLOCKS = 4  # the scheduler's; the scratch blocks follow
SLOTS = torch.arange(20, 31, device=DEVICE)  # rows 0-10 at positions 20-30 of block 1


def step_metadata():
    """Block table, query starts, sequence lengths: every request's rows in block 1."""
    block_table = torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([20 + QSL[i + 1] for i in range(3)], dtype=torch.int32,
                            device=DEVICE)
    return block_table, torch.tensor(QSL, dtype=torch.int32, device=DEVICE), seq_lens


def setup(max_tokens=8, commit_fails=False):
    num_blocks = OWN_BLOCKS + scratch_blocks(3, max(NUM_DRAFTS), BLOCK)[1]
    raws, key_caches, value_caches = layer_caches(LAYERS, num_blocks, BLOCK, HEADS, HEAD_SIZE)

    def plain_write(layer, key, value, slots):  # reshape_and_cache_flash's bytes
        keep = slots >= 0
        to = slots[keep]
        key_caches[layer][to // BLOCK, to % BLOCK] = key[: len(slots)][keep]
        value_caches[layer][to // BLOCK, to % BLOCK] = value[: len(slots)][keep]

    staging = ScratchStaging(key_caches, value_caches, plain_write, step_metadata, 3,
                             max(NUM_DRAFTS), 16)
    stage, commit, write_back = staging.ops()

    def failing_commit(verdict):
        raise RuntimeError("injected commit failure")

    interceptor = NworInterceptor(
        StagedLayers(LAYERS, max_tokens), plain_write, stage_fn=stage,
        commit_fn=failing_commit if commit_fails else commit, write_back=write_back,
        kv_bytes_per_token=1, device=DEVICE)
    return interceptor, raws


def forward(interceptor, step_kv):
    for layer in range(LAYERS):
        interceptor.stage(layer, *step_kv[layer], SLOTS)


def written(raw) -> set[int]:
    """The scheduler's slots that no longer hold the sentinel (the scratch blocks left out)."""
    own = raw[:OWN_BLOCKS]
    return set(torch.nonzero((own != SENTINEL).all(-1).all(-1).flatten()).flatten().tolist())


def holds_rows(raw, step_kv_layer, slots) -> bool:
    """Each of ``slots`` (20 + row) holds its row's K and V."""
    key, value = step_kv_layer
    return all(torch.equal(raw[s // BLOCK, s % BLOCK, :, :HEAD_SIZE], key[s - 20])
               and torch.equal(raw[s // BLOCK, s % BLOCK, :, HEAD_SIZE:], value[s - 20])
               for s in slots)


def sampled(accepted):
    out = torch.full((3, 4), -1, device=DEVICE)
    for i, a in enumerate(accepted):
        out[i, : a + 1] = 5
    return out


@pytest.fixture
def step_kv():
    torch.manual_seed(0)
    return [rows(11, HEADS, HEAD_SIZE) for _ in range(LAYERS)]


def test_staged_step_commits_only_accepted_drafts(step_kv):
    interceptor, raws = setup()
    step = VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE)
    assert interceptor.begin(step)
    forward(interceptor, step_kv)
    interceptor.commit(sampled([1, 0, 2]))
    expected = {20 + r for r in range(11) if r not in DRAFT_ROWS} | {21, 28, 29}
    assert all(written(raw) == expected for raw in raws)
    assert all(holds_rows(raw, step_kv[layer], expected) for layer, raw in enumerate(raws))
    counters = interceptor.counters()
    assert counters.fallbacks == {}
    assert (counters.tokens_committed, counters.tokens_rejected) == (3, 2)
    # Read without waiting (a serving engine's metrics): the commit's copy has landed by now.
    assert interceptor.counters(wait=False) == counters


def test_buffer_too_small_falls_back(step_kv):
    interceptor, raws = setup(max_tokens=4)
    step = VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE)
    assert not interceptor.begin(step)
    assert interceptor.counters().fallbacks == {"overflow": 1}


def test_commit_error_falls_back_to_plain_writes(step_kv):
    interceptor, raws = setup(commit_fails=True)
    step = VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE)
    interceptor.begin(step)
    forward(interceptor, step_kv)
    interceptor.commit(sampled([1, 0, 2]))
    expected = {20 + r for r in range(11) if r not in DRAFT_ROWS} | {21, 28, 29}
    assert all(written(raw) == expected for raw in raws)
    assert all(holds_rows(raw, step_kv[layer], expected) for layer, raw in enumerate(raws))
    counters = interceptor.counters()
    assert counters.fallbacks == {"commit_error": 1}
    assert (counters.tokens_committed, counters.tokens_rejected) == (3, 2)


def test_fake_tensors_during_capture_fall_back(step_kv):
    from torch._subclasses.fake_tensor import FakeTensorMode

    interceptor, _ = setup()
    step = VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE)
    interceptor.begin(step)
    seen = []
    interceptor.plain_write = lambda layer, k, v, s: seen.append(layer)
    with FakeTensorMode() as mode:
        key, value = (mode.from_tensor(t) for t in step_kv[0])
        slots = mode.from_tensor(SLOTS)
    interceptor.stage(0, key, value, slots)
    assert seen == [0]
    assert interceptor.counters().fallbacks == {"fake_tensor": 1}


def test_a_failure_mid_step_writes_back_the_layers_already_staged(step_kv):
    """Layer 1 brings another slot mapping: layer 0's rows, kept in scratch, are written back
    as vLLM writes them (drafts too), and layers 1 and 2 write the plain way."""
    interceptor, raws = setup()
    assert interceptor.begin(VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE))
    interceptor.stage(0, *step_kv[0], SLOTS)
    assert written(raws[0]) == {20 + r for r in range(11) if r not in [0, 1, 2, 7, 8, 9, 10]}
    for layer in (1, 2):
        interceptor.stage(layer, *step_kv[layer], SLOTS.clone())
    interceptor.commit(sampled([1, 0, 2]))
    every_row = {20 + r for r in range(11)}
    assert all(written(raw) == every_row for raw in raws)
    assert all(holds_rows(raw, step_kv[layer], every_row) for layer, raw in enumerate(raws))
    assert interceptor.counters().fallbacks == {"slot_mapping_mismatch": 1}


def test_a_step_without_a_commit_is_written_back_at_the_next_begin(step_kv):
    """No verdict came: every kept row is written, so the request's last sampled token is in
    the cache (it would be lost in scratch otherwise)."""
    interceptor, raws = setup()
    assert interceptor.begin(VerifyStep.from_batch(NUM_DRAFTS, QSL, DEVICE))
    forward(interceptor, step_kv)
    interceptor.begin(None)
    every_row = {20 + r for r in range(11)}
    assert all(written(raw) == every_row for raw in raws)
    assert interceptor.counters().fallbacks == {"no_commit": 1}
