"""What tests and benchmarks share: engine audits and traces (``cache_audit``, ``step_record``,
the test-only vLLM plugins ``soak_audit`` and ``engine_trace``) and a ``vllm serve`` to test
against (``served_model``, ``server_process``).

Imported as ``tests.support.<module>`` with the repository root importable: pytest has it
(``pythonpath`` in pyproject.toml), so does ``python -m benchmarks.<name>`` run from the root. A
child process is given the root on its ``PYTHONPATH`` (:func:`pythonpath`): the probes that tests
start, and the engine and server processes that load the plugins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pythonpath(*first: str | os.PathLike, env: Mapping[str, str] = os.environ) -> str:
    """A child process's ``PYTHONPATH``: ``first`` (paths or ``PYTHONPATH`` strings), the
    repository root (``tests.support``, ``benchmarks``), then ``env``'s own; each path once."""
    paths = [*map(str, first), str(REPO), env.get("PYTHONPATH", "")]
    return os.pathsep.join(dict.fromkeys(p for s in paths for p in s.split(os.pathsep) if p))
