"""The survival plan (vllm_nwor.scv.survival): per-position acceptance, and the chunks that
maximise a step's expected tokens per second, checked against every plan of small batches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_nwor.scv.survival import PositionAcceptance, StepTable, plan_chunks


def table(k: int, per_pass: float, per_token: float, fixed: float = 1.0,
          tokens: int = 256) -> StepTable:
    return StepTable(draft=per_pass * np.arange(k + 1),
                     verify=fixed + per_token * np.arange(tokens + 1))


def value(chunks, survival, step: StepTable, plain: int) -> float:
    n = len(chunks)
    made = n + sum(survival[i, :c].sum() for i, c in enumerate(chunks))
    return made / float(step.seconds(max(chunks), plain + sum(chunks)))


def survival_of(rates: list[list[float]]) -> np.ndarray:
    return np.cumprod(np.array(rates), axis=1)


def test_no_drafts_where_they_cost_more_than_they_make():
    survival = survival_of([[0.1, 0.1, 0.1]] * 4)
    assert plan_chunks(survival, table(3, per_pass=0.5, per_token=0.01), 4).tolist() == [0] * 4


def test_every_draft_where_drafts_are_cheap_and_accepted():
    survival = survival_of([[0.99, 0.99, 0.99]] * 4)
    chunks = plan_chunks(survival, table(3, per_pass=0.01, per_token=0.001), 4)
    assert chunks.tolist() == [3] * 4


def test_a_mixed_batch_drafts_for_the_requests_that_accept():
    survival = survival_of([[0.95] * 4, [0.05] * 4, [0.95] * 4, [0.05] * 4])
    chunks = plan_chunks(survival, table(4, per_pass=0.05, per_token=0.02), 4)
    assert chunks[[1, 3]].tolist() == [0, 0] and chunks[[0, 2]].min() >= 2


def test_limits_cap_each_requests_chunk():
    survival = survival_of([[0.99] * 3] * 3)
    chunks = plan_chunks(survival, table(3, per_pass=0.01, per_token=0.001), 3,
                         limits=np.array([0, 1, 3]))
    assert chunks.tolist() == [0, 1, 3]


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    survival = np.cumprod(rng.uniform(0.0, 1.0, (n, k)), axis=1)
    step = StepTable(draft=np.concatenate(([0.0], np.cumsum(rng.uniform(0, 0.3, k)))),
                     verify=np.maximum.accumulate(1.0 + rng.uniform(0, 0.2, 64).cumsum()))
    return rng, n, k, survival, step


@pytest.mark.parametrize("seed", range(40))
def test_a_decoding_step_gets_the_plan_of_the_highest_rate_of_all(seed):
    _, n, k, survival, step = random_case(seed)
    chunks = plan_chunks(survival, step, n)
    best = max(value(c, survival, step, n) for c in itertools.product(range(k + 1), repeat=n))
    assert value(chunks, survival, step, n) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_a_step_with_prompts_gets_the_most_tokens_less_the_steady_rates_worth_of_its_seconds(
        seed):
    rng, n, k, survival, step = random_case(seed)
    plain = n + int(rng.integers(1, 30))  # prompt chunks beside the decoding requests
    plans = list(itertools.product(range(k + 1), repeat=n))
    rate = max(value(c, survival, step, n) for c in plans)  # the requests decoding alone

    def net(chunks):
        made = n + sum(survival[i, :c].sum() for i, c in enumerate(chunks))
        return made - rate * float(step.seconds(max(chunks), plain + sum(chunks)))

    chunks = plan_chunks(survival, step, plain)
    assert net(chunks) == pytest.approx(max(map(net, plans)), rel=1e-9, abs=1e-12)


def test_prompts_beside_do_not_make_drafts_free():
    survival = survival_of([[0.7] * 4] * 8)
    step = table(4, per_pass=1.0, per_token=0.02)  # drafting does not pay while decoding
    assert plan_chunks(survival, step, 8).tolist() == [0] * 8
    assert plan_chunks(survival, step, 8 + 200).tolist() == [0] * 8  # nor beside 200 prompt


def test_a_chunk_is_accepted_up_to_its_first_rejection_and_unseen_after():
    acceptance = PositionAcceptance(max_chunk=3, window=10**9)  # nothing forgotten
    for _ in range(20):
        acceptance.observe_many(["a"], np.array([3]), np.array([1]))  # yes, no, unseen
    rates = acceptance.survival(["a"])[0]
    prior = 20.5 / 21  # the pool's, at position 1, worth one observation
    assert rates[0] == pytest.approx((20 + prior) / 21)
    assert rates[1] / rates[0] < 0.05
    # position 3 was never verified: its rate is the pool's over all positions (20 of 40)
    assert rates[2] / rates[1] == pytest.approx(0.5)


def test_a_request_at_chunk_zero_drifts_back_to_the_prior():
    acceptance = PositionAcceptance(max_chunk=2, window=4)
    for _ in range(8):  # a request that rejects, among requests that accept
        acceptance.observe_many(["low", "high"], np.array([2, 2]), np.array([0, 2]))
        acceptance.tick()
    low = acceptance.survival(["low"])[0, 0]
    for _ in range(32):  # then verifies nothing, while the others go on accepting
        acceptance.observe_many(["high"], np.array([2]), np.array([2]))
        acceptance.tick()
    assert acceptance.survival(["low"])[0, 0] > 0.8 > 0.2 > low


def test_forgotten_requests_start_from_the_prior():
    acceptance = PositionAcceptance(max_chunk=2, window=16)
    acceptance.observe_many(["a"], np.array([2]), np.array([0]))
    acceptance.forget("a")
    assert acceptance.survival(["b"])[0].tolist() == acceptance.survival(["a"])[0].tolist()
