"""Server tests: real ``vllm serve`` processes on loopback, on the CPU, with tiny models."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from served_model import write_served_model  # noqa: E402
from server_process import VllmServer  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> str:
    """The served model's directory (see served_model.py to swap in another model)."""
    return write_served_model(tmp_path_factory.mktemp("served-model"))


@pytest.fixture(scope="module")
def telemetry_servers(served_model, tmp_path_factory):
    """(on, off): NWOR with its default telemetry, and the plugin installed but not enabled.

    Both start at once, so their start-ups overlap; both are stopped however the tests end.
    """
    logs = tmp_path_factory.mktemp("server-logs")
    servers = []
    try:
        servers.append(VllmServer(served_model, {**NGRAM, "nwor": True}, logs / "on.log"))
        servers.append(VllmServer(served_model, NGRAM, logs / "off.log"))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
