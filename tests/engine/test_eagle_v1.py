"""NWOR with EAGLE, EAGLE-3 and MTP drafting on vLLM's V1 model runner (the CPU engine's only
runner; on a GPU, ``VLLM_USE_V2_MODEL_RUNNER=0``; vLLM runs these on its V2 runner there by
default, see ``tests/gpu/test_eagle_gpu.py``).

The target stages and commits as with any other drafter; the EAGLE head's own layers keep
vLLM's plain write. EAGLE runs on a pair built to reject (``write_bigram_eagle_pair``: a target
whose next token depends on the current one, and a head that is right about one time in six);
EAGLE-3 on the same pair's EAGLE-3 head (its first draft right most of the time, its later ones
only where the target repeats a token); MTP on MiMo
(``write_mimo_mtp_config``, dummy weights), whose MTP layer rejects everything. Each engine
pair: NWOR off then on, greedy tokens identical (logprobs to the CPU reference's rounding), the
cache audited after every step (on the NWOR-off engine too, where it must find the rejected
drafts vLLM wrote), NWOR's counters equal to vLLM's spec-decode stats. Then SCV on the same
heads: greedy output unchanged.
"""

from __future__ import annotations

import pytest
from engine_utils import (
    engine,
    generate_with_logprobs,
    record_chunks,
    spec_decode_stats,
    target_layers,
)

import vllm_nwor
from tests.support.cache_audit import CacheAudit, read_cpu_attn_tokens, runner_of


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from vllm_nwor.testing import write_bigram_eagle_pair, write_mimo_mtp_config

    root = tmp_path_factory.mktemp("eagle")
    mimo = write_mimo_mtp_config(tmp_path_factory.mktemp("mtp"))
    return {"eagle": write_bigram_eagle_pair(root, noise=0.03),
            "eagle3": write_bigram_eagle_pair(root, eagle3=True),
            "mtp": (mimo, None)}


def _run(pair: tuple[str, str], method: str, **keys) -> dict:
    target, head = pair
    speculative = {"method": method, "num_speculative_tokens": 3, **keys}
    options = {}
    if head is None:  # MTP: the target's own layer; MiMo's config only, dummy weights
        options["load_format"] = "dummy"
    else:
        speculative["model"] = head
    with engine(target, speculative, **options) as llm:
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        audit = CacheAudit(runner_of(llm), target_layers(llm), read_cpu_attn_tokens, block_size)
        chunks = record_chunks(llm)
        tokens, logprobs, outputs = generate_with_logprobs(llm)
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "acceptance": [getattr(o.outputs[0].spec_decode_metrics, "per_step_accepted", None)
                           for o in outputs],
            "chunks": chunks,
            "stats": spec_decode_stats(llm),
            "counters": vllm_nwor.get_counters(llm),
            "audit": audit,
        }


@pytest.fixture(scope="module")
def runs(pairs):
    """``runs(method, **keys)``: one engine's run, each started once for the module."""
    done: dict = {}

    def run(method: str, **keys) -> dict:
        key = (method, tuple(sorted(keys.items())))
        if key not in done:
            done[key] = _run(pairs[method], method, **keys)
        return done[key]

    return run


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_nwor_with_eagle_gives_vllms_tokens(runs, method):
    off = runs(method)
    on = runs(method, nwor=True)
    assert on["tokens"] == off["tokens"]
    assert on["logprobs"] == off["logprobs"]  # vLLM's own attention kernel on both sides
    drafted, accepted = on["stats"]
    assert on["stats"] == off["stats"]
    counters = on["counters"]
    assert counters.fallbacks == {}
    assert (counters.tokens_staged, counters.tokens_committed) == (drafted, accepted)
    assert drafted - accepted > 0, "the run must reject drafts"
    if method != "mtp":
        assert accepted > 0, "the bigram pair's heads are sometimes right"
    audit = on["audit"]
    assert audit.rejected_drafts == drafted - accepted and audit.checked_tokens > 0
    assert audit.violations == []
    # The audit's negative control: vLLM's plain write (NWOR off) leaves rejected drafts behind.
    assert any("beyond the committed length" in v for v in off["audit"].violations)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_scv_with_eagle_keeps_greedy_output(runs, method):
    """SCV (adaptive, with NWOR) with an EAGLE head on V1: each request verifies a chunk of the
    head's drafts; greedy tokens are those of vLLM without the plugin, chunk sizes vary, what
    NWOR commits is each chunk's accepted prefix, and the acceptance lengths add up."""
    plain = runs(method)
    scv = runs(method, nwor=True, scv="adaptive", scv_probe_interval=2)
    assert scv["tokens"] == plain["tokens"]
    sizes = {c for per_request in scv["chunks"].values() for c in per_request}
    assert len(sizes) > 2, sizes  # chunk 0 (plain decoding) and several others
    drafted, accepted = scv["stats"]
    counters = scv["counters"]
    assert counters.fallbacks == {}
    assert (counters.tokens_staged, counters.tokens_committed) == (drafted, accepted)
    assert sum(map(sum, scv["acceptance"])) == accepted
    assert scv["audit"].violations == []
