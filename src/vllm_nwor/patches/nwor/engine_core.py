"""Engine-core patch: keep NWOR's scratch blocks out of the scheduler's block pool.

Verify attention reads each drafting request's chunk from scratch blocks at the end of every
layer's paged cache (:mod:`vllm_nwor.nwor.kernels.scratch`; docs/gpu.md, docs/design.md). The
workers allocate the cache vLLM sized; the scheduler is given that many blocks less the scratch
blocks, so it never hands one to a request.
"""

from __future__ import annotations

from vllm.v1.engine.core import EngineCore

from vllm_nwor._logging import get_logger
from vllm_nwor.config import NworConfigError
from vllm_nwor.nwor.kernels.scratch import scratch_blocks
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config

logger = get_logger(__name__)


def reserved_blocks(vllm_config) -> int:
    """How many blocks the scheduler must not hand out: NWOR's scratch blocks, else 0."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 0
    if not plugin_config(vllm_config).nwor:
        return 0
    return scratch_blocks(vllm_config.scheduler_config.max_num_seqs, spec.num_speculative_tokens,
                          vllm_config.cache_config.block_size)[1]


def _wrap_initialize_kv_caches(initialize_kv_caches):
    def wrapper(self, vllm_config):
        kv_cache_config = initialize_kv_caches(self, vllm_config)
        reserved = reserved_blocks(vllm_config)
        if reserved:
            left = kv_cache_config.num_blocks - reserved
            needed = -(-vllm_config.model_config.max_model_len
                       // vllm_config.cache_config.block_size)
            if left < needed:
                raise NworConfigError(
                    f"'nwor': true keeps {reserved} KV blocks for verify attention "
                    f"(max_num_seqs x (1 + ceil(num_speculative_tokens / block_size))); of the "
                    f"{kv_cache_config.num_blocks} blocks that leaves {left}, fewer than one "
                    f"request of max_model_len={vllm_config.model_config.max_model_len} needs "
                    f"({needed}). Raise gpu_memory_utilization (on the CPU: "
                    "VLLM_CPU_KVCACHE_SPACE) or lower max_num_seqs."
                )
            kv_cache_config.num_blocks = left
            vllm_config.cache_config.num_gpu_blocks = left
            logger.info("NWOR: %d of %d KV blocks kept for verify attention's scratch blocks",
                        reserved, left + reserved)
        return kv_cache_config

    return wrapper


PATCHES = [
    Patch(
        EngineCore,
        "_initialize_kv_caches",
        _wrap_initialize_kv_caches,
        why="The scheduler's KV cache config has NWOR's scratch blocks taken off the end (the "
        "workers keep them). Retired by a way to reserve KV blocks for a backend's own use.",
    ),
]
