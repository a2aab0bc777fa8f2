"""Routes the target model's KV writes in verify steps: stages the drafts, then commits the
accepted ones or falls back to vLLM's write path. The terms are defined in :mod:`vllm_nwor.nwor`.

The :class:`NworInterceptor` decides *once per verify step, for all layers at once*, whether the
step is staged. Its lifecycle is::

    begin(step) -> stage(layer) for every target layer -> commit(sampled) | discard(reason)

FULL CUDA graphs (a backend with a fused stage): while vLLM captures its graphs, a layer called
with more than one token per request takes the staged path with no step begun
(:meth:`NworInterceptor.stage_for_graph`). The captured stage reads which rows to stage from a
device buffer at a fixed address (:meth:`IndexUploader.rows`), which every step fills before the
graph replays: the step's own indices when it is staged, -1 (write every row) when it is not.
Replaying such a graph runs no Python in the layers, so a step begun and committed with no layer
seen staging is a graph replay, and the graph staged every layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake

from vllm_nwor._logging import get_logger
from vllm_nwor.nwor.counters import CommittedReadback, FallbackReason, NworCounters
from vllm_nwor.nwor.kv_staging import CommitFn, StagedLayers, StageFn, WriteBackFn
from vllm_nwor.nwor.verify_step import IndexUploader, VerifyStep

logger = get_logger(__name__)

PlainWrite = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""vLLM's own KV write for one target layer: ``(layer_idx, key, value, slot_mapping)``."""


def _real(tensor: torch.Tensor) -> bool:
    """Not a fake or meta tensor (tracing, compile). A plain ``torch.Tensor`` is checked first:
    that is every call of a step that runs."""
    if type(tensor) is torch.Tensor:
        return not tensor.is_meta
    return not (is_fake(tensor) or tensor.is_meta)


class _Fallback(Exception):
    def __init__(self, reason: FallbackReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class NworInterceptor:
    """Routes the target model's KV writes during verify steps: stage, then commit or fall back.

    Args:
        staged: which layers have staged the step.
        plain_write: vLLM's own write path for one layer: a layer that cannot stage writes
            through it.
        stage_fn, commit_fn, write_back: the backend's fused stage (per layer), commit (all
            layers at once) and write-back, through which every fallback writes what the stage
            kept out of the cache, and which redoes a commit that raised.
        kv_bytes_per_token: bytes one token's K and V take in the paged cache, all target layers.
        uploader: carries each step's indices to the device (see :class:`IndexUploader`).
        device: where the committed-token counter lives (the caches').
    """

    def __init__(
        self,
        staged: StagedLayers,
        plain_write: PlainWrite,
        *,
        stage_fn: StageFn,
        commit_fn: CommitFn,
        write_back: WriteBackFn,
        kv_bytes_per_token: int,
        uploader: IndexUploader | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.staged = staged
        self.plain_write = plain_write
        self.stage_fn, self.commit_fn, self.write_back = stage_fn, commit_fn, write_back
        self.uploader = uploader
        self.kv_bytes_per_token = kv_bytes_per_token
        self._step: VerifyStep | None = None
        self._failed = False
        self._slot_source: torch.Tensor | None = None
        self._steps = 0
        self._tokens_staged = 0
        self._committed = torch.zeros((), dtype=torch.int64, device=device)
        # On CUDA the host reads the count from copies made after each commit (counters(wait=
        # False)); elsewhere the count is host memory already.
        self._readback = CommittedReadback() if self._committed.is_cuda else None
        self._fallbacks: Counter[str] = Counter()
        self.capturing = False  # set by the runner while vLLM captures its CUDA graphs
        self.graph_staging = False  # a captured CUDA graph holds the staged path
        self.graph_steps = 0  # staged steps that replayed such a graph

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def step(self) -> VerifyStep | None:
        """The verify step being staged, if any."""
        return self._step

    @property
    def active(self) -> bool:
        return self._step is not None

    def begin(self, step: VerifyStep | None) -> bool:
        """Decides, once for all layers, whether this step is staged. ``None``: no drafts."""
        if self._step is not None:
            self.discard(FallbackReason.NO_COMMIT)
        if step is None:
            return False
        if step.num_tokens > self.staged.max_tokens:
            self._fallbacks[FallbackReason.OVERFLOW.value] += 1
            return False
        self.staged.reset(step.num_tokens)
        self._step = step
        self._failed = False
        self._slot_source = None
        return True

    def begin_batch(self, num_draft_tokens: Sequence[int] | None,
                    query_start_loc: Sequence[int] | np.ndarray,
                    device: torch.device | str) -> bool:
        """Builds the step from the batch's draft counts and query start locations (host; None:
        no drafts) and begins it. A step that cannot be built is not staged: every row takes
        vLLM's write (``stage_error``), as after any staging error."""
        step = None
        if num_draft_tokens is not None:
            try:
                step = VerifyStep.from_batch(num_draft_tokens, query_start_loc, device,
                                             self.uploader)
            except Exception:
                logger.exception("NWOR: building the verify step failed; vLLM writes it")
                self.begin(None)
                self._fallbacks[FallbackReason.STAGE_ERROR.value] += 1
                return False
        return self.begin(step)

    def stage(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Takes layer ``layer_idx``'s KV write through the backend's stage.

        Called in every layer of a verify step that runs outside CUDA graphs, so it does little
        on the host: no NVTX range (the commit has one) and one frame to the stage."""
        if self._step is None:
            raise RuntimeError("NworInterceptor.stage() called outside a verify step")
        if self._failed:
            self.plain_write(layer_idx, key, value, slot_mapping)
            return
        try:
            self._stage(layer_idx, key, value, slot_mapping)
        except _Fallback as fallback:
            reason = fallback.reason
        except Exception:
            logger.exception("NWOR: staging layer %d failed; falling back", layer_idx)
            reason = FallbackReason.STAGE_ERROR
        else:
            return
        self._fall_back(reason)
        self.plain_write(layer_idx, key, value, slot_mapping)

    def is_staged(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s drafts are staged, so its attention must not read
        this step's rows from the cache. False outside a step and after a fallback."""
        return self._step is not None and not self._failed and self.staged.is_staged(layer_idx)

    def commit(self, sampled_token_ids: torch.Tensor) -> None:
        """Writes the accepted staged tokens of every layer; rejected ones are dropped.

        ``sampled_token_ids`` is the rejection sampler's output, ``[num_reqs, max_spec_len +
        1]`` with rejected positions ``-1`` (see :meth:`VerifyStep.verdict`); the verdict is
        read from it on the device. It opens no NVTX range: the range and its frame cost
        host time in every step. Nsight shows the commit as its
        kernel, ``_commit_kv_kernel``.
        """
        step, self._step = self._step, None
        if step is None or self._failed:
            return
        if not self.staged.is_complete():
            if not self._replayed_graph():
                self._fallbacks[FallbackReason.INCOMPLETE.value] += 1
                self._write_all_staged(step)
                return
            self.graph_steps += 1  # the graph staged every layer, marked or not
        verdict = step.verdict(sampled_token_ids, self._committed)
        try:
            self.commit_fn(verdict)
        except Exception:
            logger.exception("NWOR: commit failed; committing through vLLM's write path")
            self._fallbacks[FallbackReason.COMMIT_ERROR.value] += 1
            # If vLLM's own write fails too, the error propagates: the engine stops rather than
            # run on a cache that lacks accepted tokens.
            self.write_back(range(self.staged.num_layers), step.row_stage_index.shape[0],
                            verdict)
        self._steps += 1
        self._tokens_staged += self.staged.num_tokens
        if self._readback is not None:
            self._readback.after_commit(self._committed, self._steps, self._tokens_staged)

    def discard(self, reason: FallbackReason) -> None:
        """Ends the step without a verdict. Staged drafts are written as vLLM would write them.

        Without a verdict the rejected share is unknown, so every staged token is written:
        nothing that may be accepted is lost.
        """
        if self._step is None:
            return
        self._fallbacks[reason.value] += 1
        if not self._failed:
            self._write_all_staged(self._step)
        self._step = None

    # -- FULL CUDA graphs (see the module docstring) -------------------------------------------

    def stages_in_graph(self, max_query_len: int) -> bool:
        """Whether a layer call during graph capture (or its warm-up) takes the staged path: a
        batch of more than one token per request, which a verify step may replay."""
        return (self.capturing and self._step is None and self.uploader is not None
                and max_query_len > 1)

    def stage_for_graph(
        self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The fused stage as a graph captures it, reading the rows to stage at replay time.

        In warm-ups and capture vLLM's slot mapping is all -1, so nothing is written here."""
        assert self.uploader is not None  # stages_in_graph
        rows = self.uploader.rows(slot_mapping.shape[0])
        self.stage_fn(layer_idx, key, value, slot_mapping, rows)
        if key.is_cuda and torch.cuda.is_current_stream_capturing():
            self.graph_staging = True

    def unstage_rows(self, num_rows: int) -> None:
        """Makes a step that is not staged write all of its ``num_rows`` rows, should it replay a
        graph captured with the staged path."""
        if self.graph_staging and self.uploader is not None and num_rows > 0:
            self.uploader.rows(num_rows).fill_(-1)

    # -- counters ----------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Zeroes the counters (after vLLM's start-up warm-up steps, which no scheduler saw)."""
        self._steps = self._tokens_staged = self.graph_steps = 0
        self._committed.zero_()
        self._fallbacks.clear()
        if self._readback is not None:
            self._readback.reset()

    def counters(self, *, wait: bool = True) -> NworCounters:
        """A snapshot. ``wait``: read the device's committed count now, which waits for every
        step queued on the GPU. Without it (a serving engine's metrics) the token counts are
        those of the newest commit the host has seen land (:class:`CommittedReadback`): every
        step whose outputs the engine has, not the steps still running."""
        if wait or self._readback is None:
            steps, staged, committed = (self._steps, self._tokens_staged,
                                        int(self._committed.item()))
        else:
            steps, staged, committed = self._readback.latest()
        rejected = staged - committed
        return NworCounters(
            verify_steps_staged=steps,
            tokens_staged=staged,
            tokens_committed=committed,
            tokens_rejected=rejected,
            rejected_kv_bytes=rejected * self.kv_bytes_per_token,
            fallbacks=dict(self._fallbacks),
        )

    # -- internals ---------------------------------------------------------------------------

    def _stage(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The backend's stage of the layer, or raises ``_Fallback``."""
        if not (_real(key) and _real(value) and _real(slot_mapping)):
            raise _Fallback(FallbackReason.FAKE_TENSOR)
        step = self._step
        assert step is not None
        if self._slot_source is None:
            self._slot_source = slot_mapping  # first layer: the slot mapping all layers share
        elif slot_mapping is not self._slot_source:
            raise _Fallback(FallbackReason.SLOT_MAPPING)
        self.stage_fn(layer_idx, key, value, slot_mapping, step.row_stage_index)
        self.staged.mark_staged(layer_idx)

    def _fall_back(self, reason: FallbackReason) -> None:
        """All-or-nothing: every layer staged so far gets vLLM's write of all its drafts now."""
        logger.debug("NWOR: verify step falls back (%s)", reason.value)
        self._fallbacks[reason.value] += 1
        assert self._step is not None  # stage() checked it
        self._write_all_staged(self._step)
        self._failed = True

    def _replayed_graph(self) -> bool:
        """Whether the step replayed a FULL graph captured with the staged path: no layer ran
        Python, and such a graph stages every layer."""
        return self.graph_staging and not self.staged.holds_data()

    def _write_all_staged(self, step: VerifyStep) -> None:
        # A replayed graph staged every layer. (A step is begun in the same execute_model call
        # as its forward, so after a replayed graph the plan written back is the step's own.)
        layers = (range(self.staged.num_layers) if self._replayed_graph()
                  else self.staged.layers_with_data())
        self.write_back(layers, step.row_stage_index.shape[0], None)
