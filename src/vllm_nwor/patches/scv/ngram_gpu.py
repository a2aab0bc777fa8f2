"""ngram_gpu with SCV: a step that verifies no drafts does not wait for the drafter.

On vLLM's V1 runner the ``ngram_gpu`` drafter proposes on the GPU, and some of its draft slots
have no n-gram match. So at the start of the next step the runner waits for the drafter's count
of valid drafts per request (``update_scheduler_for_invalid_drafts``, an event sync) and trims
the rest.
With async scheduling that wait ends the overlap: the host prepares the step only once the GPU
has finished the previous one, drafter included.

A step that schedules no drafts has nothing to trim. With SCV on, such a step (every request at
chunk 0) skips the wait. Everything else is vLLM's: the drafter still runs every step (its pass
keeps its token table on the GPU current), and a step with drafts waits and trims as before.

The runner calls the function by its module-level name with no runner and a copy of the
scheduler output made from its fields (so no mark set on the scheduler's copy arrives): whether
SCV is on is this process's setting, set when its runner allocates its KV cache
(:func:`configure`; vLLM runs one model runner per worker process).
"""

from __future__ import annotations

from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_nwor.patches._patch import Patch
from vllm_nwor.patches.settings import plugin_config

_scv_on = False


def configure(runner) -> None:
    """This process's runner: whether its steps with no drafts skip the wait (SCV on)."""
    global _scv_on
    _scv_on = plugin_config(runner.vllm_config).scv != "off"


def _wrap_initialize_kv_cache(initialize_kv_cache):
    def wrapper(self, *args, **kwargs):
        initialize_kv_cache(self, *args, **kwargs)
        configure(self)

    return wrapper


def _wrap_update_scheduler_for_invalid_drafts(update_scheduler_for_invalid_drafts):
    def wrapper(num_valid_draft_tokens_event, num_valid_draft_tokens_cpu, scheduler_output,
                req_id_to_index):
        if _scv_on and not scheduler_output.scheduled_spec_decode_tokens:
            return  # no drafts to trim: no wait for their counts
        update_scheduler_for_invalid_drafts(num_valid_draft_tokens_event,
                                            num_valid_draft_tokens_cpu, scheduler_output,
                                            req_id_to_index)

    return wrapper


PATCHES = [
    Patch(
        GPUModelRunner,
        "initialize_kv_cache",
        _wrap_initialize_kv_cache,
        why="Note whether SCV is on in this process, for the function below, which vLLM calls "
        "without the runner.",
    ),
    Patch(
        gpu_model_runner,
        "update_scheduler_for_invalid_drafts",
        _wrap_update_scheduler_for_invalid_drafts,
        why="With SCV and ngram_gpu: a step that schedules no drafts skips the wait for the "
        "drafter's valid-draft counts, which it has nothing to trim with. Retired by the same "
        "early return in vLLM.",
    ),
]
