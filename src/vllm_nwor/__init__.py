"""vllm-nwor: transactional (No-Write-On-Reject) speculative-decoding verification for vLLM.

Switch it on with ``"nwor": true`` in ``--speculative-config``; see README.md.
"""

from __future__ import annotations

from typing import Any

from vllm_nwor.config import NworConfig, NworConfigError
from vllm_nwor.staging import NworCounters
from vllm_nwor.telemetry import combine_rank_counters

__version__ = "0.1.0"

__all__ = [
    "NworConfig", "NworConfigError", "NworCounters", "get_counters", "runner_counters",
    "__version__",
]


def get_counters(llm: Any) -> NworCounters | None:
    """NWOR counters of a running ``vllm.LLM`` (None when NWOR is off).

    Token counts are the same on every tensor-parallel rank; KV bytes not written are summed over
    the ranks, since each holds its own heads.
    """
    combined = combine_rank_counters(llm.collective_rpc("nwor_counters"))
    return None if combined is None else NworCounters(**combined)


def runner_counters(model_runner: Any) -> NworCounters | None:
    """NWOR counters of one model runner, read in its own worker process (None when NWOR is
    off). For code that already runs inside the worker, such as a step-by-step audit."""
    from vllm_nwor.patches.model_runner import INTERCEPTOR_ATTR

    interceptor = getattr(model_runner, INTERCEPTOR_ATTR, None)
    return None if interceptor is None else interceptor.counters()
