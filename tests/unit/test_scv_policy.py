"""SCV's chunk-size policy, table-driven (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_nwor.scv import (
    AcceptanceEstimator,
    ChunkPolicy,
    RequestTable,
    ScvSettings,
    SpecChunk,
    StepCost,
    StepCostModel,
    choose_sizes,
    expected_tokens,
    nonnegative_least_squares,
    planner,
)

K = 4

# Cost regimes (seconds: fixed, per scheduled token, per draft pass, per draft token, off the
# FULL graphs, and a step that drafts at all).
BATCH_1 = StepCost(0.006, 2e-6, 5e-4, 0, 0)  # memory-bound: verify rows nearly free, passes cost
BATCH_128 = StepCost(0.008, 7e-5, 0, 5e-6, 0)  # compute-bound: every verify row costs compute
DRAFT_HEAVY = StepCost(0.010, 2e-6, 4e-3, 0, 0)  # a draft pass costs two fifths of a target step


@pytest.mark.parametrize(
    "regime, groups, expected",
    [
        # Low concurrency: speculate fully even at modest acceptance; shortly at low acceptance.
        (BATCH_1, [(0.9, 1)], [K]),
        (BATCH_1, [(0.5, 1)], [2]),  # drafts cost launches: two is the optimum
        (BATCH_1, [(0.2, 1)], [1]),
        # High concurrency: only high acceptance pays; low acceptance means plain decoding.
        (BATCH_128, [(0.95, 128)], [K]),
        (BATCH_128, [(0.05, 128)], [0]),
        (BATCH_128, [(0.3, 128)], [0]),  # L about 1.4: the regime where fixed k loses a third
        (BATCH_128, [(0.6, 128)], [1]),
        # A heterogeneous batch: each request gets its own chunk, the accepting half a short
        # one: what it saves are slots, and the slots it frees fill with the others (K is
        # worth more only for the next step: 3% more tokens per second, 3% fewer settled).
        (BATCH_128, [(0.95, 64), (0.05, 64)], [2, 0]),
        # An expensive drafter: it only runs when acceptance repays it.
        (DRAFT_HEAVY, [(0.3, 2)], [0]),
        (DRAFT_HEAVY, [(0.99, 2)], [K]),
    ],
)
def test_choose_sizes(regime, groups, expected):
    rates = np.concatenate([np.full(count, rate) for rate, count in groups])
    sizes = choose_sizes(rates, K, regime)
    assert sizes.tolist() == [size for (_, count), size in zip(groups, expected, strict=True)
                              for _ in range(count)]


@pytest.mark.parametrize(
    "off_graph, mixed_graphs, groups, expected",
    [
        # Batch 32, half accepting well, half not, and running off the FULL graphs is free:
        # each request gets its own chunk.
        (0.0, False, [(0.95, 16), (0.1, 16)], [K, 0]),
        # ... costs a third of a step: every request verifies the same chunk (one FULL graph),
        # one draft: at K the rejecting half, which the batch settles into, would verify K.
        (0.003, False, [(0.95, 16), (0.1, 16)], [1, 1]),
        # ... unless FULL graphs take mixed batches too (cudagraph_mode FULL).
        (0.003, True, [(0.95, 16), (0.1, 16)], [K, 0]),
        # Everyone alike: the sizes are uniform anyway; that cost changes nothing.
        (0.003, False, [(0.95, 32)], [K]),
        (0.003, False, [(0.05, 32)], [0]),
    ],
)
def test_choose_sizes_counts_what_leaving_the_graphs_costs(off_graph, mixed_graphs, groups,
                                                           expected):
    rates = np.concatenate([np.full(count, rate) for rate, count in groups])
    sizes = choose_sizes(rates, K, StepCost(0.006, 5e-5, 0, 5e-6, off_graph), 512,
                         mixed_graphs=mixed_graphs)
    assert sizes.tolist() == [size for (_, count), size in zip(groups, expected, strict=True)
                              for _ in range(count)]


def test_choose_sizes_keeps_the_batch_within_the_largest_graph():
    """Batch 128 accepting well: 1 + 4 tokens per request would be 640 tokens, past a 512-token
    largest FULL graph; when running without one costs 15 ms, two drafts (384 tokens) win."""
    rates = np.full(128, 0.9)
    cliff = StepCost(0.008, 2e-5, 1e-3, 0, 0.015)
    assert choose_sizes(rates, K, cliff, None).tolist() == [K] * 128  # no graphs at all
    sizes = choose_sizes(rates, K, cliff, 512)
    assert 128 * (1 + sizes.max()) <= 512 and sizes.max() >= 2


def plan_value(rates, sizes, cost, max_graph_tokens=None) -> float:
    """Expected tokens per second, under the cost model, of the batch a plan settles into
    where every request leaving is replaced by one alike (choose_sizes)."""
    gains = [expected_tokens(a, s) for a, s in zip(rates, sizes, strict=True)]
    held = sum(1 / g for g in gains)  # slots held, in proportion
    n = len(rates)
    scheduled = n + n * sum(s / g for s, g in zip(sizes, gains, strict=True)) / held
    on_graph = (max_graph_tokens is not None and min(sizes) == max(sizes)
                and scheduled <= max_graph_tokens)
    return n * n / held / cost.seconds(n, scheduled, max(sizes), not on_graph)


# The step cost the H200 fitted at batch 128 (scv_spread_lengths_2026-11-23_h200.json).
H200 = StepCost(4.4e-3, 2.38e-5, 3.06e-4, 6.46e-6, 1.37e-4, drafting=1.07e-3)


def test_hurrying_the_accepting_half_fills_its_slots_with_the_rejecting_half():
    """The mix (half the requests accept every draft, half 1 in 6) at batch 128: verifying 8
    drafts for the accepting half yields a quarter more tokens per second in the next step, but
    those requests leave 9 times sooner and the rejecting half takes their slots, every step
    still paying for the draft passes over the whole batch. Plain decoding is worth more in
    the batch that settles. With one request there is no one to take its slot."""
    rates = np.repeat([1.0, 0.167], 64)
    next_step = (64 * 9 + 64) / H200.seconds(128, 128 + 64 * 8, 8, True)
    assert next_step > 1.2 * 128 / H200.seconds(128, 128, 0, False)
    assert not choose_sizes(rates, 8, H200, 504).any()
    assert choose_sizes(np.array([1.0]), 8, H200, 504).tolist() == [8]


def test_a_batch_settled_under_a_plan_values_it_as_its_next_step():
    """Taken to be what a plan settled into, the batch values that plan as its next step, and
    the accepting requests, few in the batch because they leave soon, keep their chunk where
    the next step says it pays."""
    rates = np.repeat([0.95, 0.05], [16, 112])
    cost = StepCost(0.008, 2e-5, 0, 0, 0)
    settled_under = np.where(rates > 0.5, K, 0)
    assert choose_sizes(rates, K, cost, settled_under=settled_under).tolist() == (
        [K] * 16 + [0] * 112)


def test_a_batch_is_what_its_requests_history_settled_it_into_not_the_last_plan():
    """The H200's mix at batch 128 (half the requests accept nearly every draft, half 1 in
    6; its fit then): after fifteen plain steps a probe step drafted part of the batch. Taken
    as settled under a plan drafting the accepting half, the batch values drafting for every
    request above plain decoding (on the H200 it then did so for 42-45 steps). Its requests' own
    history (a token per step) says plain decoding."""
    fit = StepCost(4.787e-3, 2.3e-5, 3.85e-4, 7e-6, 1.375e-3, 4.47e-4, 4.389e-3)
    rates = np.repeat([0.98, 0.17], 64)
    last = np.repeat([1, 0], 64)
    assert choose_sizes(rates, 8, fit, 504, settled_under=last).any()
    history = (np.full(128, 100.0), np.full(128, 100.0))
    assert not choose_sizes(rates, 8, fit, 504, settled_under=last, history=history).any()
    # a batch whose history is the last plan values plans as settled under it
    made = np.where(rates > 0.5, 100 * expected_tokens(0.98, 1), 100.0)
    kept = choose_sizes(rates, 8, fit, 504, settled_under=last, history=(made, history[1]))
    assert kept.tolist() == choose_sizes(rates, 8, fit, 504, settled_under=last).tolist()


@pytest.mark.parametrize(
    "behind, left, drafted",
    [
        (0, 4, True),  # nothing to catch up
        (20000, 20000, True),  # a long catch-up spread over many steps to come
        (20000, 4, False),  # the same catch-up for a request about to finish
    ],
)
def test_a_request_behind_is_drafted_where_its_catch_up_pays(behind, left, drafted):
    """Two requests accepting 9 drafts in 10 at batch 1's costs, the second ``behind``
    positions without draft K/V and ``left`` tokens from its end: drafting it first costs the
    draft model's pass over those positions (2 us each), spread over the steps it has left."""
    cost = BATCH_1._replace(per_caught_up=2e-6)
    catch_up = cost.per_caught_up * np.array([0, behind]) / left
    sizes = choose_sizes(np.full(2, 0.9), K, cost, catch_up=catch_up)
    assert sizes[0] > 0 and bool(sizes[1]) == drafted
    assert choose_sizes(np.full(2, 0.9), K, cost).tolist() == [K, K]  # unpriced: both


def test_the_policy_follows_the_draft_syncs_positions_behind():
    """What the lazy draft sync keeps (patches/draft_sync.py), step by step: at budget 0 every
    scheduled request skips its tokens; at a drafting step the drafted requests catch up (the
    positions the plan reports), one left out stays behind if it was, and one that was not (a
    prompt chunk, a request at chunk 0) has this step covered by the drafter."""
    policy = ChunkPolicy(ScvSettings("adaptive", K, 4, 16, lazy_draft_sync=True))
    steps = [  # scheduled tokens (c: a prompt in chunks, not planned), planned chunks
        ({"a": 128, "b": 1}, [0, 0], 0),
        ({"a": 1, "b": 1, "c": 64}, [2, 0], 128),
        ({"a": 3, "b": 2, "c": 64}, [0, 1], 2 + 0),  # b: 1 + 1 behind
        ({"a": 1, "b": 2, "c": 1}, [0, 0], 0),
        ({"a": 1, "b": 2, "c": 1}, [1, 1], 1 + 2),
    ]
    caught_up = []
    for scheduled, sizes, _ in steps:
        policy._choose = lambda req_ids, rows, remaining, sizes=sizes: np.array(sizes)
        policy.plan(["a", "b"], remaining=[100, 100], scheduled=scheduled)
        caught_up.append(policy.caught_up)
    assert caught_up == [expected for *_, expected in steps]


def test_cost_model_prices_the_positions_a_catch_up_covers():
    true_cost = StepCost(0.004, 2e-5, 8e-4, 3e-6, 1e-3, 2e-3, catching_up=5e-4, per_caught_up=2e-6)
    model = StepCostModel(window=1000, min_steps=10)
    rng = np.random.default_rng(3)
    for n, tokens, budget, _, off_graph in random_steps(true_cost, 300):
        caught_up = int(rng.integers(0, 4000)) if budget and rng.random() < 0.3 else 0
        model.observe(n, tokens, budget, true_cost.seconds(n, tokens, budget, off_graph,
                                                           caught_up), off_graph, caught_up)
    assert model.coefficients == pytest.approx(true_cost, rel=0.05)


@pytest.mark.parametrize("off_graph, max_graph_tokens", [(0.0, None), (0.002, 96)])
def test_chosen_sizes_beat_every_uniform_size_under_the_model(off_graph, max_graph_tokens):
    rng = np.random.default_rng(0)
    for _ in range(50):
        rates = rng.uniform(0.01, 0.99, size=rng.integers(1, 64))
        cost = StepCost(rng.uniform(0.005, 0.02), rng.uniform(0, 5e-5), rng.uniform(0, 1e-3),
                        1e-6, off_graph)
        chosen = choose_sizes(rates, K, cost, max_graph_tokens).tolist()
        best_uniform = max(plan_value(rates, [c] * len(rates), cost, max_graph_tokens)
                           for c in range(K + 1))
        assert plan_value(rates, chosen, cost, max_graph_tokens) >= 0.999 * best_uniform


def test_choose_sizes_stops_early_only_where_no_plan_with_drafts_wins():
    """The early exits for plans without drafts return what the full search returns, with every
    term of the cost, a batch settled under an earlier plan and catch-up charges; and they are
    taken (the search is what costs the host time at batch 256)."""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(600):
        n = int(rng.integers(1, 300))
        rates = rng.uniform(0.0, 1.0, size=n) ** rng.uniform(0.2, 4)
        cost = StepCost(*rng.uniform(0, 1e-2, 2) * [1, 1e-4], *rng.uniform(0, 2e-3, 2) * [1, 1e-2],
                        rng.choice([0.0, 2e-3]), *rng.uniform(0, 2e-3, 3) * [1, 1, 1e-4],
                        *rng.uniform(0, 5e-5, 4) * (rng.random(4) < 0.5))
        settled_under = rng.integers(0, K + 1, size=n) if rng.random() < 0.5 else None
        catch_up = rng.uniform(0, 1e-5, size=n) * (rng.random(n) < 0.5) if rng.random() < 0.5 \
            else None
        cases.append((rates, cost, rng.choice([None, 96, 512]),
                      {"settled_under": settled_under, "catch_up": catch_up}))
    searched = 0
    real = planner.drafts_can_win

    def counted(*args):
        nonlocal searched
        searched += real(*args)
        return real(*args)

    planner.drafts_can_win = counted
    try:
        fast = [choose_sizes(rates, K, cost, graphs, **kw).tolist()
                for rates, cost, graphs, kw in cases]
    finally:
        planner.drafts_can_win = real
    full = [choose_sizes(rates, K, cost, graphs, exit_early=False, **kw).tolist()
            for rates, cost, graphs, kw in cases]
    assert fast == full
    zero = sum(not any(sizes) for sizes in full)
    assert 100 < zero < 500  # both kinds of batch were tried
    assert searched < len(cases) - 0.75 * zero  # most batches kept at 0 were not searched


@pytest.mark.parametrize(
    "history, low, high",
    [
        ([(4, 4)] * 10, 0.85, 1.0),  # always fully accepted
        ([(4, 0)] * 10, 0.0, 0.15),  # always rejected at once
        ([(4, 1)] * 20, 0.4, 0.6),  # one accepted, then rejected: per-draft rate about 1/2
        ([(4, 0)] * 20 + [(4, 4)] * 20, 0.8, 1.0),  # recovers: old rejections are forgotten
    ],
)
def test_acceptance_estimator(history, low, high):
    estimator = AcceptanceEstimator(window=8)
    for size, accepted in history:
        estimator.tick()
        estimator.observe("r", size, accepted)
    assert low <= estimator.rate("r") <= high
    # A new request starts from the traffic's recent acceptance (here request r's alone).
    assert low - 0.05 <= estimator.rate("unseen") <= high


def test_a_new_request_starts_at_one_half_without_traffic_and_at_the_traffics_rate_with_it():
    estimator = AcceptanceEstimator(window=16)
    assert estimator.rate("first") == 0.5
    for _ in range(40):  # eight requests that never accept
        estimator.tick()
        for r in range(8):
            estimator.observe(f"r{r}", 4, 0)
    assert estimator.rate("new") < 0.05
    for _ in range(200):  # nothing verified for a long time (every request at chunk 0)
        estimator.tick()
    # The traffic's acceptance is still what the last verdicts said: a batch that should not
    # draft does not drift back to drafting (only probes bring a request back).
    assert estimator.rate("newer") < 0.05
    assert max(estimator.rates([f"r{r}" for r in range(8)])) < 0.05


def test_a_new_request_starts_at_the_batchs_requests_not_at_their_drafts():
    """One request verifies eight drafts a step and accepts them all; four verify one and
    reject it. Most drafts were accepted, but most requests reject: a new request starts low."""
    estimator = AcceptanceEstimator(window=16)
    batch = ["good", "bad0", "bad1", "bad2", "bad3"]
    for _ in range(20):
        estimator.tick()
        estimator.observe("good", 8, 8)
        for req in batch[1:]:
            estimator.observe(req, 1, 0)
    rates = estimator.rates([*batch, "new"])
    assert rates[0] > 0.9 and max(rates[1:5]) < 0.1
    assert 0.15 < rates[5] < 0.3  # the requests' mean (1 + 0 + 0 + 0 + 0) / 5, not 8 / 12
    assert estimator.rate("new") > 0.6  # alone (no batch evidence): the pooled drafts


def test_a_shared_probes_fresh_verdicts_outweigh_the_pools_old_traffic():
    """The pool remembers a long spell of rejections; then the traffic turns and a shared probe
    gives each of 128 requests one verdict, three in four accepted. A step later no request has
    a whole observation's evidence left, and the batch is priced from those verdicts, not from
    the pool's old traffic (that said 0.39 here)."""
    estimator = AcceptanceEstimator(window=16)
    old = [f"old{r}" for r in range(128)]
    for _ in range(100):  # one verify step's verdicts at a time, as the policy observes them
        estimator.tick()
        estimator.observe_many(old, np.full(128, 2), np.zeros(128, dtype=int))
    for req in old:
        estimator.forget(req)
    batch = [f"new{r}" for r in range(128)]
    estimator.tick()
    estimator.observe_many(batch, np.ones(128, dtype=int), (np.arange(128) % 4 != 0).astype(int))
    estimator.tick()
    rates = estimator.rates(batch)
    assert 0.7 < rates.mean() < 0.8
    # A request alone is not its own prior: a rejected probe's verdict is not counted twice.
    alone = AcceptanceEstimator(window=16)
    alone.tick()
    alone.observe("r", 1, 0)
    alone.tick()
    pool = 0.5 / 2.0  # the Jeffreys prior and one rejection
    assert alone.rate("r") == pytest.approx(pool / (15 / 16 + 1.0))


def random_steps(true_cost: StepCost, count: int, seed: int = 1, requests=(64, 128)):
    """Steps of random budgets, tokens and graphs, with ``requests`` in ``[low, high)`` (one
    band of concurrency by default, 64-127)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n, budget = int(rng.integers(*requests)), int(rng.integers(0, 9))
        tokens = n + int(rng.integers(0, n * budget + 1))
        off_graph = bool(rng.integers(0, 2))
        yield n, tokens, budget, true_cost.seconds(n, tokens, budget, off_graph), off_graph


def test_cost_model_recovers_a_linear_step_time():
    true_cost = StepCost(0.004, 2e-5, 8e-4, 3e-6, 1e-3, 2e-3)
    model = StepCostModel(window=1000, min_steps=10)
    for step in random_steps(true_cost, 200):
        model.observe(*step)
    assert model.ready(100)
    assert model.coefficients == pytest.approx(true_cost, rel=0.05)


def test_cost_model_has_no_negative_costs_when_the_budget_never_changes():
    """Every step at budget 8 and batch 1 (what the GPU showed): the intercept and the draft
    costs cannot be told apart. The fit must still predict these steps, with no cost below 0
    (an unconstrained fit traded a large fixed cost against a negative draft cost, and
    clipping it made drafts look free)."""
    model = StepCostModel(window=256, min_steps=32)
    rng = np.random.default_rng(0)
    for _ in range(300):
        model.observe(1, 9, 8, 0.010 * (1 + 0.1 * rng.standard_normal()))
    cost = model.coefficients
    assert min(cost) >= 0
    assert cost.seconds(1, 9, 8, False) == pytest.approx(0.010, rel=0.05)


def test_cost_model_keeps_what_a_window_without_drafts_cannot_tell():
    """A full window of plain steps at one batch size (a batch held at chunk 0): the draft
    and off-graph costs keep their last fit instead of dropping to 0 (drafting looking free),
    and the fixed cost is not traded against the per-token one."""
    true_cost = StepCost(0.004, 2e-5, 8e-4, 3e-6, 1e-3, 2e-3)
    model = StepCostModel(window=256, min_steps=10, refit_interval=16)
    for step in random_steps(true_cost, 300):
        model.observe(*step)
    learnt = model.coefficients
    for _ in range(300):
        model.observe(100, 100, 0, true_cost.seconds(100, 100, 0, False), False)
        kept = model.coefficients
    for term in ("per_pass", "per_draft", "off_graph", "drafting"):
        assert getattr(kept, term) == pytest.approx(getattr(learnt, term), rel=0.01)
        assert getattr(learnt, term) > 0
    assert kept.fixed == pytest.approx(0.004, rel=0.05)
    assert kept.seconds(100, 500, 4, False) == pytest.approx(
        true_cost.seconds(100, 500, 4, False), rel=0.05)


def test_plain_steps_do_not_push_out_what_drafting_costs():
    """What the GPU showed at batch 128 (``scv_b128_fixed2_2026-11-23_h200.json``): the warm-up
    saw every budget at batch 128, then SCV held the batch at chunk 0 for hundreds of steps.
    Kept by band alone, those plain steps pushed the drafting steps out, the drafting terms
    were left to a few slow drafting steps of a smaller batch (compiles during the warm-up),
    and the fit priced a step verifying 2 drafts per request at about twice its cost. Kept by
    band and budget, the drafting steps stay and the price stays right."""
    true_cost = StepCost(0.0054, 2.4e-5, 0, 1.5e-6, 0.005, 0.0011)
    model = StepCostModel(window=128, min_steps=32, refit_interval=16)
    for budget in range(K + 1):  # the warm-up: every budget at batch 128, 40 steps each
        tokens = 128 * (1 + budget)
        for _ in range(40):
            model.observe(128, tokens, budget, true_cost.seconds(128, tokens, budget, False))
    for budget in (1, 3):  # a few drafting steps at batch 40, slowed four times by compiles
        model.observe(40, 40 * (1 + budget), budget,
                      4 * true_cost.seconds(40, 40 * (1 + budget), budget, False))
    for _ in range(600):
        model.observe(128, 128, 0, true_cost.seconds(128, 128, 0, False))
    for budget in (0, 2):
        assert model.coefficients.seconds(128, 128 * (1 + budget), budget, False) == (
            pytest.approx(true_cost.seconds(128, 128 * (1 + budget), budget, False), rel=0.05))


def test_steps_at_batch_1_do_not_price_batch_32():
    """What the GPU showed: after the batch-1 cells, SCV held uniform L=3 at chunk 0 in 457 of
    489 steps at batch 32, where fixed k=2 gained 1.43x. At batch 1 a draft pass's own cost and
    its cost per request are one column, and a fit split them at will (half and half here);
    carried to batch 32, that priced a pass at about ten times its cost. Steps are kept by
    band of concurrency: batch 32 is explored before it is planned, and with both batch sizes
    in the fit, both are priced right."""
    true_cost = StepCost(4.6e-3, 1.7e-5, 4.5e-4, 1e-5, 1e-3, 5e-4)
    cost = StepCostModel(window=256, min_steps=32, refit_interval=16)
    for step in random_steps(true_cost, 256, requests=(1, 2)):
        cost.observe(*step)
    assert cost.ready(1) and not cost.ready(32)
    policy = ChunkPolicy(ScvSettings("adaptive", 8, 16, acceptance_window=16,
                                     max_graph_tokens=512), cost)
    batch = [f"r{i}" for i in range(32)]
    budgets = []
    for _ in range(33):  # (a step's row is complete with the next step)
        plan = policy.plan(batch)
        budgets.append(policy.draft_budget())
        tokens = 32 + sum(plan.values())
        uniform = len(set(plan.values())) == 1
        policy.observe_step(32, tokens, budgets[-1],
                            true_cost.seconds(32, tokens, budgets[-1], not uniform), uniform,
                            verified=tokens - 32)
    assert max(budgets) >= 4, budgets  # explored, not planned from batch 1's fit
    assert cost.ready(8) and not cost.ready(64)  # between seen batch sizes, not beyond
    for n in (1, 32):
        assert cost.coefficients.seconds(n, 5 * n, 4, False) == pytest.approx(
            true_cost.seconds(n, 5 * n, 4, False), rel=0.02)
    rates = np.full(32, 0.74)  # L=3 at k=4
    assert choose_sizes(rates, 8, cost.coefficients).min() >= 2  # and drafts


def test_a_drafting_steps_own_cost_keeps_a_low_acceptance_batch_plain():
    """What the GPU showed at batch 32, L=1.5: a step that drafts at all costs about 2.8 ms
    beyond its passes (the drafter's preparation and first pass, the rejection sampler), a
    pass about 1 ms. Fitted without that term, the passes absorbed it and budget 1 looked
    nearly free: SCV drafted budget 1 in a third of the steps and ran at 0.86x of plain
    decoding. The fit to the steps such a policy sees must keep the batch plain, as the true
    cost does. (At one batch size a step's own cost and a higher cost of its first tokens are
    one column; the steps come from two.)"""
    true_cost = StepCost(0.0055, 1.3e-5, 1e-3, 0, 0, 2.8e-3)
    model = StepCostModel(window=256, min_steps=10, refit_interval=16)
    rng = np.random.default_rng(0)
    for _ in range(256):  # mostly budget 0 and 1, sometimes an exploration up to 3
        budget = int(rng.choice(4, p=[0.6, 0.3, 0.05, 0.05]))
        n = int(rng.choice([1, 32]))
        model.observe(n, n * (1 + budget), budget,
                      true_cost.seconds(n, n * (1 + budget), budget, False))
    rates = np.full(32, 0.45)
    assert not choose_sizes(rates, 8, true_cost).any()
    assert not choose_sizes(rates, 8, model.coefficients).any()
    assert model.coefficients.drafting == pytest.approx(2.8e-3, rel=0.05)


def test_a_plan_is_priced_as_run_step_after_step_where_an_interval_holds_the_next_step():
    """What the GPU showed at batch 1, L=1.5 (async scheduling, the host the bound): the
    interval between two outputs held much of the next step's preparation. The plain step
    before a probe took 8.9 ms, the probe 4.7 and the step verifying it 3.8, against 4.95 for
    a plain step; fitted to each step's own terms, a step verifying one draft and drafting
    one, 7.3 ms one after another, was priced at 6.6, and SCV drafted where plain decoding
    was faster. Here each interval holds 30% of its step's cost and 70% of the next one's;
    the steps are mostly plain, with short stretches at chunk 1 (as probes make) that begin
    by catching the draft up. A plan run step after step is priced at what it costs (fitted
    to each step's own terms, chunk 1 was priced at 0.79-0.80 of it)."""
    true_cost = StepCost(4.9e-3, 2e-5, 1.2e-3, 0, 0, 1.1e-3, catching_up=6e-4,
                         per_caught_up=2e-6)
    rng = np.random.default_rng(0)
    plans = []  # each step's (tokens, budget, positions caught up)
    while len(plans) < 800:
        plain = int(rng.integers(5, 30))
        plans += [(1, 0, 0)] * plain
        plans += [(1, 1, plain)] + [(2, 1, 0)] * int(rng.integers(0, 3)) + [(2, 0, 0)]
    costs = [true_cost.seconds(1, *plan[:2], False, plan[2]) for plan in plans]
    model = StepCostModel(window=256, min_steps=10, refit_interval=16)
    for step, (tokens, budget, caught_up) in enumerate(plans[:-1]):
        interval = 0.3 * costs[step] + 0.7 * costs[step + 1]
        model.observe(1, tokens, budget, interval, False, caught_up)
    for tokens, budget in ((1, 0), (2, 1)):
        assert model.coefficients.seconds(1, tokens, budget, False) == pytest.approx(
            true_cost.seconds(1, tokens, budget, False), rel=0.02), (tokens, budget)


def test_a_step_is_paired_only_with_the_step_right_after_it():
    model = StepCostModel(window=16, min_steps=1)
    model.observe(1, 1, 0, 0.005)
    model.interrupt()  # a step between them was not observed
    model.observe(1, 2, 1, 0.007)
    assert model.steps == 0
    model.observe(1, 2, 1, 0.007)
    assert model.steps == 1
    policy = ChunkPolicy(ScvSettings("adaptive", K, 16, acceptance_window=16), model)
    policy.observe_step(1, 1, 0, 0.0, verified=0)  # no time measured: not a step either
    policy.observe_step(1, 1, 0, 0.005, verified=0)
    assert model.steps == 1


def test_nonnegative_least_squares_finds_the_best_support():
    """Against every support tried in turn (what the fit did before): the same residual."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows, columns = int(rng.integers(8, 60)), int(rng.integers(1, 8))
        x = rng.uniform(0, 1, (rows, columns)) * rng.uniform(0.01, 100, columns)
        y = x @ rng.uniform(-1, 1, columns) + rng.normal(0, 0.1, rows)
        weights = rng.uniform(0.1, 1, rows)
        best = np.inf
        for mask in range(1 << columns):
            support = [c for c in range(columns) if mask >> c & 1]
            theta = np.zeros(columns)
            if support:
                theta[support] = np.linalg.lstsq(
                    x[:, support] * np.sqrt(weights)[:, None], y * np.sqrt(weights),
                    rcond=None)[0]
            if (theta >= 0).all():
                best = min(best, float(weights @ (x @ theta - y) ** 2))
        theta = nonnegative_least_squares(x, y, weights)
        assert (theta >= 0).all()
        assert float(weights @ (x @ theta - y) ** 2) == pytest.approx(best, rel=1e-6, abs=1e-9)


def test_nonnegative_least_squares_from_a_start_ends_at_the_same_fit():
    """The cost model starts each fit from the terms the last one kept: from a start that fits
    (the best support), one that does not (a term the best fit drops) and one that misses
    terms, the fit is the one found from none."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        rows, columns = int(rng.integers(20, 80)), int(rng.integers(2, 10))
        x = rng.uniform(0, 1, (rows, columns)) * rng.uniform(0.01, 100, columns)
        y = x @ (rng.uniform(-1, 1, columns) * (rng.random(columns) < 0.7))
        y = y + rng.normal(0, 0.05, rows)
        weights = rng.uniform(0.1, 1, rows)
        cold = nonnegative_least_squares(x, y, weights)
        for start in (cold > 0, ~(cold > 0), rng.random(columns) < 0.5):
            warm = nonnegative_least_squares(x, y, weights, start=start)
            assert warm == pytest.approx(cold, rel=1e-7, abs=1e-12)


def best_term(bars: np.ndarray, rate: float) -> float:
    """A request's best term of the early exit (``planner.drafts_can_win``) at ``rate``."""
    gain = np.cumsum(rate ** np.arange(len(bars)))
    return float(np.max(1 - bars[1:, 1:] / gain[None, 1:]))


def test_rate_floor_of_the_early_exit_is_safe_and_close():
    """Below the rate ``bars_at`` gives, no request's term of the early exit is positive (every
    batch of such requests is kept at chunk 0 without the search); a little above it, one is."""
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(1, 300))
        cost = StepCost(*rng.uniform(0, 1e-2, 2) * [1, 1e-4],
                        *rng.uniform(0, 2e-3, 2) * [1, 1e-2], rng.choice([0.0, 2e-3]),
                        *rng.uniform(0, 2e-3, 3) * [1, 1, 1e-4],
                        *rng.uniform(0, 5e-5, 4) * (rng.random(4) < 0.5))
        bars, floor = planner.bars_at(n, 8, cost, rng.choice([None, 96, 512]),
                                      bool(rng.random() < .3))
        assert best_term(bars, floor) < -1e-9
        if floor < 1 - 1e-4:
            assert best_term(bars, floor + 1e-4) > -1e-6
            checked += 1
    assert checked > 100


def test_cost_model_learns_that_a_token_costs_less_in_a_larger_step():
    """A forward over few tokens is bound by memory, over many by compute: on the H200 a plain
    step cost about 0.04 ms more per request from batch 1 to 128, and a step of 1,152 tokens
    about 0.025 ms per token. One cost per token, fitted over all steps, priced a plain step at
    batch 32 too high and drafting steps about right, so that drafting looked cheaper than it
    is. With the cost per token falling at 16, 64, 256 and 1,024 tokens, the fit prices both."""

    def true_seconds(n, tokens, budget):
        return 1e-3 * (5.0 + 0.04 * min(tokens, 256) + 0.022 * max(tokens - 256, 0)
                       + (budget > 0) * (0.7 + 0.35 * budget))

    model = StepCostModel(window=256, min_steps=10, refit_interval=16)
    for n in (1, 32, 128):
        for budget in range(9):
            for _ in range(20):
                model.observe(n, n * (1 + budget), budget,
                              true_seconds(n, n * (1 + budget), budget))
    cost = model.coefficients
    for n in (1, 32, 128):
        for budget in (0, 1, 2, 8):
            tokens = n * (1 + budget)
            assert cost.seconds(n, tokens, budget, False) == pytest.approx(
                true_seconds(n, tokens, budget), rel=0.01), (n, budget)
    assert cost.per_token_at(32) == pytest.approx(4e-5, rel=0.01)
    assert cost.per_token_at(512) == pytest.approx(2.2e-5, rel=0.01)


def test_cost_model_ignores_a_rare_slow_step():
    true_cost = StepCost(0.004, 2e-5, 8e-4, 3e-6, 1e-3, 2e-3)
    model = StepCostModel(window=1000, min_steps=10)
    for i, (requests, tokens, budget, seconds, off) in enumerate(random_steps(true_cost, 200)):
        model.observe(requests, tokens, budget, seconds * (20 if i % 50 == 7 else 1), off)
    assert model.coefficients.fixed == pytest.approx(0.004, rel=0.1)


def compute_bound_policy(probe_interval=4, probe_cost=1.0):
    """A policy whose cost model has learnt a compute-bound engine (1 ms per verified token);
    shared probe steps may take any share of its time unless ``probe_cost`` says otherwise."""
    cost = StepCostModel(window=1000, min_steps=1)
    for band in range(8):  # every band of concurrency up to 255 requests
        for step in random_steps(StepCost(0.002, 1e-3, 0, 1e-5, 0), 20, seed=band,
                                 requests=(1 << band, 2 << band)):
            cost.observe(*step)
    settings = ScvSettings("adaptive", K, probe_interval, acceptance_window=16,
                           probe_cost=probe_cost)
    return ChunkPolicy(settings, cost)


def verify(policy, req, plan, accept_all):
    size = plan[req]
    policy.observe([SpecChunk(req, tuple(range(size)), 10, size if accept_all else 0)])


def test_a_rejected_request_drops_to_chunk_zero_and_probes_back():
    policy = compute_bound_policy(probe_interval=4)
    engine = TimedSteps(policy)
    sizes, probes, good = [], [], []
    for step in range(120):
        plan = engine.step(["bad", "good"])
        sizes.append(plan["bad"])
        good.append(plan["good"])
        probes.append("bad" in policy.probes)
        recovered = step >= 60
        verify(policy, "bad", plan, accept_all=recovered)
        verify(policy, "good", plan, accept_all=True)
    first = sizes[:60]
    assert first[-20:].count(0) >= 18, first  # converged to plain decoding
    assert any(probes[:60]), "a request at chunk 0 must be probed"
    assert sizes[-10:].count(K) >= 7, sizes[60:]  # came back once the probes were accepted
    assert good.count(K) >= 100  # but for warm-up and exploring a nearby plan now and then


def test_failed_probes_back_off():
    policy = compute_bound_policy(probe_interval=2)
    engine = TimedSteps(policy)
    attempts = []
    for step in range(200):
        plan = engine.step(["bad"])
        if plan["bad"]:
            attempts.append(step)
        verify(policy, "bad", plan, accept_all=False)
    assert np.diff(attempts[-5:]).min() >= 8  # no longer retried every other step
    assert len(attempts) < 30


def test_probes_keep_their_clock_when_the_estimator_is_replaced():
    """The benchmarks' warm-up ends with a fresh estimator (its verdicts are not the
    workload's); shared probes must still come every ``probe_interval`` steps after it."""
    interval = 4
    policy = compute_bound_policy(probe_interval=interval)
    engine = TimedSteps(policy)
    for _ in range(200):  # a long warm-up that probes a rejecting request
        plan = engine.step(["warm"])
        verify(policy, "warm", plan, accept_all=False)
    policy.forget("warm")
    policy.acceptance = AcceptanceEstimator(policy.settings.acceptance_window)
    probed = []
    for step in range(60):
        plan = engine.step(["bad"])
        if "bad" in policy.probes:
            probed.append(step)
        verify(policy, "bad", plan, accept_all=False)
    assert probed and probed[0] <= 2 * interval, probed


def test_probes_are_gathered_on_shared_steps():
    """Requests joining one after the other, never accepting: their probes fall on shared
    steps, so most steps draft nothing for the whole batch."""
    interval = 8
    policy = compute_bound_policy(probe_interval=interval)
    engine = TimedSteps(policy)
    drafting_steps = []
    for step in range(240):
        batch = [f"r{i}" for i in range(min(step + 1, 24))]
        plan = engine.step(batch)
        if policy.draft_budget() > 0:
            drafting_steps.append(step)
        for req in batch:
            verify(policy, req, plan, accept_all=False)
    late = [s for s in drafting_steps if s >= 120]
    assert late, "requests at chunk 0 must still be probed"
    assert len(late) <= 120 // interval + 1, late


class TimedSteps:
    """Plans a policy's steps and observes each as taking what the policy's cost model says,
    plus ``probe_surcharge`` seconds on a step planned to learn (a shared probe step; a random
    plan where the model prices nothing yet): a cost the model does not price, as a draft
    catch-up is not. With the scheduler's bookkeeping (``patches/scheduler.py``), such a step
    and the next are observed as learning. ``extra`` sums the seconds the steps took over
    plain steps, ``plain`` the plain steps' seconds, ``largest_probe`` is the most one
    learning step and the next took over plain steps."""

    def __init__(self, policy, probe_surcharge=0.0):
        self.policy, self.surcharge = policy, probe_surcharge
        self.cost = policy.cost.coefficients
        self.extra = self.plain = 0.0
        self.learning_steps = 0
        self.largest_probe = self._this_probe = 0.0
        self._before = False

    def step(self, req_ids):
        policy, n = self.policy, len(req_ids)
        plan = policy.plan(req_ids)
        budget = policy.draft_budget()
        tokens = n + sum(plan.values())
        uniform = len(set(plan.values())) == 1
        plain = self.cost.seconds(n, n, 0, False)
        seconds = self.cost.seconds(n, tokens, budget, not uniform)
        if policy.learning_step:
            seconds += self.surcharge
            self.learning_steps += 1
        self.plain += plain
        self.extra += seconds - plain
        if policy.learning_step:
            self._this_probe = seconds - plain
        elif self._before:
            self._this_probe += seconds - plain
            self.largest_probe = max(self.largest_probe, self._this_probe)
        policy.observe_step(n, tokens, budget, seconds, uniform,
                            learning=policy.learning_step or self._before, verified=tokens - n)
        self._before = policy.learning_step
        return plan


def run_never_accepting(policy, batch, steps, probe_surcharge=0.0):
    """``batch`` requests that never accept, for ``steps`` :class:`TimedSteps`."""
    engine = TimedSteps(policy, probe_surcharge)
    batch_ids = [f"r{i}" for i in range(batch)]
    for _ in range(steps):
        plan = engine.step(batch_ids)
        for req in batch_ids:
            verify(policy, req, plan, accept_all=False)
    return engine


@pytest.mark.parametrize("batch", [1, 24])
def test_shared_probe_steps_cost_at_most_their_share(batch):
    """Nobody accepts: the steps that draft only to probe cost at most probe_cost of the time,
    give or take the last probe, and still come."""
    share = 0.01
    policy = compute_bound_policy(probe_interval=4, probe_cost=share)
    run = run_never_accepting(policy, batch, 2000)
    assert run.learning_steps >= 2
    assert 0 < run.extra <= share * (run.plain + run.extra) + run.largest_probe


def test_probe_steps_pay_what_they_measured_not_what_the_model_says():
    """A shared probe step costs five plain steps more than the cost model prices (on the
    GPU a probe step at batch 128 also caught the draft up over every skipped position and
    took 23 ms against 10 ms): the ledger pays the measured time, so probes still take at
    most probe_cost of it, give or take one probe step, and still come. Priced by the model
    alone they took several times their share."""
    share, batch = 0.01, 24
    policy = compute_bound_policy(probe_interval=4, probe_cost=share)
    surcharge = 5 * policy.cost.coefficients.seconds(batch, batch, 0, False)
    run = run_never_accepting(policy, batch, 3000, surcharge)
    assert run.learning_steps >= 2
    assert run.largest_probe > surcharge
    assert run.extra <= share * (run.plain + run.extra) + run.largest_probe, (
        run.extra / (run.plain + run.extra))


def test_a_learning_step_owes_what_its_drafts_cost_not_its_prompt_tokens():
    """What the GPU showed at batch 128: random plans of the warm-up fell on steps that also
    ran 16,000 prompt tokens (360-400 ms each); priced against a plain decode step, the three
    owed the ledger 1.1 s, which the engine repays at 1% of its time, and no shared probe came
    for the rest of the benchmark. Priced against the same step without drafts, such a step
    owes what drafting cost it, and shared probes come again soon after."""
    policy = compute_bound_policy(probe_interval=4, probe_cost=0.01)
    cost = policy.cost.coefficients
    n, prompt_tokens, budget = 40, 16_000, 3
    tokens = n + prompt_tokens
    seconds = cost.seconds(n, tokens, budget, True)
    policy.observe_step(n, tokens, budget, seconds, uniform=False, learning=True, verified=0)
    assert policy.learning_excess[1] == pytest.approx(
        seconds - cost.seconds(n, tokens, 0, True), rel=1e-6)
    run = run_never_accepting(policy, n, 400)
    assert run.learning_steps >= 2


def test_a_learning_steps_counterpart_replays_the_graphs_its_step_could():
    """With vLLM's cudagraph_mode FULL a step with prompt tokens replays a FULL graph too, so
    the same step without drafts is priced on the graphs, as the step itself is."""
    cost = StepCostModel(min_steps=1)
    for step in random_steps(StepCost(0.002, 1e-4, 0, 1e-5, 0.003, 0.001), 200,
                             requests=(32, 64)):
        cost.observe(*step)
    policy = ChunkPolicy(ScvSettings("adaptive", K, 4, 16, max_graph_tokens=512,
                                     mixed_graphs=True), cost)
    fit = cost.coefficients
    assert fit.off_graph > 0
    n, tokens = 40, 140  # 100 prompt tokens, no drafts verified: unequal, within the graphs
    seconds = fit.seconds(n, tokens, 2, False)
    policy.observe_step(n, tokens, 2, seconds, uniform=False, learning=True, verified=0)
    assert policy.learning_excess[1] == pytest.approx(
        seconds - fit.seconds(n, tokens, 0, False), rel=1e-6)


def test_random_plans_where_nothing_is_priced_are_paid_from_the_ledger():
    """The cost model prices batches of 128-255 requests only, and the batch drains to 40
    (the end of a run at batch 256 on the GPU). Random plans there are learning steps: the
    first one puts the ledger in debt (it costs five plain steps more than the model says, as
    a catch-up over skipped positions did), and until the 40-request batch's own steps price
    it the policy plans from the fit. Without the ledger every one of those steps was random."""
    cost = StepCostModel(window=1000, min_steps=32)
    for step in random_steps(StepCost(0.002, 1e-3, 0, 1e-5, 0), 64, requests=(128, 256)):
        cost.observe(*step)
    policy = ChunkPolicy(ScvSettings("adaptive", K, 4, 16, probe_cost=0.01), cost)
    assert policy.cost.priced() and not policy.cost.ready(40)
    surcharge = 5 * policy.cost.coefficients.seconds(40, 40, 0, False)
    run = run_never_accepting(policy, 40, 200, surcharge)
    assert policy.cost.ready(40)
    assert 1 <= policy.unpriced_plans <= 3, policy.unpriced_plans
    assert run.extra <= 0.01 * (run.plain + run.extra) + run.largest_probe


def test_a_random_plan_that_drafts_nothing_owes_nothing():
    """Random plans at a concurrency the model does not price are learning steps only where
    they draft: on the H200 a warm-up step planned at budget 0 took 786 ms where 350 were
    priced, owed the ledger 0.4 s, and no shared probe came through six cells after it."""
    cost = StepCostModel(window=1000, min_steps=32)
    for step in random_steps(StepCost(0.002, 1e-3, 0, 1e-5, 0), 64, requests=(128, 256)):
        cost.observe(*step)
    policy = ChunkPolicy(ScvSettings("adaptive", K, 4, 16), cost)
    batch = [f"r{i}" for i in range(40)]
    drafting = set()
    for _ in range(30):
        plan = policy.plan(batch)
        assert policy.learning_step == any(plan.values())
        drafting.add(policy.learning_step)
    assert drafting == {False, True} and policy.unpriced_plans == 30


def test_one_slow_learning_step_owes_what_its_neighbours_did():
    """A learning step slowed by something of its own (a host pause, a compile) owes what the
    learning steps before it took over their price, not its own delay; the same surcharge on
    every learning step counts in full
    (test_probe_steps_pay_what_they_measured_not_what_the_model_says)."""
    policy = compute_bound_policy(probe_interval=4, probe_cost=0.01)
    cost = policy.cost.coefficients
    n, budget = 40, 2
    price = cost.seconds(n, n + n * budget, budget, True)  # no graphs in this engine
    owed = price - cost.seconds(n, n, 0, True)  # its drafts over the same step without them
    for delay in (0.001, 0.002, 0.4):
        policy.observe_step(n, n + n * budget, budget, price + delay, learning=True,
                            verified=n * budget)
    assert policy.learning_excess[0] == 3
    assert policy.learning_excess[1] == pytest.approx(3 * owed + 0.001 + 0.0015 + 0.002)


def test_fixed_mode_verifies_full_chunks():
    fixed = ChunkPolicy(ScvSettings("fixed", 2, 4, 4))
    assert fixed.plan(["a", "b"]) == {"a": 2, "b": 2} and fixed.draft_budget() == 2
    assert fixed.drafts_asked() == 2 and fixed.cuts() == []  # the drafter proposes 2


def test_a_drafter_that_proposes_all_k_is_asked_for_k_and_every_shorter_chunk_cut():
    """ngram_gpu proposes k drafts whatever it is asked (ScvSettings.drafter_proposes)."""
    fixed = ChunkPolicy(ScvSettings("fixed", 2, 4, 4, drafter_proposes=3))
    assert fixed.plan(["a", "b"]) == {"a": 2, "b": 2} and fixed.draft_budget() == 2
    assert fixed.drafts_asked() == 3 and fixed.cuts() == [("a", 2), ("b", 2)]
    assert fixed.uniform_plans == 1  # every request got the same chunk


def test_warm_up_explores_budgets_and_chunks():
    cold = ChunkPolicy(ScvSettings("adaptive", K, 4, 4))  # no step times yet
    budgets, sizes = set(), set()
    for _ in range(50):
        plan = cold.plan(["a", "b", "c"])
        assert all(0 <= size <= cold.draft_budget() <= K for size in plan.values())
        assert cold.draft_budget() == max(plan.values())
        budgets.add(cold.draft_budget())
        sizes |= set(plan.values())
    assert budgets == sizes == set(range(K + 1))


def test_draft_budget_is_the_longest_chunk():
    policy = compute_bound_policy()
    for _ in range(10):
        verify(policy, "bad", {"bad": 4}, accept_all=False)
        verify(policy, "good", {"good": 4}, accept_all=True)
    plan = policy.plan(["bad", "good"])
    assert policy.draft_budget() == max(plan.values()) == K


def test_request_table_grows_and_reuses_the_rows_of_forgotten_requests():
    table = RequestTable(count=0, wait=4)
    ids = [f"r{i}" for i in range(40)]  # past the first capacity (16)
    rows = table.rows(ids)
    assert sorted(rows.tolist()) == list(range(40)) and len(table) == 40
    table.columns["count"][rows] = np.arange(40)
    assert table.columns["count"][table.rows(["r7", "r39"])].tolist() == [7, 39]  # kept
    table.forget("r7")
    assert "r7" not in table and len(table) == 39
    row = table.rows(["new"])[0]
    assert row == rows[7]  # the freed row, back at its defaults
    assert table.columns["count"][row] == 0 and table.columns["wait"][row] == 4


def test_rate_bound_is_at_least_every_rate():
    """The policy keeps a batch at chunk 0 from the bound alone where it is below the rate
    floor, so it must hold for every state: requests with verdicts old and new, without any,
    forgotten, and batches of which no request has a whole observation left."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        estimator = AcceptanceEstimator(int(rng.integers(1, 40)))
        ids = [f"r{i}" for i in range(int(rng.integers(1, 40)))]
        for _ in range(int(rng.integers(1, 80))):
            estimator.tick()
            judged = [r for r in ids if rng.random() < 0.3]
            if judged:
                sizes = rng.integers(1, 9, len(judged))
                estimator.observe_many(judged, sizes, rng.integers(0, sizes + 1))
            if rng.random() < 0.05:
                estimator.forget(ids[int(rng.integers(len(ids)))])
            batch = [r for r in ids if rng.random() < 0.7] or ids[:1]
            assert estimator.rate_bound(batch) >= estimator.rates(batch).max() - 1e-12


def test_request_table_answers_again_from_its_last_lookup_until_a_request_goes():
    """A step looks its batch up several times; the answer is kept, read-only, and not kept
    past a forgotten request (whose row the next new request takes)."""
    table = RequestTable(count=0)
    ids = ["a", "b", "c"]
    first = table.rows(ids)
    assert table.rows(list(ids)) is first and not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 5
    table.columns["count"][first] = [1, 2, 3]
    table.forget("b")
    again = table.rows(ids)  # b comes back: a row of defaults (its old one, freed)
    assert again.tolist() == first.tolist() and table.columns["count"][again].tolist() == [1, 0, 3]
    table.forget("b")
    assert table.rows(["a", "new", "c"]).tolist() == first.tolist()  # "new" took b's row
    assert table.rows(["x", "x"]).tolist() == [3, 3]  # one row for a request named twice


def test_settings_are_checked():
    with pytest.raises(ValueError):
        ScvSettings("sometimes", K, 4, 4)
    with pytest.raises(ValueError):
        ScvSettings("adaptive", K, 0, 4)


def test_plan_chunk_zero_holds_every_request_at_zero_without_choosing():
    """The benchmarks' ``plan`` ablation: a plan of zeros, the budget and cuts cleared, the
    policy's own choice never made."""
    policy = ChunkPolicy(ScvSettings("adaptive", K, 4, 16))
    policy._choose = lambda req_ids, rows, remaining: np.array([2, 1])
    policy.plan(["a", "b"])
    assert policy.draft_budget() == 2 and policy.current_plan() == {"a": 2, "b": 1}

    def never(*args):
        raise AssertionError("plan_chunk_zero must not choose")

    policy._choose = never
    assert policy.plan_chunk_zero(["a", "b"]) == {"a": 0, "b": 0}
    assert policy.draft_budget() == 0 and policy.cuts() == []
