"""Per-request synthetic acceptance (benchmark feature): only ever rejects, never accepts."""

from __future__ import annotations

import pytest
import torch

from vllm_nwor.synthetic import rate_at, thin_acceptance, thin_counts


@pytest.mark.parametrize(
    "spec, tokens, expected",
    [
        (None, 5, 1.0),
        (0.25, 5, 0.25),
        (1.7, 0, 1.0),  # clipped
        ([[0, 0.0], [40, 1.0]], 39, 0.0),
        ([[0, 0.0], [40, 1.0]], 40, 1.0),
        ([[10, 0.5]], 3, 1.0),  # before the first entry: untouched
    ],
)
def test_rate_at(spec, tokens, expected):
    assert rate_at(spec, tokens) == expected


def test_rate_one_changes_nothing_and_rate_zero_keeps_only_the_first_token():
    sampled = torch.tensor([[5, 6, 7, 8], [5, 6, -1, -1], [9, -1, -1, -1]])
    assert torch.equal(thin_acceptance(sampled, torch.ones(3)), sampled)
    thinned = thin_acceptance(sampled, torch.zeros(3))
    assert thinned.tolist() == [[5, -1, -1, -1], [5, -1, -1, -1], [9, -1, -1, -1]]


def test_thinning_keeps_a_prefix_of_what_the_sampler_emitted():
    torch.manual_seed(0)
    sampled = torch.randint(0, 100, (2000, 5))
    lengths = torch.randint(1, 6, (2000, 1))  # what the sampler emitted: a prefix per row
    sampled[torch.arange(5)[None, :] >= lengths] = -1
    thinned = thin_acceptance(sampled, torch.full((2000,), 0.5))
    kept = thinned != -1
    assert torch.equal(thinned[kept], sampled[kept])  # tokens never change
    assert bool((kept[:, 0]).all())  # the first token always stays
    assert bool((kept[:, 1:] <= kept[:, :-1]).all())  # a prefix
    assert bool((kept.sum(1) <= (sampled != -1).sum(1)).all())  # never accepts more
    full = lengths.flatten() == 5
    accepted = (kept[full].sum(1) - 1).float()  # drafts kept where the sampler accepted all 4
    assert 0.85 < accepted.mean() < 1.05  # 0.5 + 0.25 + 0.125 + 0.0625 = 0.94


def test_v2_counts_rate_one_changes_nothing_and_rate_zero_moves_every_accepted_draft_to_rejected():
    # V2's verdict: 3 drafts accepted of 3, 1 of 3 (2 rejected), nothing sampled (a prompt chunk)
    num_sampled, num_rejected = torch.tensor([4, 2, 0]), torch.tensor([0, 2, 0])
    thin_counts(num_sampled, num_rejected, torch.ones(3), max_drafts=3)
    assert (num_sampled.tolist(), num_rejected.tolist()) == ([4, 2, 0], [0, 2, 0])
    thin_counts(num_sampled, num_rejected, torch.zeros(3), max_drafts=3)
    assert (num_sampled.tolist(), num_rejected.tolist()) == ([1, 1, 0], [3, 3, 0])


def test_v2_counts_keep_each_accepted_draft_with_its_requests_rate_given_the_ones_before():
    n = 20_000
    generator = torch.Generator().manual_seed(0)
    num_sampled = torch.full((n,), 5, dtype=torch.int32)  # 4 of 4 drafts accepted
    num_rejected = torch.zeros(n, dtype=torch.int32)
    rates = torch.tensor([0.5, 0.9]).repeat(n // 2)
    thin_counts(num_sampled, num_rejected, rates, max_drafts=4, generator=generator)
    accepted = (num_sampled - 1).float()
    assert torch.all(num_sampled + num_rejected == 5)  # drafts moved, none made or lost
    for rate, mean in ((0.5, accepted[0::2].mean()), (0.9, accepted[1::2].mean())):
        expected = sum(rate ** j for j in range(1, 5))  # E[kept of 4] with rate a each
        assert float(mean) == pytest.approx(expected, rel=0.03)
