"""The equivalence matrix on the CPU engine (benchmarks/equivalence.py): NWOR off vs on under
vLLM's defaults, prefix caching on, greedy tokens identical.

Each case is two engines in this process, one after the other, with the harness's workload:
shared-prefix prompts, chunked prefill beside verify steps, requests ending at ``max_tokens``
mid-chunk, stop token ids inside accepted drafts, two-round prompts that hit blocks NWOR
committed, requests that read from the prefix cache a block a drafting request completes in the
same step, and sampling at temperature 0.8 with ``n=3``. The NWOR-on run also audits the cache
after every step and checks its counters against vLLM's stats. The GPU matrix (same cases, same
code) is recorded under benchmarks/results/equivalence_gpu_*.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import equivalence  # noqa: E402

CPU_CASES = {case.name: case for case in equivalence.cases(on_cuda=False)}
RUN = ["defaults_draft_model", "defaults_ngram", "preemption", "block_size_32_k5",
       "two_engines_one_process", "structured_output"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("equivalence")
    return {name: equivalence.model_paths(CPU_CASES[name].model, root) for name in RUN}


@pytest.mark.parametrize("name", RUN)
def test_nwor_on_gives_vllms_tokens_under_vllms_defaults(models, name):
    case = CPU_CASES[name]
    row = equivalence.run_case(case, models[name], on_cuda=False, run=equivalence.run_engine)
    assert row["settings"]["enable_prefix_caching"], "vLLM's default"
    assert row["greedy_tokens_exact"], row["mismatches"]
    assert row["greedy_logprobs_exact"], "within 1e-3 (the CPU's staged attention is a reference)"
    assert row["checks_failed"] == [], row["checks_failed"]
    # What the workload claims to exercise, it did.
    assert row["hits_beside_verify"] > 0 and row["prefix_cache_hits"] > 0
    assert row["audit"]["rejected_drafts"] > 0 and row["audit"]["num_violations"] == 0


def test_the_comparison_fails_on_one_changed_token():
    """The negative control of the token check (the GPU matrix's is the bug put back: the
    plugin's commit before the fix, recorded as negative_controls)."""
    out = {"tokens": [[5, 6, 7]], "logprobs": [[-0.1, -0.2, -0.3]], "finish": ["length"],
           "stop": [None], "sampled": False}
    off = {"outputs": [out]}
    on = {"outputs": [out | {"tokens": [[5, 9, 7]]}]}
    assert equivalence.compare(off, off, 0.0)["exact"]
    result = equivalence.compare(off, on, 0.0)
    assert not result["exact"] and result["mismatches"] == [
        {"request": 0, "seq": 0, "first_difference": 1}]
    on = {"outputs": [out | {"logprobs": [[-0.1, -0.25, -0.3]]}]}
    assert not equivalence.compare(off, on, 0.0)["greedy_logprobs_exact"]
