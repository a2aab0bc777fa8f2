"""NWOR's KV capacity cost on the GPU: the blocks it keeps from the scheduler, and the
preemptions that costs under a saturating load, NWOR off against on at the same
``gpu_memory_utilization``.

Each engine runs in a fresh process, one after the other (``--order``: off, on, then off again,
what two plugin-off runs differ by), with vLLM's defaults but for the speculative
config (``ngram``, k = 3, NWOR on or off) and ``--memory``. The model is Llama-3-8B-shaped,
32 layers, random weights (``load_format="dummy"``). The load: ``--requests`` greedy requests
of ``--prompt-len`` tokens and ``--output-len`` output tokens, all submitted at once, far more
tokens than the KV cache holds, so the scheduler runs as many as fit and preempts when decode
steps need blocks it no longer has. Per engine: the KV blocks vLLM sized, those NWOR kept for
its scratch blocks and their share, the scheduler's blocks, vLLM's preemption counter, the
generated tokens and the wall time of ``LLM.generate``.

    python -m benchmarks.capacity --jsonl $OUT/capacity.jsonl     # on the GPU
    python -m benchmarks.capacity --merge $OUT/capacity.jsonl --result <json>
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.engines import prompts, write_models
from benchmarks.harness.results import (
    append_jsonl,
    parse_or_merge,
    recorded_environment,
    write_json,
)

K = 3


def engine_kwargs(target: str, nwor: bool, memory: float | None) -> dict:
    speculative = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2}
    if nwor:
        speculative["nwor"] = True
    kwargs = dict(model=target, load_format="dummy", skip_tokenizer_init=True,
                  disable_log_stats=False, seed=0, speculative_config=speculative)
    if memory is not None:
        kwargs["gpu_memory_utilization"] = memory
    return kwargs


def run_engine(spec: dict) -> dict:
    """One engine in this process: start, read its KV blocks, run the load."""
    from vllm import LLM, SamplingParams

    import vllm_nwor.inspect as inspect

    llm = LLM(**engine_kwargs(spec["target"], spec["nwor"], spec["memory"]))
    config = llm.llm_engine.vllm_config
    scheduler_blocks = config.cache_config.num_gpu_blocks
    reserved = inspect.reserved_kv_blocks(llm)
    batch = prompts(spec["requests"], seed=1, length=spec["prompt_len"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    wall = time.perf_counter() - start
    metrics = {m.name: m for m in llm.get_metrics()}
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "nwor": spec["nwor"],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "kv_blocks": scheduler_blocks + reserved,
        "nwor_reserved_blocks": reserved,
        "reserved_share": reserved / (scheduler_blocks + reserved),
        "scheduler_blocks": scheduler_blocks,
        "block_size": config.cache_config.block_size,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "preemptions": int(metrics["vllm:num_preemptions"].value),
        "drafted": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "generated_tokens": generated,
        "wall_s": wall,
        "output_tokens_per_s": generated / wall,
    }


def probe(spec: dict) -> dict:
    """:func:`run_engine` in a fresh process (engines on one GPU start one at a time)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.capacity", "--probe",
                               json.dumps(spec), str(out)], cwd=Path(__file__).parents[1],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"engine (nwor={spec['nwor']}) failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="capacity-"))
    target, _ = write_models(root)
    spec = dict(target=target, memory=args.memory, requests=args.requests,
                prompt_len=args.prompt_len, output_len=args.output_len)
    order = [side == "on" for side in args.order.split(",")]
    runs = []
    for i, nwor in enumerate(order):
        run = probe({**spec, "nwor": nwor}) | {"order": i}
        print(json.dumps(run), flush=True)
        runs.append(run)
        append_jsonl(args.jsonl, {"run": run, "workload": {**spec, "k": K, "method": "ngram"}})


def merge(jsonl: Path, result: Path, note: str | None = None) -> None:
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    runs = [r["run"] for r in records]
    off = [r for r in runs if not r["nwor"]]
    on = [r for r in runs if r["nwor"]]
    if not off or not on:
        raise SystemExit(f"{jsonl}: needs runs with NWOR off and on")
    summary = {
        "nwor_reserved_blocks": on[0]["nwor_reserved_blocks"],
        "kv_blocks": on[0]["kv_blocks"],
        "reserved_share": on[0]["reserved_share"],
        "preemptions_off": [r["preemptions"] for r in off],
        "preemptions_on": [r["preemptions"] for r in on],
        "preemptions_on_over_off": (
            on[0]["preemptions"] / off[0]["preemptions"] if off[0]["preemptions"] else None),
    }
    workload = {k: v for k, v in records[0]["workload"].items() if k != "target"}
    write_json(result, {**recorded_environment(jsonl), "workload": workload,
                        "model": "Llama-3-8B shape (32 layers), dummy weights, bf16",
                        **({"note": note} if note else {}), "summary": summary, "runs": runs})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory", type=float, default=None,
                   help="gpu_memory_utilization for every engine (default: vLLM's)")
    p.add_argument("--requests", type=int, default=1536)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--order", default="off,on,off",
                   help="the engines, one after the other: off / on, comma-separated (a second "
                   "off is the A/A control; one side alone to run the two sides on two GPUs)")
    p.add_argument("--note", help="with --merge: how the run was placed (recorded)")
    p.add_argument("--probe", nargs=2, metavar=("SPEC_JSON", "OUT_JSON"), help="one engine")
    return p


if __name__ == "__main__":
    cli = parser()
    args = parse_or_merge(cli, lambda jsonl, result: merge(jsonl, result, cli.parse_args().note))
    if args is not None and args.probe:
        spec_json, out = args.probe
        Path(out).write_text(json.dumps(run_engine(json.loads(spec_json))))
    elif args is not None:
        main(args)
