"""Lazy draft sync: SCV's chunk-0 steps skip the draft model; it catches up before drafting.

With draft_model on vLLM's V1 runner (the V2 runner, a GPU's default on vLLM 0.32, drafts k
every step and is not patched here), vLLM runs the draft model over every step's tokens even when
no drafts are wanted (draft budget 0, vLLM's own dynamic-k path), so that the draft's KV cache
stays complete.
That pass is what makes a chunk-0 step cost more than a step without speculation: the draft
pass is most of the difference (docs/scv.md), more than SCV may lose.

With SCV on and method draft_model, a step whose draft budget is 0 skips the drafter entirely
(what vLLM's k = 0 path returns: no drafts). The runner records, per request, the first position
whose draft K/V was not written, and the step's input tokens at their positions in a device
token history (the CPU token table holds placeholders under async scheduling). When a request is
next drafted, one catch-up pass of the draft model over its missing positions writes their draft
K/V (through the same layers and the same slots vLLM's pass would use) before vLLM's own pass. A
request that stays at chunk 0 costs the draft nothing; one that comes back pays the pass it
skipped, once, batched with the others.

Not with several KV-cache groups, context or pipeline parallelism, multimodal or M-RoPE
positions, or a draft with its own vocabulary: there the step keeps vLLM's pass. If recording or
catching up ever fails, the runner logs it and keeps vLLM's pass from then on; output is
unchanged either way (the target verifies every draft), only the acceptance of requests that
were behind suffers until they finish.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor._logging import get_logger
from vllm_nwor.nwor.verify_step import IndexUploader
from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config

logger = get_logger(__name__)

_NO_GAP = np.iinfo(np.int64).max

DRAFTED_ATTR = "nwor_drafted"
"""On a scheduler output that proposes drafts: the requests SCV's plan drafts (chunk > 0)."""

STATE_ATTR = "_nwor_draft_sync"
"""On the runner: its :class:`LazyDraftSync`, or False where vLLM's pass is kept."""


class LazyDraftSync:
    """Which positions lack draft K/V, per request, and the tokens to fill them with."""

    def __init__(self, runner: GPUModelRunner) -> None:
        self.max_tokens = runner.scheduler_config.max_num_batched_tokens
        self.history = torch.zeros((runner.max_num_reqs, runner.max_model_len),
                                   dtype=torch.int32, device=runner.device)
        self.slot: dict[str, int] = {}  # request -> history row
        self._free_slots = list(range(runner.max_num_reqs - 1, -1, -1))
        self.stale_from: dict[str, int] = {}  # request -> first position without draft K/V
        # The batch rows' history rows reach the device in one pinned copy that does not wait
        # for the stream (a copy from pageable memory may), when the batch changes.
        self._uploader = IndexUploader(runner.max_num_reqs, runner.device)
        self._row_slots: torch.Tensor | None = None  # on the device: batch row -> history row
        self._rows_of: list[str] | None = None  # the batch _row_slots maps
        self._gapped: list[str] | None = None  # the batch of the last record, every one gapped
        self.skipped_steps = 0
        self.caught_up_tokens = 0
        self.kept_behind = 0
        """Requests left behind at a drafting step (at chunk 0 in its plan), summed over steps."""

    def _forget_departed(self, runner: GPUModelRunner) -> None:
        """A request that left the batch (finished, preempted) starts over if it comes back:
        its KV is recomputed from its first position."""
        live = runner.input_batch.req_id_to_index
        for req_id in [r for r in self.slot if r not in live]:
            self._free_slots.append(self.slot.pop(req_id))
            self.stale_from.pop(req_id, None)

    def _batch(self, runner: GPUModelRunner) -> list[str]:
        """The batch's requests, each with a history row, and the rows' map on the device
        (uploaded only when the batch changed)."""
        batch = runner.input_batch
        req_ids = batch.req_ids[: batch.num_reqs]
        if req_ids != self._rows_of:
            self._forget_departed(runner)
            slot = self.slot
            for req_id in req_ids:
                if req_id not in slot:
                    slot[req_id] = self._free_slots.pop()
            self._row_slots = self._uploader.upload(
                np.fromiter((slot[r] for r in req_ids), dtype=np.int64, count=len(req_ids)))
            self._rows_of = req_ids
        return req_ids

    def _keep_tokens(self, runner: GPUModelRunner) -> None:
        """This step's input tokens into the history, at their requests' rows and positions:
        two small kernels, no host work per request."""
        num_tokens = int(runner.query_start_loc.np[runner.input_batch.num_reqs])
        token_slots = self._row_slots[runner.req_indices.gpu[:num_tokens]]
        self.history[token_slots, runner.positions[:num_tokens]] = (
            runner.input_ids.gpu[:num_tokens].to(self.history.dtype))

    def record_skipped_step(self, runner: GPUModelRunner) -> None:
        """This step's tokens got no draft K/V: note where each request's gap starts and keep
        the tokens (on the device, where the step's inputs are) for the catch-up. While the
        batch stays what it was at the last record (a batch held at chunk 0), every gap is
        already open and nothing is done per request."""
        req_ids = self._batch(runner)
        if req_ids != self._gapped:
            stale_from = self.stale_from
            firsts = runner.input_batch.num_computed_tokens_cpu[: len(req_ids)]
            known = np.fromiter((stale_from.get(r, _NO_GAP) for r in req_ids), np.int64,
                                len(req_ids))
            for row in np.flatnonzero(firsts < known).tolist():  # a gap starts (or earlier)
                stale_from[req_ids[row]] = int(firsts[row])
            self._gapped = req_ids
        self._keep_tokens(runner)
        self.skipped_steps += 1

    def catch_up(self, runner: GPUModelRunner, drafted: Collection[str] | None = None) -> None:
        """Before vLLM's draft pass: the draft K/V of every position a request to be drafted
        (``drafted``; None: every request) skipped. A request left at chunk 0 stays behind:
        vLLM's pass writes its draft K/V of this step from an incomplete context, so this
        step's tokens join its gap (kept in the history) and its catch-up rewrites them."""
        self._batch(runner)  # forgets the departed (every request's slot is given out there)
        batch = runner.input_batch
        gaps = []  # (batch row, history row, first missing position, this step's first position)
        behind = {}
        for req_id, start in self.stale_from.items():
            if drafted is not None and req_id not in drafted:
                behind[req_id] = start
                continue
            row = batch.req_id_to_index[req_id]
            end = int(batch.num_computed_tokens_cpu[row])
            if start < end:
                gaps.append((row, self.slot[req_id], start, end))
        self.stale_from = behind  # vLLM's pass covers this step's tokens of the others
        self._gapped = None
        if behind:
            self._keep_tokens(runner)
            self.kept_behind += len(behind)
        while gaps:
            # One piece per request per pass, within the engine's token budget.
            pieces, budget, rest = [], self.max_tokens, []
            for row, slot, start, end in gaps:
                take = min(end - start, budget)
                if take > 0:
                    pieces.append((row, slot, start, start + take))
                    budget -= take
                if start + take < end:
                    rest.append((row, slot, start + take, end))
            self._draft_pass(runner, pieces)
            gaps = rest

    def _draft_pass(self, runner: GPUModelRunner, pieces: list[tuple[int, int, int, int]]
                    ) -> None:
        drafter, device = runner.drafter, runner.device
        rows = np.array([p[0] for p in pieces], dtype=np.int64)
        slots = np.array([p[1] for p in pieces], dtype=np.int64)
        starts = np.array([p[2] for p in pieces], dtype=np.int64)
        ends = np.array([p[3] for p in pieces], dtype=np.int64)
        lengths = ends - starts
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        num_tokens = int(query_start[-1])
        positions_np = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        table = runner.input_batch.block_table[0]
        block_ids = table.get_numpy_array()[np.repeat(rows, lengths),
                                            positions_np // table.block_size]
        slot_mapping_np = block_ids * table.block_size + positions_np % table.block_size

        def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype=dtype,
                                                                    non_blocking=True)

        positions = to_device(positions_np, torch.int64)
        token_slots = to_device(np.repeat(slots, lengths), torch.int64)
        input_ids = self.history[token_slots, positions]
        slot_mapping = to_device(slot_mapping_np, torch.int64)
        metadata = CommonAttentionMetadata(
            query_start_loc=to_device(query_start, torch.int32),
            query_start_loc_cpu=torch.from_numpy(query_start),
            seq_lens=to_device(ends, torch.int32),
            seq_lens_cpu_upper_bound=torch.from_numpy(ends.astype(np.int32)),
            num_reqs=len(pieces),
            num_actual_tokens=num_tokens,
            max_query_len=int(lengths.max()),
            max_seq_len=int(ends.max()),
            block_table_tensor=table.get_device_tensor(runner.input_batch.num_reqs)[
                to_device(rows, torch.int64)],
            slot_mapping=slot_mapping,
            causal=True,
            positions=positions,
        )
        _, per_layer = drafter.build_per_group_and_layer_attn_metadata(metadata)
        with set_forward_context(
            per_layer, runner.vllm_config, num_tokens=num_tokens,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping={name: slot_mapping for name in drafter._draft_attn_layer_names},
        ):
            drafter.model(input_ids=input_ids, positions=positions, inputs_embeds=None)
        self.caught_up_tokens += num_tokens


def lazy_draft_sync(runner) -> LazyDraftSync | None:
    """The runner's lazy draft sync, once its first draft step has set it up; None where it is
    off (or not set up yet)."""
    return getattr(runner, STATE_ATTR, None) or None


def disable_lazy_draft_sync(runner) -> None:
    """The draft model runs on every step from now on, as in vLLM (tests and benchmarks compare
    the two)."""
    setattr(runner, STATE_ATTR, False)


def _state(runner: GPUModelRunner) -> LazyDraftSync | None:
    state = getattr(runner, STATE_ATTR, None)
    if state is None:
        config = plugin_config(runner.vllm_config)
        parallel = runner.vllm_config.parallel_config
        speculative = runner.speculative_config
        wanted = (
            config.scv != "off"
            and speculative is not None and speculative.method == "draft_model"
            and len(runner.kv_cache_config.kv_cache_groups) == 1
            and parallel.decode_context_parallel_size == 1
            and parallel.pipeline_parallel_size == 1
            # The catch-up feeds the target's token ids and 1-D positions to the draft as is.
            and not runner.uses_mrope
            and not getattr(runner.drafter, "supports_mm_inputs", False)
            and not getattr(runner.drafter, "use_heterogeneous_vocab", False)
        )
        state = LazyDraftSync(runner) if wanted else False
        setattr(runner, STATE_ATTR, state)
        if state:
            logger.info("Lazy draft sync: chunk-0 steps skip the draft model, which catches "
                        "up before a request is drafted again")
    return state or None


def _next_tokens_without_drafting(runner: GPUModelRunner, sampled_token_ids, *args,
                                  **kwargs) -> None:
    """What vLLM's pass leaves behind besides drafts, under async scheduling: each request's
    next input token and valid sampled count, which the next step reads to fill its inputs and
    correct its token counts (vLLM does the same when the drafter does not run,
    ``GPUModelRunner.sample_tokens``). A step that verified no drafts (one token sampled per
    request) needs neither: vLLM's bookkeeping then keeps its sampled tokens as the next inputs,
    as it does without speculation, and skips the padded preparation's loop over the requests
    and its copy to the host."""
    if (isinstance(sampled_token_ids, torch.Tensor) and sampled_token_ids.shape[-1] > 1
            and runner.valid_sampled_token_count_event is not None):
        next_token_ids, valid_counts = runner.drafter.prepare_next_token_ids_padded(
            sampled_token_ids, runner.requests, runner.input_batch,
            runner.discard_request_mask.gpu)
        runner._copy_valid_sampled_token_count(next_token_ids, valid_counts)


def _wrap_propose_draft_token_ids(propose_draft_token_ids):
    def wrapper(self, scheduler_output, *args, **kwargs):
        state = _state(self)
        if state is not None:
            try:
                if scheduler_output.num_spec_tokens_to_schedule == 0:
                    state.record_skipped_step(self)
                    _next_tokens_without_drafting(self, *args, **kwargs)
                    return torch.empty((self.input_batch.num_reqs, 0), dtype=torch.int64,
                                       device=self.device)
                state.catch_up(self, getattr(scheduler_output, DRAFTED_ATTR, None))
            except Exception:
                # Output never depends on the draft's KV (the target verifies every draft):
                # requests still behind draft from an incomplete context until they finish.
                logger.warning("Lazy draft sync failed; the draft model now runs on every "
                               "step", exc_info=True)
                setattr(self, STATE_ATTR, False)
        return propose_draft_token_ids(self, scheduler_output, *args, **kwargs)

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "propose_draft_token_ids",
        _wrap_propose_draft_token_ids,
        why="With SCV and draft_model: skip the draft model on steps with draft budget 0 and "
        "write the skipped positions' draft K/V before a request is drafted again. Retired by "
        "a drafter hook that defers its KV sync.",
    ),
]
