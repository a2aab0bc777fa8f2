"""Loggers under vLLM's ``vllm`` logger, so plugin lines share vLLM's handler, level and format.

Plain :mod:`logging`, so the core stays importable without vLLM.
"""

import logging


def get_logger(module_name: str) -> logging.Logger:
    """``vllm_nwor.nwor.interceptor`` logs as ``vllm.nwor.nwor.interceptor``."""
    return logging.getLogger("vllm.nwor." + module_name.removeprefix("vllm_nwor."))
