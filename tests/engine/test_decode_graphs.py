"""The FULL-graph dispatch for SCV's chunk-0 steps (patches/decode_graphs.py), without a GPU.

The capture and replay themselves need CUDA graphs (checked on the GPU by
``benchmarks/scv_step_profile.py``: same greedy tokens as plain decoding); here, which batches
are dispatched as one-token decode, and that vLLM's query length is restored afterwards.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.patches import decode_graphs


def fake_runner(keys=frozenset({"graph"})):
    runner = SimpleNamespace(uniform_decode_query_len=5,
                             cudagraph_dispatcher=SimpleNamespace(uniform_decode_query_len=5))
    setattr(runner, decode_graphs.KEYS_ATTR, set(keys))
    return runner


def determine(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
              use_cascade_attn, allow_microbatching=True, force_eager=False,
              force_uniform_decode=None):
    """Records the query lengths vLLM's method would see."""
    return self.uniform_decode_query_len, self.cudagraph_dispatcher.uniform_decode_query_len


wrapped = decode_graphs._wrap_determine_batch_execution_and_padding(determine)


@pytest.mark.parametrize("num_tokens, num_reqs, max_tokens, force, seen", [
    (8, 8, 1, None, (1, 1)),    # every request at chunk 0: one-token decode graphs
    (40, 8, 5, None, (5, 5)),   # a uniform verify batch: vLLM's own graphs
    (12, 8, 5, None, (5, 5)),   # mixed chunk sizes: PIECEWISE, as vLLM decides
    (8, 8, 1, True, (5, 5)),    # vLLM's capture runs (forced) are left alone
])
def test_one_token_batches_see_query_length_one(num_tokens, num_reqs, max_tokens, force, seen):
    runner = fake_runner()
    result = wrapped(runner, num_tokens, num_reqs, None, max_tokens, False,
                     force_uniform_decode=force)
    assert result == seen
    assert (runner.uniform_decode_query_len,
            runner.cudagraph_dispatcher.uniform_decode_query_len) == (5, 5)


def test_without_captured_graphs_nothing_changes():
    assert wrapped(fake_runner(keys=()), 8, 8, None, 1, False) == (5, 5)


def test_the_wrapper_fits_vllms_signature():
    """The keyword names the wrapper reads exist on vLLM 0.26's method."""
    import inspect

    params = inspect.signature(GPUModelRunner._determine_batch_execution_and_padding).parameters
    assert {"num_tokens", "num_reqs", "max_num_scheduled_tokens",
            "force_uniform_decode"} <= set(params)


def runner_for(scv="adaptive", mode="FULL_AND_PIECEWISE", query_len=5, dp=1, lora=None):
    from vllm.config import CUDAGraphMode

    parallel = SimpleNamespace(data_parallel_size=dp, use_ubatching=False)
    return SimpleNamespace(
        uniform_decode_query_len=query_len,
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]),
        vllm_config=SimpleNamespace(additional_config={"scv": scv}, lora_config=lora,
                                    parallel_config=parallel),
    )


@pytest.mark.parametrize("runner, wanted", [
    (runner_for(), True),
    (runner_for(scv="off"), False),               # SCV off: never a chunk-0 step
    (runner_for(mode="PIECEWISE"), False),        # no FULL decode graphs (NWOR on, or chosen)
    (runner_for(mode="FULL"), False),             # one routine for all batches: nothing to add
    (runner_for(query_len=1), False),             # no speculation
    (runner_for(dp=2), False),                    # data parallel: left to vLLM
    (runner_for(lora=object()), False),
])
def test_extra_graphs_only_where_they_apply(runner, wanted):
    assert decode_graphs._wanted(runner) is wanted
