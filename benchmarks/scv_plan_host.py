"""SCV's host time per step: the policy's own work in a step (plan, verdicts, step time), alone.

The chunk-0 step on the GPU was bound by host time (``scv_chunk0_parts_2026-11-22_h200.json``:
leaving out the planning recovered most of its gap to no speculation), so what ``plan``
costs per step counts. This drives :class:`ChunkPolicy` as the scheduler patch does, without
vLLM: a batch kept full (a finished request replaced at once, 128 tokens each), each step
planned with the tokens left and the scheduled tokens (the lazy draft sync followed), its
drafts' verdicts drawn at the workload's acceptance and its duration from a step cost
(``--cost``: the fit SCV made at batch 256 on the H200, uniform L=3, in
``scv_priced_catch_up_2026-11-23_h200.json``), which the policy fits online as on the GPU.

Two ways are compared in one run, alternating by repetition: ``search`` (every step that
the bound by budget alone does not settle searches the plans, as before 2026-11-23) and
``bounded`` (``choose_sizes``' early exit by request, ``scv._drafts_can_win``). The result
has each one's median microseconds per step, their ratio, and whether their choices were the
same (they must be: the bound only skips searches that return chunk 0).

    PYTHONPATH=src .venv/bin/python benchmarks/scv_plan_host.py --result F.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import environment, write_result  # noqa: E402
from scv_sim import WORKLOADS  # noqa: E402
from vllm_nwor import scv  # noqa: E402
from vllm_nwor.scv import ChunkPolicy, ScvSettings, SpecChunk, StepCost  # noqa: E402

H200_B256_L3 = StepCost(4.595e-3, 2.3e-5, 0.0, 5e-6, 4.78e-3, 1.784e-3, 7.483e-3, 0.0,
                        0.0, 5e-6, 0.0, 0.0)


def drive(rates: list[float], batch: int, steps: int, cost: StepCost, seed: int = 0,
          request_bound: bool = True):
    """Seconds of the policy's work per step (plan, observe, observe_step; not the drawing of
    verdicts), after a warm-up, and its budget counts; without ``request_bound``, the early
    exit by request is switched off (``search``)."""
    bound = scv._drafts_can_win
    if not request_bound:
        scv._drafts_can_win = lambda *args: True
    try:
        return _drive(rates, batch, steps, cost, seed)
    finally:
        scv._drafts_can_win = bound


def _drive(rates: list[float], batch: int, steps: int, cost: StepCost, seed: int):
    policy = ChunkPolicy(ScvSettings(mode="adaptive", max_chunk=8, probe_interval=16,
                                     acceptance_window=16, max_graph_tokens=512,
                                     lazy_draft_sync=True), seed=seed)
    rng = np.random.default_rng(seed)
    made = 0

    def new():
        nonlocal made
        made += 1
        return f"r{made}", rates[made % len(rates)]

    running = dict(new() for _ in range(batch))  # request: acceptance
    left = dict.fromkeys(running, 128)
    last: dict[str, int] = {}
    times = []
    for _ in range(steps):
        req_ids = list(running)
        scheduled = {r: 1 + last.get(r, 0) for r in req_ids}
        remaining = [left[r] for r in req_ids]  # built by the scheduler patch, as here
        start = time.perf_counter()
        plan = policy.plan(req_ids, remaining=remaining, scheduled=scheduled)
        planning = time.perf_counter() - start
        verdicts = []
        for r, size in plan.items():
            if size:
                draws = rng.random(size) < running[r]
                accepted = size if draws.all() else int(np.argmin(draws))  # leading successes
                verdicts.append(SpecChunk(r, tuple(range(size)), 0, accepted))
        start = time.perf_counter()
        policy.observe(verdicts)
        budget, verified = policy.draft_budget(), sum(plan.values())
        tokens = len(req_ids) + verified
        policy.observe_step(len(req_ids), tokens, budget,
                            float(cost.seconds(len(req_ids), tokens, budget, False,
                                               policy.caught_up)),
                            verified=verified, caught_up=policy.caught_up)
        times.append(planning + time.perf_counter() - start)
        last = plan
        for chunk in verdicts:
            left[chunk.req_id] -= chunk.accepted
        for r in req_ids:
            left[r] -= 1
            if left[r] <= 0:
                policy.forget(r)
                del running[r], left[r]
                r, rate = new()
                running[r], left[r] = rate, 128
    return times[steps // 4:], list(policy.budget_counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    ways = {"search": False, "bounded": True}  # the request bound
    cells = []
    for name, rates in WORKLOADS.items():
        for batch in args.batches:
            times = {w: [] for w in ways}
            counts = {}
            for rep in range(args.reps):
                for way, request_bound in ways.items():  # alternating
                    t, counts[way] = drive(rates, batch, args.steps, H200_B256_L3, seed=rep,
                                           request_bound=request_bound)
                    times[way] += t
            us = {w: round(statistics.median(t) * 1e6, 1) for w, t in times.items()}
            cells.append({"workload": name, "batch": batch, "median_us_per_step": us,
                          "bounded_over_search": round(us["bounded"] / us["search"], 3),
                          "same_choices": counts["search"] == counts["bounded"],
                          "budget_counts": counts["bounded"]})
            print(cells[-1], flush=True)
    write_result(args.result, {
        **environment(), "benchmark": "scv_plan_host",
        "workload": {"steps": args.steps, "reps": args.reps, "output_len": 128,
                     "cost": H200_B256_L3._asdict(), "rates": WORKLOADS},
        "cells": cells})


if __name__ == "__main__":
    main()
