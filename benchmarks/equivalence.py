"""NWOR on vs off under vLLM's defaults: the equivalence matrix (CPU in CI, GPU on the device).

A case runs two engines with the same settings, one at a time: NWOR off, then NWOR on. vLLM's
defaults stand (prefix caching, its own choice of async scheduling, chunked prefill, EOS live,
and on the GPU torch.compile and CUDA graphs); a case changes only what it is about, and says
why in its ``why``. Every case's workload has two rounds in one engine:

- round 1: prompts that share a long prefix (some identical), prompts longer than the step's
  token budget (chunked prefill beside verify steps), greedy requests ending at different
  ``max_tokens`` (mid-chunk);
- round 2, built from each request's round-1 output: prompts that extend a round-1 prompt with
  its output (prefix-cache hits on blocks NWOR committed), and the round-1 greedy prompts again
  with a stop token id taken from the middle of their round-1 output (a stop inside accepted
  drafts), and with a stop string where the model has a tokenizer;
- round 3: seeded sampling at temperature 0.8, one request with ``n=3``;
- round 4 (:func:`same_step_hits`): requests that read from the prefix cache a block that a
  drafting request completes in the same step.

Greedy requests must match token for token, and their logprobs bit for bit where verify
attention is vLLM's own call (FLASH_ATTN); on the CPU, NWOR's staged attention is a PyTorch
reference, so logprobs are compared within a tolerance. Seeded sampling was not reproducible
across vLLM 0.26 engines even with NWOR off (an A/A case measures it): its requests must have
identical logprobs up to the first token that differs, and are reported, not required equal.

Every NWOR-on run also checks the paged cache after every step (tests/support/cache_audit.py:
committed tokens written, nothing past them), and that its counters equal vLLM's spec-decode
stats.

Cases at ``tensor_parallel_size`` 2 (``tp2_*``, two GPUs) have their model runner in two worker
processes. There the audit rides in vLLM's plugin mechanism (tests/support/soak_audit.py, loaded
into every worker of both engines: the NWOR-off engine's audit is the negative control), and
each worker also records what it ran (tests/support/step_record.py: its rank and GPU, each target
step's CUDA graph mode, custom all-reduce, NWOR's FULL-graph steps). Every rank must have seen
the same steps and verdicts and counted the same tokens, and on CUDA replayed FULL graphs for
verify steps with custom all-reduce on.

    python -m benchmarks.equivalence [--cases NAME,...] [--out JSON]   # the matrix
    (tests/gpu/test_tensor_parallel_gpu.py runs the tp2_* cases and checks every claim above)
    python -m benchmarks.equivalence --probe SPEC_JSON OUT_JSON          # one engine

(from the repository root, as every benchmark: ``benchmarks`` is a package)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    """One row of the matrix: an engine pair (NWOR off, NWOR on) and its workload."""

    name: str
    method: str = "draft_model"  # or "ngram"
    k: int = 3
    model: dict = field(default_factory=dict)  # write_tiny_llama_pair's keywords, or shipped
    engine: dict = field(default_factory=dict)  # LLM keywords that differ from the harness's
    why: str = ""  # one line: why ``engine`` departs from vLLM's defaults
    audit: bool = True  # the per-step cache audit (NWOR on)
    nwor_both: bool = False  # an A/A control: NWOR off on both sides
    two_engines: bool = False  # NWOR on runs beside a second NWOR engine in its process
    preempt: bool = False  # a small KV cache; both sides get the same blocks for requests
    kv_tokens: int = 768  # with ``preempt``: the KV cache in tokens, vLLM's null block included
    nwor_kv_extra: int = 0  # a negative control: the NWOR side's KV cache this many tokens larger
    structured: bool = False  # the structured-output workload instead of rounds 1-4
    workload: str = "rounds"  # or "pressure" / "long_prompts" (:func:`round_pressure`, ...)
    engine_process: bool = False  # the engine core in a process of its own (LLM's default)
    fresh_compile: bool = False  # each engine compiles anew, into caches of its own
    cold_cache: bool = False  # the pair shares compile caches that start empty: off compiles
    tensor_parallel_size: int = 1  # > 1: the runner in worker processes, audited there


# Shapes for the GPU (FlashAttention 3 needs head dims of 64 or more): head dim, GQA ratio.
GPU_SHAPES = {
    "hd64_gqa2": dict(hidden_size=256, num_heads=4, num_kv_heads=2),
    "hd64_gqa1": dict(hidden_size=256, num_heads=4, num_kv_heads=4),
    "hd128_gqa4": dict(hidden_size=512, num_heads=4, num_kv_heads=1),
    "hd128_gqa8": dict(hidden_size=1024, num_heads=8, num_kv_heads=1),
}
CPU_SHAPES = {
    "hd32_gqa2": dict(hidden_size=128, num_heads=4, num_kv_heads=2),
    "hd64_gqa4": dict(hidden_size=256, num_heads=4, num_kv_heads=1),
}
# A noisy copy of the target drafts: accepted often, not always (real rejections).
DRAFT = dict(num_layers=3, draft_layers=3, draft_noise=0.08)
# Prefix caching (vLLM's default) and without it: a case name's suffix, engine keys, why's tail.
CACHING = (("", {}, ""),
           ("_no_prefix_caching", dict(enable_prefix_caching=False), "; prefix caching off"))
# Llama-3-8B's attention (32 query heads, 8 KV heads of 128) in 4 layers, random weights.
MODEL_8B = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, num_layers=4, draft_layers=1,
                draft_noise=0.08)


def cases(on_cuda: bool) -> list[Case]:
    shapes = GPU_SHAPES if on_cuda else CPU_SHAPES
    first = next(iter(shapes))
    model = {**DRAFT, **shapes[first]}
    rows = [
        Case("defaults_draft_model", model=model),
        Case("defaults_ngram", method="ngram", k=4, model=model),
        Case("aa_control_draft_model", model=model, nwor_both=True,
             why="A/A: NWOR off twice, vLLM's own spread between two engines"),
        Case("block_size_32_k5", k=5, model=model, engine=dict(block_size=32),
             why="block size 32 (vLLM's default is 16)"),
        Case("block_size_64", model=model, engine=dict(block_size=64),
             why="block size 64"),
        Case("preemption", model=model, preempt=True,
             why="a KV cache too small for the batch (num_gpu_blocks_override), to preempt"),
        Case("prefix_caching_off", model=model, engine=dict(enable_prefix_caching=False),
             why="prefix caching off, the setting every earlier test used"),
        Case("two_engines_one_process", model=model, two_engines=True,
             engine=dict(enforce_eager=True) if on_cuda else {},
             why="on the GPU no CUDA graphs: vLLM 0.26 refused a second engine's capture in one "
             "process (\"CUDA graph capturing detected at an inappropriate time\", NWOR off too)"),
    ]
    rows += [Case(f"shape_{name}", model={**DRAFT, **shape}) for name, shape in shapes.items()
             if name != first]
    if on_cuda:
        rows += cases_8b()
    # Under load: KV pressure that preempts again and again, prefix caching on and off.
    for method in ("ngram", "draft_model"):
        for suffix, off, why in CACHING:
            rows.append(Case(
                f"pressure_{method}{suffix}", method=method, model=model, preempt=True,
                kv_tokens=1024, workload="pressure",
                # On the CPU, the CPU backend's smallest block size (32), so that the 64-token
                # prefix is cached.
                engine=({} if on_cuda else dict(block_size=32)) | off,
                why="a KV cache of 1,024 tokens for 24 requests of 240-340 tokens: preempted "
                "again and again" + why))
    if on_cuda:  # EAGLE-3 on vLLM's V2 runner (its default for dense models on a GPU)
        eagle3 = {"bigram_eagle3": True, **GPU_SHAPES["hd64_gqa2"]}
        for suffix, off, why in CACHING:
            rows.append(Case(
                f"pressure_eagle3{suffix}", method="eagle3", model=eagle3, preempt=True,
                kv_tokens=1024, workload="pressure", engine=off,
                why="EAGLE-3 (the bigram pair's head) on the V2 runner, a KV cache of 1,024 "
                "tokens for 24 requests of 240-340 tokens" + why))
            rows.append(Case(
                f"tp2_long_prompts_eagle3{suffix}", method="eagle3", k=4, model=eagle3,
                tensor_parallel_size=2, workload="long_prompts",
                engine=dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256,
                            **off),
                why="EAGLE-3 on the V2 runner at tensor_parallel_size=2, prompts of 300-700 "
                "tokens over a 256-token budget" + why))
    if not on_cuda:  # vLLM's CPU engine at TP 2: two worker processes, one core each
        rows += [Case(
            f"tp2_long_prompts_{method}{suffix}", method=method, model=model,
            tensor_parallel_size=2, workload="long_prompts_small",
            engine=dict(block_size=32, max_model_len=1024, **off),
            why="tensor_parallel_size=2, 12 prompts of 150-400 tokens over the 128-token budget: "
            "prefilled in chunks beside verify steps; block size 32 for prefix-cache hits" + why)
            for method in ("draft_model", "ngram") for suffix, off, why in CACHING]
        rows += [Case(
            f"tp2_long_prompts_eagle3{suffix}", method="eagle3", k=3,
            model={"bigram_eagle3": True, **GPU_SHAPES["hd64_gqa2"]},
            tensor_parallel_size=2, workload="long_prompts_small",
            engine=dict(block_size=32, max_model_len=1024, **off),
            why="EAGLE-3 (the bigram pair's head, on the CPU's V1 runner) at "
            "tensor_parallel_size=2, prompts over the 128-token budget beside verify steps" + why)
            for suffix, off, why in CACHING]
    rows.append(Case("structured_output", model={"shipped": True}, structured=True,
                     engine=dict(max_model_len=256),
                     why="the shipped pair: a tokenizer (for grammars and stop strings) and a "
                     "trained draft; its 256 positions"))
    if on_cuda:
        rows += [Case(f"tp2_{method}", method=method, model=model, tensor_parallel_size=2,
                      why="tensor_parallel_size=2 on two GPUs, custom all-reduce on; the audit "
                      "and the step record run in every worker of both engines")
                 for method in ("draft_model", "ngram")]
        rows += [Case(f"tp2_long_prompts_{method}{suffix}", method=method, k=4, model=model,
                      tensor_parallel_size=2, workload="long_prompts",
                      engine=dict(max_model_len=1024, max_num_seqs=16,
                                  max_num_batched_tokens=256, **off),
                      why="tensor_parallel_size=2, prompts of 300-700 tokens over a 256-token "
                      "budget: prefilled in chunks beside verify steps" + why)
                 for method in ("ngram", "draft_model") for suffix, off, why in CACHING]
        rows += [
            Case("async_scheduling_on", model=model, engine=dict(async_scheduling=True),
                 audit=False, why="async scheduling on (vLLM's default is off for draft_model;"
                 " the audit needs sync steps)"),
            Case("eager", model=model, engine=dict(enforce_eager=True),
                 why="no CUDA graphs, no compile: every layer through NWOR's Python path"),
        ]
    return rows


def cases_8b() -> list[Case]:
    """Llama-3-8B's attention (4 random-weight layers) under load on the GPU: KV pressure at
    vLLM's LLM batch defaults on an H200 (1,024 sequences, 16,384 tokens) with a KV cache of
    2,048 tokens for 24 requests of 460-660, and tensor parallelism 2 with 48 prompts of
    500-1,500 tokens over a 1,024-token budget (batch 32).

    ``*_in_process``: the engine core in the caller's process, stepped as requests are added
    all at once, so both engines see the same batches. The others run the engine core in its
    own process, as ``LLM`` does by default: its first step takes the requests that have
    arrived by then, so two engines' batches differ with the plugin off too (the ``aa_*``
    rows measure it). ``*_fresh_compile``: each engine compiles on its own, into caches of its
    own, with the plugin off on both sides; ``*_cold_cache``: the first engine compiles into
    empty caches and the second loads what it wrote (vLLM's compile cache leaves the prefix
    caching setting out of its key, so a case pair with prefix caching on and one with it off
    may meet either)."""
    # 2,048 tokens for requests and vLLM's null block, which vLLM 0.32 takes off before it
    # checks that one request of max_model_len (2,048) fits.
    pressure = dict(model=MODEL_8B, preempt=True, kv_tokens=2048 + 16, workload="pressure_long")
    pressure_engine = dict(max_model_len=None, max_num_seqs=1024, max_num_batched_tokens=16384)
    tp = dict(k=4, model=MODEL_8B, tensor_parallel_size=2, workload="long_prompts_wide")
    tp_engine = dict(max_model_len=None, max_num_seqs=32, max_num_batched_tokens=1024)
    rows = []
    for suffix, off, why in CACHING:
        for method in ("ngram", "draft_model"):
            rows.append(Case(f"pressure_8b_{method}{suffix}_in_process", method=method,
                             engine={**pressure_engine, **off}, **pressure,
                             why="KV pressure, Llama-3-8B's attention" + why))
            rows.append(Case(f"tp2_wide_prompts_8b_{method}{suffix}_in_process", method=method,
                             engine={**tp_engine, **off}, **tp,
                             why="tensor_parallel_size=2, chunked prefill beside verify steps, "
                             "Llama-3-8B's attention" + why))
        rows.append(Case(f"pressure_8b_ngram{suffix}", method="ngram", engine_process=True,
                         engine={**pressure_engine, **off}, **pressure,
                         why="as pressure_8b_ngram_in_process, the engine core in its own "
                         "process" + why))
        rows.append(Case(f"aa_pressure_8b_ngram{suffix}", method="ngram", engine_process=True,
                         engine={**pressure_engine, **off}, nwor_both=True, **pressure,
                         why="A/A: NWOR off twice, the engine core in its own process" + why))
        rows.append(Case(f"tp2_wide_prompts_8b_ngram{suffix}", method="ngram",
                         engine_process=True, engine={**tp_engine, **off}, **tp,
                         why="as tp2_wide_prompts_8b_ngram_in_process, the engine core in its "
                         "own process" + why))
    rows += [
        Case("tp2_wide_prompts_8b_ngram_eager", method="ngram", engine_process=True,
             engine={**tp_engine, "enforce_eager": True}, **tp,
             why="as tp2_wide_prompts_8b_ngram, without torch.compile and CUDA graphs"),
        Case("aa_tp2_wide_prompts_8b_ngram", method="ngram", engine_process=True,
             engine=tp_engine, nwor_both=True, **tp,
             why="A/A: NWOR off twice, tensor_parallel_size=2"),
        Case("aa_pressure_8b_ngram_in_process", method="ngram", engine=pressure_engine,
             nwor_both=True, **pressure,
             why="A/A: NWOR off twice, KV pressure, the engine core in this process"),
        Case("neg_pressure_8b_ngram_in_process", method="ngram", engine=pressure_engine,
             nwor_kv_extra=64, **pressure,
             why="the negative control of the pressure rows: the NWOR side's KV cache 64 "
             "tokens larger (smaller leaves it less than one request of max_model_len), so "
             "its schedule, and then its tokens, must part"),
        Case("aa_tp2_wide_prompts_8b_ngram_cold_cache", method="ngram", engine=tp_engine,
             nwor_both=True, cold_cache=True, **tp,
             why="A/A: NWOR off twice, the engine core in this process; the first engine "
             "compiles into empty caches, the second loads what it wrote"),
        Case("aa_tp2_wide_prompts_8b_ngram_fresh_compile", method="ngram", engine=tp_engine,
             nwor_both=True, fresh_compile=True, **tp,
             why="A/A: NWOR off twice, the engine core in this process, each engine compiling "
             "on its own"),
    ]
    return rows


# -- the workload ---------------------------------------------------------------------------

PREFIX = [(11 * j) % 397 + 3 for j in range(200)]  # shared by round 1's first prompts


def round_one(vocab: int) -> list[tuple[list[int], dict]]:
    """(prompt, SamplingParams keywords) of round 1."""
    requests = []
    for i in range(6):  # a shared 200-token prefix; 0 and 1 identical
        prompt = PREFIX + [(5 * i + j) % (vocab - 3) + 3 for j in range(4 + (i > 1) * i)]
        requests.append((prompt, dict(max_tokens=[40, 40, 7, 13, 29, 33][i])))
    for i in range(4):  # longer than the token budget: prefilled in chunks beside verify steps
        prompt = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(150 + 30 * i)]
        requests.append((prompt, dict(max_tokens=24 + 5 * i)))
    return requests


def round_pressure(vocab: int, lengths: tuple[int, int] = (120, 220),
                   max_tokens: int = 120) -> list[tuple[list[int], dict]]:
    """The ``pressure`` workload: 24 greedy requests of ``lengths`` prompt tokens (half share a
    64-token prefix) and ``max_tokens`` output tokens, far more than a ``preempt`` case's KV
    cache holds: requests are preempted again and again, and resumed by recomputing their
    prompts and outputs (from prefix-cache hits where caching is on). ``pressure_long``: 300-500
    prompt tokens and 160 output tokens."""
    shared = [(17 * j) % (vocab - 3) + 3 for j in range(64)]
    low, high = lengths
    requests = []
    for i in range(24):
        own = [(5 * i + 11 * j + 1) % (vocab - 3) + 3
               for j in range(low + (i * 37) % (high - low))]
        prompt = (shared + own[64:]) if i % 2 else own
        requests.append((prompt, dict(max_tokens=max_tokens)))
    return requests


def round_long_prompts(vocab: int, count: int = 32, shared_len: int = 200,
                       lengths: tuple[int, int] = (300, 700),
                       max_tokens: int = 40) -> list[tuple[list[int], dict]]:
    """The ``long_prompts`` workload: ``count`` greedy requests whose prompts (``lengths``
    tokens, the first ``shared_len`` shared) are longer than the case's token budget, so every
    prompt is prefilled in chunks in steps that also verify other requests' drafts.
    ``long_prompts_wide``: 48 requests of 500-1,500 tokens, 300 shared, 64 output tokens."""
    shared = [(13 * j + 5) % (vocab - 3) + 3 for j in range(shared_len)]
    low, high = lengths
    return [(shared + [(7 * i + 3 * j + 2) % (vocab - 3) + 3
                       for j in range(low - shared_len + (i * 53) % (high - low))],
             dict(max_tokens=max_tokens)) for i in range(count)]


WORKLOADS = {
    "pressure": round_pressure,
    "pressure_long": lambda vocab: round_pressure(vocab, (300, 500), 160),
    "long_prompts": round_long_prompts,
    "long_prompts_wide": lambda vocab: round_long_prompts(vocab, 48, 300, (500, 1500), 64),
    "long_prompts_small": lambda vocab: round_long_prompts(vocab, 12, 130, (150, 400), 24),
}


def round_sampled(vocab: int, on_cuda: bool) -> list[tuple[list[int], dict]]:
    """Sampling at temperature 0.8, in a round of its own: vLLM 0.26 did not reproduce it
    across engines with speculative decoding, and greedy requests that share its batches would
    then meet different batch shapes. Seeded on the GPU; on the CPU a seeded request stopped the
    engine in vLLM 0.26 ("CPU Generator does not use offset", with NWOR off too; not checked on
    0.32)."""
    return [([(3 * i + 17 * j) % (vocab - 3) + 3 for j in range(20 + 9 * i)],
             dict(max_tokens=30, temperature=0.8, n=3 if i == 0 else 1,
                  **({"seed": 100 + i} if on_cuda else {})))
            for i in range(3)]


def round_two(first: list[tuple[list[int], dict]], outputs: list[list[list[int]]],
              has_tokenizer: bool) -> list[tuple[list[int], dict]]:
    """Round 2 from round 1's requests and outputs (one token list per sequence)."""
    requests = []
    for (prompt, params), out in zip(first, outputs, strict=True):
        tokens = out[0]
        if params.get("temperature") or len(tokens) < 8:
            continue
        # The prompt extended by its output: its blocks are prefix-cache hits.
        requests.append((prompt + tokens + [5, 6, 7], dict(max_tokens=20)))
        # The same prompt, stopping at a token from the middle of its output.
        stop = tokens[len(tokens) // 2]
        requests.append((prompt, dict(params, stop_token_ids=[stop])))
        if has_tokenizer:
            requests.append((prompt, dict(params, stop=["\n"])))
    return requests


STRUCTURED_PREFIX = (
    "class Rectangle:\n    def __init__(self, width, height):\n        self.width = width\n"
    "        self.height = height\n\n    def area(self):\n        return self.width * self.h"
)  # 133 bytes: a full CPU block (128) that every structured request shares


def round_structured() -> list[tuple[str, dict]]:
    """Greedy requests under a regex and a JSON schema (xgrammar masks the drafts' logits in
    the verify step), and stop strings, all after a shared prefix: (text prompt, keywords)."""
    from vllm.sampling_params import StructuredOutputsParams

    regex = StructuredOutputsParams(regex=r"(def|class) [a-z_]{2,16}\((self)?(, [a-z]+)*\):")
    schema = StructuredOutputsParams(json={
        "type": "object", "required": ["name", "sides"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "sides": {"type": "integer"}}}, disable_any_whitespace=True)
    suffixes = ["eight\n\n    ", "eight\n\n    def ", "eight\n\n# ", "eight * 2\n"]
    requests = []
    for i, suffix in enumerate(suffixes):
        prompt = STRUCTURED_PREFIX + suffix
        requests.append((prompt, dict(max_tokens=40, structured_outputs=regex)))
        requests.append((prompt, dict(max_tokens=60, structured_outputs=schema)))
        requests.append((prompt, dict(max_tokens=60, stop=["\n    def", "return"])))
        requests.append((prompt, dict(max_tokens=30 + 7 * i)))
    return requests


def same_step_hits(llm, vocab: int, block_size: int) -> list[dict]:
    """Requests that read, from the prefix cache, a block that a drafting request completes in
    the same step. Each request A first runs alone (its greedy output), then again with the
    prefix cache reset, one engine step at a time; before every step in which A's last sampled
    token will end a block, a request B joins whose prompt is A's tokens so far and one more:
    the scheduler hashes that block when it schedules A, and gives it to B in the same step,
    whose forward reads it. Returns every A and B, in the order they were added."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    # Prompts one token short of a block boundary: A's first verify step's last sampled token
    # ends that block, whatever the acceptance; later crossings land on a boundary or not.
    lengths = [block_size - 1, 2 * block_size - 1, 37, 52]
    prompts = [[(13 * i + 7 * j) % (vocab - 3) + 3 for j in range(n)]
               for i, n in enumerate(lengths)]
    solo = _generate(llm, [(p, dict(max_tokens=60)) for p in prompts])
    llm.reset_prefix_cache()
    order, done, joined = [], {}, 0
    for i, prompt in enumerate(prompts):
        a = f"a{i}"
        engine.add_request(a, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=60, logprobs=0))
        order.append(a)
        produced = 0
        while engine.has_unfinished_requests():
            length = len(prompt) + produced  # A's tokens; its last sampled one is at length - 1
            if a not in done and produced and length % block_size == 0 and joined < 4 * (i + 1):
                b = f"b{i}-{produced}"
                tokens = prompt + solo[i]["tokens"][0][:produced] + [5]
                engine.add_request(b, {"prompt_token_ids": tokens},
                                   SamplingParams(temperature=0.0, max_tokens=12, logprobs=0))
                order.append(b)
                joined += 1
            for out in engine.step():
                if out.request_id == a:
                    produced = len(out.outputs[0].token_ids)
                if out.finished:
                    done[out.request_id] = out
    if joined == 0:
        raise RuntimeError("no request joined in a step whose drafting request ends a block")
    return [summary(done[rid], sampled=False) for rid in order]


# -- one engine -----------------------------------------------------------------------------


def engine_kwargs(case: Case, paths: tuple[str, str], nwor: bool, on_cuda: bool) -> dict:
    """``LLM``'s keywords: vLLM's defaults but for what every small engine needs and
    ``case.engine``."""
    target, draft = paths
    speculative = {"method": case.method, "num_speculative_tokens": case.k}
    if case.method == "ngram":
        speculative |= {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
    else:
        speculative["model"] = draft
    if nwor:
        speculative["nwor"] = True
    kwargs = dict(
        model=target, speculative_config=speculative,
        skip_tokenizer_init=not Path(target, "tokenizer.json").exists(),
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,  # a small token budget
        gpu_memory_utilization=0.15 if on_cuda else 0.3, disable_log_stats=False, seed=0,
        dtype="bfloat16" if on_cuda else "float32",
    )
    if case.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = case.tensor_parallel_size
    if case.preempt:
        # case.kv_tokens of KV cache, the same blocks for requests on both sides: NWOR keeps
        # its scratch blocks out of the override, so NWOR off gets the override less them.
        from vllm_nwor.nwor.kernels.scratch import scratch_blocks

        block_size = case.engine.get("block_size", default_block_size(on_cuda))
        max_num_seqs = case.engine.get("max_num_seqs", kwargs["max_num_seqs"])
        reserved = scratch_blocks(max_num_seqs, case.k, block_size)[1]
        tokens = case.kv_tokens + (case.nwor_kv_extra if nwor else 0)
        kwargs["num_gpu_blocks_override"] = tokens // block_size + (reserved if nwor else 0)
    # A case's None restores vLLM's own default for a key the harness sets.
    return {k: v for k, v in {**kwargs, **case.engine}.items() if v is not None}


def default_block_size(on_cuda: bool) -> int:
    """vLLM's block size when none is given: 16 on CUDA, 128 on the CPU."""
    return 16 if on_cuda else 128


def _generate(llm, requests) -> list[dict]:
    from vllm import SamplingParams

    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p, _ in requests]
    # Greedy unless a request says otherwise (SamplingParams' own default is temperature 1).
    params = [SamplingParams(logprobs=0, **{"temperature": 0.0, **kw}) for _, kw in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [summary(o, sampled=bool(kw.get("temperature")))
            for o, (_, kw) in zip(outputs, requests, strict=True)]


def summary(output, sampled: bool) -> dict:
    """A finished ``RequestOutput``: each sequence's tokens, their logprobs, how it ended."""
    return {
        "tokens": [list(c.token_ids) for c in output.outputs],
        "logprobs": [[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
                     for c in output.outputs],
        "finish": [c.finish_reason for c in output.outputs],
        "stop": [c.stop_reason for c in output.outputs],
        "sampled": sampled,
    }


def use_compile_caches(root: Path) -> None:
    """vLLM's, Inductor's and Triton's compile caches under ``root`` for this process and its
    workers (set before the engine starts)."""
    os.environ.update(VLLM_CACHE_ROOT=str(root / "vllm"),
                      TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
                      TRITON_CACHE_DIR=str(root / "triton"))


def run_engine(spec: dict) -> dict:
    """One engine (in this process, its workers beside it under tensor parallelism): the
    rounds, the cache audit, the counters."""
    # The engine core in this process, also under tensor parallelism (its workers are processes
    # of their own either way): in a process of its own it would start stepping as the first
    # requests arrive, and how many requests a step sees, so the two engines' batches and their
    # bf16 sums, would depend on timing NWOR has no part in.
    if spec["case"].get("engine_process"):  # as LLM runs it by default, timing and all
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec["case"].get("fresh_compile"):  # caches of its own: nothing compiled is reused
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        use_compile_caches(Path(tempfile.mkdtemp(prefix="fresh-compile-")))
    if spec.get("cache_dir"):  # the pair's own caches, empty before its first engine
        use_compile_caches(Path(spec["cache_dir"]))
    import gc

    from vllm import LLM

    import vllm_nwor
    from tests.support.cache_audit import (
        CacheAudit,
        read_cpu_attn_tokens,
        read_flash_attn_tokens,
        runner_of,
    )
    from tests.support.soak_audit import ENV_DIR
    from tests.support.step_record import StepRecorder
    from vllm_nwor.patches.nwor.model_runner import attention_layers

    case, on_cuda, nwor = Case(**spec["case"]), spec["on_cuda"], spec["nwor"]
    tensor_parallel = case.tensor_parallel_size > 1
    remote = tensor_parallel or case.engine_process  # the runners in other processes
    if remote and not os.environ.get(ENV_DIR):
        raise RuntimeError(f"{case.name}: this engine's runners are in other processes; run it "
                           "through probe(), which loads the audit plugin into them")
    kwargs = engine_kwargs(case, tuple(spec["paths"]), nwor, on_cuda)
    llm = LLM(**kwargs)
    config = llm.llm_engine.vllm_config
    runner = audit = steps = other = None
    if not remote:
        runner = runner_of(llm)
        if case.two_engines and nwor:  # a second NWOR engine here, bound after this one
            other_case = Case(**{**spec["case"], "k": case.k + 1})
            other = LLM(**engine_kwargs(other_case, tuple(spec["paths"]), True, on_cuda))
    block_size = config.cache_config.block_size
    if runner is not None and case.audit and nwor:
        read = read_flash_attn_tokens if on_cuda else read_cpu_attn_tokens
        audit = CacheAudit(runner, attention_layers(runner.get_model()), read, block_size)
    if runner is not None:
        steps = StepRecorder(runner)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    has_tokenizer = not kwargs["skip_tokenizer_init"]
    if case.structured:
        outputs = _generate(llm, round_structured())
    elif case.workload != "rounds":
        outputs = _generate(llm, WORKLOADS[case.workload](vocab))
    else:
        first = round_one(vocab)
        out1 = _generate(llm, first)
        if other is not None:  # the other engine runs between this one's rounds
            _generate(other, first[:4])
        second = round_two(first, [o["tokens"] for o in out1], has_tokenizer)
        out2 = _generate(llm, second)
        out3 = _generate(llm, round_sampled(vocab, on_cuda))
        outputs = out1 + out2 + out3 + same_step_hits(llm, vocab, block_size)
    metrics = {m.name: m for m in llm.get_metrics()}
    rank_counters = llm.collective_rpc("nwor_counters")
    counters_error = None
    try:
        counters = vllm_nwor.get_counters(llm)
    except RuntimeError as error:  # the ranks counted differently: recorded, judged by checks()
        counters, counters_error = None, str(error)
    settings = {
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "block_size": block_size,
        "runner": "V2" if config.use_v2_model_runner else "V1",
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        # the KV cache in blocks where a case sets it (NWOR's side: its scratch blocks too)
        "num_gpu_blocks_override": config.cache_config.num_gpu_blocks_override,
    }
    if runner is not None:
        settings |= {
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            "cudagraph_mode": str(runner.compilation_config.cudagraph_mode),
            "attention": type(attention_layers(runner.get_model())[0].impl).__name__,
        }
        verify_steps, hits_beside_verify = steps.verify_steps, steps.hits_beside_verify
        prefill_beside_verify = steps.prefill_beside_verify
        audit = None if audit is None else {
            "violations": audit.violations[:10], "num_violations": len(audit.violations),
            "rejected_drafts": audit.rejected_drafts, "checked_tokens": audit.checked_tokens}
    else:
        ranks = worker_audits(Path(os.environ[ENV_DIR]))
        worker = ranks[0]["worker"] if ranks else {}
        settings |= {key: worker.get(key) for key in
                     ("async_scheduling", "cudagraph_mode", "attention")}
        settings |= {"custom_all_reduce": [r["worker"]["custom_all_reduce"] for r in ranks],
                     "gpus": [r["worker"]["device"] for r in ranks]}
        verify_steps, hits_beside_verify = (worker.get("verify_steps", 0),
                                            worker.get("hits_beside_verify", 0))
        prefill_beside_verify = worker.get("prefill_beside_verify", 0)
        audit = combined_audit(ranks)
    result = {
        "outputs": outputs,
        "drafted": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "preemptions": int(metrics["vllm:num_preemptions"].value),
        "prefix_cache_hits": int(metrics["vllm:prefix_cache_hits"].value),
        "counters": None if counters is None else counters.as_dict(),
        "verify_steps": verify_steps,
        "hits_beside_verify": hits_beside_verify,
        "prefill_beside_verify": prefill_beside_verify,
        "settings": settings,
        "audit": audit,
    }
    if tensor_parallel:
        result |= {"rank_counters": rank_counters, "counters_error": counters_error}
    elif counters_error is not None:
        raise RuntimeError(counters_error)
    for engine in (llm, other):
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
    del llm, other
    gc.collect()
    return result


AUDIT_KEYS = ("steps", "verify_steps", "drafted", "accepted", "rejected", "checked_tokens",
              "cache_violations", "counter_violations", "fallbacks", "counters")


def worker_audits(directory: Path) -> list[dict]:
    """Each worker's audit (tests/support/soak_audit.py) and record of what it ran, by rank."""
    from tests.support.soak_audit import read_status

    ranks = [{"tp_rank": status["worker"]["tp_rank"],
              **{key: status[key] for key in AUDIT_KEYS},
              "violations": (status["cache_violation_samples"]
                             + status["counter_violation_samples"])[:10],
              "worker": status["worker"]} for status in read_status(directory)]
    return sorted(ranks, key=lambda rank: rank["tp_rank"])


def combined_audit(ranks: list[dict]) -> dict | None:
    """The workers' audits as one run's (the keys an in-process audit has), each rank's beside:
    violations of every rank, drafts and tokens as rank 0 counted them (the ranks must agree,
    :func:`tp_checks`)."""
    if not ranks:
        return None
    violations = [f"rank {r['tp_rank']}: {v}" for r in ranks for v in r["violations"]]
    return {"violations": violations[:10],
            "num_violations": sum(r["cache_violations"] + r["counter_violations"] for r in ranks),
            "rejected_drafts": ranks[0]["rejected"], "checked_tokens": ranks[0]["checked_tokens"],
            "ranks": ranks}


def probe(spec: dict, timeout: int = 900) -> dict:
    """:func:`run_engine` in a fresh process (one engine at a time on a GPU). A tensor-parallel
    case gets the audit plugin in its workers, reporting to a directory of its own."""
    from tests.support import engine_trace, pythonpath, soak_audit

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ)
        env.pop(soak_audit.ENV_DIR, None)
        env.pop(engine_trace.ENV_DIR, None)
        if spec["case"].get("tensor_parallel_size", 1) > 1 and not spec["on_cuda"]:
            # vLLM's CPU workers, one core each (its automatic binding wants a NUMA node each).
            cpus = sorted(os.sched_getaffinity(0))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cpus[:2])))
        def load_plugin(plugin_path: str) -> None:  # a test-only vLLM plugin, in every process
            env["PYTHONPATH"] = pythonpath(plugin_path, env=env)

        env["PYTHONPATH"] = pythonpath(env=env)  # the repository root: -m benchmarks.equivalence
        if spec["case"].get("tensor_parallel_size", 1) > 1 or spec["case"].get("engine_process"):
            load_plugin(soak_audit.install(Path(tmp) / "site"))
            env[soak_audit.ENV_DIR] = str(Path(tmp) / "audit")
            (Path(tmp) / "audit").mkdir()
        if spec.get("trace"):  # the per-step trace, in the engine core and rank 0's worker
            load_plugin(engine_trace.install(Path(tmp) / "trace-site"))
            env[engine_trace.ENV_DIR] = spec["trace"]
            Path(spec["trace"]).mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.equivalence", "--probe",
                                   json.dumps(spec), str(out)], capture_output=True, text=True,
                                  timeout=timeout, env=env)
        except subprocess.TimeoutExpired as hung:  # what it printed before it was killed
            stderr = hung.stderr.decode(errors="replace") if isinstance(hung.stderr, bytes) \
                else (hung.stderr or "")
            raise RuntimeError(f"probe timed out after {timeout} s ({spec['case']['name']}, "
                               f"nwor={spec['nwor']}):\n{stderr[-4000:]}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"probe failed ({spec['case']['name']}, nwor={spec['nwor']}):\n"
                               f"{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


# -- comparing two runs ---------------------------------------------------------------------


def compare(off: dict, on: dict, logprob_atol: float) -> dict:
    """Greedy sequences token for token (and logprobs within ``logprob_atol``, 0 = bit for
    bit); sampled sequences: logprobs identical up to their first differing token, and whether
    their tokens are identical too (``sampled_tokens_exact``, required of seeded requests on two
    GPUs by :func:`tp_checks`)."""
    same = total = 0
    greedy_exact, logprobs_exact, sampled_logprobs_exact = True, True, True
    sampled_exact = True
    mismatches = []
    for i, (a, b) in enumerate(zip(off["outputs"], on["outputs"], strict=True)):
        for s, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            n = min(len(ta), len(tb))
            agree = next((j for j in range(n) if ta[j] != tb[j]), n)
            same += agree
            total += max(len(ta), len(tb))
            la, lb = a["logprobs"][s][:agree], b["logprobs"][s][:agree]
            close = all(abs(x - y) <= logprob_atol for x, y in zip(la, lb, strict=True))
            if a["sampled"]:
                sampled_logprobs_exact &= close
                sampled_exact &= ta == tb and a["finish"][s] == b["finish"][s]
                continue
            if ta != tb or a["finish"][s] != b["finish"][s]:
                greedy_exact = False
                mismatches.append({"request": i, "seq": s, "first_difference": agree})
            logprobs_exact &= close
    return {"exact": greedy_exact and logprobs_exact and sampled_logprobs_exact,
            "greedy_tokens_exact": greedy_exact, "greedy_logprobs_exact": logprobs_exact,
            "sampled_logprobs_exact_to_first_difference": sampled_logprobs_exact,
            "sampled_tokens_exact": sampled_exact,
            "agreement": same / max(total, 1), "mismatches": mismatches[:10]}


def checks(on: dict, case: Case) -> list[str]:
    """What must hold of a NWOR-on run (a case's row: the NWOR-on run's numbers and the
    comparison's); each failure as a line."""
    failed = []
    counters = on["counters"]
    if on.get("counters_error"):
        return [on["counters_error"], *tp_checks(on, case.tensor_parallel_size)]
    if counters is None:
        return ["no NWOR counters: NWOR is off"]
    if counters["fallbacks"]:
        failed.append(f"fallbacks {counters['fallbacks']}")
    if case.two_engines:  # vLLM's metrics are per process: both engines add to them
        if on["audit"] and counters["tokens_rejected"] != on["audit"]["rejected_drafts"]:
            failed.append(f"rejected {counters['tokens_rejected']} != the sampler's "
                          f"{on['audit']['rejected_drafts']}")
        return failed
    if on["settings"]["async_scheduling"]:
        # vLLM verifies, one step late, drafts of requests that ended in the step before;
        # its stats leave those out, NWOR counts what it staged and committed.
        if counters["tokens_staged"] < on["drafted"]:
            failed.append(f"staged {counters['tokens_staged']} < vLLM's drafted {on['drafted']}")
        return failed
    if counters["tokens_staged"] != on["drafted"]:
        failed.append(f"staged {counters['tokens_staged']} != vLLM's drafted {on['drafted']}")
    if counters["tokens_committed"] != on["accepted"]:
        failed.append(f"committed {counters['tokens_committed']} != vLLM's accepted "
                      f"{on['accepted']}")
    if not 0 < on["accepted"] < on["drafted"]:
        failed.append(f"no partial acceptance ({on['accepted']} of {on['drafted']})")
    if on["audit"] is not None and on["audit"]["num_violations"]:
        failed.append(f"cache audit: {on['audit']['violations'][:3]}")
    if on["prefix_cache_hits"] == 0 and on["settings"]["enable_prefix_caching"]:
        failed.append("no prefix-cache hits")
    if case.preempt and on["preemptions"] == 0:
        failed.append("no preemption")
    if case.tensor_parallel_size > 1:
        failed += tp_checks(on, case.tensor_parallel_size)
    return failed


def tp_checks(on: dict, tp: int) -> list[str]:
    """What must hold of a tensor-parallel NWOR-on run's ranks (a row of :func:`run_case`):
    every rank audited, with the same steps and verdicts, and the same token counters; on CUDA
    each rank with custom all-reduce on, verify steps replayed as FULL graphs that NWOR staged
    in, seeded sampling giving NWOR off's tokens, and NWOR off's ranks agreeing among
    themselves (else the baseline is broken, not NWOR)."""
    ranks = (on.get("audit") or {}).get("ranks") or []
    if [r["tp_rank"] for r in ranks] != list(range(tp)):
        return [f"audited ranks {[r['tp_rank'] for r in ranks]}, expected 0 to {tp - 1}"]
    failed = []
    seen = {(r["steps"], r["drafted"], r["accepted"]) for r in ranks}
    if len(seen) > 1:
        failed.append(f"ranks saw different (steps, drafted, accepted): {sorted(seen)}")
    tokens = [{k: v for k, v in (c or {}).items() if k != "rejected_kv_bytes"}
              for c in on.get("rank_counters") or []]
    if len(tokens) != tp or any(t != tokens[0] for t in tokens):
        failed.append(f"NWOR's counters by rank differ: {tokens}")
    for rank in ranks:
        worker, name = rank["worker"], f"rank {rank['tp_rank']}"
        if worker["device_type"] != "cuda":
            continue
        if not worker["custom_all_reduce"]:
            failed.append(f"{name}: custom all-reduce is off")
        if not 0 < (worker["nwor_graph_steps"] or 0) <= worker["full_verify_steps"]:
            failed.append(f"{name}: {worker['nwor_graph_steps']} staged steps in FULL graphs, "
                          f"{worker['full_verify_steps']} FULL verify steps "
                          f"({worker['dispatches']})")
    if ranks and ranks[0]["worker"]["device_type"] == "cuda":
        if not on.get("sampled_tokens_exact", True):
            failed.append("seeded sampled tokens differ from NWOR off's")
        # The baseline: vLLM alone shares no verdict, so its ranks agree only if they drew
        # alike (seeded on the GPU; on the CPU, unseeded, they did not always).
        off = ((on.get("off") or {}).get("audit") or {}).get("ranks") or []
        if len({(r["steps"], r["drafted"], r["accepted"]) for r in off}) > 1:
            failed.append("NWOR off: vLLM's ranks saw different (steps, drafted, accepted): "
                          f"{sorted({(r['steps'], r['drafted'], r['accepted']) for r in off})}")
    return failed


def run_case(case: Case, paths: tuple[str, str], on_cuda: bool, run=probe,
             trace: Path | None = None) -> dict:
    """Both engines of a case, one after the other, and the row. ``trace``: each engine writes
    its per-step trace under ``trace/<case>/{off,on}`` (tests/support/engine_trace.py), and the row
    names the first step at which they part."""
    spec = {"case": asdict(case), "paths": list(paths), "on_cuda": on_cuda}
    if case.cold_cache:  # the first engine compiles into it, the second loads what it wrote
        spec["cache_dir"] = tempfile.mkdtemp(prefix="cold-cache-")
    dirs = {side: str(Path(trace) / case.name / side) for side in ("off", "on")} if trace else {}
    off = run({**spec, "nwor": False, "trace": dirs.get("off")})
    on = run({**spec, "nwor": not case.nwor_both, "trace": dirs.get("on")})
    result = compare(off, on, logprob_atol=0.0)
    if trace:
        from tests.support import engine_trace

        traces = {side: engine_trace.read(Path(d)) for side, d in dirs.items()}
        result["trace"] = {side: engine_trace.summary(t) for side, t in traces.items()}
        result["trace"]["first_difference"] = engine_trace.first_difference(
            traces["off"], traces["on"])
    row = {
        "name": case.name, "why": case.why,
        "settings": {**on["settings"], "method": case.method, "num_speculative_tokens": case.k,
                     "model": case.model, **{k: v for k, v in case.engine.items()}},
        **result, "checks_failed": [],
        "drafted": on["drafted"], "accepted": on["accepted"], "counters": on["counters"],
        "off": {"drafted": off["drafted"], "accepted": off["accepted"],
                "preemptions": off["preemptions"]},
        "preemptions": on["preemptions"], "prefix_cache_hits": on["prefix_cache_hits"],
        "verify_steps": on["verify_steps"], "hits_beside_verify": on["hits_beside_verify"],
        "prefill_beside_verify": on["prefill_beside_verify"],
        "audit": on["audit"],
    }
    if case.tensor_parallel_size > 1:
        # Each rank's counters, and the NWOR-off engine's audit: the negative control, which
        # finds the rejected drafts vLLM's plain write put in every rank's cache.
        row |= {"rank_counters": on["rank_counters"], "counters_error": on["counters_error"]}
        row["off"] |= {"audit": off["audit"], "settings": off["settings"]}
    failed = [] if case.nwor_both else checks(row, case)
    if case.preempt and off["preemptions"] != on["preemptions"]:
        failed.append(f"preemptions differ: {off['preemptions']} off, {on['preemptions']} on")
    row["checks_failed"] = failed
    return row


def model_paths(model: dict, root: Path) -> tuple[str, str]:
    from vllm_nwor.testing import shipped_pair, write_tiny_llama_pair

    if model.get("shipped"):  # the checkout's models/, also where the package is installed apart
        return shipped_pair(HERE.parent / "models")
    where = root / "-".join(f"{k}{v}" for k, v in sorted(model.items()))
    shape = {k: v for k, v in model.items() if k != "bigram_eagle3"}
    draft = "eagle3" if model.get("bigram_eagle3") else "draft"  # an EAGLE-3 head, or a model
    if (where / draft / "config.json").exists():
        return str(where / "target"), str(where / draft)
    if model.get("bigram_eagle3"):  # a target and an EAGLE-3 head that is right now and then
        from vllm_nwor.testing import write_bigram_eagle_pair

        return write_bigram_eagle_pair(where, eagle3=True, **shape)
    return write_tiny_llama_pair(where, **model)


def merge(paths: list[Path], out: Path, on_cuda: bool = True) -> None:
    """One result file from runs split over several calls (a device call runs a few cases):
    each case's checks recomputed by this code; runs of another plugin commit (the fix taken
    out) and cases that are negative controls (``nwor_kv_extra``) go under
    ``negative_controls``."""
    from benchmarks.harness.results import write_json

    runs = [json.loads(Path(p).read_text()) for p in paths]
    known = {c.name: c for c in cases(on_cuda)}
    payload = {k: v for k, v in runs[0].items() if k != "cases"} | {"cases": []}
    for run in runs:
        for row in run["cases"]:
            case = known.get(row["name"])
            if case is not None and "error" not in row and not case.nwor_both:
                row["checks_failed"] = checks(row, case)
            same_commit = run["commit"].split("+")[0] == payload["commit"].split("+")[0]
            if same_commit and not (case and case.nwor_kv_extra):
                payload["cases"].append(row | {"commit": run["commit"]})
            else:
                payload.setdefault("negative_controls", []).append(row | {"commit": run["commit"]})
    write_json(out, payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", nargs=2, metavar=("SPEC", "OUT"))
    parser.add_argument("--merge", nargs="+", type=Path, help="result files to merge into --out")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--out", type=Path, help="the result JSON")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "nwor-eq")
    parser.add_argument("--trace", type=Path, help="write each engine's per-step trace here and "
                        "name the first step where NWOR off and on part")
    args = parser.parse_args()
    if args.probe:
        result = run_engine(json.loads(args.probe[0]))
        Path(args.probe[1]).write_text(json.dumps(result))
        return
    if args.merge:
        merge(args.merge, args.out)
        return
    import torch

    on_cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if on_cuda else 0
    chosen = [c for c in cases(on_cuda)
              if not args.cases or c.name in args.cases.split(",")]
    if on_cuda and (more := [c.name for c in chosen if c.tensor_parallel_size > gpus]):
        print(f"left out, they need more than the {gpus} GPU(s) here: {more}", flush=True)
        chosen = [c for c in chosen if c.tensor_parallel_size <= gpus]
    where = "gpu" if on_cuda else "cpu"
    out = args.out or HERE / "results" / f"equivalence_{where}_{datetime.date.today()}.json"
    run_matrix(chosen, args.models, out, on_cuda, trace=args.trace)


def run_matrix(chosen: list[Case], models: Path, out: Path, on_cuda: bool,
               keep: bool = False, trace: Path | None = None) -> dict:
    """The cases one after the other, the result file written after each (a case that fails is
    a row with its error, not the end of the matrix); returns the file's payload. ``keep``: the
    rows ``out`` already holds stay, but for those of the cases run now."""
    from benchmarks.harness.results import environment, write_json

    names = {case.name for case in chosen}
    kept = json.loads(out.read_text())["cases"] if keep and out.exists() else []
    payload = {**environment(), "cases": [row for row in kept if row["name"] not in names]}
    for case in chosen:
        start = time.perf_counter()
        try:
            row = run_case(case, model_paths(case.model, models), on_cuda, trace=trace)
        except Exception as error:
            row = {"name": case.name, "exact": False, "error": str(error)[-2000:]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        payload["cases"].append(row)
        print(json.dumps({k: row.get(k) for k in ("name", "exact", "agreement", "preemptions",
                                                   "checks_failed", "error", "seconds",
                                                   "trace")}),
              flush=True)
        write_json(out, payload)
    return payload

if __name__ == "__main__":
    main()
