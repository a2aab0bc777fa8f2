"""NWOR with EAGLE, EAGLE-3 and MTP on the GPU, on vLLM's V2 model runner (where these methods
run on dense models by default) and on its V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``).

Each engine is a fresh process (``engine_probe_gpu.py``) with vLLM's defaults: FLASH_ATTN,
torch.compile, CUDA graphs FULL_AND_PIECEWISE, prefix caching, chunked prefill, and vLLM's
choice of async scheduling (on for these methods; on V1 the audit turns it off, see the probe).
Every case runs NWOR off, then on, both with the per-step cache audit, on prompts of which the
later start from prefix-cache hits beside verify steps:

- EAGLE on the bigram pair (``write_bigram_eagle_pair``: a head right about one time in four,
  real weights, real rejections, greedy);
- EAGLE-3 (the pair's EAGLE-3 head) and MTP on MiMo with dummy weights (whose drafts are right
  almost never) with vLLM's synthetic rejection sampling, which accepts each draft by a seeded
  coin (mean acceptance length 2 of 4), the same coins on both sides, so both engines emit
  the same tokens: the V2 runner's synthetic sampler, with NWOR.

Asserted: tokens and logprobs identical, the audit clean with NWOR on and catching vLLM's
rejected writes with NWOR off (its negative control), NWOR's counters equal to the audit's
per-step count of drafted and accepted tokens, the requests' acceptance lengths adding up to
vLLM's counts, and verify batches replaying FULL graphs captured with NWOR's staged path.

SCV (fixed at chunk 1, adaptive) with EAGLE and EAGLE-3 on both runners, greedy, real partial
acceptance (the bigram pair's heads): tokens within vLLM's own spread between k = 3 and k = 1,
FULL graphs replayed for the chunk sizes' shapes, acceptance lengths adding up to vLLM's
accepted count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import pythonpath
from tests.support.step_record import token_agreement as agreement

HERE = Path(__file__).parent
K = 3
SYNTHETIC = {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vllm_nwor.testing import write_bigram_eagle_pair, write_mimo_mtp_config

    root = tmp_path_factory.mktemp("eagle-gpu")
    # Head dim 64 (FlashAttention on a GPU); noise 0.015: about one draft in four accepted (CPU).
    shape = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}
    target, eagle = write_bigram_eagle_pair(root, noise=0.015, **shape)
    _, eagle3 = write_bigram_eagle_pair(root, eagle3=True, **shape)
    # Not under ``root``: vLLM takes a draft whose path contains "eagle-" for an EAGLE head.
    mimo = write_mimo_mtp_config(tmp_path_factory.mktemp("mtp"))
    return {"eagle": (target, eagle), "eagle3": (target, eagle3), "mtp": (mimo, None)}


def probe(tmp_path, spec: dict, v2: bool) -> dict:
    env = dict(os.environ)
    if v2:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice: V2 for these methods
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env["PYTHONPATH"] = pythonpath(env=env)  # the repository root: tests.support
    out = tmp_path / f"probe-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_probe_gpu.py"), json.dumps({**spec, "v2": v2}),
         str(out)], capture_output=True, text=True, timeout=500, env=env,
    )
    out.with_suffix(".stderr").write_text(proc.stderr)  # whole: vLLM's errors can be long
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(spec["method"], "V2" if v2 else "V1", spec["speculative"],
          {k: v for k, v in result.items() if k not in ("tokens", "logprobs")})
    return result


# Four prompts, then four that share whole blocks with them (32 or 48 tokens, block size 16):
# with 4 requests at a time, the later four start from prefix-cache hits while the first
# ones' last requests verify drafts.
BASE = [[(7 * i + 13 * j) % 500 + 2 for j in range(n)] for i, n in enumerate([40, 61, 33, 90])]
PROMPTS = BASE + [p[:32 + 16 * (i % 2)] + [(11 * i + 5 * j) % 500 + 2 for j in range(9)]
                  for i, p in enumerate(BASE)]


def case_spec(models, method: str, nwor: bool) -> dict:
    target, draft = models[method]
    speculative = {"num_speculative_tokens": K, **({} if method == "eagle" else SYNTHETIC)}
    spec = {"target": target, "draft": draft, "method": method, "audit": True,
            "speculative": {**speculative, **({"nwor": True} if nwor else {})},
            "sampling": {"logprobs": 1, "seed": 1234}, "prompts": PROMPTS}
    if method == "mtp":
        spec["engine"] = {"load_format": "dummy"}  # MiMo's config only: dummy weights
    return spec


CASES = [("eagle", True), ("eagle3", True), ("mtp", True), ("eagle", False), ("eagle3", False)]


@pytest.mark.parametrize("method, v2", CASES, ids=[f"{m}-{'v2' if v else 'v1'}" for m, v in CASES])
def test_nwor_on_gives_vllms_tokens_and_keeps_rejected_drafts_out(models, tmp_path, method, v2):
    off = probe(tmp_path, case_spec(models, method, False), v2)
    on = probe(tmp_path, case_spec(models, method, True), v2)
    expected_runner = "vllm.v1.worker.gpu.model_runner" if v2 else "vllm.v1.worker.gpu_model_runner"
    assert on["runner"] == off["runner"] == expected_runner
    assert on["attention_impl"] == "FlashAttentionImpl"
    assert on["cudagraph_mode"] == off["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert on["async_scheduling"] == off["async_scheduling"]

    assert on["prefix_cache_hits"] > 0 and off["prefix_cache_hits"] > 0  # prefix caching on
    assert on["tokens"] == off["tokens"]
    assert on["logprobs"] == off["logprobs"]  # vLLM's own attention kernel: bit for bit
    assert (on["drafted"], on["accepted"]) == (off["drafted"], off["accepted"])

    audit = on["audit"]
    assert 0 < audit["accepted"] < audit["drafted"], "the run must accept and reject drafts"
    assert audit["num_violations"] == 0, audit["violations"]
    # The audit's negative control: vLLM's plain write leaves rejected drafts behind.
    assert any("beyond" in v for v in off["audit"]["violations"])

    counters = on["counters"]
    assert counters["fallbacks"] == {}
    # Every step's drafts and verdicts, as the audit counted them from the scheduler's and the
    # sampler's outputs. (vLLM's stats leave out a step verified after its request ended.)
    assert (counters["tokens_staged"], counters["tokens_committed"]) == (
        audit["drafted"], audit["accepted"])
    assert on["drafted"] <= counters["tokens_staged"]

    # Telemetry: each request's acceptance lengths, one per verify step, are vLLM's counts.
    lengths = on["acceptance"]
    assert sum(map(sum, lengths)) == on["accepted"]
    assert K * sum(map(len, lengths)) == on["drafted"]

    # Verify batches (1 + K tokens per request) replayed FULL graphs with the staged path.
    assert on["dispatches"].get(f"{1 + K}:FULL", 0) > 0, on["dispatches"]
    assert on["graph_steps"] > 0


# -- SCV and telemetry on both runners ------------------------------------------------------------

SCV_CASES = [("eagle", True), ("eagle3", True), ("eagle", False), ("eagle3", False)]


@pytest.fixture(scope="module", params=SCV_CASES,
                ids=[f"{m}-{'v2' if v else 'v1'}" for m, v in SCV_CASES])
def scv_runs(request, models, tmp_path_factory):
    """Greedy, no synthetic acceptance (greedy rejection sampling emits the target's tokens
    whatever the drafts; the bigram pair's heads are right part of the time): vLLM at k and at
    1 (its own spread between two k), SCV fixed at chunk 1 and SCV adaptive (each with
    NWOR)."""
    method, v2 = request.param
    tmp = tmp_path_factory.mktemp(f"scv-{method}-{'v2' if v2 else 'v1'}")
    target, head = models[method]

    def run(k: int, **keys):
        return probe(tmp, {"target": target, "draft": head, "method": method,
                           "speculative": {"num_speculative_tokens": k, **keys}}, v2=v2)

    return {"v2": v2, "k": run(K), "k1": run(1),
            "fixed1": run(K, nwor=True, scv="fixed", scv_chunk_size=1),
            "adaptive": run(K, nwor=True, scv="adaptive", scv_probe_interval=2)}


def test_scv_keeps_greedy_output_within_vllms_own_spread(scv_runs):
    plain, spread = scv_runs["k"], agreement(scv_runs["k1"]["tokens"], scv_runs["k"]["tokens"])
    assert 0 < plain["accepted"] < plain["drafted"], "real partial acceptance"
    runner = f"vllm.v1.worker.{'gpu.model_runner' if scv_runs['v2'] else 'gpu_model_runner'}"
    for name in ("fixed1", "adaptive"):
        run = scv_runs[name]
        assert run["runner"] == runner
        assert run["counters"]["fallbacks"] == {}
        assert agreement(run["tokens"], plain["tokens"]) >= min(spread, 1.0), name


def test_scv_replays_full_graphs_for_its_chunk_sizes(scv_runs):
    # vLLM at k = 3 captures FULL decode graphs for 4 tokens per request only; SCV at chunk 1
    # verifies 2 tokens per request, and its chunk-0 steps decode 1.
    fixed = scv_runs["fixed1"]
    assert fixed["dispatches"].get("2:FULL", 0) > 0, fixed["dispatches"]
    assert fixed["accepted"] <= fixed["drafted"] <= fixed["counters"]["tokens_staged"]
    assert fixed["scv_budgets"] is not None
    adaptive = scv_runs["adaptive"]
    assert adaptive["dispatches"].get("1:FULL", 0) > 0, adaptive["dispatches"]


def test_scv_acceptance_lengths_add_up_to_the_schedulers_counts(scv_runs):
    """Telemetry: each request's acceptance lengths (one per verify step it took part in) add
    up, over the run, to vLLM's accepted-token count."""
    for name in ("fixed1", "adaptive"):
        run = scv_runs[name]
        lengths = run["acceptance"]
        assert all(isinstance(r, list) for r in lengths), name
        assert sum(map(sum, lengths)) == run["accepted"], name


# -- vLLM's adaptive verification beside the plugin --------------------------------------------


def test_vllms_adaptive_verification_runs_with_eagle3_beside_the_plugins_telemetry(
        models, tmp_path):
    """vLLM's adaptive verification (``enable_adaptive_verification``: V2 runner, FULL graphs)
    with EAGLE-3, the bigram pair's head (real partial acceptance, greedy), the plugin installed
    with its telemetry on (NWOR and SCV are refused beside it). It is what SCV must beat; this
    checks that it runs here at all. Greedy output within vLLM's own spread between k = 3 and
    k = 1, at most k drafts verified a request, and each request's acceptance lengths adding up
    to vLLM's accepted count."""
    target, head = models["eagle3"]

    def run(k: int = K, **keys):
        return probe(tmp_path, {"target": target, "draft": head, "method": "eagle3",
                                "speculative": {"num_speculative_tokens": k, **keys}}, v2=True)

    fixed, fixed1 = run(), run(1)
    adaptive = run(enable_adaptive_verification=True, nwor_telemetry=True)
    assert adaptive["runner"] == "vllm.v1.worker.gpu.model_runner"
    spread = agreement(fixed1["tokens"], fixed["tokens"])
    assert agreement(adaptive["tokens"], fixed["tokens"]) >= min(spread, 1.0)
    assert 0 < adaptive["accepted"] < adaptive["drafted"], "real partial acceptance"
    lengths = adaptive["acceptance"]
    assert sum(map(sum, lengths)) == adaptive["accepted"]
    assert adaptive["drafted"] <= K * sum(map(len, lengths))


def test_per_request_synthetic_acceptance_on_the_v2_runner(models, tmp_path):
    """The benchmarks' per-request synthetic acceptance on the V2 runner, with NWOR: EAGLE-3
    with vLLM's synthetic rejection sampling at full acceptance, every other request at rate 0
    and the rest at 1. Requests at 0 accept no draft, those at 1 every draft (but where
    ``max_tokens`` cut the last step); the audit finds NWOR's counters equal to the thinned
    verdicts and no rejected draft in a request's blocks."""
    target, head = models["eagle3"]
    run = probe(tmp_path, {
        "target": target, "draft": head, "method": "eagle3", "audit": True,
        "rates": [0.0, 1.0], "prompts": PROMPTS,
        "speculative": {"num_speculative_tokens": K, "rejection_sample_method": "synthetic",
                        "synthetic_acceptance_length": K + 1.0, "nwor": True,
                        "synthetic_acceptance_per_request": True}}, v2=True)
    lengths = run["acceptance"]
    assert all(n == 0 for n in (n for r in lengths[0::2] for n in r)), lengths[0::2]
    assert all(n == K for r in lengths[1::2] for n in r[:-1]), lengths[1::2]
    assert sum(map(sum, lengths)) == run["accepted"] > 0
    audit, counters = run["audit"], run["counters"]
    assert audit["num_violations"] == 0, audit["violations"]
    assert (counters["tokens_staged"], counters["tokens_committed"]) == (
        audit["drafted"], audit["accepted"])
