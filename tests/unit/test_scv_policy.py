"""SCV's chunk-size policy, table-driven (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_nwor.scv import (
    AcceptanceEstimator,
    ChunkPolicy,
    ScvSettings,
    SpecChunk,
    StepCostModel,
    choose_sizes,
    expected_tokens,
)

K = 4

# Cost regimes, per step: (fixed s, s per scheduled token, s per proposed draft), and the batch.
BATCH_1 = (0.006, 2e-6, 5e-4)  # memory-bound: extra verify rows nearly free, drafts cost launches
BATCH_128 = (0.008, 7e-5, 5e-6)  # compute-bound: every verify row costs real compute
DRAFT_HEAVY = (0.010, 2e-6, 2e-3)  # a drafter that costs a fifth of a target step per draft


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
        # A heterogeneous batch: each request gets its own chunk.
        (BATCH_128, [(0.95, 64), (0.05, 64)], [K, 0]),
        # An expensive drafter: it only runs when acceptance repays it.
        (DRAFT_HEAVY, [(0.3, 2)], [0]),
        (DRAFT_HEAVY, [(0.99, 2)], [K]),
    ],
)
def test_choose_sizes(regime, groups, expected):
    rates = np.concatenate([np.full(count, rate) for rate, count in groups])
    sizes = choose_sizes(rates, K, *regime)
    assert sizes.tolist() == [size for (_, count), size in zip(groups, expected, strict=True)
                              for _ in range(count)]


@pytest.mark.parametrize(
    "per_mixed, groups, expected",
    [
        # Batch 32, half accepting well, half not, and leaving the FULL graphs is free: each
        # request gets its own chunk.
        (0.0, [(0.95, 16), (0.1, 16)], [K, 0]),
        # ... costs a third of a step: every request verifies the same chunk (one FULL graph).
        (0.003, [(0.95, 16), (0.1, 16)], [K, K]),
        # Everyone alike: the sizes are uniform anyway; the mixed cost changes nothing.
        (0.003, [(0.95, 32)], [K]),
        (0.003, [(0.05, 32)], [0]),
    ],
)
def test_choose_sizes_counts_what_a_mixed_batch_costs(per_mixed, groups, expected):
    rates = np.concatenate([np.full(count, rate) for rate, count in groups])
    sizes = choose_sizes(rates, K, 0.006, 5e-5, 5e-6, per_mixed)
    assert sizes.tolist() == [size for (_, count), size in zip(groups, expected, strict=True)
                              for _ in range(count)]


def plan_value(rates, sizes, fixed, per_token, per_draft, per_mixed=0.0) -> float:
    """Expected tokens per second of a plan under the cost model."""
    tokens = sum(expected_tokens(a, s) for a, s in zip(rates, sizes, strict=True))
    seconds = (fixed + per_token * (len(rates) + sum(sizes)) + per_draft * len(rates) * max(sizes)
               + per_mixed * (min(sizes) != max(sizes)))
    return tokens / seconds


@pytest.mark.parametrize("per_mixed", [0.0, 0.002])
def test_chosen_sizes_beat_every_uniform_size_under_the_model(per_mixed):
    rng = np.random.default_rng(0)
    for _ in range(50):
        rates = rng.uniform(0.01, 0.99, size=rng.integers(1, 64))
        costs = (rng.uniform(0.005, 0.02), rng.uniform(0, 5e-5), 1e-6, per_mixed)
        chosen = choose_sizes(rates, K, *costs).tolist()
        best_uniform = max(plan_value(rates, [c] * len(rates), *costs) for c in range(K + 1))
        assert plan_value(rates, chosen, *costs) >= 0.999 * best_uniform


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
    for _ in range(200):  # no observations for a long time: back to the uninformed prior
        estimator.tick()
    assert estimator.rate("newer") == pytest.approx(0.5, abs=0.01)


def test_cost_model_recovers_a_linear_step_time():
    model = StepCostModel(window=1000, min_steps=10)
    rng = np.random.default_rng(1)
    for _ in range(200):
        tokens, drafted = int(rng.integers(8, 600)), int(rng.integers(0, 512))
        mixed = bool(rng.integers(0, 2))
        model.observe(tokens, drafted, 0.004 + 2e-5 * tokens + 3e-6 * drafted + 1e-3 * mixed,
                      mixed)
    fixed, per_token, per_draft, per_mixed = model.coefficients
    assert model.ready
    assert fixed == pytest.approx(0.004, rel=0.05)
    assert per_token == pytest.approx(2e-5, rel=0.05)
    assert per_draft == pytest.approx(3e-6, rel=0.05)
    assert per_mixed == pytest.approx(1e-3, rel=0.05)


def compute_bound_policy(probe_interval=4):
    """A policy whose cost model has learnt a compute-bound engine (1 ms per verified token)."""
    cost = StepCostModel(window=1000, min_steps=1)
    for tokens, drafted in [(10, 0), (60, 40), (30, 12), (90, 25)]:
        cost.observe(tokens, drafted, 0.002 + 1e-3 * tokens + 1e-5 * drafted)
    settings = ScvSettings("adaptive", K, probe_interval, acceptance_window=16)
    return ChunkPolicy(settings, cost)


def verify(policy, req, plan, accept_all):
    size = plan[req]
    policy.observe([SpecChunk(req, tuple(range(size)), 10, size if accept_all else 0)])


def test_a_rejected_request_drops_to_chunk_zero_and_probes_back():
    policy = compute_bound_policy(probe_interval=4)
    sizes, probes = [], []
    for step in range(120):
        plan = policy.plan(["bad", "good"])
        sizes.append(plan["bad"])
        probes.append("bad" in policy._probes)
        recovered = step >= 60
        verify(policy, "bad", plan, accept_all=recovered)
        verify(policy, "good", plan, accept_all=True)
    assert plan["good"] == K
    first = sizes[:60]
    assert first[-20:].count(0) >= 18, first  # converged to plain decoding
    assert any(probes[:60]), "a request at chunk 0 must be probed"
    assert sizes[-1] == K, sizes[60:]  # came back once the probes were accepted


def test_failed_probes_back_off():
    policy = compute_bound_policy(probe_interval=2)
    attempts = []
    for step in range(200):
        plan = policy.plan(["bad"])
        if plan["bad"]:
            attempts.append(step)
        verify(policy, "bad", plan, accept_all=False)
    assert np.diff(attempts[-5:]).min() >= 8  # no longer retried every other step
    assert len(attempts) < 30


def test_probes_are_gathered_on_shared_steps():
    """Requests joining one after the other, never accepting: their probes fall on shared
    steps, so most steps draft nothing for the whole batch."""
    interval = 8
    policy = compute_bound_policy(probe_interval=interval)
    drafting_steps = []
    for step in range(240):
        batch = [f"r{i}" for i in range(min(step + 1, 24))]
        plan = policy.plan(batch)
        if policy.draft_budget() > 0:
            drafting_steps.append(step)
        for req in batch:
            verify(policy, req, plan, accept_all=False)
    late = [s for s in drafting_steps if s >= 120]
    assert late, "requests at chunk 0 must still be probed"
    assert len(late) <= 120 // interval + 1, late


def test_fixed_mode_verifies_full_chunks():
    fixed = ChunkPolicy(ScvSettings("fixed", 2, 4, 4))
    assert fixed.plan(["a", "b"]) == {"a": 2, "b": 2} and fixed.draft_budget() == 2


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


def test_settings_are_checked():
    with pytest.raises(ValueError):
        ScvSettings("sometimes", K, 4, 4)
    with pytest.raises(ValueError):
        ScvSettings("adaptive", K, 0, 4)
