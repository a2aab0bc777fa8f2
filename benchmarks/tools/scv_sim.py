"""What are SCV's choices worth where the step costs are known (a simulated engine)?

SCV's policy in a simulated engine, on the CPU in seconds: a diagnostic, not a measurement.

The real :class:`vllm_nwor.scv.ChunkPolicy` plans every step of a simulated steady load
(``batch`` requests in flight, ``load`` x ``batch`` requests of ``OUTPUT_LEN`` tokens, a new one
admitted as one finishes). Each draft is accepted with the request's own rate, in sequence, as
vLLM's synthetic rejection sampling with the per-request rate does. A step takes the seconds of
a cost function shaped after the H200 runs (``benchmarks/results/scv_*_h200.json``: a plain step
about 5 / 5.4 / 7.2 / 10.8 ms at batch 1 / 32 / 128 / 256, a cost per scheduled token; a cost
per draft pass and per drafted token, and the drafter's pass over prompts; leaving the FULL
graphs; the prompts, the first batch's in the first step and those of the requests admitted
after a step in the next; with SCV, the lazy draft sync's catch-ups), with multiplicative
noise. The policy sees only
its own observations (its cost model is fitted online, as in the engine), after a warm-up that,
as ``harness.engines.warm_every_chunk`` does, runs every chunk size at every batch size of the run
and then starts from fresh acceptance estimates.

It reports each policy's tokens per simulated second, and SCV's over the best other (no
speculation and every fixed k), per workload and batch. Nothing is claimed from it about the
GPU: it shows what the policy's choices are worth where the costs are known, and lets a change
to the policy be compared with the current one in the same simulated traffic.

    python -m benchmarks.tools.scv_sim --batches 1 32 128 --seeds 4

``--unpriced`` adds, per cell, SCV without pricing the lazy draft sync's catch-ups
(``scv_unpriced``). ``--by-rate`` adds, per cell, the best policy that knows every request's
true rate and gives each a fixed chunk by it (a bound on what per-request chunk sizes can do in
that traffic).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import numpy as np

from vllm_nwor.scv import ChunkPolicy, ScvSettings, SpecChunk, StepCostModel
from vllm_nwor.scv.survival import PositionAcceptance, StepTable, plan_chunks

OUTPUT_LEN = 128
PROMPT_LEN = 128
MAX_CHUNK = 8
MAX_GRAPH_TOKENS = 504
WORKLOADS = {  # per-draft acceptance rates, drawn per request in turn
    "uniform_L1.5": [0.336],
    "uniform_L3": [0.741],
    "uniform_L4": [0.888],
    "mixed_L1.2_and_full": [0.167, 1.0],
}


def step_seconds(n: int, tokens: int, budget: int, uniform: bool, rng: np.random.Generator,
                 noise: float, prompt_tokens: int = 0) -> float:
    """A step's seconds: ``n`` requests, ``tokens`` scheduled (``prompt_tokens`` of them
    prompts), the drafter proposing ``budget`` per request after it, every request verifying
    as many drafts or not (``uniform``); shaped after the H200 runs, in ms."""
    # The cost fit to every step SCV's engine took in one H200 run (vLLM 0.26 line; plain
    # steps of 4.8 / 5.4 / 7.2 / 10.8 ms at batch 1 / 32 / 128 / 256): a scheduled token costs
    # the same whether it is a request's next token or a draft it verifies (a cost per request
    # beside it fits to 0), a draft pass its own launches and a cost per request.
    ms = 4.64 + 0.0237 * tokens
    if budget:
        # The drafter also runs over the step's prompt tokens: 16,128 of them took 26 ms more
        # in a step that drafted than in one that did not (the same run).
        ms += 0.5 * budget + 0.0058 * n * budget + 0.0016 * prompt_tokens
    if not uniform or tokens > MAX_GRAPH_TOKENS:
        ms += 0.05 * n ** 0.5 + 0.004 * tokens  # host work and launches of a step off the graphs
    return ms * 1e-3 * float(rng.lognormal(0.0, noise))


@functools.cache
def profiled_table(n: int, varlen_graphs: bool) -> StepTable:
    """What a start-up profile would find at ``n`` requests: :func:`step_seconds` without
    noise, by drafting depth and by tokens up to every request's drafts and prompt (the
    ``survival`` and ``av`` policies)."""
    rng = np.random.default_rng(0)
    plain = step_seconds(n, n, 0, True, rng, 0.0)
    draft = np.array([step_seconds(n, n, d, True, rng, 0.0) - plain
                      for d in range(MAX_CHUNK + 1)])
    verify = np.array([step_seconds(n, t, 0, varlen_graphs or t == n, rng, 0.0)
                       for t in range(n * (1 + MAX_CHUNK + PROMPT_LEN) + 1)])
    return StepTable(draft=draft, verify=verify)


def survival_sizes(name: str, acceptance: PositionAcceptance, req_ids: list[str],
                   live: dict, varlen_graphs: bool) -> np.ndarray:
    """``survival``: every request's chunk from :func:`plan_chunks` over the profiled table.
    ``av``: as vLLM's adaptive verification chooses a budget: the drafter always proposes
    ``MAX_CHUNK``, so its cost is the same whatever is verified, and only the verify budget is
    chosen (its acceptance estimates here are the same per-position verdicts)."""
    table = profiled_table(len(req_ids), varlen_graphs)
    if name == "av":
        table = StepTable(draft=np.full(MAX_CHUNK + 1, table.draft[MAX_CHUNK]), verify=table.verify)
    limits = np.array([max(live[r][1] - 1, 0) for r in req_ids])
    plain = len(req_ids) + sum(live[r][3] for r in req_ids)
    return plan_chunks(acceptance.survival(req_ids), table, plain, limits)


def catch_up_seconds(positions: int) -> float:
    """The lazy draft sync's catch-up before a drafting step (draft_model): a 2-layer draft
    of the 8B shape over ``positions`` skipped positions, in passes of at most 8,192 tokens
    (shaped after the H200: at batch 256 a step drafting again after 13-17 steps at chunk 0,
    3,300-4,400 positions behind, took 7-10 ms more than the draft pass alone)."""
    if not positions:
        return 0.0
    return (0.5 * -(-positions // 8192) + 0.002 * positions) * 1e-3


def simulate(policy_name: str, rates: list[float], batch: int, load: int, seed: int,
             noise: float, warm_batches: list[int], async_scheduling: bool = True,
             policy: ChunkPolicy | None = None, varlen_graphs: bool = False) -> dict:
    """One policy's run. With ``async_scheduling`` (as the GPU benchmarks run every policy)
    SCV plans each step before it has observed the last one's verdicts and time, as the
    scheduler patch does: vLLM schedules step N+1 before step N's output comes. SCV starts
    from ``policy`` where one is given (one engine serving cell after cell), else from a
    fresh one after the warm-up."""
    rng = np.random.default_rng(seed)
    if policy_name.startswith("scv") and policy is None:
        policy = new_policy(seed, warm_batches, rng, noise)
    counts_before = list(policy.budget_counts) if policy is not None else []
    fixed = 0 if policy_name == "no_spec" else (
        int(policy_name.removeprefix("fixed_k")) if policy_name.startswith("fixed_k") else None)
    survival = PositionAcceptance(MAX_CHUNK, 16) if policy_name in ("survival", "av") else None
    by_rate = None  # "by_rate_<high>_<low>": the true rate's chunk, high for rates of 1/2 and up
    if policy_name.startswith("by_rate_"):
        by_rate = tuple(int(c) for c in policy_name.removeprefix("by_rate_").split("_"))
    total = load * batch
    admitted = 0
    # request -> [rate, tokens left, draft positions behind, prompt tokens scheduled next step]
    live: dict[str, list] = {}

    def admit() -> None:
        nonlocal admitted
        live[f"r{admitted}"] = [rates[admitted % len(rates)], OUTPUT_LEN, 0, PROMPT_LEN]
        admitted += 1

    while admitted < min(batch, total):
        admit()
    seconds = 0.0
    tokens_out = 0
    steps = 0
    learning_before = False
    pending = None  # a step's verdicts, time and finished requests, not yet observed

    def observe(chunks, step_args, finished) -> None:
        policy.observe(chunks)
        *args, learning, verified, caught_up = step_args
        policy.observe_step(*args, learning=learning, verified=verified, caught_up=caught_up)
        for req_id in finished:
            policy.forget(req_id)

    while live:
        req_ids = list(live)
        if survival is not None:
            sizes = survival_sizes(policy_name, survival, req_ids, live, varlen_graphs)
        elif by_rate is not None:
            sizes = np.array([by_rate[0] if live[r][0] >= 0.5 else by_rate[1] for r in req_ids])
        elif policy is None:
            sizes = np.full(len(req_ids), fixed)
        elif policy_name == "scv_unpriced":  # catch-ups not priced
            plan = policy.plan(req_ids)
            sizes = np.array([plan[r] for r in req_ids])
        else:  # the engine's scheduled tokens per request: the last plan's drafts and prompts
            last = policy.current_plan()
            plan = policy.plan(req_ids, remaining=[live[r][1] for r in req_ids],
                               scheduled={r: 1 + last.get(r, 0) + live[r][3] for r in req_ids})
            sizes = np.array([plan[r] for r in req_ids])
        if policy is not None:  # as patches/scv/scheduler.py records them when it plans
            learning = policy.learning_step or learning_before
            learning_before, caught_up = policy.learning_step, policy.caught_up
            if pending is not None:  # the last step's output comes after this plan
                observe(*pending)
                pending = None
        prefill = sum(live[r][3] for r in req_ids)
        tokens, budget = len(req_ids) + int(sizes.sum()) + prefill, int(sizes.max(initial=0))
        uniform = (bool(sizes.min() == budget) or varlen_graphs) and not prefill
        if policy_name == "av":  # the drafter proposes every draft, whatever is verified
            budget = MAX_CHUNK
        step = step_seconds(len(req_ids), tokens, budget, uniform, rng, noise, prefill)
        positions = 0
        if policy is not None:
            # SCV's lazy draft sync (patches/scv/draft_sync.py): at budget 0 every request skips
            # the step's tokens; otherwise the drafted catch up on what they skipped, and one
            # left out stays behind if it was.
            for req_id, size in zip(req_ids, sizes.tolist(), strict=True):
                state = live[req_id]
                if budget and size:
                    positions += state[2]
                    state[2] = 0
                elif not budget or state[2]:
                    state[2] += 1 + size + state[3]
            step += catch_up_seconds(positions)
        chunks = []
        for req_id, size in zip(req_ids, sizes.tolist(), strict=True):
            rate, left = live[req_id][:2]
            live[req_id][3] = 0
            accepted = 0
            while accepted < size and rng.random() < rate:
                accepted += 1
            if size:
                chunks.append(SpecChunk(req_id, (0,) * size, 0, accepted))
            made = min(1 + accepted, left)
            tokens_out += made
            live[req_id][1] = left - made
        if survival is not None:
            if chunks:
                survival.observe_many([c[0] for c in chunks],
                                      np.array([len(c[1]) for c in chunks]),
                                      np.array([c[3] for c in chunks]))
            survival.tick()
        seconds += step
        steps += 1
        finished = [r for r, state in live.items() if state[1] <= 0]
        for req_id in finished:
            del live[req_id]
            if survival is not None:
                survival.forget(req_id)
            if admitted < total:
                admit()
        if policy is not None:
            pending = (chunks, (len(req_ids), tokens, budget, step, uniform, learning,
                                int(sizes.sum()), caught_up), finished)
            if not async_scheduling or not live:
                observe(*pending)
                pending = None
    row = {"tok_s": tokens_out / seconds, "steps": steps}
    if policy is not None:
        row["budget_counts"] = [after - before for after, before in
                                zip(policy.budget_counts, counts_before, strict=True)]
    return row


def new_policy(seed: int, warm_batches: list[int], rng: np.random.Generator,
               noise: float) -> ChunkPolicy:
    """SCV's policy as a benchmark engine starts it: settings as on the GPU, warmed up."""
    policy = ChunkPolicy(ScvSettings("adaptive", MAX_CHUNK, 16, 16,
                                     max_graph_tokens=MAX_GRAPH_TOKENS, lazy_draft_sync=True),
                         StepCostModel(), seed=seed)
    warm(policy, warm_batches, rng, noise)
    return policy


def warm(policy: ChunkPolicy, batches: list[int], rng: np.random.Generator,
         noise: float) -> None:
    """Every chunk size at every batch size, observed by the cost model; then fresh acceptance
    estimates (the benchmarks' warm-up)."""
    for n in batches:
        for size in range(MAX_CHUNK + 1):
            for _ in range(40):
                tokens = n * (1 + size)
                policy.observe_step(n, tokens, size,
                                    step_seconds(n, tokens, size, True, rng, noise),
                                    verified=n * size)
    policy.acceptance = type(policy.acceptance)(policy.settings.acceptance_window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--load", type=int, default=4, help="requests per slot")
    parser.add_argument("--by-rate", action="store_true",
                        help="also every by_rate_<high>_<low> policy (the true rate's chunk: "
                             "high 0-8 for rates of 1/2 and up, low 0-2 below), reported apart "
                             "as the best such policy over no speculation")
    parser.add_argument("--unpriced", action="store_true",
                        help="also SCV without the catch-up's price (scv_unpriced)")
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="SCV observes each step before planning the next (vLLM without "
                             "async scheduling); by default it plans one step ahead")
    parser.add_argument("--carry", action="store_true",
                        help="SCV's policy (one per seed) carried from cell to cell in this "
                             "order, workloads then batches, as one engine serves them in "
                             "scv_bench.py; by default each cell starts a fresh one")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="sigma of the step time's lognormal noise")
    parser.add_argument("--survival", action="store_true",
                        help="also the survival plan over a profiled table (survival) and a "
                             "budget-only choice as vLLM's adaptive verification makes it (av)")
    parser.add_argument("--varlen-graphs", action="store_true",
                        help="decode batches of unequal chunks replay FULL graphs (vLLM 0.32's "
                             "V2 runner), for every policy")
    args = parser.parse_args()
    others = ["no_spec"] + [f"fixed_k{k}" for k in (1, 2, 3, 4, 6, 8)]
    cells = []
    carried = {seed: new_policy(seed, args.batches, np.random.default_rng(seed), args.noise)
               for seed in range(args.seeds)} if args.carry else {}
    for workload in args.workloads:
        for batch in args.batches:
            tok_s = {}
            choices = []
            extra = (["scv_unpriced"] if args.unpriced else []) + (
                ["av", "survival"] if args.survival else [])
            for name in [*others, *extra, "scv"]:
                runs = [simulate(name, WORKLOADS[workload], batch, args.load, seed,
                                 args.noise, args.batches, not args.sync_scheduling,
                                 carried.get(seed) if name == "scv" else None,
                                 args.varlen_graphs)
                        for seed in range(args.seeds)]
                tok_s[name] = round(statistics.mean(r["tok_s"] for r in runs), 1)
                if name.startswith("scv"):
                    choices = np.sum([r["budget_counts"] for r in runs], axis=0).tolist()
            best = max(others, key=tok_s.get)
            cells.append({"workload": workload, "batch": batch, "best_other": best,
                          "scv_over_best_other": round(tok_s["scv"] / tok_s[best], 3),
                          "scv_budget_counts": choices, "tok_s": tok_s})
            if args.unpriced:
                cells[-1]["scv_unpriced_over_best_other"] = round(
                    tok_s["scv_unpriced"] / tok_s[best], 3)
            if args.survival:
                for name in ("av", "survival"):
                    cells[-1][f"{name}_over_best_other"] = round(tok_s[name] / tok_s[best], 3)
            if args.by_rate:
                by_rate = {name: statistics.mean(
                    simulate(name, WORKLOADS[workload], batch, args.load, seed, args.noise,
                             args.batches, not args.sync_scheduling)["tok_s"]
                    for seed in range(args.seeds))
                    for name in (f"by_rate_{h}_{lo}" for h in range(9) for lo in range(3))}
                top = max(by_rate, key=by_rate.get)
                cells[-1]["by_rate_best"] = [top, round(by_rate[top] / tok_s["no_spec"], 3)]
            print(json.dumps(cells[-1]), flush=True)


if __name__ == "__main__":
    main()
