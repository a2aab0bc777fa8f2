"""After every step, a target layer's paged cache holds exactly the committed tokens.

Every block is filled with a sentinel when the scheduler hands it to a request (freed blocks
keep the finished request's K/V, which is legitimate). After each step (after rejection sampling
and commit), for every request and every target layer:

- every position below the request's KV length (prompt and accepted tokens) is written;
- every position from there to the end of its blocks still holds the sentinel, so no rejected
  draft was ever written there.

With NWOR off the same check must fail: vLLM writes rejected drafts into the cache.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import engine, generate, runner_of, spec_config, spec_decode_stats, target_layers

from vllm_nwor.kv_layout import PagedKVLayout

SENTINEL = -12345.0


def _layout(layer) -> PagedKVLayout:
    from vllm_nwor.patches.cpu_attn import BACKEND

    return BACKEND.layer_state(layer)


class CacheAudit:
    """Wraps the runner's sample_tokens to check the target caches at the end of every step."""

    def __init__(self, llm) -> None:
        self.runner = runner_of(llm)
        self.layers = target_layers(llm)
        self.layouts = [_layout(layer) for layer in self.layers]
        for layer in self.layers:
            layer.kv_cache.fill_(SENTINEL)
        self.rejected_drafts = 0
        self.violations: list[str] = []
        self.checked_tokens = 0
        execute_model = self.runner.execute_model
        sample_tokens = self.runner.sample_tokens
        self.runner.execute_model = lambda out, *a, **kw: self._fill_new_blocks(
            execute_model, out, *a, **kw
        )
        self.runner.sample_tokens = lambda *a, **kw: self._step(sample_tokens, *a, **kw)

    def _fill_new_blocks(self, execute_model, scheduler_output, *args, **kwargs):
        new_blocks = [b for req in scheduler_output.scheduled_new_reqs for b in req.block_ids[0]]
        for block_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if block_ids is not None:
                new_blocks += block_ids[0]
        for layer in self.layers:
            layer.kv_cache[new_blocks] = SENTINEL
        return execute_model(scheduler_output, *args, **kwargs)

    def _step(self, sample_tokens, *args, **kwargs):
        runner = self.runner
        scheduler_output = runner.execute_model_state.scheduler_output
        batch = runner.input_batch
        before = {
            rid: int(batch.num_computed_tokens_cpu[batch.req_id_to_index[rid]])
            for rid in batch.req_ids
        }
        output = sample_tokens(*args, **kwargs)
        for index, rid in enumerate(output.req_ids):
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            sampled = output.sampled_token_ids[index]
            rejected = drafts - (len(sampled) - 1) if drafts and sampled else 0
            self.rejected_drafts += rejected
            kv_len = before[rid] + scheduler_output.num_scheduled_tokens[rid] - rejected
            self._check(rid, kv_len)
        return output

    def _check(self, rid: str, kv_len: int) -> None:
        block_ids = torch.tensor(self.runner.requests[rid].block_ids[0])
        capacity = len(block_ids) * self.layouts[0].block_size
        for layer, layout in zip(self.layers, self.layouts, strict=True):
            key, value = layout.gather(layer.kv_cache, block_ids, capacity)
            kv = torch.cat([key, value], dim=-1).flatten(1)
            written = (kv != SENTINEL).all(dim=1)
            untouched = (kv == SENTINEL).all(dim=1)
            if not bool(written[:kv_len].all()):
                self.violations.append(f"{rid} {layer.layer_name}: committed token missing")
            if not bool(untouched[kv_len:].all()):
                bad = torch.nonzero(~untouched[kv_len:]).flatten() + kv_len
                self.violations.append(
                    f"{rid} {layer.layer_name}: positions {bad.tolist()} written beyond "
                    f"the committed length {kv_len}"
                )
        self.checked_tokens += kv_len


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("nwor", [True, False], ids=["nwor-on", "nwor-off"])
def test_no_rejected_draft_reaches_the_cache(tiny_models, method, nwor):
    target, draft = tiny_models
    speculative = spec_config(method, draft, nwor=True) if nwor else spec_config(method, draft)
    with engine(target, speculative) as llm:
        audit = CacheAudit(llm)
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
