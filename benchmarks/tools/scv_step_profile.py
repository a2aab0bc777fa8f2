"""Where does a speculative step's time go, engine by engine (chunk 0's floor included)?

Where a speculative step's time goes, engine by engine: a diagnostic, one GPU.

Engines side by side (``--engines``), all with async scheduling, on a uniform workload (L=1.5
by default, ``--acceptance-length``; per-request synthetic acceptance, as in ``scv_bench.py``):
no speculation, fixed k=2, 4 and 8, SCV adaptive, SCV held at its largest chunk (8: SCV's
machinery without its choices, ``scv_fixed``; at chunk 2 or 4, ``scv_fixed2``, ``scv_fixed4``:
the steps of one budget, traced, to price against the fixed k's own), and SCV held at
chunk 0 by a given cost model (``scv_cost_model``: verification priced far above its worth,
probes rare), which isolates the spec path's floor from SCV's choices. ``--method ngram_gpu``:
the speculative engines draft with ngram_gpu (``vllm_k0`` and ``vllm_ngram_k0`` keep theirs).
``vllm_k0`` is vLLM's own dynamic-k path held at k = 0 (``num_speculative_tokens_per_batch_size``),
with no plugin feature on: the same floor without the plugin; ``vllm_ngram_k0`` is that with
ngram_gpu, whose drafter runs no model. ``no_spec_v1`` is no speculation on vLLM's V1 model
runner: vLLM 0.26 ran plain decoding of this model on its V2 runner but speculation with
draft_model or ngram on V1 (``VllmConfig.use_v2_model_runner``), so the two no-speculation
engines tell the runners' difference apart from what speculating costs. ``scv_chunk0_bare`` is
``scv_chunk0`` without the plugin's own host work of a chunk-0 step (no planning, no record of
the skipped draft pass, no telemetry): what is left is vLLM's speculative path at zero drafts;
``scv_chunk0_no_<part>`` leaves out one of them. ``scv_chunk0_trim_wait`` is ``scv_chunk0``
where a step without drafts still waits for ngram_gpu's valid-draft counts, as in vLLM
(``patches/scv/ngram_gpu.py`` left out; with ``--method ngram_gpu``).

It reports throughput per batch size (alternating, ``--reps`` runs: the median and each run)
and, at each of
``--profile-batches`` (1 by default), torch profiler tables of one run per engine (self CPU time
and self CUDA time by op) and cProfile's tables of the same run (the engine is in-process:
scheduler, runner and plugin). Greedy tokens of each engine are compared with no speculation's:
SCV held at chunk 0 verifies no drafts, so they must match.

    python -m benchmarks.tools.scv_step_profile --jsonl $OUT/scv_step_profile.jsonl
    python -m benchmarks.tools.scv_step_profile --merge scv_step_profile.jsonl --result <json>
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.engines import (
    ABLATE_KEY,
    PINNED_AT_ZERO,
    agreement,
    alternate,
    prompts,
    start_engines,
    stop_engines,
    tokens_per_second,
    write_models,
)
from benchmarks.harness.results import (
    append_jsonl,
    parse_or_merge,
    recorded_environment,
    write_json,
)
from benchmarks.scv_bench import METHODS, REFERENCE_K, engine_kwargs, rate_for_length

CHUNK0_PARTS = ("plan", "record", "telemetry")
"""The plugin's host work of a chunk-0 step, each left out by its own engine."""
ENGINES = ("no_spec", "no_spec_v1", "fixed_k2", "fixed_k4", "fixed_k8", "scv", "scv_fixed",
           "scv_fixed2", "scv_fixed4", "scv_chunk0", "scv_chunk0_bare",
           *(f"scv_chunk0_no_{part}" for part in CHUNK0_PARTS), "scv_chunk0_trim_wait",
           "vllm_k0", "vllm_ngram_k0")
VLLM_K0 = [[1, 1 << 20, 0]]


def configs(target: str, draft: str, max_batch: int, share: float,
            names: tuple[str, ...] = ENGINES, method: str = "draft_model") -> dict[str, dict]:
    """Each engine's kwargs; the speculative policies draft with ``method`` (``scv_bench``'s
    ``--method``), but for ``vllm_k0`` and ``vllm_ngram_k0``, whose drafters are their own."""
    out = {}
    for name in names:
        policy = ("scv_chunk0" if name.startswith("scv_chunk0") else
                  "scv" if name.startswith("scv_fixed") else
                  "fixed_k8" if name.startswith("vllm_") else name)
        out[name] = engine_kwargs(policy, target, draft, max_batch, share, method)
        speculative = out[name].get("speculative_config")
        if name == "scv_fixed":
            out[name]["speculative_config"] = {**speculative, "scv": "fixed"}
        if name in ("scv_fixed2", "scv_fixed4"):  # against fixed k=2 or 4: the same verify
            # chunks, an engine of k=8
            chunk = int(name.removeprefix("scv_fixed"))
            out[name]["speculative_config"] = {**speculative, "scv": "fixed",
                                               "scv_chunk_size": chunk}
        if name == "scv_chunk0_trim_wait":
            out[name][ABLATE_KEY] = ["trim_wait"]
        elif name.startswith("scv_chunk0_"):  # without (some of) the plugin's own host work
            left_out = CHUNK0_PARTS if name.endswith("_bare") else (name.rsplit("_", 1)[1],)
            if "telemetry" in left_out:
                out[name]["speculative_config"]["nwor_telemetry"] = False
            out[name][ABLATE_KEY] = [part for part in left_out if part != "telemetry"]
        if name == "vllm_k0":
            out[name]["speculative_config"] = {
                "method": "draft_model", "model": draft, "num_speculative_tokens": 8,
                "num_speculative_tokens_per_batch_size": VLLM_K0}
        if name == "vllm_ngram_k0":  # the same with no drafter model
            out[name]["speculative_config"] = {
                "method": "ngram_gpu", "num_speculative_tokens": 8,
                "num_speculative_tokens_per_batch_size": VLLM_K0}
    return out


def merge(jsonl: Path, result: Path) -> None:
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    length = records[0].get("acceptance_length", 1.5) if records else 1.5
    payload = {**recorded_environment(jsonl), "benchmark": "scv_step_profile",
               "workload": {"acceptance": f"uniform L={length:g} at k=4 (per-request synthetic)",
                            "load": "steady, 2 x batch requests, batch in flight",
                            "drafter": sorted({r.get("method", "draft_model") for r in records}),
                            "prompt_len": 128, "async_scheduling": "on for every engine",
                            "scv_chunk0": PINNED_AT_ZERO},
               "cells": [r for r in records if "profile" not in r],
               "profiles": [r for r in records if "profile" in r]}
    write_json(result, payload)
    print(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--reps", type=int, default=2,
                        help="runs per engine and batch, alternating (the median is reported)")
    parser.add_argument("--acceptance-length", type=float, default=1.5,
                        help="every request's mean acceptance length at k=4 (synthetic)")
    parser.add_argument("--method", choices=METHODS, default="draft_model",
                        help="the speculative engines' drafter (scv_bench.py's)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-batches", type=int, nargs="+", default=[1],
                        help="requests in flight in each profiled run (2x as many served)")
    parser.add_argument("--engine-core-process", action="store_true",
                        help="each engine core in its own process, as vLLM's LLM runs by "
                        "default (implies --no-profile; no ablation engines)")
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    args.no_profile |= args.engine_core_process
    rate = rate_for_length(args.acceptance_length, REFERENCE_K)
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        engines = start_engines(configs(target, draft, max(args.batches),
                                        round(0.88 / len(args.engines), 3),
                                        tuple(args.engines), args.method),
                                args.engine_core_process)
        try:
            for engine in engines.values():  # SCV's at every chunk size and measured batch
                profiled = () if args.no_profile else args.profile_batches
                for batch in sorted({4, *args.batches, *profiled}):
                    engine.warm(prompts(batch, seed=99))
            for batch in args.batches:
                extra = [{"synthetic_acceptance_rate": rate}] * (2 * batch)
                runs = {name: [] for name in engines}
                for rep in range(args.reps):
                    batch_prompts = prompts(2 * batch, seed=1000 * batch + rep, length=128)
                    for name, run in alternate(engines, batch_prompts, rep, extra,
                                               batch).items():
                        runs[name].append(run)
                by_rep = {name: [tokens_per_second(r) for r in rs] for name, rs in runs.items()}
                row = {"batch": batch, "acceptance_length": args.acceptance_length,
                       "method": args.method, "tok_s": {
                    name: round(statistics.median(values), 1) for name, values in by_rep.items()},
                    "tok_s_by_rep": {name: [round(v, 1) for v in values]
                                     for name, values in by_rep.items()}, "drafted": {
                    name: sum(r["drafted"] for r in rs) for name, rs in runs.items()},
                    "engine_core_process": args.engine_core_process,
                    # each run's engine steps: how many, median and trimmed mean, in ms
                    "step_ms_by_rep": {name: [r.get("step_ms") for r in rs]
                                       for name, rs in runs.items()}}
                scv = {name: [r["scv"] for r in rs if r.get("scv")] for name, rs in runs.items()}
                if any(scv.values()):  # what each SCV engine chose, and from what (harness.engines)
                    row["scv"] = {name: {
                        "budget_counts_by_rep": [x["counters"]["budget_counts"] for x in xs],
                        "budget_changes_by_rep": [x["budget_changes"] for x in xs],
                        "steps_by_rep": [x["steps"] for x in xs],
                        "coefficients": xs[-1]["coefficients"]} for name, xs in scv.items() if xs}
                if "no_spec" in runs:  # greedy: drafts never verified means the same tokens
                    row["same_tokens_as_no_spec"] = {
                        name: round(agreement(rs[0]["tokens"], runs["no_spec"][0]["tokens"])[0], 5)
                        for name, rs in runs.items()}
                print(json.dumps(row), flush=True)
                append_jsonl(args.jsonl, row)
            for batch in args.profile_batches if not args.no_profile else ():
                batch_prompts = prompts(2 * batch, seed=7, length=128)
                extra = [{"synthetic_acceptance_rate": rate}] * (2 * batch)
                for name, engine in engines.items():
                    run = engine.profile(batch_prompts, extra, batch)
                    record = {"profile": name, "batch": batch,
                              "acceptance_length": args.acceptance_length,
                              "method": args.method, "tok_s": round(tokens_per_second(run), 1),
                              "gpu_busy": run["gpu_busy"], "tables": run["profile"]}
                    print(name, batch, record["tok_s"], run["gpu_busy"], flush=True)
                    for table in run["profile"].values():
                        print(table, flush=True)
                    append_jsonl(args.jsonl, record)
        finally:
            stop_engines(engines)


if __name__ == "__main__":
    main()
