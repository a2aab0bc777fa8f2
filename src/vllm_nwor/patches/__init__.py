"""Every vLLM attribute the plugin replaces or adds, in the order they are applied.

This package is the only place that touches vLLM internals. Each patch keeps the original and
calls it; see each entry's ``why`` for what it does and what would retire it. The modules are
grouped by feature: ``nwor/`` (staged KV writes and verify attention), ``scv/`` (per-request
chunks), ``telemetry/`` (the plugin's metrics); ``engine_args`` (the plugin's config),
``draft_window`` (the draft context window) and ``_patch`` (the utility) serve all of them.

0. ``VllmConfig.compute_hash``: vLLM's config hash (its compile cache's key) without the
   plugin's keys, so the plugin shares vLLM's compiled kernels.
1. ``EngineArgs.create_engine_config``: move the plugin's keys out of the speculative config
   into ``additional_config``; validate the finished config; with telemetry on, ask for
   vLLM's per-request speculative-decoding metrics at ``detailed``.
2. ``GPUModelRunner.initialize_kv_cache``: bind the interceptor to the target's attention layers.
3. ``GPUModelRunner._prepare_inputs``: begin each verify step, once for all layers.
4. ``GPUModelRunner._sample``: commit the accepted drafts after rejection sampling.
4a. V2 runner (``vllm/v1/worker/gpu/model_runner.py``, EAGLE/EAGLE-3/MTP on dense models):
    ``initialize_kv_cache`` (bind), ``prepare_inputs`` (begin), ``sample`` (commit, the
    verdict built from ``num_sampled``), ``capture_model`` (as 9).
5. ``CPUAttentionBackendImpl.do_kv_cache_update``: stage draft rows of bound layers.
6. ``CPUAttentionBackendImpl.forward``: chunk-verify attention in staged steps (and no 2nd write).
7. ``FlashAttentionImpl.do_kv_cache_update``: bound layers write through the scratch plan.
8. ``FlashAttentionImpl.forward``: in staged steps, vLLM's own attention over a block table
   whose drafting requests' last blocks are scratch blocks holding the step's chunk.
9. ``GPUModelRunner.capture_model``: with NWOR on, FULL graphs of batches that may verify are
   captured with the staged path (docs/gpu.md).
9a. ``EngineCore._initialize_kv_caches``: on CUDA with NWOR on, the scheduler gets the KV cache
   less the scratch blocks, which the workers keep for verify attention.
10. ``WorkerBase.nwor_counters`` (added): counters for ``collective_rpc``.
11. ``Scheduler.__init__``: create the SCV chunk policy when ``scv`` is on.
12. ``Scheduler._update_after_schedule``: the draft budget for the drafter.
13. ``AsyncScheduler._update_after_schedule``: per-request chunk cut of draft placeholders.
14. ``Scheduler.update_draft_token_ids``: per-request chunk cut of new drafts.
15. ``Scheduler.update_from_output``: feed the policy chunks, verdicts and step times.
16. ``DraftModelProposer._get_model``: window the draft model's attention (draft context window).
17. ``GPUModelRunner._check_and_update_cudagraph_mode``, 18. ``._warmup_and_capture``,
    19. ``._determine_batch_execution_and_padding``: with SCV on, FULL decode graphs for steps
    where every request has the same chunk, of any size (``decode_graphs.py``).
19a. V2 runner: ``CudaGraphManager._init_candidates``: with SCV on, FULL decode graphs for
    uniform batches of every chunk size (vLLM's dynamic-speculation loop; ``decode_graphs_v2.py``).
20. ``GPUModelRunner.propose_draft_token_ids``: with SCV and draft_model, skip the draft model on
    chunk-0 steps and catch it up before a request is drafted again (``draft_sync.py``).
20a. ``gpu_model_runner.update_scheduler_for_invalid_drafts`` (the runner module's name for
    vLLM's function): with SCV and ngram_gpu, a step with no drafts does not wait for the
    drafter's valid-draft counts (``ngram_gpu.py``).

Telemetry (``telemetry/engine.py``, ``telemetry/frontend.py``; docs/telemetry.md). Per-request
acceptance is vLLM's own (``--per-request-spec-decode-metrics``, set to ``detailed`` by 1.):

21. ``Scheduler.make_spec_decoding_stats``: count each verified request's chunk size.
22. ``EngineCore._attach_iteration_details``: attach the step's numbers to its scheduler stats.
23. ``MPClient.__init__``: decode the engine core's outputs with the plugin's stats field.
24. ``OutputProcessor._update_stats_from_finished``: finished requests' metrics (vLLM's) to the
    stats.
25. ``StatLoggerManager.__init__``: add the plugin's stat logger (Prometheus, log line).
"""

from __future__ import annotations

from vllm_nwor.patches._patch import Patch


def all_patches() -> list[Patch]:
    """The patches applied when the plugin registers, in every process."""
    from vllm_nwor.patches import draft_window, engine_args
    from vllm_nwor.patches.nwor import (
        cpu_attn,
        engine_core,
        flash_attn,
        model_runner,
        model_runner_v2,
        worker,
    )
    from vllm_nwor.patches.scv import (
        decode_graphs,
        decode_graphs_v2,
        draft_sync,
        ngram_gpu,
        scheduler,
    )
    from vllm_nwor.patches.telemetry import engine as telemetry_engine
    from vllm_nwor.patches.telemetry import frontend as telemetry_frontend

    return [
        *engine_args.PATCHES,
        *model_runner.PATCHES,
        *model_runner_v2.PATCHES,
        *cpu_attn.PATCHES,
        *flash_attn.PATCHES,
        *engine_core.PATCHES,
        *worker.PATCHES,
        *scheduler.PATCHES,
        *draft_window.PATCHES,
        *decode_graphs.PATCHES,
        *decode_graphs_v2.PATCHES,
        *draft_sync.PATCHES,
        *ngram_gpu.PATCHES,
        *telemetry_engine.PATCHES,
        *telemetry_frontend.PATCHES,
    ]


def apply_all() -> int:
    """Applies every patch; returns how many were newly installed (0 when already applied)."""
    return sum(patch.apply() for patch in all_patches())

