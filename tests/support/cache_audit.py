"""A per-step audit of the target model's paged KV cache, for engine tests (CPU and GPU).

Every block is filled with a sentinel when the scheduler hands it to a request (freed blocks
keep the finished request's K/V, which is legitimate), except the blocks a request gets from
the prefix cache: those hold another request's committed K/V, which it reads. After each step,
after rejection sampling and the commit, for every request and every target layer:

- every position below the request's KV length (prompt and accepted tokens) is written;
- every position from there to the end of its blocks still holds the sentinel.

The second fails exactly when a rejected draft was written into the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SENTINEL = -32768.0  # exact in fp32, fp16 and bf16, and far from any K/V value

ReadTokens = Callable[[object, torch.Tensor, int], torch.Tensor]
"""``(layer, block_ids, num_tokens) -> [num_tokens, ...]`` K and V of each token, flattened,
on the cache's device."""


def read_flash_attn_tokens(layer, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """FLASH_ATTN's cache (B, H, N, 2D) read per token: [tokens, H * 2D]."""
    kv = layer.kv_cache.transpose(1, 2)[block_ids.to(layer.kv_cache.device)]  # (b, N, H, 2D)
    return kv.reshape(-1, kv.shape[2] * kv.shape[3])[:num_tokens]


_CPU_LAYOUTS: dict[tuple, object] = {}


def read_cpu_attn_tokens(layer, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """CPU_ATTN's cache read per token through a layout learned from vLLM's own write op."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from tests.support.kv_layout import PagedKVLayout

    impl, cache = layer.impl, layer.kv_cache
    _, num_kv_heads, block_size, _ = cache.shape
    key = (layer.isa, cache.dtype, block_size, num_kv_heads, impl.head_size)
    if key not in _CPU_LAYOUTS:
        def probe_write(k, v, block, slots):
            # Between steps: NWOR's patch, if loaded, hands this to vLLM's own write.
            CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, k, v, block, slots)

        _CPU_LAYOUTS[key] = PagedKVLayout.probe(probe_write, (1, *cache.shape[1:]), block_size,
                                                num_kv_heads, impl.head_size, cache.dtype)
    k, v = _CPU_LAYOUTS[key].gather(cache, block_ids, num_tokens)
    return torch.cat([k, v], dim=-1).flatten(1)


def runner_of(llm):
    """The in-process model runner (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def is_v2_runner(runner) -> bool:
    """Whether ``runner`` is vLLM's V2 model runner (request state on the GPU, no input_batch)."""
    return hasattr(runner, "req_states")


class CacheAudit:
    """Audits ``runner`` (vLLM's V1 or V2 model runner) from now on; ``layers`` are its target
    layers.

    The V1 runner keeps each request's blocks and computed tokens on the host. The V2 runner
    keeps them on the GPU: the audit follows each request's blocks from the scheduler outputs
    and reads its KV length (``num_computed_tokens``, advanced by the accepted tokens after
    rejection sampling) from the runner's request states."""

    def __init__(self, runner, layers: list, read_tokens: ReadTokens, block_size: int) -> None:
        self.runner = runner
        self.layers = layers
        self.read_tokens = read_tokens
        self.block_size = block_size
        for layer in layers:
            layer.kv_cache.fill_(SENTINEL)
        self.drafted = self.accepted = self.rejected_drafts = 0
        self.checked_tokens = 0
        self.violations: list[str] = []
        self.v2 = is_v2_runner(runner)
        self.block_ids: dict[str, list[int]] = {}  # V2: each request's blocks
        self.scheduler_output = None  # V2: the step's
        execute_model = self.runner.execute_model
        sample_tokens = self.runner.sample_tokens
        self.runner.execute_model = lambda out, *a, **kw: self._fill_new_blocks(
            execute_model, out, *a, **kw
        )
        self.runner.sample_tokens = lambda *a, **kw: self._step(sample_tokens, *a, **kw)

    def _fill_new_blocks(self, execute_model, scheduler_output, *args, **kwargs):
        hit = lambda computed: computed // self.block_size  # noqa: E731 (prefix-cache blocks)
        new_blocks = [b for req in scheduler_output.scheduled_new_reqs
                      for b in req.block_ids[0][hit(req.num_computed_tokens):]]
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens, strict=True):
            if block_ids is not None:  # a resumed request's list starts with its cache hits
                new_blocks += block_ids[0][hit(computed) if rid in cached.resumed_req_ids
                                           else 0:]
        for layer in self.layers:
            layer.kv_cache[new_blocks] = SENTINEL
        if self.v2:
            self._follow_blocks(scheduler_output)
        return execute_model(scheduler_output, *args, **kwargs)

    def _follow_blocks(self, scheduler_output) -> None:
        for rid in scheduler_output.finished_req_ids:
            self.block_ids.pop(rid, None)
        for req in scheduler_output.scheduled_new_reqs:
            self.block_ids[req.req_id] = list(req.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if block_ids is None:
                continue
            if rid in cached.resumed_req_ids:
                self.block_ids[rid] = list(block_ids[0])
            else:
                self.block_ids.setdefault(rid, []).extend(block_ids[0])
        self.scheduler_output = scheduler_output

    def _step(self, sample_tokens, *args, **kwargs):
        if self.v2:
            return self._step_v2(sample_tokens, *args, **kwargs)
        runner = self.runner
        scheduler_output = runner.execute_model_state.scheduler_output
        batch = runner.input_batch
        before = {
            rid: int(batch.num_computed_tokens_cpu[batch.req_id_to_index[rid]])
            for rid in batch.req_ids
        }
        output = sample_tokens(*args, **kwargs)
        if hasattr(output, "get_output"):  # async scheduling
            output = output.get_output()
        kv_lens = {}
        for index, rid in enumerate(output.req_ids):
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            sampled = output.sampled_token_ids[index]
            rejected = drafts - (len(sampled) - 1) if drafts and sampled else 0
            self.drafted += drafts
            self.accepted += drafts - rejected if sampled else 0
            self.rejected_drafts += rejected
            kv_lens[rid] = before[rid] + scheduler_output.num_scheduled_tokens[rid] - rejected
        self._check(kv_lens)
        return output

    def _step_v2(self, sample_tokens, *args, **kwargs):
        scheduler_output, self.scheduler_output = self.scheduler_output, None
        output = sample_tokens(*args, **kwargs)
        if scheduler_output is None:  # the model did not run
            return output
        result = output.get_output() if hasattr(output, "get_output") else output
        states = self.runner.req_states
        kv_lens = {}
        for index, rid in enumerate(result.req_ids):
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            sampled = result.sampled_token_ids[index]
            accepted = len(sampled) - 1 if drafts and len(sampled) else 0
            self.drafted += drafts
            self.accepted += accepted
            self.rejected_drafts += drafts - accepted if drafts else 0
            kv_lens[rid] = int(states.num_computed_tokens.gpu[states.req_id_to_index[rid]])
        self._check(kv_lens)
        return output

    def _blocks_of(self, rid: str) -> list[int]:
        return self.block_ids[rid] if self.v2 else self.runner.requests[rid].block_ids[0]

    def _check(self, kv_lens: dict[str, int]) -> None:
        """One read per layer over every request's blocks; compared on the cache's device."""
        if not kv_lens:
            return
        blocks = [self._blocks_of(rid) for rid in kv_lens]
        block_ids = torch.tensor([b for ids in blocks for b in ids], dtype=torch.long)
        capacity = len(block_ids) * self.block_size
        for layer in self.layers:
            kv = self.read_tokens(layer, block_ids, capacity)
            written = (kv != SENTINEL).all(dim=1).cpu()
            untouched = (kv == SENTINEL).all(dim=1).cpu()
            start = 0
            for (rid, kv_len), ids in zip(kv_lens.items(), blocks, strict=True):
                end = start + len(ids) * self.block_size
                if not bool(written[start:start + kv_len].all()):
                    self.violations.append(f"{rid} {layer.layer_name}: committed token missing")
                if not bool(untouched[start + kv_len:end].all()):
                    bad = (torch.nonzero(~untouched[start + kv_len:end]).flatten()
                           + kv_len).tolist()
                    self.violations.append(
                        f"{rid} {layer.layer_name}: positions {bad} written beyond "
                        f"the committed length {kv_len}"
                    )
                start = end
        self.checked_tokens += sum(kv_lens.values())
