"""Worker patch: the NWOR counters, readable from a running engine via ``collective_rpc``."""

from __future__ import annotations

from vllm.v1.worker.worker_base import WorkerBase

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.nwor.binding import interceptor_of


def _nwor_counters(_missing):
    def nwor_counters(self, wait: bool = True) -> dict | None:
        """This worker's NWOR counters as a dict, or None when NWOR is off. ``wait=False``
        does not wait for the GPU (``NworInterceptor.counters``)."""
        interceptor = interceptor_of(getattr(self, "model_runner", None))
        return None if interceptor is None else interceptor.counters(wait=wait).as_dict()

    return nwor_counters


PATCHES = [
    Patch(
        WorkerBase,
        "nwor_counters",
        _nwor_counters,
        new=True,
        why="Adds a method for LLM.collective_rpc('nwor_counters'). Retired by NWOR stats in "
        "ModelRunnerOutput.",
    ),
]
