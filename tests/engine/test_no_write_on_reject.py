"""After every step, a target layer's paged cache holds exactly the committed tokens.

The audit (``tests/support/cache_audit.py``) fills each block with a sentinel when the scheduler
hands it to a request and checks, after every step, that committed tokens are written and that
nothing past them is. With NWOR off the same check must fail: vLLM writes rejected drafts into
the cache.
"""

from __future__ import annotations

import pytest
from engine_utils import engine, generate, spec_config, spec_decode_stats, target_layers

from tests.support.cache_audit import CacheAudit, read_cpu_attn_tokens, runner_of


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("nwor", [True, False], ids=["nwor-on", "nwor-off"])
def test_no_rejected_draft_reaches_the_cache(tiny_models, method, nwor):
    target, draft = tiny_models
    speculative = spec_config(method, draft, nwor=True) if nwor else spec_config(method, draft)
    with engine(target, speculative) as llm:
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        audit = CacheAudit(runner_of(llm), target_layers(llm), read_cpu_attn_tokens, block_size)
        generate(llm)
        drafted, accepted = spec_decode_stats(llm)
    assert audit.rejected_drafts == drafted - accepted > 0, "the run must reject drafts"
    assert audit.checked_tokens > 0
    if nwor:
        assert audit.violations == []
    else:
        # The same check on vLLM's plain write path finds the rejected drafts it wrote.
        assert any("beyond the committed length" in v for v in audit.violations)
        assert not any("missing" in v for v in audit.violations)
