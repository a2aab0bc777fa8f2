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

import json

import pytest

from benchmarks import equivalence

CPU_CASES = {case.name: case for case in equivalence.cases(on_cuda=False)}
RUN = ["defaults_draft_model", "defaults_ngram", "preemption", "block_size_32_k5",
       "two_engines_one_process", "structured_output"]


UNDER_LOAD = ["pressure_ngram", "pressure_draft_model_no_prefix_caching",
              "tp2_long_prompts_draft_model", "tp2_long_prompts_draft_model_no_prefix_caching",
              "tp2_long_prompts_ngram", "tp2_long_prompts_ngram_no_prefix_caching",
              "tp2_long_prompts_eagle3", "tp2_long_prompts_eagle3_no_prefix_caching"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("equivalence")
    return {name: equivalence.model_paths(CPU_CASES[name].model, root)
            for name in RUN + UNDER_LOAD}


@pytest.mark.parametrize("name", RUN)
def test_nwor_on_gives_vllms_tokens_under_vllms_defaults(models, name):
    case = CPU_CASES[name]
    row = equivalence.run_case(case, models[name], on_cuda=False, run=equivalence.run_engine)
    assert row["settings"]["enable_prefix_caching"], "vLLM's default"
    assert row["greedy_tokens_exact"], row["mismatches"]
    assert row["greedy_logprobs_exact"], "bit for bit: vLLM's own attention kernel on both sides"
    assert row["checks_failed"] == [], row["checks_failed"]
    # What the workload claims to exercise, it did.
    assert row["hits_beside_verify"] > 0 and row["prefix_cache_hits"] > 0
    assert row["audit"]["rejected_drafts"] > 0 and row["audit"]["num_violations"] == 0


@pytest.mark.parametrize("name", UNDER_LOAD)
def test_under_load_nwor_keeps_vllms_schedule_and_tokens(models, name, tmp_path):
    """KV pressure that preempts again and again, and at tensor parallelism 2 (draft_model and
    ngram, prefix caching on and off) prompts prefilled in chunks beside verify steps: both
    engines (each in its own process, with the per-step trace of tests/support/engine_trace.py)
    schedule, preempt, compute logits and sample exactly alike at every step. (Seen failing with the
    NWOR side given 64 tokens less KV cache: 14 preemptions against 17, the trace parting at
    step 10's schedule.)"""
    from tests.support import engine_trace

    case = CPU_CASES[name]
    row = equivalence.run_case(case, models[name], on_cuda=False, run=equivalence.probe,
                               trace=tmp_path)
    assert row["greedy_tokens_exact"], row["mismatches"]
    assert row["checks_failed"] == [], row["checks_failed"]
    off, on = (engine_trace.read(tmp_path / name / side) for side in ("off", "on"))
    assert engine_trace.first_difference(off, on) is None
    assert engine_trace.summary(on)["preemptions"] == row["preemptions"]
    assert (row["prefix_cache_hits"] > 0) == row["settings"]["enable_prefix_caching"]
    if case.preempt:
        assert row["preemptions"] >= 5 and row["off"]["preemptions"] == row["preemptions"]
    else:  # prompts longer than the token budget, prefilled beside other requests' drafts
        assert row["verify_steps"] > 0 and row["prefill_beside_verify"] > 0
        assert (row["hits_beside_verify"] > 0) == row["settings"]["enable_prefix_caching"]


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


def test_sampled_tokens_are_compared_apart_from_the_greedy_verdict():
    """A sampled sequence that differs leaves ``exact`` (greedy, and sampled logprobs up to the
    difference) as it was, and shows in ``sampled_tokens_exact``."""
    out = {"tokens": [[5, 6, 7]], "logprobs": [[-0.1, -0.2, -0.3]], "finish": ["length"],
           "stop": [None], "sampled": True}
    off = {"outputs": [out]}
    assert equivalence.compare(off, off, 0.0)["sampled_tokens_exact"]
    result = equivalence.compare(off, {"outputs": [out | {"tokens": [[5, 6, 9]]}]}, 0.0)
    assert result["exact"] and not result["sampled_tokens_exact"]


TP_CASE = next(c for c in equivalence.cases(on_cuda=True) if c.name == "tp2_draft_model")


def tp_row() -> dict:
    """A tp2 row as run_case makes it, on two GPUs, every check passing."""
    counters = {"verify_steps_staged": 9, "tokens_staged": 30, "tokens_committed": 10,
                "tokens_rejected": 20, "rejected_kv_bytes": 100, "fallbacks": {}}
    worker = {"device_type": "cuda", "custom_all_reduce": True, "nwor_graph_steps": 5,
              "full_verify_steps": 7, "dispatches": {"4:FULL": 7, "mixed:PIECEWISE": 2}}
    ranks = [{"tp_rank": rank, "steps": 12, "drafted": 30, "accepted": 10,
              "worker": dict(worker)} for rank in (0, 1)]
    return {"counters": counters | {"rejected_kv_bytes": 200}, "counters_error": None,
            "rank_counters": [dict(counters), dict(counters)], "drafted": 30, "accepted": 10,
            "prefix_cache_hits": 4, "preemptions": 0, "sampled_tokens_exact": True,
            "settings": {"async_scheduling": False, "enable_prefix_caching": True},
            "audit": {"num_violations": 0, "violations": [], "ranks": ranks},
            "off": {"audit": {"ranks": [dict(r) for r in ranks]}}}


def break_rank_counters(row):
    row["rank_counters"][1]["tokens_committed"] = 0


def break_custom_all_reduce(row):
    row["audit"]["ranks"][1]["worker"]["custom_all_reduce"] = False


def break_full_graphs(row):
    row["audit"]["ranks"][0]["worker"]["nwor_graph_steps"] = 0


def break_verdicts(row):
    row["audit"]["ranks"][1]["accepted"] = 11


def lose_a_rank(row):
    del row["audit"]["ranks"][1]


def break_seeded_sampling(row):
    row["sampled_tokens_exact"] = False


def break_the_baseline(row):
    row["off"]["audit"]["ranks"][1]["accepted"] = 11


def counters_disagree(row):
    row["counters"] = None
    row["counters_error"] = ("NWOR counters differ across tensor-parallel ranks: "
                             "tokens_committed is rank 0: 10, rank 1: 0")


@pytest.mark.parametrize("breaks, failure", [
    (break_rank_counters, "NWOR's counters by rank differ"),
    (break_custom_all_reduce, "rank 1: custom all-reduce is off"),
    (break_full_graphs, "rank 0: 0 staged steps in FULL graphs, 7 FULL verify steps"),
    (break_verdicts, "ranks saw different (steps, drafted, accepted)"),
    (lose_a_rank, "audited ranks [0], expected 0 to 1"),
    (break_seeded_sampling, "seeded sampled tokens differ from NWOR off's"),
    (counters_disagree, "tokens_committed is rank 0: 10, rank 1: 0"),
    (break_the_baseline, "NWOR off: vLLM's ranks saw different"),
])
def test_tensor_parallel_checks_fail_on_each_broken_claim(breaks, failure):
    """The GPU rows' checks (equivalence.tp_checks, through checks) pass a good two-rank row
    and name each claim that one broken rank breaks."""
    assert equivalence.checks(tp_row(), TP_CASE) == []
    row = tp_row()
    breaks(row)
    failed = equivalence.checks(row, TP_CASE)
    assert any(failure in line for line in failed), failed


def test_run_matrix_keeps_the_rows_of_cases_run_before(tmp_path, monkeypatch):
    """The GPU TP test runs one case at a time into one result file (``keep``): rows of other
    cases stay, a case run again replaces its row, and a case that fails is a row with its
    error."""
    def run_case(case, paths, on_cuda, **kwargs):
        if case.name == "tp2_ngram":
            raise RuntimeError("probe failed")
        return {"name": case.name, "exact": True}

    monkeypatch.setattr(equivalence, "run_case", run_case)
    monkeypatch.setattr(equivalence, "model_paths", lambda model, root: ("t", "d"))
    out = tmp_path / "tp2.json"
    tp2 = {c.name: c for c in equivalence.cases(on_cuda=True) if c.tensor_parallel_size == 2}
    out.write_text('{"cases": [{"name": "tp2_draft_model", "exact": false}, {"name": "x"}]}')
    payload = equivalence.run_matrix([tp2["tp2_draft_model"]], tmp_path, out, True, keep=True)
    assert [(r["name"], r.get("exact")) for r in payload["cases"]] == [
        ("x", None), ("tp2_draft_model", True)]
    payload = equivalence.run_matrix([tp2["tp2_ngram"]], tmp_path, out, True, keep=True)
    assert [r["name"] for r in payload["cases"]] == ["x", "tp2_draft_model", "tp2_ngram"]
    assert "probe failed" in payload["cases"][-1]["error"]
    assert json.loads(out.read_text()) == payload
    payload = equivalence.run_matrix([tp2["tp2_ngram"]], tmp_path, out, True)  # not kept
    assert [r["name"] for r in payload["cases"]] == ["tp2_ngram"]
