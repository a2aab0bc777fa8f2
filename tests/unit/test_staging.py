"""The staging core: the interceptor's lifecycle, fallbacks, counters (no vLLM needed).

A fake paged cache (one ``[slots, heads, dim]`` tensor pair per layer, filled with a sentinel)
stands in for vLLM's; ``plain_write`` plays vLLM's write op, skipping slot -1 as vLLM does. The
fused ops are FLASH_ATTN's (:class:`ScratchStaging`) over that cache seen as blocks of one slot,
with the kernels' PyTorch references (what the Triton kernels are tested against on the GPU):
the last slots are the scratch blocks, and the requests' own slots lie below them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_nwor.nwor.counters import FallbackReason
from vllm_nwor.nwor.interceptor import NworInterceptor
from vllm_nwor.nwor.kernels._common import HAS_TRITON, next_power_of_2, triton
from vllm_nwor.nwor.kernels.commit_kv import copy_rows_reference
from vllm_nwor.nwor.kernels.scratch import scratch_blocks
from vllm_nwor.nwor.kv_staging import PAD_SLOT_ID, ScratchStaging, StagedLayers
from vllm_nwor.nwor.verify_step import IndexUploader, StagingOverflow, VerifyStep

SENTINEL = -777.0
NUM_LAYERS, HEADS, DIM, NUM_SLOTS = 4, 2, 8, 64

# A batch of three requests: a verify step with 2 drafts (rows 0-2), a prefill chunk with no
# drafts (rows 3-6), and a verify step with 3 drafts (rows 7-10). Slots 20.. in batch order.
NUM_DRAFTS = [2, 0, 3]
QUERY_START_LOC = [0, 3, 7, 11]
NUM_ROWS = 11
SLOTS = torch.arange(20, 20 + NUM_ROWS)
DRAFT_ROWS = [1, 2, 8, 9, 10]
PADDED_ROWS = 16  # a CUDA graph's size for the batch
CONTEXT = 2  # committed positions of each request before its rows, in blocks 0-5
SCRATCH_BASE = NUM_SLOTS - scratch_blocks(len(NUM_DRAFTS), max(NUM_DRAFTS), 1)[1]


class FakeCache:
    """Per-layer K/V caches indexed by slot, and vLLM's write semantics (slot -1 = skip)."""

    def __init__(self) -> None:
        self.key = torch.full((NUM_LAYERS, NUM_SLOTS, HEADS, DIM), SENTINEL)
        self.value = torch.full((NUM_LAYERS, NUM_SLOTS, HEADS, DIM), SENTINEL)
        self.writes: list[tuple[int, list[int]]] = []
        self.broken: Exception | None = None  # set: every write raises it

    def plain_write(self, layer_idx, key, value, slot_mapping) -> None:
        if self.broken is not None:
            raise self.broken
        n = len(slot_mapping)
        keep = slot_mapping >= 0
        self.key[layer_idx, slot_mapping[keep]] = key[:n][keep]
        self.value[layer_idx, slot_mapping[keep]] = value[:n][keep]
        self.writes.append((layer_idx, slot_mapping[keep].tolist()))

    def written_slots(self, layer_idx, below: int = SCRATCH_BASE) -> set[int]:
        written = (self.key[layer_idx, :below] != SENTINEL).all(-1).all(-1)
        return set(torch.nonzero(written).flatten().tolist())


def layer_kv(layer_idx: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V whose values identify their layer and row, so a misplaced write shows."""
    base = torch.arange(num_tokens * HEADS * DIM, dtype=torch.float32).view(num_tokens, HEADS, DIM)
    return base + 1000 * layer_idx, -(base + 1000 * layer_idx) - 1


def step_metadata() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table, query starts and sequence lengths of the batch: request ``i``'s context in
    blocks ``2i, 2i + 1``, its rows in the blocks of their slots (20.. in batch order)."""
    table = torch.zeros((len(NUM_DRAFTS), CONTEXT + 4), dtype=torch.int32)
    for i in range(len(NUM_DRAFTS)):
        start, end = QUERY_START_LOC[i], QUERY_START_LOC[i + 1]
        table[i, :CONTEXT] = torch.tensor([2 * i, 2 * i + 1])
        table[i, CONTEXT:CONTEXT + end - start] = SLOTS[start:end]
    seq_lens = torch.tensor([CONTEXT + QUERY_START_LOC[i + 1] - QUERY_START_LOC[i]
                             for i in range(len(NUM_DRAFTS))], dtype=torch.int32)
    return table, torch.tensor(QUERY_START_LOC, dtype=torch.int32), seq_lens


def make_interceptor(cache: FakeCache, max_tokens: int = 16, commit_fn=None,
                     uploader: IndexUploader | None = None) -> NworInterceptor:
    blocks = [c.unsqueeze(1) for c in cache.key], [c.unsqueeze(1) for c in cache.value]
    staging = ScratchStaging(*blocks, cache.plain_write, step_metadata, len(NUM_DRAFTS),
                             max(NUM_DRAFTS), PADDED_ROWS)
    stage_fn, commit, write_back = staging.ops()
    return NworInterceptor(StagedLayers(NUM_LAYERS, max_tokens), cache.plain_write,
                           stage_fn=stage_fn, commit_fn=commit_fn or commit,
                           write_back=write_back, kv_bytes_per_token=100, uploader=uploader)


def staging_of(interceptor: NworInterceptor) -> ScratchStaging:
    return interceptor.write_back.__self__


def run_forward(interceptor: NworInterceptor, layers=range(NUM_LAYERS)) -> None:
    for layer_idx in layers:
        key, value = layer_kv(layer_idx, NUM_ROWS)
        interceptor.stage(layer_idx, key, value, SLOTS)


def sampled(accepted_per_request: list[int]) -> torch.Tensor:
    """A rejection-sampler output with the given accepted drafts per request (-1 = rejected)."""
    out = torch.full((len(NUM_DRAFTS), max(NUM_DRAFTS) + 1), -1)
    for i, accepted in enumerate(accepted_per_request):
        out[i, : accepted + 1] = 7
    return out


def expected_slots(accepted_per_request: list[int]) -> set[int]:
    """Non-draft rows plus accepted drafts: what must be in the cache after the step."""
    rows = set(range(NUM_ROWS)) - set(DRAFT_ROWS)
    for i, accepted in enumerate(accepted_per_request):
        end = QUERY_START_LOC[i + 1]
        rows |= set(range(end - NUM_DRAFTS[i], end - NUM_DRAFTS[i] + accepted))
    return {20 + r for r in rows}


def assert_cache_holds(cache: FakeCache, slots: set[int], below: int = SCRATCH_BASE) -> None:
    """Exactly ``slots`` below slot ``below`` are written, each with its row's K/V."""
    for layer_idx in range(NUM_LAYERS):
        assert cache.written_slots(layer_idx, below) == slots, f"layer {layer_idx}"
        key, value = layer_kv(layer_idx, NUM_ROWS)
        for slot in slots:
            assert torch.equal(cache.key[layer_idx, slot], key[slot - 20])
            assert torch.equal(cache.value[layer_idx, slot], value[slot - 20])


def begin(interceptor: NworInterceptor) -> VerifyStep:
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu")
    assert step is not None and interceptor.begin(step)
    return step


# -- VerifyStep --------------------------------------------------------------------------------


def test_verify_step_places_drafts_at_the_end_of_each_request():
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu")
    assert step.draft_rows.tolist() == DRAFT_ROWS
    assert step.row_stage_index.tolist() == [-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4]
    assert step.token_req.tolist() == [0, 0, 2, 2, 2]
    assert step.token_pos.tolist() == [0, 1, 0, 1, 2]
    assert VerifyStep.from_batch([0, 0], [0, 1, 5], "cpu") is None


def test_each_index_array_starts_on_a_16_byte_boundary():
    """The commit kernel's compiled form takes only 16-byte aligned pointers (kernels._common.
    Launcher); the step's arrays share one upload, so each is placed at an even int64 offset."""
    uploader = IndexUploader(64, "cpu")
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", uploader)
    views = (step.row_stage_index, step.draft_rows, step.token_req, step.token_pos)
    assert NUM_ROWS % 2 == 1 and len(step.draft_rows) % 2 == 1  # odd lengths: padding needed
    assert [v.data_ptr() % 16 for v in views] == [0, 0, 0, 0]
    assert step.row_stage_index.data_ptr() == uploader._device_buffer.data_ptr()  # graphs read it


@pytest.mark.parametrize("n,want", [(0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (128, 128),
                                    (129, 256)])
def test_the_kernels_host_next_power_of_2_is_tritons(n, want):
    """The kernel wrappers' constexpr sizes come from a host helper, not from Triton's constexpr
    function (about 2 µs a call); both must give the same sizes."""
    assert next_power_of_2(n) == want
    if HAS_TRITON:
        assert all(next_power_of_2(m) == triton.next_power_of_2(m) for m in range(n + 1))


def test_the_verdict_reads_the_sampler_output():
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu")
    counter = torch.zeros((), dtype=torch.int64)
    verdict = step.verdict(sampled([1, 0, 3]), counter)
    assert verdict.accepted().tolist() == [True, False, True, True, True]
    assert step.verdict(sampled([0, 0, 0]), counter).accepted().tolist() == [False] * 5


def test_a_repeated_step_is_not_uploaded_again_unless_its_rows_were_overwritten():
    uploader = IndexUploader(64, "cpu")
    first = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", uploader)
    uploader._device_buffer[NUM_ROWS:].fill_(99)  # past the step: no upload would restore it
    again = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", uploader)
    assert again is first, "a repeated step is the last one, not built again"
    assert uploader._device_buffer[NUM_ROWS] == 99, "the same indices were copied again"
    uploader.rows(NUM_ROWS).fill_(-1)  # what unstage_rows does for a step that is not staged
    after = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", uploader)
    assert after is not first
    assert after.row_stage_index.tolist() == [-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4]
    assert after.draft_rows.tolist() == DRAFT_ROWS
    other = VerifyStep.from_batch([1, 0, 1], QUERY_START_LOC, "cpu", uploader)
    assert other.num_draft_tokens == (1, 0, 1) and other.num_tokens == 2


# -- commit ------------------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [[1, 0, 2], [0, 0, 0], [2, 0, 3]])
def test_commit_writes_exactly_non_draft_rows_and_accepted_drafts(accepted):
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    # Before the verdict: only non-draft rows are in the cache, for every layer.
    for layer_idx in range(NUM_LAYERS):
        assert cache.written_slots(layer_idx) == expected_slots([0, 0, 0])
    interceptor.commit(sampled(accepted))
    assert_cache_holds(cache, expected_slots(accepted))
    counters = interceptor.counters()
    assert counters.verify_steps_staged == 1
    assert counters.tokens_staged == 5
    assert counters.tokens_committed == sum(accepted)
    assert counters.tokens_rejected == 5 - sum(accepted)
    assert counters.rejected_kv_bytes == 100 * (5 - sum(accepted))
    assert counters.fallbacks == {}
    assert not interceptor.active


def test_attention_knows_which_layers_are_staged_until_commit():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    assert not interceptor.is_staged(0)  # layer 0 has not staged yet
    run_forward(interceptor, layers=[0])
    assert interceptor.is_staged(0) and not interceptor.is_staged(1)
    scratch = staging_of(interceptor).write_slots[DRAFT_ROWS]  # where layer 0 put its drafts
    assert (scratch >= SCRATCH_BASE).all()
    key, value = layer_kv(0, NUM_ROWS)
    assert torch.equal(cache.key[0, scratch], key[DRAFT_ROWS])
    assert torch.equal(cache.value[0, scratch], value[DRAFT_ROWS])
    run_forward(interceptor, layers=[1, 2, 3])
    interceptor.commit(sampled([0, 0, 0]))
    assert not interceptor.is_staged(0)


def test_the_next_step_starts_with_nothing_staged():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor, layers=[0, 1])
    interceptor.commit(sampled([0, 0, 0]))
    begin(interceptor)
    assert not interceptor.staged.holds_data()
    assert not any(interceptor.is_staged(layer) for layer in range(NUM_LAYERS))
    run_forward(interceptor, layers=[0, 1])
    assert interceptor.staged.holds_data() and interceptor.is_staged(1)
    assert not interceptor.staged.is_complete()


def test_duplicate_staging_counts_unique_tokens_not_operations():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    run_forward(interceptor)  # every layer staged twice
    interceptor.commit(sampled([2, 0, 3]))
    assert interceptor.counters().tokens_staged == 5
    assert_cache_holds(cache, expected_slots([2, 0, 3]))


def test_a_step_of_more_drafts_than_a_step_may_stage_overflows():
    staged = StagedLayers(NUM_LAYERS, 8)
    staged.reset(8)
    with pytest.raises(StagingOverflow, match="9 draft tokens exceed the 8 a step may stage"):
        staged.reset(9)
    with pytest.raises(ValueError, match="num_layers >= 1"):
        StagedLayers(0, 8)


# -- fallbacks ---------------------------------------------------------------------------------


def test_overflow_goes_to_fallback_and_plain_writes():
    cache = FakeCache()
    interceptor = make_interceptor(cache, max_tokens=4)  # the step has 5 drafts
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu")
    assert interceptor.begin(step) is False
    assert not interceptor.active
    assert interceptor.counters().fallbacks == {"overflow": 1}
    # Not active: the runner's layers take vLLM's write themselves.
    with pytest.raises(RuntimeError, match="outside a verify step"):
        run_forward(interceptor)


@pytest.mark.parametrize("fail_at", [0, 2, 3])
def test_commit_failure_at_layer_l_falls_back_with_the_cache_correct(fail_at):
    """A commit that wrote some layers' accepted rows and raised, without counting (as
    ``CommitFn`` says): the write-back commits every layer again, and counts once."""
    cache = FakeCache()

    def failing_commit(verdict):
        staging = staging_of(interceptor)
        rows = verdict.row_stage_index.shape[0]
        copy_rows_reference(staging.key_caches, staging.value_caches, staging.write_slots[:rows],
                            verdict.keep_rows(staging.commit_slots[:rows]), range(fail_at))
        raise RuntimeError("injected commit failure")

    interceptor = make_interceptor(cache, commit_fn=failing_commit)
    begin(interceptor)
    run_forward(interceptor)
    interceptor.commit(sampled([1, 0, 2]))
    assert_cache_holds(cache, expected_slots([1, 0, 2]))
    counters = interceptor.counters()
    assert counters.fallbacks == {"commit_error": 1}
    # The NWOR guarantee held: rejected drafts were not written, so the step still counts.
    assert counters.tokens_committed == 3 and counters.tokens_rejected == 2


def test_a_step_that_cannot_be_built_is_written_by_vllm_and_the_engine_goes_on():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    # More drafts than the request's rows: VerifyStep.from_batch raises.
    assert not interceptor.begin_batch([5, 0, 3], QUERY_START_LOC, "cpu")
    assert interceptor.step is None
    assert interceptor.counters().fallbacks == {"stage_error": 1}
    for layer_idx in range(NUM_LAYERS):  # not staged: the layers' writes are vLLM's own
        key, value = layer_kv(layer_idx, NUM_ROWS)
        assert not interceptor.active
        cache.plain_write(layer_idx, key, value, SLOTS)
    assert interceptor.begin_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu")  # the next step stages
    run_forward(interceptor)
    interceptor.commit(sampled([1, 0, 2]))
    assert interceptor.counters().tokens_committed == 3


def test_commit_failure_with_failing_plain_writes_is_not_swallowed():
    cache = FakeCache()
    interceptor = make_interceptor(cache, commit_fn=lambda *_: 1 / 0)
    begin(interceptor)
    run_forward(interceptor)
    cache.broken = OSError("device lost")
    with pytest.raises(OSError, match="device lost"):
        interceptor.commit(sampled([1, 0, 2]))


@pytest.mark.parametrize("fail_layer", [0, 1, 3])
def test_stage_failure_is_all_or_nothing(fail_layer):
    """A layer that cannot stage sends the whole step down vLLM's write path."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    stage = interceptor.stage_fn

    def flaky_stage(layer_idx, *args):
        if layer_idx == fail_layer:
            raise RuntimeError("injected staging failure")
        stage(layer_idx, *args)

    interceptor.stage_fn = flaky_stage
    run_forward(interceptor)
    # Every layer now holds every row, drafts included, as vLLM would have written them.
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)})
    assert not any(interceptor.is_staged(layer) for layer in range(NUM_LAYERS))
    interceptor.commit(sampled([0, 0, 0]))
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)})
    counters = interceptor.counters()
    assert counters.fallbacks == {"stage_error": 1}
    assert counters.verify_steps_staged == 0 and counters.tokens_staged == 0


def test_fake_tensors_fall_back():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    with FakeTensorMode() as mode:
        key = mode.from_tensor(layer_kv(0, NUM_ROWS)[0])
        value = mode.from_tensor(layer_kv(0, NUM_ROWS)[1])
        slots = mode.from_tensor(SLOTS)
    seen = []
    interceptor.plain_write = lambda layer, k, v, s: seen.append((layer, s is slots))
    interceptor.stage(0, key, value, slots)
    assert seen == [(0, True)]  # plain write with the untouched slot mapping
    assert interceptor.counters().fallbacks == {"fake_tensor": 1}


def test_a_layer_with_another_slot_mapping_falls_back():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor, layers=[0, 1])
    key, value = layer_kv(2, NUM_ROWS)
    interceptor.stage(2, key, value, SLOTS.clone())  # same values, different tensor
    run_forward(interceptor, layers=[3])
    interceptor.commit(sampled([0, 0, 0]))
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)})
    assert interceptor.counters().fallbacks == {"slot_mapping_mismatch": 1}


def test_a_step_without_commit_writes_its_drafts_at_the_next_begin():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    interceptor.begin(None)  # next step starts without a commit for this one
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)})
    assert interceptor.counters().fallbacks == {FallbackReason.NO_COMMIT.value: 1}
    assert not interceptor.active


def test_a_layer_that_never_staged_makes_the_commit_write_everything_staged():
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor, layers=[0, 1, 3])
    interceptor.commit(sampled([0, 0, 0]))
    for layer_idx in (0, 1, 3):
        assert cache.written_slots(layer_idx) == {20 + r for r in range(NUM_ROWS)}
    assert interceptor.counters().fallbacks == {"incomplete_staging": 1}


# -- seed 003's six bugs -----------------------------------------------------------------------


def test_seed_bug1_staging_starts_once_per_step_not_per_layer():
    """Bug 1: per-layer enable_staging let only layer 0 stage. Here every layer stages."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    assert all(interceptor.staged.is_staged(layer) for layer in range(NUM_LAYERS))
    assert all(interceptor.is_staged(layer) for layer in range(NUM_LAYERS))
    # No layer wrote a draft row directly.
    for layer_idx, slots in cache.writes:
        assert not {20 + r for r in DRAFT_ROWS} & set(slots), layer_idx
    interceptor.commit(sampled([2, 0, 3]))
    assert interceptor.counters().fallbacks == {}


def test_seed_bug2_each_layer_stages_at_its_own_index():
    """Bug 2: every layer defaulted to index 0 and overwrote the others."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    scratch = staging_of(interceptor).write_slots[DRAFT_ROWS]
    for layer_idx in range(NUM_LAYERS):
        key, _ = layer_kv(layer_idx, NUM_ROWS)
        assert torch.equal(cache.key[layer_idx, scratch], key[DRAFT_ROWS])


def test_seed_bug3_accepted_drafts_reach_the_cache():
    """Bug 3: commit was never called, so staged data never reached the cache."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    interceptor.commit(sampled([2, 0, 3]))
    for layer_idx in range(NUM_LAYERS):
        assert {20 + r for r in DRAFT_ROWS} <= cache.written_slots(layer_idx)


def test_seed_bug4_the_write_path_works_with_nwor_off_and_outside_verify_steps():
    """Bug 4: a variable defined only when NWOR was on crashed the plain path (NameError).

    The plain path here never touches step state; ruff's F821 (undefined name) guards the rest.
    """
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    assert interceptor.begin(None) is False
    assert not interceptor.is_staged(0) and interceptor.step is None
    interceptor.commit(torch.zeros(0, dtype=torch.bool))  # no step: nothing to do
    assert interceptor.counters().verify_steps_staged == 0


def test_seed_bug5_each_layer_commits_into_its_own_cache():
    """Bug 5: commit wrote every layer's K/V into one cache."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor)
    interceptor.commit(sampled([2, 0, 3]))
    assert_cache_holds(cache, expected_slots([2, 0, 3]))  # checks values per layer
    assert not torch.equal(cache.key[0], cache.key[1])


def test_seed_bug6_staging_a_layer_does_not_wipe_the_others():
    """Bug 6: a reset on every enable_staging wiped the staged mask of earlier layers."""
    cache = FakeCache()
    interceptor = make_interceptor(cache)
    begin(interceptor)
    run_forward(interceptor, layers=[0])
    run_forward(interceptor, layers=[1, 2, 3])
    assert interceptor.staged.is_complete()
    assert interceptor.staged.layers_with_data() == [0, 1, 2, 3]


# -- FULL CUDA graphs ----------------------------------------------------------------------------
# A captured graph runs the fused stage for every layer with the arguments it was captured with:
# the uploader's fixed row index, vLLM's slot mapping padded with -1 to the graph's size.


def graph_interceptor(cache: FakeCache, max_tokens: int = 16, commit_fn=None) -> NworInterceptor:
    return make_interceptor(cache, max_tokens, commit_fn, IndexUploader(64, "cpu"))


def replay_graph(interceptor: NworInterceptor) -> None:
    """What a FULL graph captured by stage_for_graph does at replay: no Python in the layers."""
    slots = torch.cat([SLOTS, torch.full((PADDED_ROWS - NUM_ROWS,), PAD_SLOT_ID)])
    for layer_idx in range(NUM_LAYERS):
        key, value = layer_kv(layer_idx, NUM_ROWS)
        pad = torch.full((PADDED_ROWS - NUM_ROWS, HEADS, DIM), 5.0)  # padding rows' K/V
        interceptor.stage_fn(layer_idx, torch.cat([key, pad]), torch.cat([value, pad]), slots,
                             interceptor.uploader.rows(PADDED_ROWS))


def captured(interceptor: NworInterceptor) -> NworInterceptor:
    """Capture: layers called with several tokens per request stage through the fixed rows."""
    seen = []
    stage_fn = interceptor.stage_fn
    interceptor.stage_fn = lambda layer_idx, key, value, slots, rows: seen.append(rows)
    interceptor.capturing = True
    assert interceptor.stages_in_graph(max_query_len=4)
    assert not interceptor.stages_in_graph(max_query_len=1)  # decode graphs stay vLLM's
    key, value = layer_kv(0, PADDED_ROWS)
    interceptor.stage_for_graph(0, key, value, torch.full((PADDED_ROWS,), PAD_SLOT_ID))
    assert seen[0].data_ptr() == interceptor.uploader.rows(PADDED_ROWS).data_ptr()
    interceptor.capturing, interceptor.stage_fn = False, stage_fn
    interceptor.graph_staging = True  # what stage_for_graph records when a CUDA stream captures
    return interceptor


def test_each_step_uploads_its_row_index_where_the_graph_reads_it():
    uploader = IndexUploader(64, "cpu")
    for num_drafts, qsl in ((NUM_DRAFTS, QUERY_START_LOC), ([1, 1], [0, 2, 4])):
        step = VerifyStep.from_batch(num_drafts, qsl, "cpu", uploader)
        assert step.row_stage_index.data_ptr() == uploader.rows(1).data_ptr()


@pytest.mark.parametrize("accepted", [[1, 0, 2], [0, 0, 0], [2, 0, 3]])
def test_a_replayed_graph_stages_and_the_commit_writes_accepted_drafts(accepted):
    cache = FakeCache()
    interceptor = captured(graph_interceptor(cache))
    for _ in range(2):  # the second step finds the first one's indices past its rows
        step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", interceptor.uploader)
        assert interceptor.begin(step)
        replay_graph(interceptor)
        interceptor.commit(sampled(accepted))
    assert_cache_holds(cache, expected_slots(accepted), below=SCRATCH_BASE)
    counters = interceptor.counters()
    assert counters.fallbacks == {} and interceptor.graph_steps == 2
    assert counters.tokens_committed == 2 * sum(accepted)


def test_a_commit_error_after_a_replayed_graph_writes_every_layer_the_plain_way():
    """No layer ran Python, so none is marked staged: the fallback must still write them all."""
    cache = FakeCache()
    interceptor = captured(graph_interceptor(cache, commit_fn=lambda *_: 1 / 0))
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", interceptor.uploader)
    assert interceptor.begin(step)
    replay_graph(interceptor)
    interceptor.commit(sampled([1, 0, 2]))
    assert_cache_holds(cache, expected_slots([1, 0, 2]), below=SCRATCH_BASE)
    assert interceptor.counters().fallbacks == {"commit_error": 1}
    assert interceptor.counters().tokens_committed == 3
    assert interceptor.graph_steps == 1


def test_a_replayed_graph_step_without_a_commit_is_written_back_in_every_layer():
    """No layer ran Python and no verdict came: every layer's rows, kept in scratch, are written
    back at the next step's begin as vLLM writes them, drafts too."""
    cache = FakeCache()
    interceptor = captured(graph_interceptor(cache))
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", interceptor.uploader)
    assert interceptor.begin(step)
    replay_graph(interceptor)
    interceptor.begin(None)
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)}, below=SCRATCH_BASE)
    assert interceptor.counters().fallbacks == {"no_commit": 1}


@pytest.mark.parametrize("why", ["no drafts", "overflow"])
def test_a_step_that_is_not_staged_replays_the_graph_writing_every_row(why):
    cache = FakeCache()
    interceptor = captured(graph_interceptor(cache, max_tokens=2 if why == "overflow" else 16))
    first = VerifyStep.from_batch([1, 0, 1], QUERY_START_LOC, "cpu", interceptor.uploader)
    assert interceptor.begin(first)  # a staged step leaves its indices in the rows
    replay_graph(interceptor)
    interceptor.commit(sampled([0, 0, 0]))  # its drafts rejected
    step = None if why == "no drafts" else VerifyStep.from_batch(
        NUM_DRAFTS, QUERY_START_LOC, "cpu", interceptor.uploader)
    assert not interceptor.begin(step)
    interceptor.unstage_rows(NUM_ROWS)  # what the runner does for such a step
    replay_graph(interceptor)
    assert_cache_holds(cache, {20 + r for r in range(NUM_ROWS)}, below=SCRATCH_BASE)


def test_a_graph_step_with_some_layers_run_in_python_is_incomplete():
    cache = FakeCache()
    interceptor = captured(graph_interceptor(cache))
    step = VerifyStep.from_batch(NUM_DRAFTS, QUERY_START_LOC, "cpu", interceptor.uploader)
    assert interceptor.begin(step)
    run_forward(interceptor, layers=[0, 1])
    interceptor.commit(sampled([0, 0, 0]))
    assert interceptor.counters().fallbacks == {"incomplete_staging": 1}
    assert interceptor.graph_steps == 0
    # Layers 0 and 1 staged: every row of theirs is written back as vLLM writes it, drafts too.
    assert all(cache.written_slots(layer, SCRATCH_BASE) == {20 + r for r in range(NUM_ROWS)}
               for layer in (0, 1))


# -- the core needs no vLLM --------------------------------------------------------------------


def test_core_modules_import_without_vllm():
    code = (
        "import sys, vllm_nwor, vllm_nwor.nwor.counters, vllm_nwor.nwor.kv_staging, "
        "vllm_nwor.nwor.interceptor, vllm_nwor.nwor.verify_step, vllm_nwor.scv, "
        "vllm_nwor.telemetry, vllm_nwor.config, "
        "vllm_nwor.inspect, vllm_nwor.plugin; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pad_slot_matches_vllm():
    assert PAD_SLOT_ID == -1
