"""Where a verify step's draft tokens sit in the flattened batch (:class:`VerifyStep`), and how
those indices reach the device (:class:`IndexUploader`: one copy that does not sync the stream,
into a device buffer whose address FULL CUDA graphs read). :class:`StagingOverflow`: a step
with more draft tokens than staging holds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_nwor.nwor.kernels.commit_kv import Verdict


class StagingOverflow(ValueError):
    """A verify step has more draft tokens than a step may stage."""


class IndexUploader:
    """Copies a step's host index arrays to the device in one copy, without a stream sync.

    On CUDA the host side is pinned and double-buffered: the CPU may prepare step N+1 while
    step N's copy is still queued, so a host buffer is reused only after its copy completed.
    The device buffer is reused every step; the step that last read it (its commit) is queued
    before the next step's copy on the same stream.
    """

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        # -1 until a step writes it: a graph captured before any step reads "write every row".
        self._device_buffer = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events: list = [None, None]
        self._turn = 0
        self._held: object = None  # the key of what the device buffer holds, if known
        self._built: object = None  # what a caller built on the held upload (remember)

    @property
    def capacity(self) -> int:
        return self._device_buffer.shape[0]

    def rows(self, n: int) -> torch.Tensor:
        """The first ``n`` entries of the device buffer: where each upload puts its first array.

        The address never changes, so a CUDA graph captured reading it reads every later
        step's upload (:attr:`VerifyStep.row_stage_index` is uploaded first)."""
        if n > self.capacity:
            raise StagingOverflow(f"{n} rows exceed the upload buffer of {self.capacity}")
        self._held = None  # the caller may write them
        return self._device_buffer[:n]

    def recall(self, key: object) -> object:
        """What :meth:`remember` kept for ``key``, while the device buffer still holds the
        upload of that key; else None."""
        return self._built if key is not None and key == self._held else None

    def remember(self, key: object, built: object) -> None:
        """Keeps ``built`` (made from the upload of ``key``) until the buffer changes."""
        if key is not None and key == self._held:
            self._built = built

    def upload(self, array: np.ndarray, key: object = None) -> torch.Tensor:
        """The device copy of ``array``. With a ``key`` (anything that identifies the array's
        contents) nothing is copied when the buffer already holds what that key named."""
        n = len(array)
        if n > self.capacity:
            raise StagingOverflow(f"{n} step indices exceed the upload buffer of {self.capacity}")
        if key is not None and key == self._held:
            return self._device_buffer[:n]
        self._held, self._built = key, None
        turn, self._turn = self._turn, self._turn ^ 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        host = self._host[turn][:n]
        host.numpy()[:] = array
        device = self._device_buffer[:n]
        device.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._events[turn] = event
        return device


@dataclass(frozen=True)
class VerifyStep:
    """Where a verify step's draft tokens sit in the flattened batch.

    Staged token ``t`` (request-major order) is draft ``token_pos[t]`` of request
    ``token_req[t]`` and sits in batch row ``draft_rows[t]``. ``row_stage_index[r]`` is the
    inverse: the staged token in batch row ``r``, or -1 for rows that are written directly.
    """

    num_draft_tokens: tuple[int, ...]
    draft_rows: torch.Tensor
    token_req: torch.Tensor
    token_pos: torch.Tensor
    row_stage_index: torch.Tensor

    @classmethod
    def from_batch(
        cls,
        num_draft_tokens: Sequence[int],
        query_start_loc: Sequence[int] | np.ndarray,
        device: torch.device | str,
        uploader: IndexUploader | None = None,
    ) -> VerifyStep | None:
        """Builds the step from per-request draft counts and query start locations (host).

        Returns ``None`` when no request has drafts. With an ``uploader`` the indices reach the
        device in one copy that does not sync the stream, and not at all when they are those
        of the uploader's last step (a decode batch that keeps its shape): that step is then
        returned again, its views unchanged.
        """
        counts = np.asarray(num_draft_tokens, dtype=np.int64)
        qsl = np.asarray(query_start_loc, dtype=np.int64)[: len(counts) + 1]
        if len(qsl) != len(counts) + 1:
            raise ValueError(
                f"query_start_loc has {len(qsl)} entries, expected {len(counts) + 1}"
            )
        key = (counts.tobytes(), qsl.tobytes())
        if uploader is not None:
            step = uploader.recall(key)
            if step is not None:  # the last step's indices, still on the device
                return step
        packed, spans = _step_indices(*key)
        if packed is None:
            return None
        if uploader is None:
            uploaded = torch.from_numpy(packed.copy()).to(device)
        else:
            uploaded = uploader.upload(packed, key)
        views = [uploaded.narrow(0, start, length) for start, length in spans]
        step = cls(
            num_draft_tokens=tuple(counts.tolist()),
            draft_rows=views[1],
            token_req=views[2],
            token_pos=views[3],
            row_stage_index=views[0],
        )
        if uploader is not None:
            uploader.remember(key, step)
        return step

    @property
    def num_tokens(self) -> int:
        return self.draft_rows.shape[0]

    def verdict(self, sampled_token_ids: torch.Tensor, committed: torch.Tensor) -> Verdict:
        """The step's verdict in the rejection sampler's output (``[num_reqs, max_spec_len +
        1]``, rejected positions ``-1``): draft ``j`` was accepted exactly when entry ``j + 1``
        is valid. It stays on the device; accepted tokens are counted into ``committed``."""
        return Verdict(sampled_token_ids, self.token_req, self.token_pos, committed,
                       self.row_stage_index)


@functools.lru_cache(maxsize=64)
def _step_indices(counts_key: bytes, qsl_key: bytes
                  ) -> tuple[np.ndarray | None, list[tuple[int, int]]]:
    """A step's index arrays, packed for one upload (see :class:`VerifyStep`), and each one's
    ``(start, length)`` in it; ``None`` without drafts. Keyed by the bytes of the draft
    counts and query start locations: decode batches repeat them step after step, and then
    cost no work here."""
    counts = np.frombuffer(counts_key, dtype=np.int64)
    qsl = np.frombuffer(qsl_key, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return None, []
    if np.any(counts > np.diff(qsl)):
        raise ValueError("a request has more drafts than scheduled tokens")
    token_req = np.repeat(np.arange(len(counts)), counts)
    chunk_start = np.cumsum(counts) - counts
    token_pos = np.arange(total) - np.repeat(chunk_start, counts)
    draft_rows = qsl[1:][token_req] - counts[token_req] + token_pos
    row_stage_index = np.full(qsl[-1], -1, dtype=np.int64)
    row_stage_index[draft_rows] = np.arange(total)
    # row_stage_index first: it then sits at the start of the uploader's device buffer, the
    # address FULL CUDA graphs were captured reading (IndexUploader.rows).
    # Each part starts on a 16-byte boundary (an even int64 offset), as the compiled form of a
    # kernel that reads it expects (kernels._common.Launcher); the gaps are zeros.
    parts = (row_stage_index, draft_rows, token_req, token_pos)
    spans, start = [], 0
    for part in parts:
        spans.append((start, len(part)))
        start += len(part) + len(part) % 2
    packed = np.zeros(start, dtype=np.int64)
    for (first, length), part in zip(spans, parts, strict=True):
        packed[first:first + length] = part
    packed.flags.writeable = False  # shared by every step with these counts
    return packed, spans
