"""SCV's probe ledger over a GPU run's recorded steps, replayed on the CPU: a diagnostic.

``scv_bench.py`` keeps every step SCV's cost model saw, in the warm-up (``groups[].warm``) and
in each measured run (``scv_choices_by_group[].steps_by_rep``). This feeds them, in the order
one engine served them (each batch size's warm-up, then workloads by batch size), to a fresh
:class:`ChunkPolicy`'s ``observe_step`` and prints, for each warm-up and repetition, the
learning steps and the ledger's balance at its end and lowest: below 0 the ledger owes, and
no shared probe step comes. The learning flags are the run's own (what its code planned);
the ledger is this checkout's. ``--drafting-only`` drops the flag of steps that neither
drafted nor verified drafts, as the policy no longer plans them to learn (twenty-fifth session).

    .venv/bin/python benchmarks/scv_ledger_replay.py \
        benchmarks/results/scv_prior_2026-11-23_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from scv_bench import workloads  # noqa: E402
from vllm_nwor.scv import ChunkPolicy, ScvSettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--max-chunk", type=int, default=8)
    parser.add_argument("--drafting-only", action="store_true")
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    cells = {(c["batch"], c["workload"]): c for c in result["cells"]}
    graphs = next(c["scv_choices_by_group"][args.group]["graphs"] for c in result["cells"])
    policy = ChunkPolicy(ScvSettings("adaptive", args.max_chunk, 16, 16,
                                     max_graph_tokens=graphs[0], mixed_graphs=graphs[1]))

    def replay(label: str, steps: list) -> None:
        learning, lowest = 0, 0.0
        for requests, tokens, budget, ms, uniform, learn, verified, caught_up in steps:
            learn = bool(learn) and (budget > 0 or verified > 0 or not args.drafting_only)
            before = policy.ledger
            policy.observe_step(requests, tokens, budget, ms / 1000, bool(uniform), learn,
                                verified=verified, caught_up=caught_up)
            if learn:
                learning += 1
                step = [requests, tokens, budget, ms, verified, caught_up]
                print(f"  {label}: learning step {step}"
                      f" balance {before:.4f} -> {policy.ledger:.4f} s")
            lowest = min(lowest, policy.ledger)
        print(f"{label}: {len(steps)} steps, {learning} learning, balance {policy.ledger:.4f} s"
              f" at the end, {lowest:.4f} s at the lowest")

    batches = sorted({batch for batch, _ in cells})
    warm = result["groups"][args.group].get("warm", {}).get("scv", {})
    for batch in batches:
        if str(batch) in warm:
            replay(f"warm-up {batch}", warm[str(batch)]["steps"])
    for workload in workloads():  # the order one engine serves them in
        for batch in batches:
            cell = cells.get((batch, workload))
            if cell is None:
                continue
            runs = cell["scv_choices_by_group"][args.group]["steps_by_rep"]
            for rep, steps in enumerate(runs):
                replay(f"{workload} batch {batch} rep {rep}", steps)


if __name__ == "__main__":
    main()
