"""What NWOR did: :class:`NworCounters` (in unique tokens), :class:`FallbackReason`, why a
verify step took vLLM's plain write path (the key its fallbacks are counted under), and
:class:`CommittedReadback`, how the host reads the device's committed count without waiting.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class FallbackReason(str, enum.Enum):
    """Why a verify step took vLLM's plain write path."""

    OVERFLOW = "overflow"  # more draft tokens than staging takes (max_num_seqs x k at most)
    FAKE_TENSOR = "fake_tensor"  # called with fake/meta tensors (tracing, compile)
    SLOT_MAPPING = "slot_mapping_mismatch"  # a layer brought a different slot mapping
    STAGE_ERROR = "stage_error"  # staging raised
    INCOMPLETE = "incomplete_staging"  # commit found a layer that never staged
    COMMIT_ERROR = "commit_error"  # the commit raised; plain writes committed instead
    NO_COMMIT = "no_commit"  # a step ended without a commit


@dataclass(frozen=True)
class NworCounters:
    """What NWOR did, in unique tokens (not layer x token operations)."""

    verify_steps_staged: int = 0
    tokens_staged: int = 0
    tokens_committed: int = 0
    tokens_rejected: int = 0
    rejected_kv_bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "verify_steps_staged": self.verify_steps_staged,
            "tokens_staged": self.tokens_staged,
            "tokens_committed": self.tokens_committed,
            "tokens_rejected": self.tokens_rejected,
            "rejected_kv_bytes": self.rejected_kv_bytes,
            "fallbacks": dict(self.fallbacks),
        }


class CommittedReadback:
    """The committed-token count as the host can read it without waiting for the GPU.

    The count lives on the device: each commit adds its accepted tokens there, in stream order.
    Reading it with ``.item()`` waits for every step the host has queued, which costs a serving
    engine the overlap of host and GPU work that async scheduling buys. Instead, after each
    commit the count is copied to pinned host memory with an event, beside the host's own counts
    as of that commit (:meth:`after_commit`); a read takes the newest copy that has landed
    (:meth:`latest`). vLLM copies a step's sampled ids to the host after its commit in the same
    stream's order, so once the engine has a step's outputs, that step's copy has landed: a read
    leaves out only steps still running.

    Args:
        slots: copies in flight at most; a slot is reused only after its copy landed.
        make_event: the event recorded after each copy (``torch.cuda.Event``).
    """

    def __init__(self, slots: int = 4, make_event: Callable[[], object] | None = None) -> None:
        make_event = make_event or torch.cuda.Event
        self._host = [torch.zeros((), dtype=torch.int64, pin_memory=torch.cuda.is_available())
                      for _ in range(slots)]
        self._events = [make_event() for _ in range(slots)]
        self._counts: list[tuple[int, int] | None] = [None] * slots  # (steps, tokens staged)
        self._next = 0
        self._landed = (0, 0, 0)  # (steps, tokens staged, tokens committed)

    def after_commit(self, committed: torch.Tensor, steps: int, tokens_staged: int) -> None:
        """Copies ``committed`` (the device count after this commit) to the host, with the
        host's counts as of the same commit."""
        slot, self._next = self._next, (self._next + 1) % len(self._host)
        if self._counts[slot] is not None:
            self._take(slot, wait=True)  # ``slots`` commits ago: landed long since
        self._host[slot].copy_(committed, non_blocking=True)
        self._events[slot].record()
        self._counts[slot] = (steps, tokens_staged)

    def latest(self) -> tuple[int, int, int]:
        """``(steps, tokens staged, tokens committed)`` as of the newest commit whose copy has
        landed; never older than what an earlier call returned."""
        slots = len(self._host)
        for back in range(1, slots + 1):  # newest first
            slot = (self._next - back) % slots
            if self._counts[slot] is not None and self._take(slot, wait=False):
                break
        return self._landed

    def reset(self) -> None:
        """Forgets every copy (the counters were zeroed)."""
        self._counts = [None] * len(self._host)
        self._landed = (0, 0, 0)

    def _take(self, slot: int, wait: bool) -> bool:
        event = self._events[slot]
        if not wait and not event.query():
            return False
        event.synchronize()
        steps, staged = self._counts[slot]
        if staged >= self._landed[1]:
            self._landed = (steps, staged, int(self._host[slot]))
        self._counts[slot] = None
        return True
