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
``bounded`` (``choose_sizes``' early exit by request, ``scv.planner.drafts_can_win`` and its
rate floor ``scv.planner.below_floor``). With
``--against REV`` the two are instead the policy module as it was at git revision ``REV``
and as it is now, both bounded: a change meant to cut the policy's host time, measured. The
result has each one's median microseconds per step, their ratio, and whether their choices
were the same. ``--cost b1_l15`` drives the fit SCV made at batch 1, uniform L=1.5, on the
H200 (``scv_warm_switch_again_2026-11-24_h200.json``), where the plain step was bound by
host time and the policy searched every step.

    PYTHONPATH=src .venv/bin/python benchmarks/scv_plan_host.py --result F.json
    PYTHONPATH=src .venv/bin/python benchmarks/scv_plan_host.py --against HEAD~1 \
        --batches 1 32 128 --cost b1_l15 --result F.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import environment, write_result  # noqa: E402
from scv_sim import WORKLOADS  # noqa: E402
from vllm_nwor import scv  # noqa: E402
from vllm_nwor.scv import StepCost  # noqa: E402

COSTS = {
    "b256_l3": StepCost(4.595e-3, 2.3e-5, 0.0, 5e-6, 4.78e-3, 1.784e-3, 7.483e-3, 0.0,
                        0.0, 5e-6, 0.0, 0.0),
    "b1_l15": StepCost(4.824e-3, 1.985e-5, 1.213e-3, 0.0, 0.0, 0.0, 7.744e-4, 1.133e-7,
                       0.0, 0.0, 0.0, 0.0),
}
H200_B256_L3 = COSTS["b256_l3"]


def module_at(revision: str):
    """``vllm_nwor.scv`` as it was at git ``revision``, loaded as a module of its own (the
    package ``src/vllm_nwor/scv/``, or the single ``scv.py`` of revisions before the split)."""
    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)))

    single = show("src/vllm_nwor/scv.py")
    with tempfile.TemporaryDirectory() as root:
        if single.returncode == 0:
            files = {"scv_at_revision.py": single.stdout}
            path = os.path.join(root, "scv_at_revision.py")
        else:
            listing = subprocess.run(
                ["git", "ls-tree", "--full-tree", "--name-only",
                 f"{revision}:src/vllm_nwor/scv"], check=True,
                capture_output=True, text=True,
                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.split()
            files = {os.path.join("scv_at_revision", name): show(
                f"src/vllm_nwor/scv/{name}").stdout.replace("vllm_nwor.scv", "scv_at_revision")
                for name in listing if name.endswith(".py")}
            path = os.path.join(root, "scv_at_revision", "__init__.py")
        for name, source in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            with open(os.path.join(root, name), "w") as f:
                f.write(source)
        spec = importlib.util.spec_from_file_location("scv_at_revision", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up)
        sys.path.insert(0, root)  # (the package's own modules)
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(root)
    return module


def _early_exit(module):
    """Where ``module``'s early exit by request lives, and its two names there: the package's
    planner, or a single-file revision's module itself."""
    planner = getattr(module, "planner", None)
    if planner is not None:
        return planner, "drafts_can_win", "below_floor"
    return module, "_drafts_can_win", "_below_floor"


def drive(rates: list[float], batch: int, steps: int, cost: StepCost, seed: int = 0,
          request_bound: bool = True, module=scv):
    """Seconds of the policy's work per step (plan, observe, observe_step; not the drawing of
    verdicts), after a warm-up, and its budget counts; without ``request_bound``, the early
    exit by request is switched off (``search``): ``drafts_can_win``, and its rate floor
    ``below_floor`` where the module has one. ``module``: the policy's module."""
    home, can_win, below = _early_exit(module)
    bound, floor = getattr(home, can_win), getattr(home, below, None)
    if not request_bound:
        setattr(home, can_win, lambda *args: True)
        if floor is not None:
            setattr(home, below, lambda *args: False)
    try:
        return _drive(rates, batch, steps, module.StepCost(*cost), seed, module)
    finally:
        setattr(home, can_win, bound)
        if floor is not None:
            setattr(home, below, floor)


def _drive(rates: list[float], batch: int, steps: int, cost: StepCost, seed: int, module=scv):
    policy = module.ChunkPolicy(module.ScvSettings(
        mode="adaptive", max_chunk=8, probe_interval=16, acceptance_window=16,
        max_graph_tokens=512, lazy_draft_sync=True), seed=seed)
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
                verdicts.append(module.SpecChunk(r, tuple(range(size)), 0, accepted))
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
    parser.add_argument("--cost", choices=sorted(COSTS), default="b256_l3")
    parser.add_argument("--against", metavar="REV",
                        help="compare the policy at this git revision with the one now")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    cost = COSTS[args.cost]
    if args.against:  # (name, module, request bound)
        ways = {args.against: (module_at(args.against), True), "now": (scv, True)}
    else:
        ways = {"search": (scv, False), "bounded": (scv, True)}
    first, second = ways
    cells = []
    for name, rates in WORKLOADS.items():
        for batch in args.batches:
            times = {w: [] for w in ways}
            counts = {}
            for rep in range(args.reps):
                for way, (module, request_bound) in ways.items():  # alternating
                    t, counts[way] = drive(rates, batch, args.steps, cost, seed=rep,
                                           request_bound=request_bound, module=module)
                    times[way] += t
            us = {w: round(statistics.median(t) * 1e6, 1) for w, t in times.items()}
            cells.append({"workload": name, "batch": batch, "median_us_per_step": us,
                          f"{second}_over_{first}": round(us[second] / us[first], 3),
                          "same_choices": counts[first] == counts[second],
                          "budget_counts": counts[second]})
            print(cells[-1], flush=True)
    write_result(args.result, {
        **environment(), "benchmark": "scv_plan_host",
        "workload": {"steps": args.steps, "reps": args.reps, "output_len": 128,
                     "cost": {"name": args.cost, **cost._asdict()}, "rates": WORKLOADS,
                     "compared": list(ways)},
        "cells": cells})


if __name__ == "__main__":
    main()
