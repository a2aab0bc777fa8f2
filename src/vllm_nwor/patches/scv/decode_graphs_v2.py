"""FULL CUDA graphs for SCV's verify batches on vLLM's V2 model runner.

With SCV on, the requests of one decode batch verify different chunks (``0 <= c <= k``), so a
batch's query lengths vary from request to request. vLLM 0.32's V2 runner has FULL decode graphs
for such batches: the *varlen decode* graphs of its adaptive verification
(``CudaGraphManager(varlen_decode=True)`` in ``vllm/v1/worker/gpu/cudagraph_utils.py``), which
replay any decode batch of 1 to ``1 + k`` tokens a request, and which its dispatcher picks by the
batch's largest query length. The V2 runner asks for them only when adaptive verification is on.
After ``initialize_kv_cache`` built the target model's manager, this turns on the same graphs
for SCV, where vLLM's own check (``get_varlen_cudagraph_unsupported_backend``) finds that every
attention backend of the target replays them (FlashAttention 3 does; FlashAttention 2 does
not, and SCV's batches then run piecewise). vLLM's ``_init_candidates`` rebuilds the
descriptors; capture and dispatch are vLLM's. The speculator's managers are left alone, as
vLLM leaves them under adaptive verification.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.attn_utils import get_varlen_cudagraph_unsupported_backend
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config


def use_varlen_decode_graphs(manager, attn_groups, vllm_config) -> bool:
    """Turns on ``manager``'s varlen decode graphs for SCV; whether they are on."""
    spec = vllm_config.speculative_config
    if (manager is None or spec is None or plugin_config(vllm_config).scv == "off"
            or manager.decode_query_len != 1 + spec.num_speculative_tokens
            or not (manager.cudagraph_mode and manager.cudagraph_mode.separate_routine())):
        return bool(manager is not None and manager.varlen_decode)
    if not manager.varlen_decode and get_varlen_cudagraph_unsupported_backend(
            attn_groups, vllm_config, manager.decode_query_len) is None:
        manager.varlen_decode = True
        manager._candidates, manager._capture_descs = {}, {}
        manager._init_candidates()
    return manager.varlen_decode


def _wrap_initialize_kv_cache(initialize_kv_cache):
    def wrapper(self, *args, **kwargs):
        out = initialize_kv_cache(self, *args, **kwargs)
        use_varlen_decode_graphs(getattr(self, "cudagraph_manager", None), self.attn_groups,
                                 self.vllm_config)
        return out

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "initialize_kv_cache",
        _wrap_initialize_kv_cache,
        why="V2 runner, SCV on: the target's FULL decode graphs replay batches whose requests "
        "verify different chunks (vLLM's varlen decode graphs, as under its adaptive "
        "verification), where the attention backends support them.",
    ),
]
