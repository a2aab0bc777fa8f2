"""SCV's FULL decode graphs on vLLM's V2 runner (``patches/scv/decode_graphs_v2.py``): vLLM's own
``CudaGraphManager._init_candidates`` builds FULL decode descriptors for every chunk size.

The CPU engine has neither the V2 runner nor CUDA graphs, so the real method runs here on a
manager given a GPU's graph settings (capture sizes 1-16, FULL_AND_PIECEWISE, 4 requests; the
manager is made without its ``__init__``, which needs a GPU's process groups). What it builds
is what a GPU engine captures and dispatches (``tests/gpu/test_eagle_gpu.py`` checks that).
"""

from __future__ import annotations

import types

import pytest
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

K = 3


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    from vllm_nwor.testing import write_bigram_eagle_pair

    return write_bigram_eagle_pair(tmp_path_factory.mktemp("dg2"))


def full_decode_shapes(eagle_pair, decode_query_len: int, **keys) -> tuple[list, object]:
    """(query length, tokens) of each FULL decode descriptor vLLM builds, and the config."""
    target, head = eagle_pair
    vllm_config = EngineArgs(
        model=target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=4,
        speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K,
                            **keys}).create_engine_config()
    manager = object.__new__(CudaGraphManager)
    manager.vllm_config, manager.max_num_reqs = vllm_config, 4
    manager.compilation_config = types.SimpleNamespace(
        cudagraph_capture_sizes=[1, 2, 4, 8, 16], max_cudagraph_capture_size=16)
    manager.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    manager.decode_query_len, manager.lora_capture_cases = decode_query_len, [0]
    manager.use_breakable_cg, manager._candidates, manager._capture_descs = False, {}, {}
    # vLLM 0.32: varlen decode graphs only with adaptive verification; no dual-batch overlap.
    manager.varlen_decode, manager.ubatch_runner = False, None
    manager._init_candidates()
    shapes = sorted({(d.uniform_token_count, d.num_tokens)
                     for d in manager._capture_descs[CUDAGraphMode.FULL]})
    return shapes, vllm_config


def test_vllm_alone_builds_full_decode_graphs_for_k_only(eagle_pair):
    shapes, _ = full_decode_shapes(eagle_pair, 1 + K)
    assert {q for q, _ in shapes} == {1 + K}


@pytest.mark.parametrize("keys, lengths", [
    ({"nwor": True, "scv": "adaptive"}, {1, 2, 3, 4}),
    ({"scv": "fixed", "scv_chunk_size": 1}, {1, 2, 4}),
])
def test_scv_builds_full_decode_graphs_for_every_chunk_size(eagle_pair, keys, lengths):
    shapes, vllm_config = full_decode_shapes(eagle_pair, 1 + K, **keys)
    assert {q for q, _ in shapes} == lengths
    # Every uniform batch of one token a request (chunk 0) up to 4 requests has its graph.
    assert {n for q, n in shapes if q == 1} == {1, 2, 4}
    # vLLM's field is back as it was: nothing else sees dynamic speculative decoding.
    assert vllm_config.speculative_config.num_speculative_tokens_per_batch_size is None
    assert not vllm_config.speculative_config.uses_dynamic_speculative_decoding()


def test_the_speculators_decode_graphs_are_left_alone(eagle_pair):
    shapes, _ = full_decode_shapes(eagle_pair, 1, scv="adaptive")
    assert shapes == [(1, 1), (1, 2), (1, 4)]
