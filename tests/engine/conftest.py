"""Engine tests run the real vLLM 0.32.0 CPU engine, in-process, on tiny random-weight models."""

from __future__ import annotations

import os

# Before vLLM is imported: run the engine in this process (so tests can reach the runner and its
# KV cache), with a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _second_engine_in_one_process():
    """vLLM 0.32's worker start rebinds its kernel overrides by scanning every module's objects,
    and reads ``vars(value)`` of llvmlite's ``ffi.lib`` (numba, imported by the ngram proposer),
    whose ``__getattr__`` answers ``__dict__`` with a C function: a second engine in one process
    then fails with "'_lib_fn_wrapper' object has no attribute 'get'", plugin or not. The tests
    start many engines in one process, so the scan skips llvmlite's modules (no kernel is
    there)."""
    from vllm.triton_utils import dispatcher

    rebind = dispatcher._rebind_kernels

    def without_llvmlite(*args, **kwargs):
        hidden = {name: module for name, module in sys.modules.items()
                  if name.split(".")[0] == "llvmlite"}
        for name in hidden:
            del sys.modules[name]
        try:
            return rebind(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    dispatcher._rebind_kernels = without_llvmlite
    yield
    dispatcher._rebind_kernels = rebind


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) checkpoints; the draft is a noisy copy that is often, not always, right."""
    from vllm_nwor.testing import write_tiny_llama_pair

    return write_tiny_llama_pair(
        tmp_path_factory.mktemp("tiny-llama"), num_layers=3, draft_layers=3, draft_noise=0.08
    )
