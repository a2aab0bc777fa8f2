"""FULL CUDA graphs for SCV's decode batches of every chunk size on vLLM's V2 model runner.

V2's CUDA-graph manager (``vllm/v1/worker/gpu/cudagraph_utils.py``) builds its FULL decode
descriptors for one query length, ``1 + k``, except under vLLM's dynamic speculative decoding,
where it builds them for every query length that
``speculative_config.num_speculative_tokens_per_batch_size`` lists, and dispatches a uniform
batch to the descriptor of its query length. With SCV on, a batch where every request verifies
``c < k`` drafts (``c = 0``: plain decoding) is such a batch. So, for the duration of
``_init_candidates`` of each manager whose decode query length is ``1 + k`` (the target
model's, and the speculator's prefill), that field lists every chunk size from 0 to
``scv_chunk_size`` (and ``k``), and vLLM's own loop builds the descriptors: graph sizes,
padding, capture and dispatch are vLLM's. The field is restored before anything else reads it
(the scheduler reads it when it is built, after the model runner). The speculator's decode
manager (query length 1) is left alone.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config


def chunk_sizes(k: int, scv_chunk_size: int | None) -> list[int]:
    """The draft counts a uniform SCV verify batch can have: 0 to the largest chunk, and k."""
    return sorted({*range(0, min(scv_chunk_size or k, k) + 1), k})


def _wrap_init_candidates(init_candidates):
    def wrapper(self):
        spec, config = self.vllm_config.speculative_config, plugin_config(self.vllm_config)
        if (spec is None or spec.uses_dynamic_speculative_decoding()
                or self.decode_query_len != 1 + spec.num_speculative_tokens
                or config.scv == "off"):
            return init_candidates(self)
        sizes = chunk_sizes(spec.num_speculative_tokens, config.scv_chunk_size)
        spec.num_speculative_tokens_per_batch_size = [(1, self.max_num_reqs, c) for c in sizes]
        try:
            return init_candidates(self)
        finally:
            spec.num_speculative_tokens_per_batch_size = None

    return wrapper


PATCHES = [
    Patch(
        CudaGraphManager,
        "_init_candidates",
        _wrap_init_candidates,
        why="V2 runner, SCV on: FULL decode graphs for uniform batches of every chunk size, "
        "built by vLLM's own dynamic-speculation loop. Retired by SCV in vLLM's dynamic "
        "speculative decoding.",
    ),
]
