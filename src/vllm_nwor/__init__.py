"""vllm-nwor: transactional (No-Write-On-Reject) speculative-decoding verification for vLLM.

Switch it on with ``"nwor": true`` in ``--speculative-config``; see README.md.

Layout: :mod:`vllm_nwor.nwor`, :mod:`vllm_nwor.scv` and :mod:`vllm_nwor.telemetry` hold each
feature's logic and import nothing of vLLM; :mod:`vllm_nwor.patches` wires them into vLLM (the
only place that touches vLLM internals); :mod:`vllm_nwor.config` parses the plugin's keys;
:mod:`vllm_nwor.inspect` reads the plugin's state in a running engine;
:mod:`vllm_nwor.plugin` is the entry point vLLM calls.
"""

from __future__ import annotations

from vllm_nwor.config import NworConfig, NworConfigError
from vllm_nwor.inspect import get_counters, runner_counters
from vllm_nwor.nwor.counters import NworCounters

__version__ = "0.1.0"

__all__ = [
    "NworConfig", "NworConfigError", "NworCounters", "get_counters", "runner_counters",
    "__version__",
]
