"""NWOR's overhead on the GPU: vLLM with NWOR on against vLLM as it is, in one run, alternating.

For each (method, k) the driver starts two engine processes on the GPU, one after the other:
vLLM with its defaults (CUDA graphs FULL_AND_PIECEWISE) and vLLM with ``"nwor": true`` (whose
verify batches replay FULL graphs captured with the staged path, see docs/gpu.md). It then sends
the same batches to both, alternating A B, B A, after one unrecorded pass over every cell (a
burn-in), and records per cell (L, batch size; ``--min-requests`` keeps that batch in flight
over more requests, so that small batches run long enough to time):

- output throughput (generated tokens / wall time of ``LLM.generate``), on/off ratio;
- median inter-token latency (per request ``(last - first token) / (tokens - 1)``, median over
  requests), on/off ratio;
- the engine's steps (``LLMEngine.step`` calls, timed in the engine process): each run's
  median step and 10%-trimmed mean step, on/off per repetition, then the median. A run's wall
  time carries its pauses and its tail; the median step is what a request waits for each step
  in steady state, the finer measure of a per-step cost;
- each run's GPU clocks (SM MHz and power sampled through NVML) and the engine process's CPU
  seconds and context switches, to tell a slowed card from a slowed host;
- the KV bytes that reach requests' own blocks per generated token, counted (arithmetic, not
  what the GPU writes: ``benchmarks/nwor_kv_traffic.py`` reads that from its counters): prompt
  tokens plus every scheduled decode token, minus NWOR's rejected tokens (``tokens_rejected``),
  which NWOR writes to its scratch blocks instead;
- greedy token agreement between the two engines' outputs.

With ``--aa`` a second plugin-off engine runs beside them, and each cell also reports it over
the first (``aa_*``): what a ratio between two engines that differ in nothing looks like, the
resolution of that cell's on/off ratio.

``--tensor-parallel-size N`` runs every engine at that tensor-parallel size (N GPUs each, all
engines on the same N; vLLM's custom all-reduce as it chooses), recorded in every cell and in
the result's ``workload``; each run's GPU clocks are then sampled on all N GPUs.

The model is Llama-3-8B-shaped with random weights (``load_format="dummy"``). Acceptance is vLLM's
synthetic rejection sampling at full acceptance (``synthetic_acceptance_length = k + 1``) thinned
per request by the benchmark feature ``synthetic_acceptance_per_request`` to the rate that gives
mean acceptance length L at k drafts (L = k + 1: no thinning). So one engine pair serves every L of
a k; ``measured_L`` in each cell is what vLLM's counters saw. That thinning needs vLLM's V1 runner:
on its V2 runner (every method on a GPU with vLLM 0.32, unless ``VLLM_USE_V2_MODEL_RUNNER=0``),
each engine pair has one L, vLLM's own ``synthetic_acceptance_length`` (:func:`own_lengths`).

    python -m benchmarks.nwor_overhead --method draft_model --k 2 4 8 --L 1.5 3.0 k+1 \\
        --batches 1 8 32 128 --jsonl $OUT/cells.jsonl
    python -m benchmarks.nwor_overhead --method draft_model --k 4 --tensor-parallel-size 2 \\
        --aa --jsonl $OUT/cells.jsonl                                      # two GPUs
    python -m benchmarks.nwor_overhead --merge $OUT/cells.jsonl --result <json>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.engines import (
    ENV_KEY,
    OUTPUT_LEN,
    PROMPT_LEN,
    TIME_NWOR_COMMIT,
    TIME_NWOR_HOST,
    agreement,
    alternate,
    prompts,
    rate_for_length,
    start_engines,
    stop_engines,
    tokens_per_second,
    write_eagle3_head,
    write_models,
)
from benchmarks.harness.results import append_jsonl, parse_or_merge, write_json
from vllm_nwor.testing import geomean_interval

KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head size x bf16


def kv_bytes_per_generated_token(run: dict, batch_prompts: list[list[int]]) -> float:
    """KV bytes in the target's requests' blocks per generated token: prompt + decode steps'
    tokens - NWOR's rejected (written to scratch blocks instead). Arithmetic, not the bytes the
    GPU writes.

    A request that generates G tokens runs G - 1 - A decode steps (A accepted drafts), each
    writing its last sampled token and its drafts: P + (G - 1 - A) + D writes per request.
    """
    generated = sum(len(t) for t in run["tokens"])
    prompt = sum(len(p) for p in batch_prompts)
    writes = prompt + generated - len(batch_prompts) - run["accepted"] + run["drafted"]
    writes -= run["rejected_by_nwor"]
    return writes * KV_BYTES_PER_TOKEN / generated


def own_lengths(method: str) -> bool:
    """Whether each engine pair runs at one acceptance length of its own (vLLM's synthetic
    length) instead of thinning per request: eagle3, and any method on a GPU, where vLLM 0.32
    runs its V2 runner unless ``VLLM_USE_V2_MODEL_RUNNER=0``."""
    import torch

    v2 = torch.cuda.is_available() and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
    return method == "eagle3" or v2


def engine_kwargs(target: str, draft: str, method: str, k: int, nwor: bool,
                  max_batch: int, cudagraph_mode: str | None = None,
                  memory: float = 0.42, tensor_parallel_size: int = 1,
                  length: float | None = None) -> dict:
    """One engine's ``LLM`` arguments. ``length``: the engine's own mean acceptance length
    (vLLM's synthetic rejection sampling, :func:`own_lengths`); else full acceptance, thinned
    per request."""
    speculative = {"num_speculative_tokens": k, "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_length": k + 1.0,
                   "synthetic_acceptance_per_request": True}
    if length is not None:
        speculative["synthetic_acceptance_length"] = length
        del speculative["synthetic_acceptance_per_request"]
    if method == "eagle3":
        speculative.update(method="eagle3", model=draft)
    elif method == "draft_model":
        speculative.update(method="draft_model", model=draft)
    else:
        speculative.update(method="ngram", prompt_lookup_max=4, prompt_lookup_min=2)
    if nwor:
        speculative["nwor"] = True
    kwargs = dict(model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=PROMPT_LEN + OUTPUT_LEN + 64, max_num_seqs=max_batch,
                  gpu_memory_utilization=memory, seed=0, disable_log_stats=False,
                  enable_prefix_caching=False, speculative_config=speculative)
    if cudagraph_mode:
        kwargs["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
    if tensor_parallel_size > 1:  # the draft model takes the same size (vLLM's default)
        kwargs["tensor_parallel_size"] = tensor_parallel_size
    return kwargs


def lengths_for(k: int, lengths: list[str]) -> list[float]:
    """``--L`` values for this k: numbers, or ``k+1``; duplicates dropped, order kept."""
    values = [float(k + 1) if x == "k+1" else float(x) for x in lengths]
    return list(dict.fromkeys(v for v in values if 1.0 <= v <= k + 1))


def run_pair(target, draft, method, k, lengths, batches, reps, baseline_mode=None,
             profile_batches=(), profile_length=3.0, min_requests=1,
             engine_core_process=False, aa=False, time_nwor_host=False,
             tensor_parallel_size=1, progress=None, time_commit=False) -> dict:
    """One engine pair (and its A/A control): every cell, then the profiles. ``progress``, if
    given, gets the record so far after each cell (the same shape, ``"partial": True``).
    With :func:`own_lengths`: one length, the engines' own (``engine_kwargs``)."""
    memory = 0.3 if aa else 0.42  # three engines share the GPU with --aa
    tp = tensor_parallel_size
    own_length = None
    if own_lengths(method):
        (own_length,) = lengths  # main() runs one engine pair per length
    configs = {
        "off": engine_kwargs(target, draft, method, k, False, max(batches), baseline_mode,
                             memory, tp, own_length),
        "on": engine_kwargs(target, draft, method, k, True, max(batches), memory=memory,
                            tensor_parallel_size=tp, length=own_length)}
    if time_nwor_host:
        configs["on"].setdefault(ENV_KEY, {})[TIME_NWOR_HOST] = "1"
    if time_commit:
        configs["on"].setdefault(ENV_KEY, {})[TIME_NWOR_COMMIT] = "1"
    if aa:  # a second plugin-off engine, alike in every way: the A/A spread of a cell
        configs["off_b"] = engine_kwargs(target, draft, method, k, False, max(batches),
                                         baseline_mode, memory, tp, own_length)
    engines = start_engines(configs, engine_core_process)
    rows = []

    def cell(L: float, batch: int, rep: int) -> dict[str, dict]:
        """One run per engine: max(batch, min_requests) requests, batch of them in flight."""
        count = max(batch, min_requests)
        extra = None if own_length is not None else \
            [{"synthetic_acceptance_rate": rate_for_length(L, k)}] * count
        batch_prompts = prompts(count, seed=1000 * batch + rep)
        runs = alternate(engines, batch_prompts, rep, extra,
                         batch if count > batch else None)
        for run in runs.values():
            run["prompts"] = batch_prompts
        return runs

    try:
        for engine in engines.values():  # warm-up: JIT compiles, first-call costs
            engine.run(prompts(2, seed=99))
        # Burn-in, not recorded: every cell once. First runs of a batch shape or acceptance
        # were slow on either engine (on/off 1.39 at batch 1 and 1.13 at batch 32 in a run
        # without it, 0.90 and 1.04 in profiled runs of the same cells with it).
        for L in lengths:
            for batch in batches:
                cell(L, batch, -1)
        for L in lengths:
            for batch in batches:
                results = {name: [] for name in engines}
                for rep in range(reps):
                    for name, run in cell(L, batch, rep).items():
                        results[name].append(run)
                rows.append({**summarise(method, k, L, batch, results),
                             "engine_core_process": engine_core_process,
                             "tensor_parallel_size": tp})
                print(json.dumps(rows[-1]), flush=True)
                if progress is not None:
                    progress(record(engines, baseline_mode, tp, rows, []) | {"partial": True})
        profiles = []
        for batch in profile_batches:
            extra = [{"synthetic_acceptance_rate": rate_for_length(profile_length, k)}] * batch
            batch_prompts = prompts(batch, seed=7)
            for name, engine in engines.items():
                run = engine.profile(batch_prompts, extra)
                profiles.append({"profile": name, "method": method, "k": k,
                                 "L": profile_length, "batch": batch,
                                 "tok_s": round(tokens_per_second(run), 1),
                                 "gpu_busy": run["gpu_busy"], "tables": run["profile"]})
                print(name, batch, profiles[-1]["tok_s"], flush=True)
        return record(engines, baseline_mode, tp, rows, profiles)
    finally:
        stop_engines(engines)


def record(engines, baseline_mode, tp, rows, profiles) -> dict:
    """One engine pair's jsonl record."""
    return {"startup_seconds": {n: round(e.startup_seconds, 1) for n, e in engines.items()},
            "baseline_cudagraph_mode": baseline_mode or "vLLM default (FULL_AND_PIECEWISE)",
            "tensor_parallel_size": tp, "cells": rows, "profiles": profiles}


def compare(base: list[dict], other: list[dict]) -> dict:
    """``other``'s runs over ``base``'s, one run of each per repetition: throughput of the
    medians and the median of each repetition's own ratio (its runs are back to back, so drift
    over the cell cancels), median ITL, greedy agreement and the divergences."""
    base_tps = [tokens_per_second(r) for r in base]  # one per repetition, in order
    other_tps = [tokens_per_second(r) for r in other]
    base_itl = statistics.median(r["itl_median"] for r in base)
    other_itl = statistics.median(r["itl_median"] for r in other)
    rates, divergences = [], []
    for a, b in zip(base, other, strict=True):
        rate, diverged = agreement(a["tokens"], b["tokens"])
        rates.append(rate)
        divergences += diverged
    steps = [(a["step_ms"], b["step_ms"]) for a, b in zip(base, other, strict=True)
             if a.get("step_ms") and b.get("step_ms")]

    def step_ratio(key: str) -> float | None:
        return statistics.median(b[key] / a[key] for a, b in steps) if steps else None

    return {"throughput": statistics.median(other_tps) / statistics.median(base_tps),
            "step_median": step_ratio("median"), "step_trimmed": step_ratio("trimmed_mean"),
            "paired": statistics.median(b / a for a, b in zip(base_tps, other_tps, strict=True)),
            "itl": other_itl / base_itl, "agreement": statistics.mean(rates),
            "divergences": divergences, "base_tps": base_tps, "other_tps": other_tps,
            "base_itl": base_itl, "other_itl": other_itl}


def summarise(method, k, L, batch, results) -> dict:
    off, on = results["off"], results["on"]
    ratios = compare(off, on)
    off_reps, on_reps = ratios["base_tps"], ratios["other_tps"]
    drafted = sum(r["drafted"] for r in on)
    accepted = sum(r["accepted"] for r in on)
    return {
        "method": method, "batch": batch, "k": k, "L": L,
        "throughput_ratio": round(ratios["throughput"], 4),
        "throughput_ratio_paired": round(ratios["paired"], 4),
        "itl_ratio": round(ratios["itl"], 4),
        "request_block_kv_bytes_per_token_on": round(statistics.mean(
            kv_bytes_per_generated_token(r, r["prompts"]) for r in on)),
        "request_block_kv_bytes_per_token_off": round(statistics.mean(
            kv_bytes_per_generated_token(r, r["prompts"]) for r in off)),
        "token_agreement": round(ratios["agreement"], 5),
        "divergences_first_position": ratios["divergences"],
        # Engine steps, each repetition's pair: median step and 10%-trimmed mean step, on/off.
        "step_ratio": _round(ratios["step_median"]),
        "step_ratio_trimmed": _round(ratios["step_trimmed"]),
        "step_ms_reps": {name: [r.get("step_ms") for r in runs]
                         for name, runs in results.items()},
        # Each run's GPU clocks (NVML samples): tells a slowed card from a slowed host.
        "gpu_clocks_reps": {name: [r.get("gpu_clocks") for r in runs]
                            for name, runs in results.items()},
        # Each run's wall seconds and the engine process's CPU seconds and context switches.
        "host_reps": {name: [{"seconds": round(r["seconds"], 4), **(r.get("host") or {})}
                             for r in runs] for name, runs in results.items()},
        "tok_s": {"off": round(statistics.median(off_reps), 1),
                  "on": round(statistics.median(on_reps), 1)},
        # Each repetition's pair (the two runs of a rep are back to back): the spread is the
        # noise a median ratio carries.
        "tok_s_reps": {"off": [round(t, 1) for t in off_reps],
                       "on": [round(t, 1) for t in on_reps]},
        "itl_ms": {"off": round(1000 * ratios["base_itl"], 3),
                   "on": round(1000 * ratios["other_itl"], 3)},
        "measured_L": round(1 + accepted / max(1, drafted) * k, 3),
        "nwor_fallbacks": on[-1]["fallbacks"],
        "reps": len(on),
        "requests_per_run": len(on[0]["tokens"]),
        **nwor_host(on),
        **({"nwor_commit_gpu_us_reps": [r["nwor_commit_gpu_us"] for r in on]}
           if any(r.get("nwor_commit_gpu_us") for r in on) else {}),
        **a_over_a(results),
    }


def nwor_host(on: list[dict]) -> dict:
    """With ``--time-nwor-host``: NWOR's host work per step outside the layers (µs), and its
    share of the on engine's median step, each the median over the repetitions."""
    runs = [r for r in on if r.get("nwor_host_us_per_step") is not None and r.get("step_ms")]
    if not runs:
        return {}
    return {"nwor_host_us_per_step": round(statistics.median(
                r["nwor_host_us_per_step"] for r in runs), 2),
            "nwor_host_share_of_step": round(statistics.median(
                r["nwor_host_us_per_step"] / (1e3 * r["step_ms"]["median"]) for r in runs), 5)}


def _round(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio, 4)


def a_over_a(results) -> dict:
    """With ``--aa``: the second plugin-off engine over the first, as on/off is reported. Two
    engines that differ in nothing show how far a cell's ratio moves by chance (which engine
    instance, which process, which moment), the resolution an on/off ratio has. Also NWOR on
    over the mean of both plugin-off engines, each repetition's own, then the median."""
    if "off_b" not in results:
        return {}
    ratios = compare(results["off"], results["off_b"])
    off, off_b = ratios["base_tps"], ratios["other_tps"]
    on = [tokens_per_second(r) for r in results["on"]]
    steps = [(a["step_ms"], b["step_ms"], c["step_ms"])
             for a, b, c in zip(results["off"], results["off_b"], results["on"], strict=True)
             if a.get("step_ms") and b.get("step_ms") and c.get("step_ms")]
    over_both_steps = statistics.median(
        c["median"] / ((a["median"] + b["median"]) / 2) for a, b, c in steps) if steps else None
    return {"aa_throughput_ratio": round(ratios["throughput"], 4),
            "aa_step_ratio": _round(ratios["step_median"]),
            "aa_step_ratio_trimmed": _round(ratios["step_trimmed"]),
            "aa_throughput_ratio_paired": round(ratios["paired"], 4),
            "aa_itl_ratio": round(ratios["itl"], 4),
            "aa_token_agreement": round(ratios["agreement"], 5),
            "tok_s_reps_off_b": [round(t, 1) for t in off_b],
            "throughput_ratio_over_both_off_paired": round(statistics.median(
                c / ((a + b) / 2) for a, b, c in zip(off, off_b, on, strict=True)), 4),
            "step_ratio_over_both_off": _round(over_both_steps)}


POOLED = ("throughput_ratio_paired", "aa_throughput_ratio_paired",
          "throughput_ratio_over_both_off_paired", "step_ratio", "aa_step_ratio", "itl_ratio",
          "aa_itl_ratio")


def has_aa_control(cell: dict) -> bool:
    """Whether the cell ran beside a second plugin-off engine (``--aa``)."""
    return "aa_throughput_ratio_paired" in cell


def pooled(cells: list[dict]) -> dict:
    """Each ratio pooled over the cells that have an A/A control, batch 1 apart from batch >= 8
    (the issue's two targets), and batch >= 8 by method: the geometric mean and its 95%
    interval from the cells' spread. A cell's ratio resolves no better than its A/A (3-10%), but
    a cost NWOR has in every cell shifts the mean of many, and the A/A's mean says how far
    chance alone shifts it. The cells' costs differ (FULL graphs or not), so this is the
    matrix's average, not each cell's."""
    with_aa = [c for c in cells if has_aa_control(c)]
    groups = {"batch_1": [c for c in with_aa if c["batch"] == 1],
              "batch_8_and_up": [c for c in with_aa if c["batch"] >= 8]}
    for method in sorted({c["method"] for c in with_aa}):  # ngram's steps leave FULL graphs
        groups[f"batch_8_and_up_{method}"] = [c for c in groups["batch_8_and_up"]
                                              if c["method"] == method]
    out = {}
    for name, group in groups.items():
        if len(group) < 2:
            continue
        out[name] = {"cells": len(group)}
        for key in POOLED:
            ratios = [c[key] for c in group if c.get(key)]
            if len(ratios) >= 2:
                out[name][key] = geomean_interval(ratios)
    return out


DRAFTS = {"draft_model": "2-layer Llama, same vocabulary, dummy weights",
          "ngram": "vLLM's ngram proposer (prompt lookup 2-4)",
          "eagle3": "one-layer EAGLE-3 head of the target's shape, dummy weights, vLLM's V2 "
                    "model runner"}


def merge(jsonl: Path, result: Path) -> None:
    from benchmarks.harness.results import recorded_environment

    cells, startups, profiles, sizes = [], [], [], set()
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        cells += record["cells"]
        profiles += record.get("profiles", [])
        startups.append(record["startup_seconds"])
        sizes.add(record.get("tensor_parallel_size", 1))
    methods = {cell["method"] for cell in cells}
    if len(sizes) > 1:
        raise SystemExit(f"{jsonl}: runs at tensor_parallel_size {sorted(sizes)}: merge (and "
                         "pool) one size at a time")
    payload = {**recorded_environment(jsonl), "benchmark": "nwor_overhead",
               "workload": {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                            "model": "Llama-3-8B shape, dummy weights, bf16",
                            "draft": DRAFTS[methods.pop()] if len(methods) == 1
                            else {m: DRAFTS[m] for m in sorted(methods)},
                            "acceptance": "vLLM synthetic rejection sampling, mean length L",
                            "tensor_parallel_size": sizes.pop() if sizes else 1},
               "baseline_cudagraph_mode": sorted({
                   r.get("baseline_cudagraph_mode", "vLLM default (FULL_AND_PIECEWISE)")
                   for r in map(json.loads, jsonl.read_text().splitlines())}),
               "startup_seconds": startups, "pooled": pooled(cells), "cells": cells}
    if profiles:
        payload["profiles"] = profiles
    if any(json.loads(line).get("partial") for line in jsonl.read_text().splitlines()):
        payload["partial"] = "the run stopped before its last cells: these are those it finished"
    write_json(result, payload)
    print(result)


def cell_key(cell: dict) -> tuple:
    return (cell["method"], cell["batch"], cell["k"], cell["L"],
            cell.get("tensor_parallel_size", 1))


def write_pooled(results: list[Path], out: Path) -> None:
    """``pooled`` over the cells of several merged results, each cell keeping its file. A cell
    (method, batch, k, L) that a later file measured again, on later code, is that file's
    alone: the earlier file's runs of it are left out and counted in its ``cells_replaced``."""
    payloads = [json.loads(path.read_text()) for path in results]
    sizes = {c.get("tensor_parallel_size", 1) for p in payloads for c in p["cells"]}
    if len(sizes) > 1:
        raise SystemExit(f"cells at tensor_parallel_size {sorted(sizes)}: pool one size at a "
                         "time")
    cells, sources = [], []
    for i, (path, payload) in enumerate(zip(results, payloads, strict=True)):
        later = {cell_key(c) for p in payloads[i + 1:] for c in p["cells"]}
        kept = [c for c in payload["cells"] if cell_key(c) not in later]
        sources.append({"file": path.name, "commit": payload.get("commit"),
                        "date": payload.get("date"), "device": payload.get("device"),
                        "cells_with_aa": sum(map(has_aa_control, kept)),
                        "cells_replaced": len(payload["cells"]) - len(kept)})
        cells += kept
    write_json(out, {"benchmark": "nwor_overhead_pooled", "sources": sources,
                     "pooled": pooled(cells)})
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=["draft_model", "ngram", "eagle3"],
                        default="draft_model",
                        help="eagle3: a one-layer EAGLE-3 head of the target's shape, on "
                        "vLLM's V2 runner; one engine pair per --L")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--L", nargs="+", default=["1.5", "3.0", "k+1"],
                        help="mean acceptance lengths: numbers or k+1")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--baseline-cudagraph-mode", choices=["PIECEWISE"],
                        help="run the NWOR-off engine in this mode: splits NWOR's overhead "
                        "into what leaving FULL graphs costs and what NWOR's own work costs")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=1,
                        help="each run serves at least this many requests, the cell's batch "
                        "of them in flight (a batch-1 run of one request is too short to time)")
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[],
                        help="after the cells, one profiled run per engine at each of these "
                        "batch sizes (torch profiler and cProfile tables)")
    parser.add_argument("--profile-L", type=float, default=3.0,
                        help="mean acceptance length of the profiled runs")
    parser.add_argument("--engine-core-process", action="store_true",
                        help="each engine core in its own process, as vLLM's LLM runs by "
                        "default (no profiles then: they need it in-process)")
    parser.add_argument("--aa", action="store_true",
                        help="also start a second plugin-off engine and report it over the "
                        "first (aa_* in each cell): the spread of a ratio between two engines "
                        "that differ in nothing")
    parser.add_argument("--time-nwor-host", action="store_true",
                        help="time NWOR's host work per step outside the layers in the on "
                        "engine (nwor_host_* in each cell; engine core in-process only)")
    parser.add_argument("--time-commit", action="store_true",
                        help="time NWOR's commit on the GPU with CUDA events around its launch "
                        "in the on engine (nwor_commit_gpu_us_reps in each cell; engine core "
                        "in-process, one GPU; the events add host work: not for the ratios)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="every engine at this tensor-parallel size (that many GPUs each, "
                        "the same ones for all engines)")
    parser.add_argument("--pool", type=Path, nargs="+",
                        help="with --result: pool the A/A cells of these merged results "
                        "(several runs' cells, see pooled(); a cell a later file has is taken "
                        "from it alone) instead of running")
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    if args.pool:
        if args.result is None:
            parser.error("--pool needs --result (the JSON file to write)")
        write_pooled(args.pool, args.result)
        return
    if (args.engine_core_process or args.tensor_parallel_size > 1) and args.time_commit:
        parser.error("--time-commit reads the model runner in the engine's process: not with "
                     "--engine-core-process or --tensor-parallel-size above 1")
    if args.engine_core_process and (args.profile_batches or args.time_nwor_host):
        parser.error("--profile-batches and --time-nwor-host need the engine core in-process")
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size is {args.tensor_parallel_size}; allowed: 1 or more")
    if args.tensor_parallel_size > 1 and (args.profile_batches or args.time_nwor_host):
        parser.error("--profile-batches and --time-nwor-host read the model runner in the "
                     "engine's process; at --tensor-parallel-size "
                     f"{args.tensor_parallel_size} it runs in the workers: allowed only at 1")
    # A run stopped at a device call's limit leaves its finished cells here, mergeable:
    # --merge <jsonl stem>.partial.jsonl (the k being run, after the finished ks' records).
    partial = None if args.jsonl is None else args.jsonl.with_suffix(".partial.jsonl")

    def progress(so_far: dict) -> None:
        done = args.jsonl.read_text() if args.jsonl.exists() else ""
        partial.write_text(done + json.dumps(so_far) + "\n")

    if own_lengths(args.method) and (args.profile_batches or args.time_nwor_host):
        parser.error("--profile-batches and --time-nwor-host read vLLM's V1 runner; this "
                     "engine runs on its V2 runner")
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        if args.method == "eagle3":
            draft = write_eagle3_head(Path(root))
        for k in args.k:
            lengths = lengths_for(k, args.L)
            # vLLM's synthetic length is an engine setting: one engine pair per length.
            for pair_lengths in ([[L] for L in lengths] if own_lengths(args.method)
                                 else [lengths]):
                append_jsonl(args.jsonl, run_pair(
                    target, draft, args.method, k, pair_lengths, args.batches, args.reps,
                    args.baseline_cudagraph_mode, args.profile_batches, args.profile_L,
                    args.min_requests, args.engine_core_process, args.aa,
                    args.time_nwor_host, args.tensor_parallel_size,
                    progress if partial else None, time_commit=args.time_commit))
    if partial is not None:
        partial.unlink(missing_ok=True)  # every record is in the jsonl


if __name__ == "__main__":
    main()
