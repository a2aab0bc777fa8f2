"""The FULL decode graphs for SCV's chunk sizes (patches/decode_graphs.py), without a GPU.

The capture and replay themselves need CUDA graphs (checked on the GPU by
``tests/gpu/test_engine_gpu.py``: greedy tokens with SCV's chunk sizes equal plain decoding's,
and the steps replayed FULL graphs); here, which batches are dispatched with which query length
and padding, and that vLLM's settings are restored afterwards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.patches.scv import decode_graphs

SIZES = [5, 10, 20, 25, 40]  # vLLM's capture sizes with k = 4: multiples of 5
VLLM_TABLE = decode_graphs.padding_table(SIZES, 40)


def fake_runner(keys=frozenset({"graph"})):
    runner = SimpleNamespace(
        uniform_decode_query_len=5,
        cudagraph_dispatcher=SimpleNamespace(uniform_decode_query_len=5,
                                             _bs_to_padded_graph_size=VLLM_TABLE))
    setattr(runner, decode_graphs.KEYS_ATTR, set(keys))
    setattr(runner, decode_graphs.PADDING_ATTR,
            {q: decode_graphs.padding_table(decode_graphs.graph_sizes(SIZES, q, 40, 8), 40)
             for q in range(1, 5)})
    return runner


def determine(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
              use_cascade_attn, allow_microbatching=True, force_eager=False,
              force_uniform_decode=None):
    """Records the query length and the padding vLLM's method would see."""
    dispatcher = self.cudagraph_dispatcher
    assert self.uniform_decode_query_len == dispatcher.uniform_decode_query_len
    return self.uniform_decode_query_len, dispatcher._bs_to_padded_graph_size[num_tokens]


wrapped = decode_graphs._wrap_determine_batch_execution_and_padding(determine)


def test_graph_sizes_and_padding():
    assert VLLM_TABLE[1] == 5 and VLLM_TABLE[11] == 20 and VLLM_TABLE[40] == 40
    assert decode_graphs.graph_sizes(SIZES, 1, 40, 8) == [5, 8]  # at most 8 requests
    assert decode_graphs.graph_sizes(SIZES, 2, 40, 8) == [6, 10, 16]
    assert decode_graphs.graph_sizes(SIZES, 3, 40, 8) == [6, 12, 21, 24]
    assert decode_graphs.graph_sizes(SIZES, 4, 40, 8) == [8, 12, 20, 28, 32]
    # The H200 benchmark's shape: k = 8, so vLLM's sizes are multiples of 9; 128 requests of 3
    # tokens are 384, between 369 and 387.
    nines = list(range(9, 505, 9))
    assert 384 in decode_graphs.graph_sizes(nines, 3, 504, 128)
    three = decode_graphs.padding_table([6, 12, 21], 40)
    assert three[1] == 6 and three[7] == 12 and three[21] == 21 and three[22] == 0


@pytest.mark.parametrize("num_tokens, num_reqs, max_tokens, force, seen", [
    (4, 4, 1, None, (1, 5)),     # every request at chunk 0: one-token graphs
    (8, 8, 1, None, (1, 8)),     # ... the full batch of 8 requests has its own size
    (4, 2, 2, None, (2, 6)),     # every request at chunk 1: two-token graphs (vLLM pads to 5)
    (12, 4, 3, None, (3, 12)),   # chunk 2 (vLLM pads to 20)
    (24, 8, 3, None, (3, 24)),   # chunk 2, the full batch (no rounded size is 24)
    (40, 8, 5, None, (5, 40)),   # a full-chunk batch: vLLM's own graphs
    (12, 8, 5, None, (5, 20)),   # mixed chunk sizes: PIECEWISE, as vLLM decides
    (4, 4, 1, True, (5, 5)),     # vLLM's capture runs (forced) are left alone
])
def test_uniform_batches_see_their_query_length(num_tokens, num_reqs, max_tokens, force, seen):
    runner = fake_runner()
    result = wrapped(runner, num_tokens, num_reqs, None, max_tokens, False,
                     force_uniform_decode=force)
    assert result == seen
    dispatcher = runner.cudagraph_dispatcher
    assert (runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len) == (5, 5)
    assert dispatcher._bs_to_padded_graph_size is VLLM_TABLE


def test_without_captured_graphs_nothing_changes():
    assert wrapped(fake_runner(keys=()), 4, 4, None, 1, False) == (5, 5)


def test_the_wrapper_fits_vllms_signature():
    """The keyword names the wrapper reads exist on vLLM 0.26's method."""
    import inspect

    params = inspect.signature(GPUModelRunner._determine_batch_execution_and_padding).parameters
    assert {"num_tokens", "num_reqs", "max_num_scheduled_tokens",
            "force_uniform_decode"} <= set(params)


def runner_for(scv="adaptive", mode="FULL_AND_PIECEWISE", query_len=5, dp=1, lora=None,
               chunk=None):
    from vllm.config import CUDAGraphMode

    parallel = SimpleNamespace(data_parallel_size=dp, use_ubatching=False)
    return SimpleNamespace(
        uniform_decode_query_len=query_len,
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]),
        vllm_config=SimpleNamespace(additional_config={"scv": scv, "scv_chunk_size": chunk},
                                    lora_config=lora, parallel_config=parallel),
    )


@pytest.mark.parametrize("runner, wanted", [
    (runner_for(), True),
    (runner_for(scv="off"), False),               # SCV off: every batch is vLLM's shape
    (runner_for(mode="PIECEWISE"), False),        # no FULL decode graphs (chosen by the user)
    (runner_for(mode="FULL"), False),             # one routine for all batches: nothing to add
    (runner_for(query_len=1), False),             # no speculation
    (runner_for(dp=2), False),                    # data parallel: left to vLLM
    (runner_for(lora=object()), False),
])
def test_extra_graphs_only_where_they_apply(runner, wanted):
    assert decode_graphs._wanted(runner) is wanted


@pytest.mark.parametrize("chunk, query_lens", [(None, [1, 2, 3, 4]), (2, [1, 2, 3]),
                                               (4, [1, 2, 3, 4])])
def test_query_lengths_are_scvs_chunk_sizes(chunk, query_lens):
    assert list(decode_graphs._query_lens(runner_for(chunk=chunk))) == query_lens


def test_keys_and_padding_tables_are_added_once_vllm_resolved_its_graphs():
    """The key-building wrapper, with a dispatcher that records keys (the capture is GPU-only)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    class Dispatcher:
        uniform_decode_query_len = 5
        _bs_to_padded_graph_size = VLLM_TABLE

        def __init__(self):
            self.added = []

        def _create_padded_batch_descriptor(self, size, uniform, has_lora):
            q = self.uniform_decode_query_len
            num_tokens = self._bs_to_padded_graph_size[size]
            return BatchDescriptor(num_tokens=num_tokens, num_reqs=num_tokens // q,
                                   uniform=uniform, has_lora=has_lora)

        def add_cudagraph_key(self, mode, key):
            self.added.append((mode, key.num_tokens, key.num_reqs))

    def wrapped(runner, mode="FULL_AND_PIECEWISE"):
        runner.compilation_config = SimpleNamespace(
            cudagraph_mode=CUDAGraphMode[mode], cudagraph_capture_sizes=SIZES,
            max_cudagraph_capture_size=40)
        runner.vllm_config.scheduler_config = SimpleNamespace(max_num_seqs=8)
        runner.cudagraph_dispatcher = Dispatcher()
        decode_graphs._wrap_check_and_update_cudagraph_mode(lambda self: None)(runner)
        return runner

    runner = wrapped(runner_for())
    added = runner.cudagraph_dispatcher.added
    assert (CUDAGraphMode.FULL, 6, 3) in added and (CUDAGraphMode.FULL, 8, 8) in added
    assert set(getattr(runner, decode_graphs.PADDING_ATTR)) == {1, 2, 3, 4}
    assert len(getattr(runner, decode_graphs.KEYS_ATTR)) == len(added)
    none = wrapped(runner_for(), mode="PIECEWISE")
    assert none.cudagraph_dispatcher.added == []
    assert getattr(none, decode_graphs.KEYS_ATTR) == set()
    assert getattr(none, decode_graphs.PADDING_ATTR) == {}
