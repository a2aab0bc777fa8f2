"""The V2 runner's verdict for NWOR's commit, on the CPU (the V2 runner itself needs a GPU).

vLLM's V2 rejection sampler leaves each request's entries past ``num_sampled`` uninitialised
where V1's are -1; ``model_runner_v2.verdict_ids`` puts V1's -1 there, so the commit accepts
draft ``j`` of a request exactly when ``j < num_sampled - 1``: its accepted prefix.
"""

from __future__ import annotations

import torch

from vllm_nwor.nwor.verify_step import VerifyStep
from vllm_nwor.patches.nwor.model_runner_v2 import verdict_ids


def test_the_commit_accepts_each_requests_prefix_of_num_sampled_minus_one():
    # Three requests with 3, 0 (a prefill chunk) and 2 drafts; k = 3 (4 columns).
    drafts = [3, 0, 2]
    query_start_loc = [0, 4, 20, 23]  # rows: 1 + 3, a 16-token chunk, 1 + 2
    step = VerifyStep.from_batch(drafts, query_start_loc, "cpu")
    num_sampled = torch.tensor([2, 0, 3], dtype=torch.int32)  # 1 accepted, none, 2 (all)
    garbage = 12345  # what V2 leaves past num_sampled: any value, never -1 on purpose
    sampled = torch.full((3, 4), garbage, dtype=torch.int64)
    sampled[0, :2] = torch.tensor([7, 8])
    sampled[2, :3] = torch.tensor([9, 10, 11])

    ids = verdict_ids(sampled, num_sampled)
    assert ids.tolist() == [[7, 8, -1, -1], [-1, -1, -1, -1], [9, 10, 11, -1]]
    verdict = step.verdict(ids, torch.zeros((), dtype=torch.int64))
    # request 0's drafts 0, 1, 2; request 2's drafts 0, 1
    assert verdict.accepted().tolist() == [True, False, False, True, True]
    # Read straight from V2's tensor, the garbage would have accepted every draft.
    raw = step.verdict(sampled, torch.zeros((), dtype=torch.int64))
    assert raw.accepted().all()
