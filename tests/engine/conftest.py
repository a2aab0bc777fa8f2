"""Engine tests run the real vLLM 0.26.0 CPU engine, in-process, on tiny random-weight models."""

from __future__ import annotations

import os

# Before vLLM is imported: run the engine in this process (so tests can reach the runner and its
# KV cache), with a small KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    """(target, draft) checkpoints; the draft is a noisy copy that is often, not always, right."""
    from vllm_nwor.testing import write_tiny_llama_pair

    return write_tiny_llama_pair(
        tmp_path_factory.mktemp("tiny-llama"), num_layers=3, draft_layers=3, draft_noise=0.08
    )
