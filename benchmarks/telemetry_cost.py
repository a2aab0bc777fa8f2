"""What telemetry costs: the same engine with ``nwor_telemetry`` off and on, alternating.

Two pairs of LLMs (engine core in its own process, as ``LLM`` runs by default, log stats on so
the Prometheus path runs too): speculative decoding alone (ngram), and with NWOR. In each pair
both engines are up at once and the workload alternates between them, round after round; the
result is the ratio of their median throughputs. A microbenchmark times the per-step work the
plugin adds on each side, at batch sizes the tiny CPU engine cannot reach.

    PYTHONPATH=src .venv/bin/python -m benchmarks.telemetry_cost

writes ``benchmarks/results/telemetry_cost_<date>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM compiles its CPU random sampler at start-up; this workload is greedy and never uses it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from vllm import LLM, SamplingParams

from benchmarks.harness.results import environment, write_result
from vllm_nwor.testing import write_tiny_llama_pair

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=512, block_size=32,
              max_num_seqs=8, max_num_batched_tokens=128, enforce_eager=True,
              gpu_memory_utilization=0.3, disable_log_stats=False, enable_prefix_caching=False)
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "num_speculative_tokens": 3}
PROMPTS = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)]
           for i, n in enumerate([5, 14, 23, 90, 40, 7, 61, 33, 12, 50, 28, 9, 70, 18, 44, 25])]


def run_once(llm: LLM, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def compare(target: str, speculative: dict, rounds: int, max_tokens: int) -> dict:
    engines = {
        "off": LLM(model=target, speculative_config={**speculative, "nwor_telemetry": False},
                   **ENGINE),
        "on": LLM(model=target, speculative_config={**speculative, "nwor_telemetry": True},
                  **ENGINE),
    }
    for llm in engines.values():  # warm-up round, not measured
        run_once(llm, max_tokens)
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    tokens = 0
    for i in range(rounds):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        for name in order:
            s, tokens = run_once(engines[name], max_tokens)
            seconds[name].append(round(s, 4))
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    # Each round runs both engines back to back: its ratio cancels slow drifts of the machine.
    paired = sorted(on / off for on, off in zip(seconds["on"], seconds["off"], strict=True))
    deciles = statistics.quantiles(paired, n=10)
    return {
        "speculative_config": speculative,
        "tokens_per_round": tokens,
        "seconds_per_round": seconds,
        "median_tokens_per_s": {k: round(tokens / m, 1) for k, m in medians.items()},
        "on_over_off_time_median_of_medians": round(medians["on"] / medians["off"], 4),
        "on_over_off_time_paired_median": round(statistics.median(paired), 4),
        "on_over_off_time_paired_p10_p90": [round(deciles[0], 4), round(deciles[-1], 4)],
        "spread_off_max_min_over_median": round(
            (max(seconds["off"]) - min(seconds["off"])) / medians["off"], 4),
    }


def hook_microbench(batch_sizes=(8, 64, 256), steps: int = 2000) -> list[dict]:
    """Per-step cost of the plugin's own engine-side work (no engine): counting each verified
    request's chunk size and taking the step's numbers. Per-request acceptance is vLLM's own.

    For scale, ``vllm_spec_stats_us_per_step`` times vLLM's own per-request spec-decode stats
    (``SpecDecodingStats.observe_draft``, what ``make_spec_decoding_stats`` does) at the same batch.
    """
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from vllm_nwor.telemetry import SpecTelemetry

    cells = []
    for batch in batch_sizes:
        start = time.perf_counter()
        for _ in range(steps):
            stats = SpecDecodingStats.new(3)
            for _req in range(batch):
                stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=1)
        vllm_us = (time.perf_counter() - start) / steps * 1e6
        telemetry = SpecTelemetry(3, collect_stats=True)
        start = time.perf_counter()
        for _ in range(steps):
            for _req in range(batch):
                telemetry.observe_verify(3)
            telemetry.take_stats(unfinished_requests=True)
        engine_us = (time.perf_counter() - start) / steps * 1e6
        cells.append({"batch": batch, "vllm_spec_stats_us_per_step": round(vllm_us, 1),
                      "engine_core_us_per_step": round(engine_us, 1)})
    return cells


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        target, _ = write_tiny_llama_pair(root, num_layers=3, draft_layers=1)
        pairs = [compare(target, NGRAM, args.rounds, args.max_tokens),
                 compare(target, {**NGRAM, "nwor": True}, args.rounds, args.max_tokens)]
    payload = {
        **environment(),
        "what": "telemetry off vs on, same engine config, alternating rounds, medians",
        "workload": {"prompts": len(PROMPTS), "max_tokens": args.max_tokens, "greedy": True,
                     "model": "tiny random Llama, 3 layers, fp32", "engine": ENGINE,
                     "multiprocessing": True, "TORCHDYNAMO_DISABLE": "1"},
        "pairs": pairs,
        "hook_microbench": hook_microbench(),
    }
    path = write_result(f"telemetry_cost_{payload['date']}.json", payload)
    print(path)
    for pair in pairs:
        print(pair["speculative_config"].get("nwor", False),
              pair["on_over_off_time_paired_median"], pair["on_over_off_time_paired_p10_p90"],
              pair["median_tokens_per_s"])
    for cell in payload["hook_microbench"]:
        print(cell)


if __name__ == "__main__":
    main()
