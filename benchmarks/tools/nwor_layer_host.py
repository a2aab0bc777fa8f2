"""What host time does NWOR add to a verify step's layers run outside CUDA graphs?

Host time of a verify step's layers run outside CUDA graphs: vLLM's KV write and attention
against NWOR's staged ones, on the GPU, without the engine.

A verify batch that is not uniform (ngram leaves some requests without drafts; SCV's mixed
chunks) runs PIECEWISE: each layer's KV update and attention run from Python, so each costs host
time in every layer. When the GPU finishes a layer's kernels sooner than the host launches the
next, that host time is the step's time. This benchmark calls FLASH_ATTN's ``do_kv_cache_update``
and ``forward`` for 32 layers of an 8B-shaped model (32 query heads, 8 KV heads, head size 128),
as vLLM's own (``original``) and as NWOR's patched versions with a real interceptor (begin,
stage, attention through the scratch blocks, commit), and reports per step:

- ``host_ms``: the time to issue the step (the host's work; the GPU is synchronised before
  each step, so the host never waits on a full launch queue);
- ``update_us`` / ``forward_us``: the same, per layer, for the KV update and the attention;
- ``gpu_ms``: the step's GPU time between two events.

A third side, ``nwor_stage_only``, is a diagnostic: NWOR's KV update (stage and scratch plan)
followed by vLLM's own attention (its output then misses the drafts: only host time counts). Its
``forward_us`` tells whether the attention's extra host time under NWOR is its own (the scratch
metadata) or the stage launch's before it. Three more are vLLM's own update and attention with one
launch of a one-element kernel between them: through Triton's JIT (``vllm_then_triton``), through
the compiled launcher NWOR's kernels use (``vllm_then_launcher``), and a PyTorch op
(``vllm_then_torch``). They tell whether vLLM's attention issues slower after any launch, after
a Triton launch, or after NWOR's stage only
(``benchmarks/results/nwor_layer_host_launch_sides_2026-11-24_h200.json``).

The sides run in one process, alternating. The plugin's code is whatever ``vllm_nwor`` imports
(``PYTHONPATH`` chooses a checkout), so two versions are compared by running this twice, and
``--label`` names the version in the output.

    python -m benchmarks.tools.nwor_layer_host --label after --jsonl $OUT/layer_host.jsonl
    python -m benchmarks.tools.nwor_layer_host --merge layer_host.jsonl \
        --result benchmarks/results/nwor_layer_host_<date>_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
import vllm.v1.attention.backends.flash_attn as fa
from vllm.forward_context import override_forward_context

from benchmarks.harness.results import (
    append_jsonl,
    parse_or_merge,
    recorded_environment,
    write_json,
)
from vllm_nwor import patches
from vllm_nwor.nwor.interceptor import NworInterceptor
from vllm_nwor.nwor.kernels._common import Launcher
from vllm_nwor.nwor.kernels.scratch import scratch_blocks
from vllm_nwor.nwor.kv_staging import StagedLayers
from vllm_nwor.nwor.verify_step import IndexUploader, VerifyStep
from vllm_nwor.patches._patch import original
from vllm_nwor.patches.nwor import flash_attn as nwor_fa
from vllm_nwor.patches.nwor.binding import BINDING_ATTR, LayerBinding, wrap_kv_cache_update

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
CASES = [  # batch, k, share of requests without drafts (as ngram leaves them)
    (1, 4, 0.0),
    (8, 8, 0.5),
    (32, 4, 0.0),
    (32, 4, 0.25),
]


class Step:
    """One verify step's inputs for every layer, and the layers."""

    def __init__(self, batch: int, k: int, no_draft: float, context: int, layers: int) -> None:
        dev = torch.device("cuda")
        drafts = [0 if i < round(no_draft * batch) else k for i in range(batch)]
        q_lens = [1 + d for d in drafts]
        blocks_per_req = -(-(context + k + 1) // BLOCK)
        self.batch, self.k = batch, k
        # NWOR's scratch blocks at the end of each cache, as the engine core keeps them free.
        num_blocks = batch * blocks_per_req + 1 + scratch_blocks(batch, k, BLOCK)[1]
        self.impl = fa.FlashAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS, None,
                                          None, "auto")
        one = torch.ones((), device=dev)
        touched = torch.zeros(1, dtype=torch.int32, device=dev)  # vllm_then_triton's kernel
        self.layers = []
        for i in range(layers):
            raw = torch.zeros(num_blocks, BLOCK, KV_HEADS, 2 * HEAD_SIZE, dtype=torch.bfloat16,
                              device=dev)
            self.layers.append(SimpleNamespace(
                impl=self.impl, layer_name=f"model.layers.{i}.self_attn.attn",
                kv_cache=raw.permute(0, 2, 1, 3), _k_scale=one, _v_scale=one, _q_scale=one,
                kv_sharing_target_layer_name=None, touched=touched))
        block_table = torch.arange(batch * blocks_per_req, dtype=torch.int32,
                                   device=dev).view(batch, blocks_per_req)
        slots = []
        for i, q in enumerate(q_lens):
            for pos in range(context, context + q):
                slots.append(int(block_table[i, pos // BLOCK]) * BLOCK + pos % BLOCK)
        n = sum(q_lens)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.qsl_host = qsl
        self.num_draft_tokens = drafts
        query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=dev)
        seq_lens = torch.tensor([context + q for q in q_lens], dtype=torch.int32, device=dev)
        metadata = fa.get_scheduler_metadata(
            batch_size=batch, max_seqlen_q=max(q_lens), max_seqlen_k=context + max(q_lens),
            num_heads_q=HEADS, num_heads_kv=KV_HEADS, headdim=HEAD_SIZE, cache_seqlens=seq_lens,
            qkv_dtype=torch.bfloat16, cu_seqlens_q=query_start_loc, page_size=BLOCK,
            causal=True, num_splits=0)
        self.metadata = fa.FlashAttentionMetadata(
            num_actual_tokens=n, max_query_len=max(q_lens), query_start_loc=query_start_loc,
            max_seq_len=context + max(q_lens), seq_lens=seq_lens, block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), use_cascade=False,
            common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
            suffix_kv_lens=None, scheduler_metadata=metadata, max_num_splits=0, causal=True)
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_SIZE, device=dev,
                          dtype=torch.bfloat16)
        q, key, value = qkv.split([HEADS * HEAD_SIZE, KV_HEADS * HEAD_SIZE,
                                   KV_HEADS * HEAD_SIZE], dim=-1)
        self.query = q.view(n, HEADS, HEAD_SIZE)  # views into one qkv tensor, as in vLLM
        self.key = key.view(n, KV_HEADS, HEAD_SIZE)
        self.value = value.view(n, KV_HEADS, HEAD_SIZE)
        self.output = torch.empty(n, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
        # Half of each request's drafts accepted.
        sampled = torch.full((batch, k + 1), -1, dtype=torch.int32, device=dev)
        sampled[:, : 1 + k // 2] = 7
        self.sampled = sampled
        self.interceptor = self._bind(batch * k, n)
        # What the layers read from vLLM's forward context: their attention metadata.
        self.context = SimpleNamespace(attn_metadata={layer.layer_name: self.metadata
                                                      for layer in self.layers})

    def _bind(self, max_tokens: int, rows: int) -> NworInterceptor:
        """As ``model_runner.bind`` builds it."""
        backend = nwor_fa.FlashAttnBackend()
        layers = self.layers

        def plain_write(layer_idx, key, value, slot_mapping):
            backend.plain_write(layers[layer_idx], key, value, slot_mapping)

        stage_fn, commit_fn, write_back = backend.fused_ops(layers, self.batch, self.k, rows)
        interceptor = NworInterceptor(
            StagedLayers(len(self.layers), max(max_tokens, 1)), plain_write,
            stage_fn=stage_fn, commit_fn=commit_fn, write_back=write_back, kv_bytes_per_token=1,
            uploader=IndexUploader(3 * max_tokens + rows + 4, "cuda"),  # as bind() sizes it
            device="cuda")
        for idx, layer in enumerate(layers):
            setattr(layer, BINDING_ATTR, LayerBinding(interceptor, idx, backend.layer_state(layer)))
        return interceptor


patches.apply_all()  # as in the engine; vLLM's own functions are then the patches' originals
VLLM_UPDATE = original(fa.FlashAttentionImpl.do_kv_cache_update)
VLLM_FORWARD = original(fa.FlashAttentionImpl.forward)
NWOR_UPDATE = wrap_kv_cache_update(VLLM_UPDATE)
NWOR_FORWARD = nwor_fa._wrap_forward(VLLM_FORWARD)


@triton.jit
def _touch(flag_ptr):
    tl.store(flag_ptr, tl.load(flag_ptr) + 1)


_TOUCH = Launcher(_touch)


def vllm_update_then_triton(impl, layer, key, value, kv_cache, slot_mapping):
    """vLLM's KV update, then one Triton launch of a one-element kernel through the JIT."""
    VLLM_UPDATE(impl, layer, key, value, kv_cache, slot_mapping)
    _touch[(1,)](layer.touched)


def vllm_update_then_launcher(impl, layer, key, value, kv_cache, slot_mapping):
    """The same kernel through the compiled launcher NWOR's stage uses."""
    VLLM_UPDATE(impl, layer, key, value, kv_cache, slot_mapping)
    _TOUCH((1, 1, 1), ("touch",), (layer.touched,))


def vllm_update_then_torch(impl, layer, key, value, kv_cache, slot_mapping):
    """vLLM's KV update, then one PyTorch kernel launch (no Triton)."""
    VLLM_UPDATE(impl, layer, key, value, kv_cache, slot_mapping)
    layer.touched.add_(1)


SIDES = {"vllm": (VLLM_UPDATE, VLLM_FORWARD, False),
         "nwor": (NWOR_UPDATE, NWOR_FORWARD, True),
         "nwor_stage_only": (NWOR_UPDATE, VLLM_FORWARD, True),
         "vllm_then_triton": (vllm_update_then_triton, VLLM_FORWARD, False),
         "vllm_then_launcher": (vllm_update_then_launcher, VLLM_FORWARD, False),
         "vllm_then_torch": (vllm_update_then_torch, VLLM_FORWARD, False)}
"""Each side's KV update, attention, and whether it runs NWOR's step (begin, commit)."""


def run_step(step: Step, side: str) -> tuple[float, float, float]:
    """Issues one step; returns host seconds in all, in KV updates and in attention."""
    update, forward, nwor = SIDES[side]
    clock = time.perf_counter
    start = clock()
    with override_forward_context(step.context):
        in_update, in_forward = _run_layers(step, nwor, update, forward)
    return clock() - start, in_update, in_forward


def _run_layers(step: Step, nwor: bool, update, forward) -> tuple[float, float]:
    impl, md = step.impl, step.metadata
    key, value, query, output, slots = step.key, step.value, step.query, step.output, \
        md.slot_mapping
    clock = time.perf_counter
    if nwor:
        step.interceptor.begin(VerifyStep.from_batch(step.num_draft_tokens, step.qsl_host,
                                                     "cuda", step.interceptor.uploader))
    in_update = in_forward = 0.0
    for layer in step.layers:
        t0 = clock()
        update(impl, layer, key, value, layer.kv_cache, slots)
        t1 = clock()
        forward(impl, layer, query, key, value, layer.kv_cache, md, output)
        in_update += t1 - t0
        in_forward += clock() - t1
    if nwor:
        step.interceptor.commit(step.sampled)
    return in_update, in_forward


def measure(step: Step, side: str, steps: int) -> dict:
    host, updates, forwards, gpu = [], [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        total, in_update, in_forward = run_step(step, side)
        end.record()
        torch.cuda.synchronize()
        host.append(total)
        updates.append(in_update)
        forwards.append(in_forward)
        gpu.append(begin.elapsed_time(end) * 1e-3)
    layers = len(step.layers)
    return {"host_ms": 1e3 * statistics.median(host),
            "update_us": 1e6 * statistics.median(updates) / layers,
            "forward_us": 1e6 * statistics.median(forwards) / layers,
            "gpu_ms": 1e3 * statistics.median(gpu)}


def merge(jsonl: Path, result: Path) -> None:
    """One cell per case and label, each the median over the runs of that label; the ratio
    ``after / before`` of NWOR's host time per step where both labels ran."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["batch"], r["k"], r["no_draft_share"], r["label"]), []).append(r)
    cells = []
    for (batch, k, no_draft, label), runs in sorted(groups.items()):
        cell = {"batch": batch, "k": k, "no_draft_share": no_draft, "label": label,
                "runs": len(runs), "rows": runs[0]["rows"]}
        for side in (s for s in SIDES if s in runs[0]):
            cell[side] = {name: round(statistics.median(r[side][name] for r in runs), 4)
                          for name in runs[0][side]}
        cell["host_ratio"] = round(cell["nwor"]["host_ms"] / cell["vllm"]["host_ms"], 4)
        cells.append(cell)
    by_case = {}
    for cell in cells:
        by_case.setdefault((cell["batch"], cell["k"], cell["no_draft_share"]), {})[
            cell["label"]] = cell
    changes = [{"batch": b, "k": k, "no_draft_share": s,
                "nwor_host_ms_after_over_before": round(
                    labels["after"]["nwor"]["host_ms"] / labels["before"]["nwor"]["host_ms"], 4)}
               for (b, k, s), labels in by_case.items() if {"after", "before"} <= set(labels)]
    payload = {**recorded_environment(jsonl), "benchmark": "nwor_layer_host",
               "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                         "block_size": BLOCK, "layers": records[0]["layers"]},
               "cells": cells, "changes": changes}
    write_json(result, payload)
    print(f"wrote {result}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="current")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    for batch, k, no_draft in CASES:
        step = Step(batch, k, no_draft, args.context, args.layers)
        for side in SIDES:  # warm-up: compiles
            measure(step, side, 3)
        rounds: dict[str, list] = {side: [] for side in SIDES}
        for r in range(args.rounds):  # alternating, order reversed every other round
            for side in (list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]):
                rounds[side].append(measure(step, side, args.steps))
        row = {"label": args.label, "batch": batch, "k": k, "no_draft_share": no_draft,
               "rows": step.metadata.num_actual_tokens, "layers": args.layers}
        for side, results in rounds.items():
            row[side] = {name: round(statistics.median(r[name] for r in results), 4)
                         for name in results[0]}
        row["host_ratio"] = round(row["nwor"]["host_ms"] / row["vllm"]["host_ms"], 4)
        print(json.dumps(row), flush=True)
        append_jsonl(args.jsonl, row)

if __name__ == "__main__":
    main()
