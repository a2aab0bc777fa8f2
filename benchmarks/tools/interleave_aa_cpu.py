"""Does running engines in short interleaved turns take the host's changing speed out?

Does interleaving take the host's speed out of a comparison? An A/A control on the CPU engine.

On the GPU machine the host's speed moves in spells of seconds
(``benchmarks/results/host_noise_b1_2026-11-24_h200.json``), and at batch 128 the step loop is
bound by the host. Whole runs alternated one after the other met different spells: two
identical engines differed run by run by 0.80-1.30
(``benchmarks/results/scv_aa_b128_2026-11-24_h200.json``), more than any of SCV's targets can
tolerate. ``harness.engines.interleave`` runs a group's engines at once, each stepping for a
fraction of a second in turn, so that every engine meets the same spells.

This checks that on the real (CPU) engine, through the GPU benchmarks' own engine processes
(``harness.engines.Engine``): two identical engines (a tiny random-weight Llama, no speculation)
serve the same requests at steady concurrency while other processes load every core in
spells (``--spell``: each spell of load, and each without, lasts a random time in that
range), a stand-in for that host. Each repetition serves the batch both ways, whole runs
(A then B, then B then A) and interleaved. The two engines' throughput ratio is 1 in truth;
its spread over the repetitions is the noise each way of running leaves in a ratio. A CPU
stand-in, not a GPU measurement: it shows what the method removes, not how noisy the GPU
machine's host is. ``--b-layers N`` gives engine ``b`` a deeper target, an A/B pair whose
ratio ``--no-load`` measures on a quiet machine: whether interleaving biases a ratio of
unequal engines. ``--b-spec K`` makes engine ``b`` speculate (draft_model, the tiny pair's draft,
K tokens a step): steps of another length and shape than ``a``'s, the GPU runs' case of fixed k
against plain decoding.

    .venv/bin/python -m benchmarks.tools.interleave_aa_cpu --result interleave_aa_<date>_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time

from benchmarks.harness.engines import (
    CPU_ENGINE,
    ENV_KEY,
    OUTPUT_LEN_KEY,
    alternate,
    start_engines,
    stop_engines,
    tokens_per_second,
)
from benchmarks.harness.results import environment, write_result


def burn(on) -> None:
    """One core's load: spins while ``on`` is set."""
    while True:
        on.wait()
        deadline = time.perf_counter() + 0.01
        while time.perf_counter() < deadline:
            pass


class Spells:
    """Every core loaded and left alone in turn, each spell a random time in ``spell``
    (seconds), while in its ``with`` block."""

    def __init__(self, spell: tuple[float, float], seed: int) -> None:
        context = mp.get_context("spawn")
        self.on, self.spell, self.rng = context.Event(), spell, random.Random(seed)
        self.workers = [context.Process(target=burn, args=(self.on,), daemon=True)
                        for _ in range(os.cpu_count() or 1)]
        self.stopped = False
        self.thread = threading.Thread(target=self._toggle, daemon=True)

    def _toggle(self) -> None:
        while not self.stopped:
            (self.on.clear if self.on.is_set() else self.on.set)()
            time.sleep(self.rng.uniform(*self.spell))
        self.on.clear()

    def __enter__(self) -> Spells:
        for worker in self.workers:
            worker.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = True
        self.thread.join()
        for worker in self.workers:
            worker.terminate()


def serve_both_ways(engines: dict, prompts: list[list[int]], rep: int, concurrency: int,
                    slice_seconds: float, extra: list) -> dict[str, dict[str, dict]]:
    """One repetition: the batch as whole runs and interleaved, each way first in turn."""
    ways = {"whole": None, "interleaved": slice_seconds}
    order = list(ways) if rep % 2 == 0 else list(ways)[::-1]
    return {way: alternate(engines, prompts, rep, extra, concurrency, ways[way])
            for way in order}


def engine_configs(target: str, batch: int, target_b: str | None = None,
                   speculative_b: dict | None = None) -> dict[str, dict]:
    """Engines ``a`` and ``b``: the same, or ``b`` with a target of its own or speculating
    (an A/B check)."""
    kwargs = {"model": target, "max_num_seqs": batch, **CPU_ENGINE,
              ENV_KEY: {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    b = {**kwargs, "model": target_b or target}
    if speculative_b is not None:
        b["speculative_config"] = speculative_b
    return {"a": kwargs, "b": b}


def spread(ratios: list[float]) -> dict:
    return {"ratios": [round(r, 4) for r in ratios], "min": round(min(ratios), 4),
            "max": round(max(ratios), 4), "stdev": round(statistics.stdev(ratios), 4)
            if len(ratios) > 1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="requests in flight")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--slice-seconds", type=float, default=0.1)
    parser.add_argument("--spell", type=float, nargs=2, default=(0.3, 3.0),
                        metavar=("MIN", "MAX"), help="seconds a spell of load lasts, and a "
                        "spell without")
    parser.add_argument("--no-load", action="store_true", help="no spells of load: what the "
                        "ratio is on a quiet machine")
    parser.add_argument("--b-layers", type=int, help="engine b's target with this many layers "
                        "instead of a's 3: an A/B pair of known ratio (measured with --no-load), "
                        "to check that interleaving does not bias a ratio of unequal engines")
    parser.add_argument("--b-spec", type=int, metavar="K", help="engine b speculates, K draft "
                        "tokens a step (draft_model): another A/B pair of known ratio")
    parser.add_argument("--result", required=True, help="file name under benchmarks/results/")
    args = parser.parse_args()

    from vllm_nwor.testing import write_tiny_llama_pair

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randrange(8, 64))]
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_tiny_llama_pair(root)
        speculative_b = None if args.b_spec is None else {
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.b_spec}
        target_b = None
        if args.b_layers is not None:
            target_b, _ = write_tiny_llama_pair(os.path.join(root, "b"),
                                                num_layers=args.b_layers)
        engines = start_engines(engine_configs(target, args.batch, target_b, speculative_b))
        extra = [{OUTPUT_LEN_KEY: args.max_tokens}] * args.requests
        ratios: dict[str, list[float]] = {"whole": [], "interleaved": []}
        runs_by_rep: list[dict] = []  # tokens per second and slices, by way and engine
        agree = True
        try:
            with contextlib.nullcontext() if args.no_load else Spells(tuple(args.spell), seed=1):
                for rep in range(args.reps):
                    ways = serve_both_ways(engines, prompts, rep, args.batch,
                                           args.slice_seconds, extra)
                    runs_by_rep.append({way: {name: [round(tokens_per_second(run), 1),
                                                      run["slices"]]
                                               for name, run in runs.items()}
                                        for way, runs in ways.items()})
                    for way, runs in ways.items():
                        ratios[way].append(tokens_per_second(runs["a"])
                                           / tokens_per_second(runs["b"]))
                        agree &= runs["a"]["tokens"] == runs["b"]["tokens"]
                    print(rep, {w: round(r[-1], 3) for w, r in ratios.items()}, flush=True)
        finally:
            stop_engines(engines)
    payload = {
        "benchmark": "interleave_aa_cpu",
        "what": "two CPU engines' throughput ratio (1 in truth where they are the same) with "
                "every core loaded in random spells (unless no_load), whole runs alternated "
                "against runs interleaved",
        "environment": environment(),
        "settings": {k: v for k, v in vars(args).items() if k != "result"},
        "same_tokens_in_every_run": agree if args.b_layers is None else None,  # greedy: b_spec too
        "whole": spread(ratios["whole"]),
        "interleaved": spread(ratios["interleaved"]),
        "runs_by_rep": runs_by_rep,
    }
    print(write_result(args.result, payload))
    print({way: payload[way] for way in ("whole", "interleaved")})


if __name__ == "__main__":
    main()
