"""FULL CUDA graphs for SCV's decode batches of every chunk size, not only vLLM's ``1 + k``.

With speculative decoding, vLLM's V1 runner captures its FULL decode graphs for batches whose
requests all have ``1 + k`` tokens (``uniform_decode_query_len``), in sizes that are multiples of
``1 + k``. SCV's draft budget ``D`` varies from step to step, so a batch where every request
verifies ``D < k`` drafts (``1 + D`` tokens each; ``D = 0`` is plain decoding) is uniform but
not vLLM's shape, and the target model runs PIECEWISE: attention and the KV update leave the
graph, every layer each step: at small batches a chunk-0 step then costs far more than the
same step without speculation (docs/scv.md).

When SCV is on and vLLM resolved FULL decode graphs (``FULL_AND_PIECEWISE``), this captures FULL
decode graphs for every query length ``q`` from 1 to ``min(1 + scv_chunk_size, k)``, next to
vLLM's own, and replays them for uniform batches of ``q`` tokens per request. For each ``q`` the
graph sizes are vLLM's capture sizes rounded up to multiples of ``q`` (a batch of ``q``-token
requests is padded to the next of them, with padding requests, as vLLM pads its own), plus
the full batch of ``max_num_seqs`` requests. The keys (``num_reqs == num_tokens / q``, uniform)
differ from vLLM's and from each other. Capture and dispatch run vLLM's own code with
``uniform_decode_query_len`` set to ``q`` and the dispatcher's padding table set to ``q``'s
sizes for the duration of the call. If capturing fails, the extra graphs are dropped and such
batches run PIECEWISE, as without this patch. (On the V2 runner SCV uses vLLM's varlen decode
graphs instead: :mod:`~vllm_nwor.patches.scv.decode_graphs_v2`.)
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor._logging import get_logger
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config

logger = get_logger(__name__)

KEYS_ATTR = "_nwor_decode_graph_keys"
"""On the runner: the descriptors of the extra FULL graphs (empty set when there are none)."""
PADDING_ATTR = "_nwor_decode_graph_padding"
"""On the runner: ``{q: padding table}``, the dispatcher's ``_bs_to_padded_graph_size`` for
batches of ``q`` tokens per request (:func:`padding_table` of :func:`graph_sizes`)."""


@contextmanager
def decode_query_len(runner: GPUModelRunner, query_len: int):
    """vLLM's decode-graph logic, for the duration, as if ``1 + k`` were ``query_len``."""
    dispatcher = runner.cudagraph_dispatcher
    saved = (runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len,
             dispatcher._bs_to_padded_graph_size)
    runner.uniform_decode_query_len = dispatcher.uniform_decode_query_len = query_len
    dispatcher._bs_to_padded_graph_size = getattr(runner, PADDING_ATTR)[query_len]
    try:
        yield
    finally:
        (runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len,
         dispatcher._bs_to_padded_graph_size) = saved


def _query_lens(runner: GPUModelRunner) -> range:
    """The query lengths SCV's uniform batches can have besides vLLM's ``1 + k``."""
    config = plugin_config(runner.vllm_config)
    k = runner.uniform_decode_query_len - 1
    return range(1, min(1 + (config.scv_chunk_size or k), k) + 1)


def _wanted(runner: GPUModelRunner) -> bool:
    mode = runner.compilation_config.cudagraph_mode
    return (
        plugin_config(runner.vllm_config).scv != "off"
        and runner.uniform_decode_query_len > 1
        and mode.separate_routine()
        and mode.decode_mode() == CUDAGraphMode.FULL
        and runner.vllm_config.lora_config is None
        # Data parallelism and micro-batching coordinate graph choices across ranks and
        # ubatches: left to vLLM.
        and runner.vllm_config.parallel_config.data_parallel_size == 1
        and not runner.vllm_config.parallel_config.use_ubatching
    )


def graph_sizes(capture_sizes: list[int], query_len: int, max_size: int,
                max_num_seqs: int) -> list[int]:
    """The sizes (tokens) of the FULL graphs for ``query_len`` tokens per request: vLLM's
    capture sizes, each rounded up to a multiple of ``query_len``, and the full batch of
    ``max_num_seqs`` requests, within vLLM's largest size and ``max_num_seqs`` requests (a full
    batch would otherwise have no graph when rounding skips its size, e.g. 128 x 3 tokens
    between 369 and 387)."""
    rounded = {-(-size // query_len) * query_len for size in capture_sizes}
    rounded.add(query_len * max_num_seqs)
    return sorted(s for s in rounded if s <= max_size and s // query_len <= max_num_seqs)


def padding_table(sizes: list[int], max_size: int) -> list[int]:
    """``table[n]``: the smallest of ``sizes`` that is at least ``n``; 0 past the largest."""
    table = [0] * (max_size + 1)
    for size in sorted(sizes, reverse=True):
        table[:size + 1] = [size] * (size + 1)
    return table


def _wrap_check_and_update_cudagraph_mode(check_and_update):
    def wrapper(self, *args, **kwargs):
        check_and_update(self, *args, **kwargs)
        max_size = self.compilation_config.max_cudagraph_capture_size or 0
        by_query_len: dict[int, list[int]] = {}
        if _wanted(self):
            max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
            sizes = list(self.compilation_config.cudagraph_capture_sizes or [])
            by_query_len = {q: graph_sizes(sizes, q, max_size, max_num_seqs)
                            for q in _query_lens(self)}
        setattr(self, PADDING_ATTR,
                {q: padding_table(s, max_size) for q, s in by_query_len.items()})
        keys = set()
        if by_query_len:
            dispatcher = self.cudagraph_dispatcher
            for query_len, graph_sizes_q in by_query_len.items():
                with decode_query_len(self, query_len):
                    for size in graph_sizes_q:
                        keys.add(dispatcher._create_padded_batch_descriptor(size, True, False))
            keys = {k for k in keys if k.uniform}
            for key in keys:
                dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
            logger.info("SCV: %d FULL decode graphs for %d to %d tokens per request, besides "
                        "vLLM's %d", len(keys), min(by_query_len), max(by_query_len),
                        self.uniform_decode_query_len)
        setattr(self, KEYS_ATTR, keys)

    return wrapper


def _drop_keys(runner: GPUModelRunner, error: BaseException) -> None:
    keys = getattr(runner, KEYS_ATTR, set())
    runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL] -= keys
    setattr(runner, KEYS_ATTR, set())
    logger.warning("SCV: capturing FULL decode graphs for SCV's chunk sizes failed (%s); "
                   "such steps run PIECEWISE", error)


def _wrap_warmup_and_capture(warmup_and_capture):
    def wrapper(self, desc, *args, **kwargs):
        if desc not in getattr(self, KEYS_ATTR, ()):
            return warmup_and_capture(self, desc, *args, **kwargs)
        try:
            with decode_query_len(self, desc.num_tokens // desc.num_reqs):
                return warmup_and_capture(self, desc, *args, **kwargs)
        except Exception as error:  # the extra graphs are an optimisation: never fatal
            _drop_keys(self, error)
            return None

    return wrapper


def graph_query_len(runner: GPUModelRunner, num_tokens: int, num_reqs: int,
                    max_num_scheduled_tokens: int) -> int | None:
    """The query length of the extra graphs a batch replays, or None (vLLM decides)."""
    if not getattr(runner, KEYS_ATTR, None):
        return None
    query_len = max_num_scheduled_tokens
    table = getattr(runner, PADDING_ATTR).get(query_len)
    if (table is None or num_tokens != query_len * num_reqs or num_tokens >= len(table)
            or not table[num_tokens]):
        return None
    return query_len


def _wrap_determine_batch_execution_and_padding(determine):
    signature = inspect.signature(determine)

    def wrapper(self, *args, **kwargs):
        if getattr(self, KEYS_ATTR, None):
            bound = signature.bind(self, *args, **kwargs).arguments
            query_len = None
            if bound.get("force_uniform_decode") is None:
                query_len = graph_query_len(self, bound["num_tokens"], bound["num_reqs"],
                                            bound["max_num_scheduled_tokens"])
            if query_len is not None:
                with decode_query_len(self, query_len):
                    return determine(self, *args, **kwargs)
        return determine(self, *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "_check_and_update_cudagraph_mode",
        _wrap_check_and_update_cudagraph_mode,
        why="With SCV on, add FULL decode-graph keys for every chunk size SCV can give a "
        "whole batch (1 to k tokens per request). Retired by vLLM capturing decode graphs for "
        "every query length the scheduler can produce.",
    ),
    Patch(
        GPUModelRunner,
        "_warmup_and_capture",
        _wrap_warmup_and_capture,
        why="Capture those graphs with vLLM's own capture path, at their query length.",
    ),
    Patch(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        _wrap_determine_batch_execution_and_padding,
        why="Dispatch uniform batches of those query lengths to those graphs.",
    ),
]
