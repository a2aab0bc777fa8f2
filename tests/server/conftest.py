"""Server tests: real ``vllm serve`` processes on loopback, on the CPU, with tiny models."""

from __future__ import annotations

import time

import pytest

from tests.support.served_model import write_served_model
from tests.support.server_process import VllmServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> str:
    """The served model's directory (see tests/support/served_model.py to swap in another model)."""
    return write_served_model(tmp_path_factory.mktemp("served-model"))


@pytest.fixture(scope="module")
def servers(served_model, tmp_path_factory) -> dict:
    """Every server the tests use, started at once so that their start-ups overlap.

    ``on``: NWOR with its default telemetry; ``off``: the plugin installed but not enabled;
    ``scv``: adaptive SCV alone (telemetry on by default, NWOR off). All are stopped however the
    tests end.
    """
    logs = tmp_path_factory.mktemp("server-logs")
    configs = {"on": {**NGRAM, "nwor": True}, "off": NGRAM, "scv": {**NGRAM, "scv": "adaptive"}}
    started = {}
    try:
        for name, config in configs.items():
            started[name] = VllmServer(served_model, config, logs / f"{name}.log")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for name, config in configs.items():
            try:
                started[name].wait_ready(deadline)
            except RuntimeError:
                # Servers starting together can race for the same free port (vLLM picks its
                # torch.distributed port by binding port 0 and letting go); start that one again.
                log = started[name].log_path.read_text(errors="replace")
                if "EADDRINUSE" not in log and "Address already in use" not in log:
                    raise
                started[name].stop()
                started[name] = VllmServer(served_model, config, logs / f"{name}.retry.log")
                started[name].wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def telemetry_servers(servers):
    """(on, off): NWOR with its default telemetry, and the plugin installed but not enabled."""
    return servers["on"], servers["off"]


@pytest.fixture(scope="module")
def scv_server(servers):
    """Adaptive SCV without NWOR; telemetry follows it."""
    return servers["scv"]
