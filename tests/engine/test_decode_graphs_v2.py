"""SCV's FULL decode graphs on vLLM's V2 runner (``patches/scv/decode_graphs_v2.py``): the
target's CUDA-graph manager builds vLLM's varlen decode graphs (as under vLLM's adaptive
verification), which replay batches whose requests verify different chunks, where vLLM finds
that the attention backends replay them.

The CPU engine has neither the V2 runner nor CUDA graphs, so the real methods run here on a
manager given a GPU's graph settings (capture sizes 1-16, FULL_AND_PIECEWISE, 4 requests; the
manager is made without its ``__init__``, which needs a GPU's process groups) and on attention
groups of real vLLM backends whose metadata builder classes answer vLLM's check (the builders
themselves need a GPU). What it builds is what a GPU engine captures and dispatches.
"""

from __future__ import annotations

import types

import pytest
import torch
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
from vllm.v1.worker.utils import AttentionGroup

from vllm_nwor.patches.scv.decode_graphs_v2 import use_varlen_decode_graphs
from vllm_nwor.patches.scv.scheduler import _mixed_graphs

K = 3


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    from vllm_nwor.testing import write_bigram_eagle_pair

    return write_bigram_eagle_pair(tmp_path_factory.mktemp("dg2"))


def manager_for(eagle_pair, decode_query_len: int, **keys) -> tuple[object, object]:
    """A V2 CUDA-graph manager as the runner builds it (varlen off), and the config."""
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
    manager.varlen_decode, manager.ubatch_runner = False, None
    manager._lora_dispatch_map, manager._max_lora_case = {}, 0
    manager._init_candidates()
    manager._graphs_captured = True  # dispatch as after capture
    return manager, vllm_config


def groups(backend, builder) -> list[list[AttentionGroup]]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return [[AttentionGroup(backend=backend, layer_names=["model.layers.0.self_attn.attn"],
                            kv_cache_spec=spec, kv_cache_group_id=0,
                            metadata_builders=[builder])]]


# Triton's builder replays any batch (ALWAYS); FlashAttention's reports UNIFORM_BATCH without
# FlashAttention 3 (here, and on GPUs before Hopper).
VARLEN = groups(TritonAttentionBackend, TritonAttentionMetadataBuilder)
UNIFORM = groups(FlashAttentionBackend, FlashAttentionMetadataBuilder)


def full_shapes(manager) -> list[tuple]:
    """(uniform query length, largest query length, tokens) of each FULL descriptor."""
    return sorted({(d.uniform_token_count, d.max_query_len, d.num_tokens)
                   for d in manager._capture_descs[CUDAGraphMode.FULL]})


def test_vllm_alone_builds_full_decode_graphs_for_k_only(eagle_pair):
    manager, vllm_config = manager_for(eagle_pair, 1 + K)
    assert not use_varlen_decode_graphs(manager, VARLEN, vllm_config)
    assert {u for u, _, _ in full_shapes(manager)} == {1 + K}


@pytest.mark.parametrize("keys", [{"nwor": True, "scv": "adaptive"},
                                  {"scv": "fixed", "scv_chunk_size": 1}])
def test_scv_builds_varlen_decode_graphs(eagle_pair, keys):
    manager, vllm_config = manager_for(eagle_pair, 1 + K, **keys)
    assert use_varlen_decode_graphs(manager, VARLEN, vllm_config)
    # Any decode batch of 1 to 1 + k tokens a request, up to 4 requests: every capture size
    # up to 4 x (1 + k) tokens.
    assert full_shapes(manager) == [(None, 1 + K, n) for n in (1, 2, 4, 8, 16)]
    # vLLM's dispatch: a batch whose requests verify chunks 0, 1 and 3 (query lengths 1, 2
    # and 4) replays the 8-token graph; one with a prefill (no query-length bound) does not.
    desc = manager.dispatch(3, 7, None, 0, max_query_len=4)
    assert (desc.cg_mode, desc.num_tokens, desc.max_query_len) == (CUDAGraphMode.FULL, 8, 4)
    assert manager.dispatch(3, 7, None, 0, max_query_len=None).cg_mode != CUDAGraphMode.FULL


def test_backends_without_varlen_graphs_keep_vllms_graphs(eagle_pair):
    manager, vllm_config = manager_for(eagle_pair, 1 + K, scv="adaptive")
    before = full_shapes(manager)
    assert not use_varlen_decode_graphs(manager, UNIFORM, vllm_config)
    assert full_shapes(manager) == before == [(1 + K, None, n) for n in (4, 8, 16)]


def test_the_speculators_decode_graphs_are_left_alone(eagle_pair):
    manager, vllm_config = manager_for(eagle_pair, 1, scv="adaptive")
    assert not use_varlen_decode_graphs(manager, VARLEN, vllm_config)
    assert full_shapes(manager) == [(1, None, 1), (1, None, 2), (1, None, 4)]


@pytest.mark.parametrize("v2, mode, mixed", [
    (True, CUDAGraphMode.FULL_AND_PIECEWISE, True),
    (False, CUDAGraphMode.FULL_AND_PIECEWISE, False),
    (False, CUDAGraphMode.FULL, True),
    (True, CUDAGraphMode.PIECEWISE, False),
])
def test_scv_prices_mixed_chunk_decode_batches_as_on_graphs_where_they_are(v2, mode, mixed):
    config = types.SimpleNamespace(use_v2_model_runner=v2,
                                   compilation_config=types.SimpleNamespace(cudagraph_mode=mode))
    assert _mixed_graphs(config) is mixed
