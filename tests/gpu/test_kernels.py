"""NWOR's Triton kernels against their PyTorch references.

Caches start filled with a sentinel; plans and commits are compared with ``torch.equal`` and
every slot that must stay untouched is checked to still hold the sentinel. Attention through the
scratch blocks is compared with vLLM's own, bit for bit. Shapes: head sizes 64/128/256, GQA
1/4/8, block sizes 16/32, 0/1/odd row counts, all drafts rejected or all accepted, offsets that
need 64 bits; caches of bf16 (float32 in Triton's interpreter) and of fp8 bytes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, ON_GPU

from vllm_nwor.nwor.kernels.commit_kv import cache_offsets, commit_kv, commit_kv_reference
from vllm_nwor.nwor.kernels.scratch import plan_scratch, plan_scratch_reference, scratch_blocks

SENTINEL = -32768.0  # exact in bf16, and never drawn by randn
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
FP8_STORAGE = torch.uint8  # vLLM's fp8 KV cache: bytes, viewed as float8 where it is read

pytestmark = pytest.mark.interpretable


def sentinel(dtype):
    """What an untouched cache element holds: never drawn by :func:`random_kv`."""
    return 0xFF if dtype == FP8_STORAGE else SENTINEL  # 0xFF is a NaN in e4m3


def random_kv(shape, dtype=DTYPE):
    """Random K/V as a cache of ``dtype`` holds them (any byte but the sentinel for fp8)."""
    if dtype == FP8_STORAGE:
        return torch.randint(0, 0xFF, shape, dtype=dtype, device=DEVICE)
    return torch.randn(shape, device=DEVICE).to(dtype)


def paged_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=DTYPE):
    """vLLM FLASH_ATTN's cache: logical (blocks, H, block_size, 2D), physical NHD; K/V views."""
    raw = torch.full((num_blocks, block_size, num_kv_heads, 2 * head_size), sentinel(dtype),
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
    from vllm_nwor.nwor.kernels import commit_kv as module

    launcher = module._COMMIT
    jit = _CountingJit(launcher.kernel)
    monkeypatch.setattr(launcher, "kernel", jit)
    monkeypatch.setattr(launcher, "_compiled", {})

    def run(misaligned=False):
        src, dst = scratch_rows(12, 8, 16)
        if misaligned:  # the same slots, one int64 (8 bytes) past a 16-byte boundary
            flat = torch.empty(1 + dst.numel(), dtype=torch.int64, device=DEVICE)
            dst = flat[1:].copy_(dst)
            assert dst.data_ptr() % 16 != 0
        assert_commit_matches_reference(2, 8, 16, 8, 128, src, dst)

    run()
    assert jit.launches == 1 and len(launcher._compiled) == 1
    for _ in range(3):
        run()
    assert jit.launches == 1  # three launches through the compiled kernel's launcher
    run(misaligned=True)
    assert jit.launches == 2  # the JIT, which compiles for the unaligned pointer
    run()
    assert jit.launches == 2  # and the aligned layout is still launched directly


# -- commit_kv ---------------------------------------------------------------------------------


def layer_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype=DTYPE):
    """Separate allocations per layer, as vLLM makes them."""
    caches = [paged_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
              for _ in range(num_layers)]
    return [c[0] for c in caches], [c[1] for c in caches], [c[2] for c in caches]


def scratch_rows(n, num_blocks, block_size):
    """``(src, dst)`` for ``n`` rows: sources in the last two blocks (the scratch), destinations
    in the others, distinct, some -1 (rows of requests without drafts, padding)."""
    src = (num_blocks - 2) * block_size + torch.randperm(2 * block_size, device=DEVICE)[:n]
    dst = torch.randperm((num_blocks - 2) * block_size, device=DEVICE)[:n]
    dst[torch.rand(n, device=DEVICE) < 0.25] = -1
    return src.long(), dst.long()


def assert_commit_matches_reference(num_layers, num_blocks, block_size, num_kv_heads, head_size,
                                    src, dst, verdict_of=None, dtype=DTYPE):
    """The kernel and the reference commit the same bytes from scratch blocks filled with
    random K/V (each layer its own); everything else keeps the sentinel. Returns the first
    run's caches and the counts each run added to ``committed`` (from 40)."""
    torch.manual_seed(3)
    scratch = random_kv((num_layers, 2, block_size, num_kv_heads, 2 * head_size), dtype)
    results, counted = [], []
    for fn in (commit_kv, commit_kv_reference):
        raws, key_caches, value_caches = layer_caches(num_layers, num_blocks, block_size,
                                                      num_kv_heads, head_size, dtype)
        for layer, raw in enumerate(raws):
            raw[-2:] = scratch[layer]
        committed = torch.full((), 40, dtype=torch.int64, device=DEVICE)
        verdict = verdict_of(committed) if verdict_of else None
        fn(key_caches, value_caches, src, dst, verdict=verdict)
        results.append(raws)
        counted.append(int(committed) - 40)
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    assert counted[0] == counted[1]
    return results[0], counted[0]


def written_below(raw, num_blocks) -> list[int]:
    """Slots below the last two blocks that no longer hold the sentinel."""
    written = (raw[:num_blocks] != sentinel(raw.dtype)).all(-1).all(-1).flatten()
    return sorted(torch.nonzero(written).flatten().tolist())


@pytest.mark.parametrize("num_rows", [0, 1, 13])
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 8), (128, 1), (256, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [DTYPE, FP8_STORAGE], ids=["float", "fp8"])
def test_commit_kv_copies_every_row_with_a_destination(num_rows, head_size, num_kv_heads,
                                                       block_size, dtype):
    torch.manual_seed(num_rows + head_size + block_size)
    src, dst = scratch_rows(num_rows, 6, block_size)
    raws, _ = assert_commit_matches_reference(3, 6, block_size, num_kv_heads, head_size, src, dst,
                                              dtype=dtype)
    for raw in raws:
        assert written_below(raw, 4) == sorted(d for d in dst.tolist() if d >= 0)
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            if d >= 0:  # the scratch row's bytes, in the row's own slot
                assert torch.equal(raw[d // block_size, d % block_size],
                                   raw[s // block_size, s % block_size])
    if len([d for d in dst.tolist() if d >= 0]):
        assert not torch.equal(raws[0][:4], raws[1][:4])  # own data per layer


@pytest.mark.parametrize("pattern", ["mixed", "all_rejected", "all_accepted", "one"])
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 8), (128, 1), (256, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_commit_kv_reads_the_samplers_verdict_like_the_reference(pattern, head_size,
                                                                 num_kv_heads, block_size):
    """With the verdict read in the kernel: a request's last sampled token and its accepted
    drafts are copied, rejected drafts are not, and the accepted drafts are counted."""
    from vllm_nwor.nwor.verify_step import VerifyStep

    torch.manual_seed(11)
    counts = [1] if pattern == "one" else [3, 0, 5, 2, 1]  # drafts per request
    if pattern == "all_rejected":
        accepted = [0] * len(counts)
    elif pattern in ("all_accepted", "one"):
        accepted = counts
    else:
        accepted = [int(torch.randint(0, c + 1, ())) for c in counts]
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + 1 + c)
    step = VerifyStep.from_batch(counts, qsl, DEVICE)
    sampled = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32, device=DEVICE)
    for row, count in enumerate(accepted):
        sampled[row, : count + 1] = 5
    src, dst = scratch_rows(qsl[-1], 6, block_size)
    dst = torch.randperm(4 * block_size, device=DEVICE)[: qsl[-1]]  # every row has a slot,
    for i, c in enumerate(counts):
        if c == 0:
            dst[qsl[i]] = -1  # but a request without drafts wrote its own: nothing to commit
    raws, counted = assert_commit_matches_reference(
        3, 6, block_size, num_kv_heads, head_size, src, dst,
        lambda committed: step.verdict(sampled, committed))
    assert counted == sum(accepted)
    kept = [int(dst[qsl[i] + j]) for i in range(len(counts)) for j in range(1 + accepted[i])
            if int(dst[qsl[i] + j]) >= 0]
    for raw in raws:
        assert written_below(raw, 4) == sorted(kept)


@pytest.mark.skipif(not ON_GPU, reason="the compiled launcher exists on the GPU only")
def test_a_steps_commit_launches_the_compiled_kernel(monkeypatch):
    """The commit as a verify step makes it (its verdict's indices from the step's one upload)
    goes through the JIT once, then through the compiled kernel, with the reference's bytes."""
    from vllm_nwor.nwor.kernels import commit_kv as module
    from vllm_nwor.nwor.verify_step import IndexUploader, VerifyStep

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
        src, dst = scratch_rows(11, 4, 16)
        dst[[0, 1, 2, 7, 8, 9, 10]] = torch.arange(7, device=DEVICE)  # the drafting requests'
        dst[3:7] = -1
        _, counted = assert_commit_matches_reference(
            2, 4, 16, 8, 128, src, dst,
            lambda committed, step=step, sampled=sampled: step.verdict(sampled, committed))
        assert counted == sum(accepted)
    assert jit.launches == 1 and len(launcher._compiled) == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a >4 GiB cache on the GPU")
def test_plan_and_commit_reach_offsets_beyond_32_bits():
    """The scratch blocks sit at the end of the cache: past 2**31 elements in a large one."""
    head_size, num_kv_heads, block_size = 128, 8, 16
    block_elems = block_size * num_kv_heads * 2 * head_size
    num_blocks = (2**31) // block_elems + 64  # the last blocks start past 2**31 elements
    raw, key_cache, value_cache = paged_cache(num_blocks, block_size, num_kv_heads, head_size)
    raw[:2] = torch.randn(raw[:2].shape, device=DEVICE).to(DTYPE)  # committed tokens
    offsets = cache_offsets([key_cache], [value_cache])
    # One request, 20 committed tokens (blocks 0 and 1), 3 rows: positions 20-22 in block 1.
    per_request, total = scratch_blocks(1, 2, block_size)
    base = num_blocks - total
    block_table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    slot_mapping = torch.tensor([20, 21, 22], device=DEVICE)
    table = torch.zeros_like(block_table)
    write_slots, commit_slots = (torch.full((3,), -1, device=DEVICE) for _ in range(2))
    plan_scratch(block_table, torch.tensor([0, 3], dtype=torch.int32, device=DEVICE),
                 torch.tensor([23], dtype=torch.int32, device=DEVICE),
                 torch.tensor([-1, 0, 1], device=DEVICE), slot_mapping, table, write_slots,
                 commit_slots, [key_cache], [value_cache], offsets, base, per_request)
    assert table.tolist() == [[0, base, 2]]
    assert write_slots.tolist() == [base * block_size + 4 + j for j in range(3)]
    assert torch.equal(raw[base, :4], raw[1, :4])  # the committed tail, copied past 2**31
    raw[base, 4:7] = 3.0  # what vLLM's write would put there
    commit_kv([key_cache], [value_cache], write_slots, commit_slots, offsets)
    assert bool((raw[1, 4:7] == 3.0).all()) and bool((raw[2] == SENTINEL).all())
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
    # (31, 2, 1) and (63, 4, 3): the last sampled token ends a block (16 or 32), which the
    # scheduler may already share; (40, 25, 3): rows before the drafts span several blocks.
    [(31, 2, 1), (0, 0, 0), (64, 9, 8), (63, 4, 3), (40, 25, 3)],
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


def own_slots(requests, block_table, qsl, block_size, padding=0):
    """vLLM's slot mapping of the step: each row's slot in its request's own blocks, then
    ``padding`` rows of -1 (a CUDA graph's)."""
    slots = []
    for i, (c, q, _) in enumerate(requests):
        slots += [int(block_table[i, pos // block_size]) * block_size + pos % block_size
                  for pos in range(c, c + q)]
    return torch.tensor(slots + [-1] * padding, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("requests", SCRATCH_STEPS)
@pytest.mark.parametrize("head_size,num_kv_heads", [(64, 1), (128, 8), (256, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [DTYPE, FP8_STORAGE], ids=["float", "fp8"])
def test_plan_scratch_matches_reference(requests, head_size, num_kv_heads, block_size, dtype):
    torch.manual_seed(len(requests) + head_size + block_size)
    per_request, total = scratch_blocks(len(requests), 8, block_size)
    base = 128
    block_table, qsl, seq_lens, stage_index = scratch_step(requests, block_size, base)
    slot_mapping = own_slots(requests, block_table, qsl, block_size, padding=2)
    committed = random_kv((3, base, block_size, num_kv_heads, 2 * head_size), dtype)
    results = []
    for fn in (plan_scratch, plan_scratch_reference):
        raws, key_caches, value_caches = layer_caches(3, base + total, block_size, num_kv_heads,
                                                      head_size, dtype)
        for layer, raw in enumerate(raws):
            raw[:base] = committed[layer]
        table = torch.full((len(requests) + 2, block_table.shape[1]), -5, dtype=torch.int32,
                           device=DEVICE)
        write_slots, commit_slots = (torch.full((int(qsl[-1]) + 4,), -9, dtype=torch.int64,
                                                device=DEVICE) for _ in range(2))
        args = (block_table, qsl, seq_lens, stage_index, slot_mapping, table, write_slots,
                commit_slots, key_caches, value_caches)
        if fn is plan_scratch:
            fn(*args, cache_offsets(key_caches, value_caches), base, per_request)
        else:
            fn(*args, base, per_request)
        results.append((table, write_slots, commit_slots, *raws))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    table, write_slots, commit_slots, raw = results[0][:4]
    n = int(qsl[-1])
    assert write_slots[n:n + 2].tolist() == [-1, -1]  # a graph's padding rows: vLLM's slot -1
    assert write_slots[n + 2:].tolist() == commit_slots[n + 2:].tolist() == [-9, -9]
    for i, (c, q, d) in enumerate(requests):  # the reference's meaning, spelled out once
        first = base + i * per_request
        rows = range(int(qsl[i]), int(qsl[i + 1]))
        if not d:
            assert torch.equal(table[i], block_table[i])
            assert write_slots[rows].tolist() == slot_mapping[rows].tolist()
            assert commit_slots[rows].tolist() == [-1] * q
            continue
        lo = (c + q - d) // block_size  # the scratch span starts at the first draft's block
        for pos in range(c, c + q):
            row = int(qsl[i]) + pos - c
            if pos < lo * block_size:  # before the span: vLLM's slot, written in the forward
                assert int(table[i, pos // block_size]) == int(block_table[i, pos // block_size])
                assert int(write_slots[row]) == int(slot_mapping[row])
                assert int(commit_slots[row]) == -1
                continue
            scratch = first + pos // block_size - lo
            assert int(table[i, pos // block_size]) == scratch
            assert int(write_slots[row]) == scratch * block_size + pos % block_size
            assert int(commit_slots[row]) == int(slot_mapping[row])
        for pos in range(lo * block_size, c):  # the committed tail, copied
            src = int(block_table[i, pos // block_size])
            assert torch.equal(raw[first, pos % block_size], raw[src, pos % block_size])


@pytest.mark.skipif(not ON_GPU, reason="needs vLLM's CUDA ops and FlashAttention")
@pytest.mark.parametrize("head_size,group", [(64, 1), (128, 4), (128, 8), (256, 2)])
@pytest.mark.parametrize("requests", SCRATCH_STEPS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_vllms_write_through_the_plan_then_the_commit_equals_vllms_plain_write(
        head_size, group, requests, kv_cache_dtype):
    """Staged: the plan, vLLM's own ``reshape_and_cache_flash`` through its write slots, vLLM's
    FA call over its table. Plain: vLLM's write through vLLM's slots, the same call over vLLM's
    table. The attention outputs are bit-identical; no draft reaches its own block before the
    commit; after a commit of every row, the blocks below the scratch hold exactly the plain
    write's bytes. With an fp8 cache vLLM's write quantizes with its scales and FA3 reads with
    its descales, as vLLM calls them: what lifting NWOR's fp8 refusal would rest on (it stays
    until this and an engine test pass on the GPU)."""
    from vllm._custom_ops import reshape_and_cache_flash
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    fp8 = kv_cache_dtype == "fp8"
    torch.manual_seed(head_size + group + len(requests))
    num_kv_heads, block_size, base = 2, 16, 128
    per_request, total = scratch_blocks(len(requests), 8, block_size)
    block_table, qsl, seq_lens, stage_index = scratch_step(requests, block_size, base)
    n = int(qsl[-1])
    key, value = rows(n, num_kv_heads, head_size)
    slots = own_slots(requests, block_table, qsl, block_size)
    read_as = torch.float8_e4m3fn if fp8 else DTYPE
    query = torch.randn(n, group * num_kv_heads, head_size, device=DEVICE).to(read_as)
    k_scale, v_scale = (torch.tensor(s if fp8 else 1.0, device=DEVICE) for s in (0.02, 0.03))
    descales = {}
    if fp8:
        shape = (len(requests), num_kv_heads)
        descales = dict(q_descale=torch.ones(shape, device=DEVICE),
                        k_descale=k_scale.expand(shape), v_descale=v_scale.expand(shape))

    def write(key_cache, value_cache, slot_mapping):
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                k_scale, v_scale)

    def attend(key_cache, value_cache, table):
        out = torch.empty(n, group * num_kv_heads, head_size, dtype=DTYPE, device=DEVICE)
        flash_attn_varlen_func(
            q=query, k=key_cache.view(read_as), v=value_cache.view(read_as), out=out,
            cu_seqlens_q=qsl, max_seqlen_q=max(q for _, q, _ in requests), seqused_k=seq_lens,
            max_seqlen_k=int(seq_lens.max()), softmax_scale=head_size**-0.5, causal=True,
            block_table=table, fa_version=3, **descales)
        return out

    raws, key_caches, value_caches = layer_caches(1, base + total, block_size, num_kv_heads,
                                                  head_size, FP8_STORAGE if fp8 else DTYPE)
    # Finite values in every block (fp8's sentinel byte is a NaN, which FA3's masked loads
    # would carry into the output).
    raws[0].copy_(torch.randn(raws[0].shape, device=DEVICE).to(read_as).view(raws[0].dtype))
    plain_raw = raws[0].clone()
    plain_key, plain_value = plain_raw[..., :head_size], plain_raw[..., head_size:]
    write(plain_key, plain_value, slots)
    want = attend(plain_key, plain_value, block_table)

    table = torch.zeros_like(block_table)
    write_slots, commit_slots = (torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
                                 for _ in range(2))
    offsets = cache_offsets(key_caches, value_caches)
    plan_scratch(block_table, qsl, seq_lens, stage_index, slots, table, write_slots,
                 commit_slots, key_caches, value_caches, offsets, base, per_request)
    before = raws[0][:base].clone()
    write(key_caches[0], value_caches[0], write_slots)
    assert torch.equal(attend(key_caches[0], value_caches[0], table), want)
    flat_before = before.view(-1, num_kv_heads, 2 * head_size)
    flat_after = raws[0][:base].reshape(-1, num_kv_heads, 2 * head_size)
    drafts = slots[stage_index >= 0]
    assert torch.equal(flat_after[drafts], flat_before[drafts]), "a draft reached its block"
    commit_kv(key_caches, value_caches, write_slots, commit_slots, offsets)
    assert torch.equal(raws[0][:base], plain_raw[:base])
