"""What NWOR did: :class:`NworCounters` (in unique tokens), and :class:`FallbackReason`, why a
verify step took vLLM's plain write path (the key its fallbacks are counted under).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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
