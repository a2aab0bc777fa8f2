"""SCV against the alternatives on the GPU: output throughput per batch size and workload.

Policies, each its own engine process:

- ``no_spec``: vLLM without speculation;
- ``fixed_k1`` .. ``fixed_k8``: the drafter (``--method``) with a fixed k, at most ``--k``;
- ``vllm_batch_schedule``: vLLM's ``num_speculative_tokens_per_batch_size`` (k by batch size);
- ``vllm_av``: vLLM's adaptive verification (``enable_adaptive_verification``, V2 runner, k =
  ``--k``): each step it admits the (request, position) draft slots of highest survival
  probability, from its own per-request acceptance estimates, within a budget from step costs
  it profiles at start-up;
- ``scv``: SCV adaptive, chunks up to ``--k``;
- ``scv_oracle``: a diagnostic, not a policy: SCV adaptive planning with every request's true
  acceptance rate in place of its estimate (``harness.engines.use_oracle``). It is compared with
  the others like ``scv`` (``scv_oracle_over_best_other``) and is never one of them. Where it
  wins and ``scv`` loses, the estimates are at fault; where both lose, the choices are.
- ``scv_fixed2``: a diagnostic too: SCV's machinery held at chunk 2 (``scv: fixed``) in an
  engine built for 8 drafts, as ``scv`` is. Against ``fixed_k2`` it shows what a step costs
  SCV over vLLM's own k=2 at the same budget, apart from any choice.
- ``scv_chunk0``: a diagnostic: SCV held at chunk 0 (verification priced out, no probes), so
  plain decoding through SCV's machinery and vLLM's speculative model runner.
- ``no_spec_v1``: a diagnostic: plain decoding on vLLM's V1 model runner, the one every
  draft_model and ngram engine got on vLLM 0.26 (plain decoding got V2). Between ``no_spec``
  and ``scv_chunk0`` it places what a step costs SCV at chunk 0: the runner, or the plugin.
- ``no_spec_aa``: a control, not a policy: a second engine without speculation, built as
  ``no_spec`` is. Its ratio over the best other (``no_spec_aa_over_best_other``; ``no_spec``
  where plain decoding is best) is the run's A/A spread: how far two identical engines side
  by side differ, the noise any of SCV's ratios carries.

One run takes a *group* of policies (``--policies``): their engines live side by side on one GPU
and every batch goes to each of them in turn, in order and then in reverse (A B C, C B A), or
with ``--slice-seconds S`` to all of them at once, each engine stepping for S seconds in turn
until every one is done (``harness.engines.interleave``; each run's clock counts its own
turns). A GPU cannot hold all six 8B engines, so the full comparison is several groups, each with
``scv`` in it, on one GPU each (``scripts/gpu_session.sh``); ``--merge`` compares SCV only with
the policies of its own group and reports the smallest ratio.

Every engine runs with async scheduling: vLLM 0.26 supported it with draft_model but left it off by
default, and without it every speculative policy pays the scheduler's CPU time on top of each step
while plain decoding does not. On vLLM 0.32 a GPU runs draft_model and ngram on the V2 runner;
this benchmark has not run on 0.32.

``batch`` is the number of requests in flight. By default the run serves ``4 * batch`` requests
(``--load-multiple``) keeping ``batch`` in flight (a new request starts when one finishes:
steady load, as a server sees it); ``--closed-batch`` sends ``batch`` requests at once and waits
for the last (a request that speculates well finishes early and its slot then idles).

Throughput is measured in each run's steady window: from the first request's finish to the
last request's admission, while ``batch`` requests are in flight
(``harness.engines.generate_at_concurrency``). The whole run's is reported beside it
(``tok_s_whole_run``): it adds the start, where every request begins together, and the drain,
where the batch shrinks. With equal lengths plain decoding serves its requests in waves that
start and finish together and has no drain, while a policy whose requests advance at
different speeds staggers them and ends on a tail of a few requests, which weighs more the
fewer requests a slot serves (with two per slot, 41% of SCV's time on the mix at batch 32 in
the simulator, ``benchmarks/tools/scv_sim.py``).

Workloads give each request its own per-draft acceptance rate ``a`` through the benchmark-only
per-request synthetic acceptance (``SamplingParams.extra_args``) on top of vLLM's synthetic
rejection sampling at full acceptance, so a request's acceptance follows ``a`` whatever the
policy's k. Uniform workloads use the ``a`` that gives mean acceptance length L at k = 4;
the heterogeneous mixes put half the requests at L of about 1.2 and half at full acceptance,
or a quarter each at per-draft rates 0.2, 0.5, 0.8 and 0.95.

    python -m benchmarks.scv_bench --policies no_spec fixed_k4 scv --jsonl $OUT/scv.jsonl
    python -m benchmarks.scv_bench --merge scv_bench.jsonl \
        --result benchmarks/results/scv_<date>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness.engines import (
    ABLATE_KEY,
    ENV_KEY,
    ORACLE,
    OUTPUT_LEN,
    OUTPUT_LEN_KEY,
    PINNED_AT_ZERO,
    agreement,
    alternate,
    prompts,
    rate_for_length,
    start_engines,
    steady_tokens_per_second,
    stop_engines,
    tokens_per_second,
    total,
    write_eagle3_head,
    write_models,
)
from benchmarks.harness.results import append_jsonl, parse_or_merge, write_json

REFERENCE_K = 4
FIXED = {f"fixed_k{j}": j for j in range(1, 9)}  # policy: its k
POLICIES = ("no_spec", *FIXED, "vllm_batch_schedule", "vllm_av", "scv", "scv_oracle",
            "scv_fixed2", "scv_full_graphs", "scv_chunk0", "no_spec_aa", "no_spec_v1")
SCV_ROWS = ("scv", "scv_oracle", "scv_fixed2", "scv_full_graphs", "scv_chunk0")
"""SCV's rows: ``scv`` and four diagnostics: ``scv_oracle`` (SCV planning with the
workload's true acceptance rates, which a real engine cannot know), ``scv_fixed2`` (SCV's
machinery held at chunk 2), ``scv_full_graphs`` (SCV with vLLM's ``cudagraph_mode`` FULL,
where FULL graphs take batches of unequal chunks too; the other policies keep vLLM's default
FULL_AND_PIECEWISE) and ``scv_chunk0`` (SCV held at chunk 0)."""
COMPARED_ROWS = (*SCV_ROWS, "no_spec_aa", "no_spec_v1")
"""The rows compared with the best of the others and never one of them: SCV's, the A/A
control ``no_spec_aa`` and plain decoding on the V1 runner, ``no_spec_v1``."""
BATCH_SCHEDULE = [[1, 16, 4], [17, 96, 2], [97, 1024, 1]]
DRAFTERS = {"draft_model": "2-layer draft model (same shape and vocabulary, dummy weights)",
            "ngram_gpu": "vLLM's ngram_gpu, prompt lookup of 2 to 4 tokens",
            "eagle3": "one-layer EAGLE-3 head of the target's shape, dummy weights, vLLM's V2 "
                      "model runner"}
METHODS = tuple(DRAFTERS)
"""The drafters (``--method``): the 2-layer draft model, vLLM's n-gram lookup on the GPU
(over the prompts' repeated motif and what follows it; it runs no model, and it runs with async
scheduling, which vLLM's CPU ngram does not), or a one-layer EAGLE-3 head (the method vLLM's
adaptive verification estimates acceptance for from the draft logits). What ngram_gpu's pass
costs a step has not been measured apart."""


def workloads() -> dict[str, list[float]]:
    """Per-request acceptance rates as a repeating pattern (applied to any batch size)."""
    uniform = {f"uniform_L{length:g}": [rate_for_length(length, REFERENCE_K)]
               for length in (1.5, 3.0, 4.0)}
    return {**uniform, "mixed_L1.2_and_full": [rate_for_length(1.2, REFERENCE_K), 1.0],
            # a quarter each accepting few, some, most and nearly all drafts
            "mixed_a0.2_0.5_0.8_0.95": [0.2, 0.5, 0.8, 0.95]}


def engine_kwargs(policy: str, target: str, draft: str, max_batch: int,
                  memory_share: float, method: str = "draft_model", k: int = 8) -> dict:
    """``LLM``'s keywords for one policy's engine; ``k``: the largest number of drafts (SCV's
    largest chunk, vLLM's adaptive verification's k and its batch schedule's)."""
    kwargs = dict(model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=768, max_num_seqs=max_batch, gpu_memory_utilization=memory_share,
                  seed=0, disable_log_stats=False, enable_prefix_caching=False,
                  async_scheduling=True)
    if policy == "no_spec_v1":
        return {**kwargs, ENV_KEY: {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
    if policy in ("no_spec", "no_spec_aa"):
        return kwargs
    k = FIXED.get(policy, k)
    drafter = ({"method": method, "model": draft} if method in ("draft_model", "eagle3") else
               {"method": method, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    speculative = {**drafter, "num_speculative_tokens": k,
                   "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_length": k + 1.0,
                   "synthetic_acceptance_per_request": True}
    if policy == "vllm_batch_schedule":
        if method == "ngram_gpu":
            raise SystemExit("vllm_batch_schedule cannot run with ngram_gpu: vLLM 0.26's "
                             "NgramProposerGPU.propose asserts that it proposes exactly "
                             "num_speculative_tokens drafts, and the schedule asks for fewer")
        speculative["num_speculative_tokens_per_batch_size"] = BATCH_SCHEDULE
    if policy == "vllm_av":
        if method == "ngram_gpu":
            raise SystemExit("vllm_av cannot run with ngram_gpu: vLLM's adaptive verification "
                             "estimates acceptance from the draft logits, which n-gram lookup "
                             "has none of")
        speculative["enable_adaptive_verification"] = True
    if policy in SCV_ROWS:
        speculative["scv"] = "adaptive"
    if policy == "scv_fixed2":
        speculative.update(scv="fixed", scv_chunk_size=2)
    if policy == "scv_chunk0":
        speculative.update(PINNED_AT_ZERO)
    if policy == "scv_oracle":
        kwargs[ABLATE_KEY] = [ORACLE]
    if policy == "scv_full_graphs":
        kwargs["compilation_config"] = {"cudagraph_mode": "FULL"}
    return {**kwargs, "speculative_config": speculative}


def run_group(policies: list[str], target: str, draft: str, batches: list[int], reps: int,
              prompt_len: int, memory: float, closed_batch: bool = False,
              names: list[str] | None = None, load_multiple: int = 2,
              output_lens: tuple[int, int] | None = None, method: str = "draft_model",
              slice_seconds: float | None = None, k: int = 8) -> dict:
    share = round(memory / len(policies), 3)
    engines = start_engines({p: engine_kwargs(p, target, draft, max(batches), share, method, k)
                             for p in policies})
    rows, warm = [], {}
    try:
        # Warm-up at every batch size: a warm-up at batch 4 alone left both speculative
        # engines at half speed in the first measured cells.
        # SCV's included at every chunk size (harness.engines.warm_every_chunk); its steps and
        # the cost fit it leaves are kept (``warm``), for offline fits.
        for policy, engine in engines.items():
            for batch in batches:
                done = engine.warm(prompts(batch, seed=99))
                if done["coefficients"] is not None:
                    warm.setdefault(policy, {})[str(batch)] = {
                        "steps": done["steps"], "coefficients": done["coefficients"]}
                if done.get("slow_steps"):  # harness.engines.sample_slow_steps, where on
                    warm.setdefault(policy, {}).setdefault(str(batch), {})["slow_steps"] = (
                        done["slow_steps"])
        for name, pattern in workloads().items():
            if names is not None and name not in names:
                continue
            for batch in batches:
                count = batch if closed_batch else load_multiple * batch
                rates = [pattern[i % len(pattern)] for i in range(count)]
                extra = [{"synthetic_acceptance_rate": r} for r in rates]
                if output_lens is not None:  # each request its own length, the same for all
                    lengths = np.random.default_rng(batch).integers(
                        output_lens[0], output_lens[1] + 1, size=count)
                    for args, length in zip(extra, lengths.tolist(), strict=True):
                        args[OUTPUT_LEN_KEY] = length
                runs: dict[str, list[dict]] = {p: [] for p in policies}
                for rep in range(reps):
                    batch_prompts = prompts(count, seed=1000 * batch + rep, length=prompt_len)
                    for policy, run in alternate(engines, batch_prompts, rep, extra,
                                                 None if closed_batch else batch,
                                                 slice_seconds).items():
                        runs[policy].append(run)
                for policy in policies:
                    drafted = sum(r["drafted"] for r in runs[policy])
                    accepted = sum(r["accepted"] for r in runs[policy])
                    row = {"policy": policy, "batch": batch, "workload": name,
                           "tok_s": round(statistics.median(
                               tokens_per_second(r) for r in runs[policy]), 1),
                           "acceptance": round(accepted / drafted, 4) if drafted else None}
                    steady = [steady_tokens_per_second(r) for r in runs[policy]]
                    if None not in steady:  # in the steady window (harness.engines)
                        row["tok_s_steady"] = round(statistics.median(steady), 1)
                    if "no_spec" in runs and policy != "no_spec":
                        # greedy tokens as no speculation's, over every repetition
                        row["agreement_with_no_spec"] = round(agreement(
                            [t for r in runs["no_spec"] for t in r["tokens"]],
                            [t for r in runs[policy] for t in r["tokens"]])[0], 5)
                    # Python's garbage collections of 1 ms or more, per repetition
                    row["gc_pauses_by_rep"] = [r.get("gc_pauses") for r in runs[policy]]
                    if any(r.get("slow_steps") for r in runs[policy]):  # where switched on
                        row["slow_steps_by_rep"] = [r["slow_steps"] for r in runs[policy]]
                    # per repetition: wall seconds, the steady window's seconds and tokens,
                    # GPU clocks, the engine process's CPU time
                    row["runs_by_rep"] = [{"seconds": round(r["seconds"], 4),
                                           "steady": r.get("steady"),
                                           "gpu_clocks": r.get("gpu_clocks"),
                                           "host": r.get("host"),
                                           "step_ms": r.get("step_ms"),
                                           "scv_policy_us_per_step": r.get(
                                               "scv_policy_us_per_step")}
                                          for r in runs[policy]]
                    scv = [r["scv"] for r in runs[policy] if r.get("scv")]
                    if scv:  # what SCV chose: steps by draft budget, uniform plans, its costs
                        counters = total([x["counters"] for x in scv])
                        row["scv_budget_counts"] = counters["budget_counts"]
                        row["scv_uniform_plans"] = counters["uniform_plans"]
                        row["scv_unpriced_plans"] = counters["unpriced_plans"]
                        # steps debited to the learning ledger, their measured ms over plain
                        debited, excess = counters["learning_excess"]
                        row["scv_learning_excess"] = [debited, round(1e3 * excess, 2)]
                        row["scv_cost_coefficients"] = scv[-1]["coefficients"]
                        row["scv_graphs"] = scv[-1]["graphs"]  # [max tokens, mixed batches]
                        row["scv_step_ms_by_budget"] = [  # observed, per step
                            round(1e3 * seconds / count, 2) if count else None
                            for count, seconds in counters["budget_seconds"]]
                        row["scv_budget_changes_by_rep"] = [x["budget_changes"] for x in scv]
                        # every step the cost model saw, for offline fits of other models:
                        # [requests, tokens, budget, ms, uniform, learning, verified]
                        row["scv_steps_by_rep"] = [x["steps"] for x in scv]
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        stop_engines(engines)
    return {"policies": policies, "method": method, "k": k, "gpu_memory_share": share,
            "load": "closed batch" if closed_batch
            else f"steady, {load_multiple} x batch requests",
            "async_scheduling": "on for every policy",
            # None: whole runs one after the other; else the runs interleaved in slices
            "slice_seconds": slice_seconds,
            "startup_seconds": {p: round(e.startup_seconds, 1) for p, e in engines.items()},
            "prompt_len": prompt_len, "reps": reps, "rows": rows, "warm": warm,
            "output_lens": list(output_lens) if output_lens else [OUTPUT_LEN, OUTPUT_LEN]}


def compare(group_tables: list[dict[str, float]]) -> tuple[dict[str, float], dict]:
    """A cell's throughput by policy (SCV's rows: the mean over groups) and, for each compared
    row, its ratio over the best other policy of each group it ran in."""
    tok_s: dict[str, float] = {}
    ratios: dict[str, list[float]] = {name: [] for name in COMPARED_ROWS}
    for table in group_tables:
        tok_s.update({p: v for p, v in table.items() if p not in COMPARED_ROWS})
        others = [v for p, v in table.items() if p not in COMPARED_ROWS]
        for name in COMPARED_ROWS:
            if name in table and others:
                ratios[name].append(round(table[name] / max(others), 4))
    for name in COMPARED_ROWS:
        values = [t[name] for t in group_tables if name in t]
        if values:
            tok_s[name] = round(statistics.mean(values), 1)
    return tok_s, ratios


def host_adjusted(runs: dict[str, list[dict]]) -> dict | None:
    """The compared rows' ratios over the best other with the host's speed taken out, from one
    group's runs of one cell (``runs_by_rep`` by policy). A diagnostic beside the headline.

    At batch 128 the step loop is bound by the host, and the host's speed moves during a run:
    the fastest of five timings of a fixed Python loop (``harness.engines.host_probe_ms``, before
    and after each run) has ranged from 3.3 to 8.3 ms on the H200 machines, and a policy's
    throughput moved with it. A policy whose runs
    met a slow host loses in the headline for that alone. This fits, over the group's runs,
    log(steady throughput) = a[policy] + b * log(probe), one slope ``b`` for all policies,
    and compares the levels ``a``: each policy at the same host speed. It assumes the host
    slows every policy alike, which need not hold (more steps per token, more host work);
    ``slope`` and ``r2`` say how well it fits. None where a policy has no steady window or
    no probe, where there are fewer than two runs more than policies, or where the probe
    did not move."""
    points = [(policy, run["steady"]["tokens"] / run["steady"]["seconds"],
               statistics.mean(run["host"]["probe_ms"]))
              for policy, policy_runs in runs.items() for run in policy_runs
              if (run.get("steady") or {}).get("seconds") and (run.get("host") or {}).get(
                  "probe_ms")]
    policies = list(runs)
    if ({p for p, *_ in points} != set(policies) or len(points) < len(policies) + 2
            or len({probe for *_, probe in points}) < 2):
        return None
    design = np.zeros((len(points), len(policies) + 1))
    for i, (policy, _, probe) in enumerate(points):
        design[i, policies.index(policy)], design[i, -1] = 1.0, np.log(probe)
    observed = np.log([tok_s for _, tok_s, _ in points])
    fit = np.linalg.lstsq(design, observed, rcond=None)[0]
    residual = observed - design @ fit
    spread = np.sum((observed - observed.mean()) ** 2)
    level = dict(zip(policies, fit[:-1], strict=True))
    others = [p for p in policies if p not in COMPARED_ROWS]
    if not others:
        return None
    best = max(level[p] for p in others)
    return {"slope": round(float(fit[-1]), 3),
            "r2": round(float(1 - np.sum(residual ** 2) / spread), 3) if spread else None,
            "over_best_other": {p: round(float(np.exp(level[p] - best)), 4)
                                for p in policies if p in COMPARED_ROWS}}


def paired_by_rep(runs: dict[str, list[dict]], table: dict[str, float]) -> dict | None:
    """Each compared row's steady throughput over the best other policy's (the best by
    ``table``, the group's headline) repetition by repetition: runs of one repetition served
    the same batch side by side (interleaved, at the same time), so their ratio carries the
    noise that both runs met once. ``best``: that policy; ``median``: each row's median
    ratio. None where a run of theirs has no steady window."""
    others = {p: v for p, v in table.items() if p not in COMPARED_ROWS}
    if not others:
        return None
    best = max(others, key=others.get)
    base = [steady_tokens_per_second(r) for r in runs.get(best, [])]
    ratios = {}
    for name in COMPARED_ROWS:
        mine = [steady_tokens_per_second(r) for r in runs.get(name, [])]
        if not mine or None in mine or None in base or len(mine) != len(base):
            continue
        ratios[name] = [round(m / b, 4) for m, b in zip(mine, base, strict=True)]
    if not ratios:
        return None
    return {"best": best, "by_rep": ratios,
            "median": {n: round(statistics.median(r), 4) for n, r in ratios.items()}}


def merge(jsonl: Path, result: Path) -> None:
    """One cell per (batch, workload). ``tok_s``: each policy's throughput in its group (SCV's
    is the mean over groups); ``scv_over_best_other``: the smallest, over groups, of SCV over
    the best other policy of the same group (same GPU, alternating batches). Both measure the
    steady window (``harness.engines.generate_at_concurrency``) where every policy of the group
    had one in every repetition, else the whole run; ``tok_s_whole_run`` and
    ``scv_over_best_other_whole_run`` are the whole run's in any case."""
    from benchmarks.harness.results import recorded_environment

    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    groups: dict[tuple[int, str], list[dict[str, float]]] = {}
    whole_runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    acceptance: dict[tuple[int, str], dict[str, float | None]] = {}
    choices: dict[tuple[int, str], list[dict]] = {}
    agreement_by_cell: dict[tuple[int, str], dict[str, float]] = {}
    # a cell's key: its rows' by policy, group and repetition
    by_rep: dict[str, dict[tuple[int, str], dict[str, list]]] = {
        "gc_pauses": {}, "runs": {}, "slow_steps": {}}
    measures: set[str] = set()
    adjusted: dict[tuple[int, str], list[dict | None]] = {}  # by group: host_adjusted
    paired: dict[tuple[int, str], list[dict | None]] = {}  # by group: paired_by_rep
    for record in records:
        group_runs: dict[tuple[int, str], dict[str, list[dict]]] = {}
        tables: dict[tuple[int, str], dict[str, float]] = {}
        steady_tables: dict[tuple[int, str], dict[str, float | None]] = {}
        for row in record["rows"]:
            key = (row["batch"], row["workload"])
            tables.setdefault(key, {})[row["policy"]] = row["tok_s"]
            steady_tables.setdefault(key, {})[row["policy"]] = row.get("tok_s_steady")
            acceptance.setdefault(key, {})[row["policy"]] = row.get("acceptance")
            group_runs.setdefault(key, {})[row["policy"]] = row.get("runs_by_rep") or []
            if "agreement_with_no_spec" in row:  # the lowest over groups
                agreements = agreement_by_cell.setdefault(key, {})
                agreements[row["policy"]] = min(agreements.get(row["policy"], 1.0),
                                                row["agreement_with_no_spec"])
            for name, found in by_rep.items():
                if row.get(f"{name}_by_rep"):
                    found.setdefault(key, {}).setdefault(row["policy"], []).append(
                        row[f"{name}_by_rep"])
            if "scv_budget_counts" in row:
                choices.setdefault(key, []).append({"policy": row["policy"], **{
                    k.removeprefix("scv_"): v for k, v in row.items() if k.startswith("scv_")}})
        for key, tok_s in tables.items():
            steady = steady_tables[key]
            headline = steady if None not in steady.values() else tok_s
            measures.add("steady window" if headline is steady else "whole run")
            groups.setdefault(key, []).append(headline)
            whole_runs.setdefault(key, []).append(tok_s)
            adjusted.setdefault(key, []).append(host_adjusted(group_runs[key]))
            paired.setdefault(key, []).append(paired_by_rep(group_runs[key], headline))
    cells = []
    for (batch, workload), group_tables in sorted(groups.items()):
        tok_s, ratios = compare(group_tables)
        whole_tok_s, whole_ratios = compare(whole_runs[(batch, workload)])
        diagnostics = {}
        for name in COMPARED_ROWS[1:]:
            if ratios[name]:
                diagnostics[f"{name}_over_best_other"] = min(ratios[name])
                diagnostics[f"{name}_over_best_other_by_group"] = ratios[name]
        host = adjusted[(batch, workload)]
        host_scv = [g["over_best_other"]["scv"] for g in host
                    if g is not None and "scv" in g["over_best_other"]]
        cells.append({"batch": batch, "workload": workload, "tok_s": tok_s,
                      "scv_over_best_other": min(ratios["scv"]) if ratios["scv"] else None,
                      **diagnostics, "scv_over_best_other_by_group": ratios["scv"],
                      # the same with the host's speed taken out (host_adjusted)
                      "scv_over_best_other_host_adjusted": min(host_scv) if host_scv else None,
                      "host_adjusted_by_group": host,
                      # repetition by repetition (paired_by_rep): with interleaved runs, each
                      # repetition's runs met the same host
                      "paired_by_group": paired[(batch, workload)],
                      "groups": group_tables,
                      "tok_s_whole_run": whole_tok_s,
                      "scv_over_best_other_whole_run": (min(whole_ratios["scv"])
                                                        if whole_ratios["scv"] else None),
                      "acceptance": acceptance.get((batch, workload), {}),
                      "agreement_with_no_spec": agreement_by_cell.get((batch, workload), {}),
                      "scv_choices_by_group": choices.get((batch, workload), []),
                      **{name: found.get((batch, workload), {})
                         for name, found in by_rep.items()
                         if name != "slow_steps" or (batch, workload) in found}})
    payload = {**recorded_environment(jsonl), "benchmark": "scv",
               "workload": {"prompt_len": sorted({r["prompt_len"] for r in records}),
                            "output_len": OUTPUT_LEN,  # [min, max] by group: ``groups``
                            "reps": sorted({r["reps"] for r in records}),
                            "model": "Llama-3-8B shape, dummy weights, bf16",
                            "drafter": sorted({DRAFTERS[r.get("method", "draft_model")]
                                               for r in records}),
                            "rates": workloads(), "batch_schedule": BATCH_SCHEDULE},
               "load": sorted({r.get("load", "closed batch") for r in records}),
               # what ``tok_s`` and ``scv_over_best_other`` measure (``merge``)
               "measure": sorted(measures),
               "async_scheduling": sorted({r.get("async_scheduling", "vLLM default: off for "
                                                 "draft_model, on without speculation")
                                           for r in records}),
               "groups": [{"policies": r["policies"],
                           "method": r.get("method", "draft_model"),
                           "k": r.get("k", 8),
                           "gpu_memory_share": r["gpu_memory_share"],
                           "startup_seconds": r["startup_seconds"],
                           # None: whole runs one after the other; else interleaved turns
                           "slice_seconds": r.get("slice_seconds"),
                           "output_lens": r.get("output_lens", [OUTPUT_LEN, OUTPUT_LEN]),
                           # SCV's warm-up steps by policy and batch (as steps_by_rep's);
                           # the cost fit after each
                           **({"warm": r["warm"]} if r.get("warm") else {})}
                          for r in records],
               "cells": cells}
    write_json(result, payload)
    print(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES,
                        default=["no_spec", "fixed_k4", "scv"])
    parser.add_argument("--method", choices=METHODS, default="draft_model",
                        help="the speculative policies' drafter")
    parser.add_argument("--k", type=int, default=8, choices=range(1, 9), metavar="1..8",
                        help="the largest number of drafts: SCV's largest chunk, vLLM's "
                        "adaptive verification's k and batch schedule's; fixed_kJ needs J <= k")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    parser.add_argument("--workloads", nargs="+", choices=list(workloads()),
                        default=list(workloads()))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--closed-batch", action="store_true",
                        help="send each batch at once instead of keeping `batch` in flight")
    parser.add_argument("--load-multiple", type=int, default=4,
                        help="requests served per slot in flight (steady load); at 3 or more "
                        "every policy has a steady window")
    parser.add_argument("--memory", type=float, default=0.9,
                        help="share of GPU memory for the whole group, split evenly")
    parser.add_argument("--output-lens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="each request's output length drawn from [MIN, MAX] (the same "
                        "for every policy) instead of all 128: requests then finish apart, "
                        "with speculation or without")
    parser.add_argument("--slice-seconds", type=float,
                        help="run the group's engines at once, taking turns of this many "
                        "seconds (harness.engines.interleave), instead of whole runs one after "
                        "the other: every engine meets the host's speed of the moment")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="prompt tokens (>= 128); short prompts keep the run decode-bound")
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    if over := [p for p in args.policies if FIXED.get(p, 0) > args.k]:
        parser.error(f"--policies {' '.join(over)}: more drafts than --k {args.k}")
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        if args.method == "eagle3":
            draft = write_eagle3_head(Path(root))
        append_jsonl(args.jsonl, run_group(args.policies, target, draft, args.batches,
                                           args.reps, args.prompt_len, args.memory,
                                           args.closed_batch, args.workloads,
                                           args.load_multiple, args.output_lens,
                                           args.method, args.slice_seconds, args.k))


if __name__ == "__main__":
    main()
