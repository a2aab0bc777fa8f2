"""NWOR on the real GPU engine (FLASH_ATTN), under vLLM's default compilation and CUDA graphs
(verify batches replay FULL graphs captured with the staged path).

Each run is a fresh process (tests/gpu/engine_probe_gpu.py) on a tiny random-weight bf16 Llama:
- ngram, NWOR off vs on, default settings (torch.compile, CUDA graphs);
- draft_model with the per-step cache audit, NWOR on (with a commit failure injected every
  fifth step) and off (the audit must catch vLLM's rejected writes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import pythonpath, step_record
from tests.support.step_record import token_agreement as agreement

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vllm_nwor.testing import write_tiny_llama_pair

    return write_tiny_llama_pair(
        tmp_path_factory.mktemp("gpu-tiny"), hidden_size=256, num_heads=4, num_kv_heads=2,
        num_layers=3, draft_layers=3, draft_noise=0.08,
    )


def probe(models, tmp_path, method, nwor, **spec) -> dict:
    """Runs engine_probe_gpu.py; ``spec`` adds speculative keys, engine keys, audit, ..."""
    speculative = {**({"nwor": True} if nwor else {}), **spec.pop("speculative", {})}
    spec = {"target": models[0], "draft": models[1], "method": method,
            "speculative": speculative, **spec}
    out = tmp_path / f"probe-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_probe_gpu.py"), json.dumps(spec), str(out)],
        capture_output=True, text=True, timeout=500,
        env={**os.environ, "PYTHONPATH": pythonpath()},  # the root: tests.support
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text()) | {"method": method}
    print(method, speculative, {k: v for k, v in result.items() if k != "tokens"})
    return result


def full_verify_steps(run: dict) -> int:
    """Steps of more than one token per request that replayed a FULL graph."""
    return step_record.full_verify_steps(run["dispatches"])


@pytest.fixture(scope="module")
def default_runs(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ngram")
    return {nwor: probe(models, tmp, "ngram", nwor) for nwor in (False, True)}


def test_default_settings_tokens_and_counters(default_runs):
    off, on = default_runs[False], default_runs[True]
    assert on["attention_impl"] == "FlashAttentionImpl"
    assert on["async_scheduling"] == off["async_scheduling"]  # NWOR keeps vLLM's choice
    assert on["cudagraph_mode"] == off["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    # Verify batches replay FULL graphs, captured with the staged path. (Not as often as with
    # NWOR off: the tokens differ on this model, so ngram's drafts and the batch shapes do.)
    assert 0 < on["graph_steps"] <= full_verify_steps(on)
    assert 0 < on["accepted"] < on["drafted"]
    counters = on["counters"]
    assert counters["fallbacks"] == {}
    assert counters["tokens_staged"] == on["drafted"]
    assert counters["tokens_committed"] == on["accepted"]
    # Verify attention is vLLM's own FlashAttention call over scratch blocks holding the same
    # K/V: greedy tokens are those of NWOR off, bit for bit, even on this tiny random model
    # whose logit margins flipped 29% of them under the earlier split attention.
    assert on["tokens"] == off["tokens"], agreement(on["tokens"], off["tokens"])
    # The scheduler never hands out the scratch blocks (max_num_seqs 4 x (1 + ceil(3 / 16))).
    assert off["kv_blocks"]["scheduler"] == off["kv_blocks"]["cache"]
    assert on["kv_blocks"]["scheduler"] == on["kv_blocks"]["cache"] - 4 * 2



def test_draft_model_no_rejected_draft_reaches_the_cache(models, tmp_path):
    on = probe(models, tmp_path, "draft_model", True, audit=True, inject_every=5)
    audit = on["audit"]
    assert audit["rejected_drafts"] > 0 and audit["checked_tokens"] > 0
    assert audit["num_violations"] == 0, audit["violations"]
    assert on["counters"]["fallbacks"].get("commit_error", 0) > 0
    assert on["counters"]["tokens_committed"] == on["accepted"]
    assert on["graph_steps"] > 0  # the audit covered steps staged inside FULL graphs


def test_draft_model_audit_catches_vllm_writing_rejected_drafts(models, tmp_path):
    off = probe(models, tmp_path, "draft_model", False, audit=True)
    assert off["audit"]["rejected_drafts"] > 0
    assert any("beyond" in v for v in off["audit"]["violations"])


# -- SCV and the draft context window on the GPU -----------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scv_with_nwor_keeps_greedy_output(models, tmp_path, async_scheduling):
    """SCV chunks (plus NWOR) under default graphs, with async scheduling off and forced on."""
    engine = {"async_scheduling": async_scheduling}
    plain = probe(models, tmp_path, "draft_model", False, engine=engine)
    scv = probe(models, tmp_path, "draft_model", True, engine=engine,
                speculative={"scv": "adaptive", "scv_probe_interval": 2})
    assert scv["async_scheduling"] == async_scheduling
    print("token agreement SCV:", agreement(scv["tokens"], plain["tokens"]))
    counters = scv["counters"]
    assert counters["fallbacks"] == {}
    staged, committed = counters["tokens_staged"], counters["tokens_committed"]
    if not async_scheduling:
        assert (staged, committed) == (scv["drafted"], scv["accepted"])
    else:
        # vLLM leaves out of its counts a step in flight when its request finished (or a
        # stale frame being discarded); the runner staged and committed it (docs/telemetry.md).
        assert scv["drafted"] <= staged <= 1.05 * scv["drafted"]
        assert 0 <= committed - scv["accepted"] <= staged - scv["drafted"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scv_cuts_ngram_gpus_drafts_to_each_chunk(models, tmp_path, async_scheduling):
    """ngram_gpu's drafter proposes all k drafts or fails (vLLM asserts it): SCV asks it for k
    and cuts each request to its chunk. SCV fixed at chunk 1 of k = 3 verifies at most one
    draft a step (at most one accepted); SCV adaptive with drafts priced high
    holds chunk 0 between probes. Greedy tokens are compared with ngram_gpu without SCV (bf16
    sums in other orders in other batch shapes, so agreement must be high, not total)."""
    engine = {"async_scheduling": async_scheduling}
    plain = probe(models, tmp_path, "ngram_gpu", False, engine=engine,
                  speculative={"nwor_telemetry": True})
    one = probe(models, tmp_path, "ngram_gpu", False, engine=engine,
                speculative={"scv": "fixed", "scv_chunk_size": 1})
    held = probe(models, tmp_path, "ngram_gpu", False, engine=engine, speculative={
        "scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0], "scv_probe_interval": 4,
        "scv_probe_cost": 1.0})
    assert one["async_scheduling"] == async_scheduling
    most = [max(max(a) for a in run["acceptance"] if a) for run in (plain, one)]
    assert most[0] > 1  # ngram_gpu alone accepts more than one draft in some steps
    assert one["accepted"] > 0 and most[1] == 1
    assert one["scv_budgets"][1] > 0
    assert held["scv_budgets"][0] > 2 * sum(held["scv_budgets"][1:]) > 0
    assert 0 < held["drafted"] < plain["drafted"] / 3
    for run in (one, held):
        print("token agreement SCV vs ngram_gpu:", agreement(run["tokens"], plain["tokens"]))
        assert agreement(run["tokens"], plain["tokens"]) > 0.9


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lazy_draft_sync_drafts_as_if_the_draft_never_skipped(models, tmp_path, async_scheduling):
    """SCV held at chunk 0, probing every 4 steps: the draft model is skipped on most steps and
    caught up at probes (tests/engine/test_draft_sync.py on the CPU). bf16 attention over a
    caught-up chunk sums in another order than step by step, so acceptance is compared in
    total; a catch-up that wrote nothing or the wrong slots would leave the probes at ~0."""
    held = {"scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0], "scv_probe_interval": 4,
            "scv_probe_cost": 1.0}  # probes every 4 steps whatever they cost
    engine = {"async_scheduling": async_scheduling}
    lazy = probe(models, tmp_path, "draft_model", False, engine=engine, speculative=held)
    every_step = probe(models, tmp_path, "draft_model", False, engine=engine, speculative=held,
                       draft_pass_every_step=True)
    assert lazy["async_scheduling"] == async_scheduling
    assert lazy["draft_sync"]["skipped_steps"] > 20 and lazy["draft_sync"]["caught_up_tokens"] > 0
    assert every_step["draft_sync"] is None
    assert every_step["accepted"] > 10
    assert lazy["accepted"] >= 0.9 * every_step["accepted"]
    print("token agreement lazy vs every step:", agreement(lazy["tokens"], every_step["tokens"]))


def test_scv_step_times_leave_out_the_engines_idle_time(models, tmp_path):
    """With async scheduling the engine schedules a step past a run's last tokens, and its
    output waits in the batch queue until the engine steps again. Two runs 3 s apart: the step
    times SCV's cost model sees in the second run (disjoint intervals within it) must add up
    to at most its wall time (a benchmark's cost model saw "steps" of 0.2-18 s between its
    runs)."""
    scv = probe(models, tmp_path, "draft_model", False, engine={"async_scheduling": True},
                speculative={"scv": "adaptive"}, idle_then_again=3)
    again = scv["again"]
    print("second run: wall seconds, SCV's observed step seconds:", again)
    assert scv["async_scheduling"]
    assert 0 < again["step_seconds"] <= again["seconds"]


def test_scv_chunk_sizes_replay_full_decode_graphs(models, tmp_path):
    """Uniform batches of SCV's chunk sizes replay FULL graphs (patches/decode_graphs.py): SCV
    fixed at 2 of k = 4 drafts (3 tokens per request; vLLM's own graphs are for 5), and held at
    chunk 0 (1 token). Greedy tokens are compared with vLLM's k = 2, whose FULL graphs are its
    own; bf16 sums in other orders in other graphs, so agreement is printed and must be high."""
    two = probe(models, tmp_path, "draft_model", False, speculative={
        "num_speculative_tokens": 4, "scv": "fixed", "scv_chunk_size": 2})
    zero = probe(models, tmp_path, "draft_model", False, engine={"async_scheduling": True},
                 speculative={"scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0],
                              "scv_probe_interval": 1000})
    vllm_k2 = probe(models, tmp_path, "draft_model", False,
                    speculative={"num_speculative_tokens": 2})
    print("dispatches:", two["dispatches"], zero["dispatches"], vllm_k2["dispatches"])
    assert two["dispatches"].get("3:FULL", 0) > 10
    assert two["dispatches"].get("3:PIECEWISE", 0) == 0
    assert zero["dispatches"].get("1:FULL", 0) > 10
    print("token agreement SCV chunk 2 vs vLLM k=2:", agreement(two["tokens"], vllm_k2["tokens"]))
    assert agreement(two["tokens"], vllm_k2["tokens"]) > 0.9
    # Held at chunk 0 under async scheduling, each step's inputs are the tokens vLLM's plain
    # bookkeeping kept (patches/draft_sync.py): wrong inputs would derail greedy decoding.
    print("token agreement SCV chunk 0 vs vLLM k=2:", agreement(zero["tokens"], vllm_k2["tokens"]))
    assert zero["async_scheduling"] and agreement(zero["tokens"], vllm_k2["tokens"]) > 0.9


def test_draft_window_keeps_a_long_request_from_dropping_the_batch(models, tmp_path):
    """The draft is told it handles 128 positions; one request of four is 300 tokens long."""
    prompts = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)]
               for i, n in enumerate([20, 300, 30, 40])]
    draft_limit = {"draft_model_max_positions": 128}
    vllm = probe(models, tmp_path, "draft_model", False, prompts=prompts, **draft_limit)
    window = probe(models, tmp_path, "draft_model", False, prompts=prompts, **draft_limit,
                   speculative={"draft_context_window": 64})
    assert window["accepted"] > 4 * max(1, vllm["accepted"])
