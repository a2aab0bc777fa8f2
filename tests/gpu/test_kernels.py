"""NWOR's Triton kernels against their PyTorch references.

Caches start filled with a sentinel; commits and direct writes are compared with ``torch.equal``
and every slot that must stay untouched is checked to still hold the sentinel. Attention is
compared within a tight tolerance. Shapes: head sizes 64/128/256, GQA 1/4/8, block sizes 16/32,
0/1/odd token counts, all drafts rejected or all accepted, offsets that need 64 bits.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, ON_GPU
from vllm_nwor.kernels.commit_kv import Verdict, cache_offsets, commit_kv, commit_kv_reference
from vllm_nwor.kernels.scratch import plan_scratch, plan_scratch_reference, scratch_blocks
from vllm_nwor.kernels.stage_kv import stage_kv, stage_kv_reference

SENTINEL = -32768.0  # exact in bf16, and never drawn by randn
DTYPE = torch.bfloat16 if ON_GPU else torch.float32

pytestmark = pytest.mark.interpretable


def paged_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=DTYPE):
    """vLLM FLASH_ATTN's cache: logical (blocks, H, block_size, 2D), physical NHD; K/V views."""
    raw = torch.full((num_blocks, block_size, num_kv_heads, 2 * head_size), SENTINEL,
                     dtype=dtype, device=DEVICE)
    kv_cache = raw.permute(0, 2, 1, 3)  # logical (B, H, N, 2D) over NHD storage
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return raw, key_cache, value_cache


def rows(n, num_kv_heads, head_size, dtype=DTYPE):
    """Key/value as vLLM passes them: views into a fused qkv tensor (strided rows)."""
    qkv = torch.randn(n, (4 + 2) * num_kv_heads * head_size, device=DEVICE).to(dtype)
    parts = qkv.split([4 * num_kv_heads * head_size, num_kv_heads * head_size,
                       num_kv_heads * head_size], dim=-1)
    return (parts[1].view(n, num_kv_heads, head_size), parts[2].view(n, num_kv_heads, head_size))


# -- stage_kv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", [0, 1, 7, 33])
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 1), (128, 8), (256, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_stage_kv_matches_reference(num_rows, head_size, num_kv_heads, block_size):
    torch.manual_seed(num_rows + head_size + block_size)
    key, value = rows(num_rows + 3, num_kv_heads, head_size)  # 3 padding rows
    slots = torch.randperm(8 * block_size, device=DEVICE)[: num_rows + 3]
    slots[num_rows:] = -1  # padding
    stage_index = torch.full((num_rows,), -1, dtype=torch.int64, device=DEVICE)
    drafts = torch.arange(num_rows, device=DEVICE)[torch.rand(num_rows, device=DEVICE) < 0.5]
    stage_index[drafts] = torch.arange(len(drafts), device=DEVICE)
    # The last rows also go to scratch slots, in blocks 8 and 9 (past the request's blocks).
    scratch = torch.full((num_rows + 3,), -1, dtype=torch.int64, device=DEVICE)
    to_scratch = min(num_rows, 5)
    scratch[num_rows - to_scratch:num_rows] = 8 * block_size + 3 + torch.arange(to_scratch)
    scratch[num_rows:] = 9 * block_size  # padding rows: never written, whatever they say
    results = []
    for fn in (stage_kv, stage_kv_reference):
        raw, key_cache, value_cache = paged_cache(10, block_size, num_kv_heads, head_size)
        staged_k = torch.full((40, num_kv_heads, head_size), SENTINEL, dtype=DTYPE, device=DEVICE)
        staged_v = staged_k.clone()
        staged_slots = torch.full((40,), -7, dtype=torch.int64, device=DEVICE)
        fn(key, value, key_cache, value_cache, slots, stage_index, staged_k, staged_v,
           staged_slots, scratch)
        results.append((raw, staged_k, staged_v, staged_slots))
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)
    raw, staged_k, _, staged_slots = results[0]
    written = (raw != SENTINEL).all(-1).all(-1).flatten()
    direct = [int(s) for r, s in enumerate(slots.tolist()[:num_rows]) if r not in drafts.tolist()]
    direct += scratch[:num_rows][scratch[:num_rows] >= 0].tolist()
    assert sorted(torch.nonzero(written).flatten().tolist()) == sorted(direct)
    for r in range(num_rows - to_scratch, num_rows):  # each scratch row holds its row's K/V
        slot = int(scratch[r])
        assert torch.equal(raw[slot // block_size, slot % block_size, :, :head_size], key[r])
    assert torch.equal(staged_slots[: len(drafts)], slots[drafts])
    assert bool((staged_slots[len(drafts):] == -7).all())
    assert bool((staged_k[len(drafts):] == SENTINEL).all())


class _CountingJit:
    """A Triton kernel whose JIT launches are counted (what ``Launcher`` avoids)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.skipif(not ON_GPU, reason="the compiled launcher exists on the GPU only")
def test_launcher_reuses_the_compiled_kernel_and_falls_back_for_unaligned_tensors(monkeypatch):
    """The first launch of a layout goes through the JIT, later ones through the compiled
    kernel's launcher with the same result; a tensor off a 16-byte boundary takes the JIT."""
    from vllm_nwor.kernels import stage_kv as module

    launcher = module._STAGE
    jit = _CountingJit(launcher.kernel)
    monkeypatch.setattr(launcher, "kernel", jit)
    monkeypatch.setattr(launcher, "_compiled", {})

    def run(misaligned=False):
        key, value = rows(12, 8, 128)
        if misaligned:  # the same rows, one element (2 bytes) past a 16-byte boundary
            flat = torch.empty(1 + key.numel(), dtype=DTYPE, device=DEVICE)
            key = flat[1:].view_as(key).copy_(key)
            assert key.data_ptr() % 16 != 0
        slots = torch.randperm(8 * 16, device=DEVICE)[:12]
        stage_index = torch.tensor([-1, 0, 1, -1, 2, 3, -1, 4, -1, -1, 5, 6], device=DEVICE)
        results = []
        for fn in (stage_kv, stage_kv_reference):
            raw, key_cache, value_cache = paged_cache(8, 16, 8, 128)
            staged_k = torch.full((16, 8, 128), SENTINEL, dtype=DTYPE, device=DEVICE)
            staged_v = staged_k.clone()
            staged_slots = torch.full((16,), -7, dtype=torch.int64, device=DEVICE)
            fn(key, value, key_cache, value_cache, slots, stage_index, staged_k, staged_v,
               staged_slots, torch.full((12,), -1, dtype=torch.int64, device=DEVICE))
            results.append((raw, staged_k, staged_v, staged_slots))
        for got, want in zip(results[0], results[1], strict=True):
            assert torch.equal(got, want)

    run()
    assert jit.launches == 1 and len(launcher._compiled) == 1
    for _ in range(3):
        run()
    assert jit.launches == 1  # three launches through the compiled kernel's launcher
    run(misaligned=True)
    assert jit.launches == 2  # the JIT, which compiles for the unaligned pointer
    run()
    assert jit.launches == 2  # and the aligned layout is still launched directly


def test_stage_kv_rejects_a_wrong_layout():
    key, value = rows(4, 2, 64)
    _, key_cache, value_cache = paged_cache(4, 16, 2, 128)  # head size 128 != 64
    staged = torch.zeros(8, 2, 64, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="key_cache has shape"):
        stage_kv(key, value, key_cache, value_cache, torch.zeros(4, dtype=torch.int64,
                 device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE), staged,
                 staged.clone(), torch.zeros(8, dtype=torch.int64, device=DEVICE),
                 torch.full((4,), -1, dtype=torch.int64, device=DEVICE))


# -- commit_kv ---------------------------------------------------------------------------------


def layer_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size):
    """Separate allocations per layer, as vLLM makes them."""
    caches = [paged_cache(num_blocks, block_size, num_kv_heads, head_size)
              for _ in range(num_layers)]
    return [c[0] for c in caches], [c[1] for c in caches], [c[2] for c in caches]


@pytest.mark.parametrize("pattern", ["mixed", "all_rejected", "all_accepted", "empty", "one"])
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 8), (128, 1), (256, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_commit_kv_matches_reference(pattern, head_size, num_kv_heads, block_size):
    torch.manual_seed(7)
    num_layers, num_tokens = 3, {"empty": 0, "one": 1}.get(pattern, 13)
    staged_k = torch.randn(num_layers, 16, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    staged_v = torch.randn(num_layers, 16, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    slots = torch.randperm(6 * block_size, device=DEVICE)[:num_tokens].long()
    if pattern == "mixed":
        slots[torch.rand(num_tokens, device=DEVICE) < 0.4] = -1
    elif pattern == "all_rejected":
        slots[:] = -1
    results = []
    for fn in (commit_kv, commit_kv_reference):
        raws, key_caches, value_caches = layer_caches(num_layers, 6, block_size, num_kv_heads,
                                                      head_size)
        fn(staged_k, staged_v, slots, key_caches, value_caches)
        results.append(raws)
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    accepted = [s for s in slots.tolist() if s >= 0]
    for raw in results[0]:
        written = torch.nonzero((raw != SENTINEL).all(-1).all(-1).flatten()).flatten().tolist()
        assert sorted(written) == sorted(accepted)
    assert not torch.equal(results[0][0], results[0][1]) or not accepted  # own data per layer


@pytest.mark.parametrize("pattern", ["mixed", "all_rejected", "all_accepted", "one"])
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 8), (128, 1), (256, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_commit_kv_reads_the_samplers_verdict_like_the_reference(pattern, head_size,
                                                                 num_kv_heads, block_size):
    """The commit with the verdict read in the kernel: only accepted drafts are written, and
    they are counted (onto what the counter held)."""
    torch.manual_seed(11)
    num_layers = 3
    counts = [1] if pattern == "one" else [3, 0, 5, 2, 1]  # drafts per request
    num_tokens = sum(counts)
    if pattern == "all_rejected":
        accepted = [0] * len(counts)
    elif pattern in ("all_accepted", "one"):
        accepted = counts
    else:
        accepted = [int(torch.randint(0, c + 1, ())) for c in counts]
    sampled = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32, device=DEVICE)
    for row, count in enumerate(accepted):
        sampled[row, : count + 1] = 5
    token_req = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    token_pos = torch.cat([torch.arange(c) for c in counts])
    staged_k = torch.randn(num_layers, 16, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    staged_v = torch.randn(num_layers, 16, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    slots = torch.randperm(6 * block_size, device=DEVICE)[:num_tokens].long()
    results, counted = [], []
    for fn in (commit_kv, commit_kv_reference):
        raws, key_caches, value_caches = layer_caches(num_layers, 6, block_size, num_kv_heads,
                                                      head_size)
        committed = torch.full((), 40, dtype=torch.int64, device=DEVICE)
        fn(staged_k, staged_v, slots, key_caches, value_caches,
           verdict=Verdict(sampled, token_req.to(DEVICE), token_pos.to(DEVICE), committed))
        results.append(raws)
        counted.append(int(committed))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    assert counted == [40 + sum(accepted)] * 2
    kept = [int(slots[t]) for t in range(num_tokens)
            if int(token_pos[t]) < accepted[int(token_req[t])]]
    for raw in results[0]:
        written = torch.nonzero((raw != SENTINEL).all(-1).all(-1).flatten()).flatten().tolist()
        assert sorted(written) == sorted(kept)


@pytest.mark.skipif(not ON_GPU, reason="the compiled launcher exists on the GPU only")
def test_a_steps_commit_launches_the_compiled_kernel(monkeypatch):
    """The commit as a verify step makes it (its verdict's indices from the step's one upload)
    goes through the JIT once, then through the compiled kernel, with the reference's bytes."""
    from vllm_nwor.kernels import commit_kv as module
    from vllm_nwor.staging import IndexUploader, VerifyStep

    launcher = module._COMMIT
    jit = _CountingJit(launcher.kernel)
    monkeypatch.setattr(launcher, "kernel", jit)
    monkeypatch.setattr(launcher, "_compiled", {})
    uploader = IndexUploader(64, DEVICE)
    for accepted in ([1, 0, 2], [2, 0, 0], [0, 0, 3], [2, 0, 3]):
        # Odd lengths (11 rows, 5 drafts): packed unpadded, the later arrays would start off a
        # 16-byte boundary and every commit would take the JIT.
        step = VerifyStep.from_batch([2, 0, 3], [0, 3, 7, 11], DEVICE, uploader)
        sampled = torch.full((3, 4), -1, dtype=torch.int32, device=DEVICE)
        for row, count in enumerate(accepted):
            sampled[row, : count + 1] = 5
        staged_k = torch.randn(2, 8, 8, 128, device=DEVICE).to(DTYPE)
        staged_v = torch.randn(2, 8, 8, 128, device=DEVICE).to(DTYPE)
        slots = torch.randperm(4 * 16, device=DEVICE)[:5].long()
        results, counted = [], []
        for fn in (commit_kv, commit_kv_reference):
            raws, key_caches, value_caches = layer_caches(2, 4, 16, 8, 128)
            committed = torch.zeros((), dtype=torch.int64, device=DEVICE)
            fn(staged_k, staged_v, slots, key_caches, value_caches,
               verdict=step.verdict(sampled, committed))
            results.append(raws)
            counted.append(int(committed))
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want)
        assert counted == [sum(accepted)] * 2
    assert jit.launches == 1 and len(launcher._compiled) == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a >4 GiB cache on the GPU")
def test_commit_and_stage_reach_offsets_beyond_32_bits():
    head_size, num_kv_heads, block_size = 128, 8, 16
    block_elems = block_size * num_kv_heads * 2 * head_size
    num_blocks = (2**31) // block_elems + 64  # the last blocks start past 2**31 elements
    raw, key_cache, value_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_size)
    slots = torch.tensor([(num_blocks - 1) * block_size + 3, 5], device=DEVICE)
    staged_k = torch.randn(1, 2, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    staged_v = torch.randn(1, 2, num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    commit_kv(staged_k, staged_v, slots, [key_cache], [value_cache])
    assert torch.equal(key_cache[num_blocks - 1, 3], staged_k[0, 0])
    assert torch.equal(value_cache[0, 5], staged_v[0, 1])
    key, value = rows(1, num_kv_heads, head_size)
    stage_kv(key, value, key_cache, value_cache, slots[:1] + 1,
             torch.tensor([-1], device=DEVICE), staged_k[0], staged_v[0],
             torch.zeros(2, dtype=torch.int64, device=DEVICE),
             torch.tensor([3], device=DEVICE))  # and to slot 3, as a scratch slot
    assert torch.equal(key_cache[0, 3], key[0])
    assert torch.equal(key_cache[num_blocks - 1, 4], key[0])
    del raw


def test_cache_offsets_reach_every_layer():
    _, key_caches, value_caches = layer_caches(3, 2, 16, 2, 64)
    key_offsets, value_offsets = cache_offsets(key_caches, value_caches)
    itemsize = key_caches[0].element_size()
    for i in range(3):
        assert key_caches[0].data_ptr() + int(key_offsets[i]) * itemsize == key_caches[i].data_ptr()
        assert (key_caches[0].data_ptr() + int(value_offsets[i]) * itemsize
                == value_caches[i].data_ptr())


# -- scratch blocks ----------------------------------------------------------------------------
# A step's requests as (committed tokens, query rows, drafts); a query of 0 rows is a padded
# request of a CUDA graph, one with no drafts a decode or a prompt chunk.
SCRATCH_STEPS = [
    [(37, 5, 4)],
    [(0, 9, 0), (100, 1, 0), (16, 4, 3), (300, 5, 4), (47, 3, 2)],
    [(31, 2, 1), (0, 0, 0), (64, 9, 8)],
]


def scratch_step(requests, block_size, num_blocks):
    """vLLM's step tensors for ``requests``, with every request's blocks below the scratch."""
    width = max(-(-(c + q) // block_size) for c, q, _ in requests) + 1
    block_table = torch.randperm(num_blocks, device=DEVICE)[: len(requests) * width]
    block_table = block_table.view(len(requests), width).int()
    qsl, rows = [0], []
    for _, q, d in requests:
        rows += [-1] * (q - d) + list(range(len(rows), len(rows) + d))
        qsl.append(qsl[-1] + q)
    stage_index = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    stage_index[stage_index >= 0] = torch.arange(int((stage_index >= 0).sum()), device=DEVICE)
    return (block_table, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            torch.tensor([c + q for c, q, _ in requests], dtype=torch.int32, device=DEVICE),
            stage_index)


@pytest.mark.parametrize("requests", SCRATCH_STEPS)
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 1), (128, 8), (256, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_plan_scratch_matches_reference(requests, head_size, num_kv_heads, block_size):
    torch.manual_seed(len(requests) + head_size + block_size)
    per_request, total = scratch_blocks(len(requests), 8, block_size)
    base = 128
    block_table, qsl, seq_lens, stage_index = scratch_step(requests, block_size, base)
    committed = torch.randn(3, base, block_size, num_kv_heads, 2 * head_size,
                            device=DEVICE).to(DTYPE)
    results = []
    for fn in (plan_scratch, plan_scratch_reference):
        raws, key_caches, value_caches = layer_caches(3, base + total, block_size, num_kv_heads,
                                                      head_size)
        for layer, raw in enumerate(raws):
            raw[:base] = committed[layer]
        table = torch.full((len(requests) + 2, block_table.shape[1]), -5, dtype=torch.int32,
                           device=DEVICE)
        row_slots = torch.full((int(qsl[-1]) + 4,), -9, dtype=torch.int64, device=DEVICE)
        args = (block_table, qsl, seq_lens, stage_index, table, row_slots, key_caches,
                value_caches)
        if fn is plan_scratch:
            fn(*args, cache_offsets(key_caches, value_caches), base, per_request)
        else:
            fn(*args, base, per_request)
        results.append((table, row_slots, *raws))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    table, row_slots, raw = results[0][:3]
    for i, (c, q, d) in enumerate(requests):  # the reference's meaning, spelled out once
        first = base + i * per_request
        if not d:
            assert torch.equal(table[i], block_table[i])
            continue
        lo = c // block_size
        for pos in range(c, c + q):
            scratch = first + pos // block_size - lo
            assert int(table[i, pos // block_size]) == scratch
            assert int(row_slots[int(qsl[i]) + pos - c]) == scratch * block_size + pos % block_size
        for pos in range(lo * block_size, c):  # the committed tail, copied
            src = int(block_table[i, pos // block_size])
            assert torch.equal(raw[first, pos % block_size], raw[src, pos % block_size])


@pytest.mark.skipif(not ON_GPU, reason="needs FlashAttention on the GPU")
@pytest.mark.parametrize("head_size,group", [(64, 1), (128, 4), (128, 8), (256, 2)])
@pytest.mark.parametrize("requests", SCRATCH_STEPS)
def test_attention_through_scratch_blocks_equals_attention_over_the_written_cache(
        head_size, group, requests):
    """Staged: drafts in the staging buffer and scratch blocks, vLLM's FA call over the
    scratch table. Plain: every row written to the cache, the same call over vLLM's table. The
    outputs are bit-identical, and the drafts' slots in the request's blocks stay untouched."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    torch.manual_seed(head_size + group + len(requests))
    num_kv_heads, block_size, base = 2, 16, 128
    per_request, total = scratch_blocks(len(requests), 8, block_size)
    block_table, qsl, seq_lens, stage_index = scratch_step(requests, block_size, base)
    n = int(qsl[-1])
    key, value = rows(n, num_kv_heads, head_size)
    slots = torch.empty(n, dtype=torch.int64, device=DEVICE)
    for i, (c, q, _) in enumerate(requests):
        for j in range(q):
            pos = c + j
            slots[int(qsl[i]) + j] = int(block_table[i, pos // block_size]) * block_size + \
                pos % block_size
    query = torch.randn(n, group * num_kv_heads, head_size, device=DEVICE).to(DTYPE)
    raws, key_caches, value_caches = layer_caches(1, base + total, block_size, num_kv_heads,
                                                  head_size)
    raws[0][:base] = torch.randn(raws[0][:base].shape, device=DEVICE).to(DTYPE)
    plain_raw = raws[0].clone()
    plain_key, plain_value = plain_raw[..., :head_size], plain_raw[..., head_size:]
    plain_key.view(-1, num_kv_heads, head_size)[slots] = key
    plain_value.view(-1, num_kv_heads, head_size)[slots] = value
    common = dict(q=query, cu_seqlens_q=qsl, max_seqlen_q=max(q for _, q, _ in requests),
                  seqused_k=seq_lens, max_seqlen_k=int(seq_lens.max()),
                  softmax_scale=head_size**-0.5, causal=True, fa_version=3)
    want = flash_attn_varlen_func(k=plain_key, v=plain_value, block_table=block_table, **common)

    table = torch.zeros_like(block_table)
    row_slots = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    plan_scratch(block_table, qsl, seq_lens, stage_index, table, row_slots, key_caches,
                 value_caches, cache_offsets(key_caches, value_caches), base, per_request)
    num_staged = int((stage_index >= 0).sum())
    staged_k = torch.empty(max(num_staged, 1), num_kv_heads, head_size, dtype=DTYPE,
                           device=DEVICE)
    staged_v, staged_slots = torch.empty_like(staged_k), torch.empty(
        max(num_staged, 1), dtype=torch.int64, device=DEVICE)
    before = raws[0][:base].clone()
    stage_kv(key, value, key_caches[0], value_caches[0], slots, stage_index, staged_k, staged_v,
             staged_slots, row_slots)
    got = flash_attn_varlen_func(k=key_caches[0], v=value_caches[0], block_table=table, **common)
    assert torch.equal(got, want)
    drafts = slots[stage_index >= 0]
    flat_before = before.view(-1, num_kv_heads, 2 * head_size)
    flat_after = raws[0][:base].reshape(-1, num_kv_heads, 2 * head_size)
    assert torch.equal(flat_after[drafts], flat_before[drafts]), "a draft reached its block"
    others = slots[stage_index < 0]
    assert torch.equal(flat_after[others, :, :head_size], key[stage_index < 0])
