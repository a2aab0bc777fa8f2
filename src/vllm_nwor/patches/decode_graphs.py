"""FULL CUDA graphs for SCV's plain-decoding steps (every request at chunk 0).

With speculative decoding, vLLM 0.26 captures its FULL decode graphs for batches whose requests
all have ``1 + k`` tokens (``uniform_decode_query_len``). When SCV gives every request of a step
chunk 0 (draft budget 0), each request has one token, the batch is not "uniform decode", and the
target model runs PIECEWISE: attention and the KV update leave the graph, 32 layers of them each
step. Measured on an H200 (``benchmarks/results/scv_step_profile_2026-11-21_h200.json``): at
batch 1 such a step took about twice as long as the same step without speculation, so no
choice of chunks could keep up with plain decoding.

When SCV is on and vLLM resolved FULL decode graphs (``FULL_AND_PIECEWISE``), this captures a
second set of FULL decode graphs for one token per request, next to vLLM's own, and replays them
for batches of one token per request. Their keys (``num_tokens == num_reqs``, uniform) differ
from vLLM's (``num_tokens == (1 + k) * num_reqs``). Capture and dispatch run vLLM's own code
with ``uniform_decode_query_len`` set to 1 for the duration of the call, exactly what vLLM does
without speculation. If capturing them fails, they are dropped and such batches stay PIECEWISE.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor._logging import get_logger
from vllm_nwor.config import config_from_additional
from vllm_nwor.patches._patch import Patch

logger = get_logger(__name__)

KEYS_ATTR = "_nwor_single_token_keys"
"""On the runner: the descriptors of the extra FULL graphs (empty set when there are none)."""


@contextmanager
def single_token_decode(runner: GPUModelRunner):
    """vLLM's decode-graph logic, for the duration, as if there were no speculation."""
    dispatcher = runner.cudagraph_dispatcher
    saved = runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len
    runner.uniform_decode_query_len = dispatcher.uniform_decode_query_len = 1
    try:
        yield
    finally:
        runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len = saved


def _wanted(runner: GPUModelRunner) -> bool:
    mode = runner.compilation_config.cudagraph_mode
    return (
        config_from_additional(runner.vllm_config.additional_config).scv != "off"
        and runner.uniform_decode_query_len > 1
        and mode.separate_routine()
        and mode.decode_mode() == CUDAGraphMode.FULL
        and runner.vllm_config.lora_config is None
        # Data parallelism and micro-batching coordinate graph choices across ranks and
        # ubatches: left to vLLM.
        and runner.vllm_config.parallel_config.data_parallel_size == 1
        and not runner.vllm_config.parallel_config.use_ubatching
    )


def _wrap_check_and_update_cudagraph_mode(check_and_update):
    def wrapper(self, *args, **kwargs):
        check_and_update(self, *args, **kwargs)
        keys: set = set()
        if _wanted(self):
            dispatcher = self.cudagraph_dispatcher
            max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
            sizes = self.compilation_config.cudagraph_capture_sizes or []
            with single_token_decode(self):
                for size in sizes:
                    if size <= max_num_seqs:
                        keys.add(dispatcher._create_padded_batch_descriptor(size, True, False))
            keys = {k for k in keys if k.uniform and k.num_reqs == k.num_tokens}
            for key in keys:
                dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
            logger.info("SCV: %d FULL decode graphs for steps at chunk 0 (one token per "
                        "request)", len(keys))
        setattr(self, KEYS_ATTR, keys)

    return wrapper


def _drop_keys(runner: GPUModelRunner, error: BaseException) -> None:
    keys = getattr(runner, KEYS_ATTR, set())
    runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL] -= keys
    setattr(runner, KEYS_ATTR, set())
    logger.warning("SCV: capturing FULL graphs for steps at chunk 0 failed (%s); such steps "
                   "run PIECEWISE", error)


def _wrap_warmup_and_capture(warmup_and_capture):
    def wrapper(self, desc, *args, **kwargs):
        if desc not in getattr(self, KEYS_ATTR, ()):
            return warmup_and_capture(self, desc, *args, **kwargs)
        try:
            with single_token_decode(self):
                return warmup_and_capture(self, desc, *args, **kwargs)
        except Exception as error:  # the extra graphs are an optimisation: never fatal
            _drop_keys(self, error)
            return None

    return wrapper


def _wrap_determine_batch_execution_and_padding(determine):
    signature = inspect.signature(determine)

    def wrapper(self, *args, **kwargs):
        if getattr(self, KEYS_ATTR, None):
            bound = signature.bind(self, *args, **kwargs).arguments
            if (bound.get("force_uniform_decode") is None
                    and bound["max_num_scheduled_tokens"] == 1
                    and bound["num_tokens"] == bound["num_reqs"]):
                with single_token_decode(self):
                    return determine(self, *args, **kwargs)
        return determine(self, *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "_check_and_update_cudagraph_mode",
        _wrap_check_and_update_cudagraph_mode,
        why="With SCV on, add FULL decode-graph keys for one token per request (steps at "
        "chunk 0). Retired by vLLM capturing decode graphs for every query length the "
        "scheduler can produce.",
    ),
    Patch(
        GPUModelRunner,
        "_warmup_and_capture",
        _wrap_warmup_and_capture,
        why="Capture those graphs with vLLM's own capture path, query length 1.",
    ),
    Patch(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        _wrap_determine_batch_execution_and_padding,
        why="Dispatch batches of one token per request to those graphs.",
    ),
]
