"""Where a speculative step's host time goes when nothing is verified: the CPU engine, cProfile.

On the GPU a step at chunk 0 (SCV's plain decoding inside a speculative engine) cost 1.4-1.5x
a step without speculation (``scv_step_profile_2026-11-21_h200.json``). Part of that is host
work, and host work shows on the CPU engine too. This runs, in one process each (the engine
in-process, so cProfile sees scheduler, runner, drafter and plugin), the same greedy workload
on the tiny CPU pair:

- ``no_spec``: no speculation;
- ``vllm_k0``: vLLM's draft_model path held at k = 0 by its own per-batch-size schedule, no
  plugin feature on;
- ``scv_chunk0``: SCV held at chunk 0 by a given cost model (as in ``scv_step_profile.py``);
- ``vllm_k2``: vLLM's draft_model path at k = 2, no plugin key (whatever ``--k`` says);
- ``scv_fixed2``: SCV in an engine built for k = 8, every chunk held at 2 (``scv: fixed``,
  ``scv_chunk_size: 2``), against ``vllm_k2``: the same drafts verified.

Engines alternate round by round; the result has each engine's median seconds per step, the
ratio to ``no_spec``, and from one more run under cProfile, each phase of vLLM's step (scheduler,
runner, drafter, output processing) and the plugin's own code, in ms per step (cProfile slows
Python down: compare phases between engines, not with the unprofiled step time).

    PYTHONPATH=src .venv/bin/python benchmarks/chunk0_cpu_profile.py --result F.json
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import (  # noqa: E402
    CPU_ENGINE,
    PINNED_AT_ZERO,
    count_engine_steps,
    environment,
    write_result,
)

ENGINES = ("no_spec", "vllm_k0", "scv_chunk0", "vllm_k2", "scv_fixed2")
# A step's phases: (label, file path fragment, function), each with all it calls (cumulative
# time); the runner's phases nest inside execute_model and sample_tokens.
PHASES = (
    ("engine step", "v1/engine/core.py", "step"),
    ("scheduler.schedule", "v1/core/sched/scheduler.py", "schedule"),
    ("scheduler.update_from_output", "v1/core/sched/scheduler.py", "update_from_output"),
    ("runner.execute_model", "v1/worker/gpu_model_runner.py", "execute_model"),
    ("  runner._update_states", "v1/worker/gpu_model_runner.py", "_update_states"),
    ("  runner._prepare_inputs", "v1/worker/gpu_model_runner.py", "_prepare_inputs"),
    ("  runner._model_forward", "v1/worker/gpu_model_runner.py", "_model_forward"),
    ("runner.sample_tokens", "v1/worker/gpu_model_runner.py", "sample_tokens"),
    ("  runner.propose_draft_token_ids", "v1/worker/gpu_model_runner.py",
     "propose_draft_token_ids"),
    ("    drafter.propose", "v1/spec_decode/llm_base_proposer.py", "propose"),
    ("  runner._bookkeeping_sync", "v1/worker/gpu_model_runner.py", "_bookkeeping_sync"),
    ("output processing", "v1/engine/output_processor.py", "process_outputs"),
)


def speculative_config(name: str, draft: str, k: int) -> dict | None:
    if name == "no_spec":
        return None
    k = {"vllm_k2": 2, "scv_fixed2": 8}.get(name, k)
    config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    if name == "vllm_k2":
        return config
    if name == "scv_fixed2":
        return {**config, "scv": "fixed", "scv_chunk_size": 2}
    if name == "vllm_k0":
        return {**config, "num_speculative_tokens_per_batch_size": [[1, 1 << 20, 0]]}
    return {**config, "scv": "adaptive", **PINNED_AT_ZERO}


def phase_times(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative seconds of each phase in PHASES. Where one file has several functions of
    the name (``sample_tokens`` wraps the method ``propose_draft_token_ids`` in a closure of
    the same name), the innermost one counts: the smallest cumulative time."""
    times: dict[str, float] = {}
    for (filename, _, function), row in stats.stats.items():
        for label, fragment, name in PHASES:
            if function == name and filename.endswith(fragment):
                times[label] = min(times.get(label, row[3]), row[3])
    times = {label: times.get(label, 0.0) for label, _, _ in PHASES}
    plugin = sum(row[2] for (filename, _, _), row in stats.stats.items()
                 if "vllm_nwor/" in filename)
    return {**times, "plugin's own code (self time)": plugin}


def plugin_functions(stats: pstats.Stats, top: int = 12) -> dict[str, tuple[float, float]]:
    """The plugin's functions with the most cumulative seconds (with all they call, numpy
    included), each as (self, cumulative); its ``wrapper`` closures are left out, as their
    cumulative time holds the vLLM method they wrap."""
    rows = {f"{filename.rsplit('vllm_nwor/', 1)[1]}:{function}": (row[2], row[3])
            for (filename, _, function), row in stats.stats.items()
            if "vllm_nwor/" in filename and function != "wrapper"}
    return dict(sorted(rows.items(), key=lambda item: -item[1][1])[:top])


def engine_main(conn, name: str, target: str, draft: str, batch: int, k: int,
                max_tokens: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, speculative_config=speculative_config(name, draft, k),
              max_num_seqs=batch, **CPU_ENGINE)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 2 for j in range(32)]}
               for i in range(batch)]
    steps = count_engine_steps(llm)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    conn.send("ready")
    while (message := conn.recv()) != "stop":
        profiler = cProfile.Profile() if message == "profile" else None
        steps[0] = 0
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if profiler:
            profiler.disable()
        seconds = time.perf_counter() - start
        reply = {"seconds": seconds, "steps": steps[0],
                 "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        if profiler:
            stats = pstats.Stats(profiler)
            reply["phases"] = phase_times(stats)
            reply["plugin_functions"] = plugin_functions(stats)
        conn.send(reply)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    from vllm_nwor.testing import write_tiny_llama_pair

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_tiny_llama_pair(root)
        engines = {}
        for name in args.engines:  # one at a time: each sizes its KV cache at start-up
            conn, child = context.Pipe()
            process = context.Process(target=engine_main, args=(
                child, name, target, draft, args.batch, args.k, args.max_tokens))
            process.start()
            if conn.recv() != "ready":
                raise RuntimeError(f"engine {name} did not start")
            engines[name] = (conn, process)
        try:
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for rnd in range(args.rounds):
                order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]
                for name in order:
                    engines[name][0].send("run")
                    runs[name].append(engines[name][0].recv())
            profiles = {}
            for name, (conn, _) in engines.items():
                conn.send("profile")
                profiles[name] = conn.recv()
        finally:
            for conn, process in engines.values():
                conn.send("stop")
                process.join(timeout=60)
    per_step = {name: statistics.median(r["seconds"] / r["steps"] for r in rs)
                for name, rs in runs.items()}
    reference = runs[args.engines[0]][0]["tokens"]
    cells = {
        name: {
            "ms_per_step": round(1e3 * per_step[name], 3),
            "over_no_spec": round(per_step[name] / per_step["no_spec"], 3)
            if "no_spec" in per_step else None,
            "steps_per_run": runs[name][0]["steps"],
            "same_tokens_as_first_engine": all(r["tokens"] == reference for r in runs[name]),
            "profiled_ms_per_step_by_phase": {
                label: round(1e3 * t / profiles[name]["steps"], 3)
                for label, t in profiles[name]["phases"].items()},
            "profiled_plugin_functions_ms_per_step_self_and_cumulative": {
                function: [round(1e3 * t / profiles[name]["steps"], 3) for t in times]
                for function, times in profiles[name]["plugin_functions"].items()},
        }
        for name in runs
    }
    for name, cell in cells.items():
        print(name, cell)
    write_result(args.result, {
        **environment(), "benchmark": "chunk0_cpu_profile",
        "workload": {"batch": args.batch, "max_tokens": args.max_tokens,
                     "k_by_engine": {name: (speculative_config(name, "d", args.k) or {}).get(
                         "num_speculative_tokens", 0) for name in runs},
                     "prompt_len": 32, "rounds": args.rounds, "model": "tiny CPU pair",
                     "scheduling": "vLLM's default on the CPU (sync)"},
        "cells": cells,
    })


if __name__ == "__main__":
    main()
