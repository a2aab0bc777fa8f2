"""Fallbacks with the fused GPU kernels: each goes to vLLM's plain write path, counted by reason.

The interceptor drives the real stage and commit kernels over paged caches laid out like
FLASH_ATTN's; ``plain_write`` plays ``reshape_and_cache_flash`` (the reference write).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import DTYPE, SENTINEL, layer_caches, rows

from conftest import DEVICE
from vllm_nwor.kernels.commit_kv import commit_kv
from vllm_nwor.kernels.stage_kv import stage_kv, stage_kv_reference
from vllm_nwor.staging import NworInterceptor, StagingBuffer, VerifyStep

pytestmark = pytest.mark.interpretable

LAYERS, HEADS, HEAD_SIZE, BLOCK = 3, 2, 64, 16
NUM_DRAFTS, QSL = [2, 0, 3], [0, 3, 7, 11]
DRAFT_ROWS = [1, 2, 8, 9, 10]


def setup(max_tokens=8, commit_fails=False):
    raws, key_caches, value_caches = layer_caches(LAYERS, 4, BLOCK, HEADS, HEAD_SIZE)
    buffer = StagingBuffer(LAYERS, max_tokens, HEADS, HEAD_SIZE, DTYPE, DEVICE)

    def plain_write(layer, key, value, slots):
        none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
        stage_kv_reference(key, value, key_caches[layer], value_caches[layer], slots, none,
                           buffer.key[layer], buffer.value[layer], buffer.slot_mapping,
                           torch.full(slots.shape, -1, dtype=torch.int64, device=DEVICE))

    def stage(layer, key, value, slots, row_stage_index, buf):
        stage_kv(key, value, key_caches[layer], value_caches[layer], slots,
                 row_stage_index, buf.key[layer], buf.value[layer], buf.slot_mapping,
                 torch.full(slots.shape, -1, dtype=torch.int64, device=DEVICE))  # no scratch

    def commit(buf, verdict):  # as the FLASH_ATTN backend commits: the verdict in the kernel
        if commit_fails:
            raise RuntimeError("injected commit failure")
        commit_kv(buf.key, buf.value, buf.slot_mapping[: buf.num_tokens], key_caches,
                  value_caches, verdict=verdict)

    interceptor = NworInterceptor(buffer, plain_write, commit, stage, kv_bytes_per_token=1)
    return interceptor, raws


def forward(interceptor, step_kv):
    slots = torch.arange(20, 31, device=DEVICE)
    for layer in range(LAYERS):
        interceptor.stage(layer, *step_kv[layer], slots)


def written(raw) -> set[int]:
    return set(torch.nonzero((raw != SENTINEL).all(-1).all(-1).flatten()).flatten().tolist())


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
    counters = interceptor.counters()
    assert counters.fallbacks == {}
    assert (counters.tokens_committed, counters.tokens_rejected) == (3, 2)


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
        slots = mode.from_tensor(torch.arange(20, 31, device=DEVICE))
    interceptor.stage(0, key, value, slots)
    assert seen == [0]
    assert interceptor.counters().fallbacks == {"fake_tensor": 1}
