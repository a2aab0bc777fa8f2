"""NWOR on the shipped pair: real text, a draft that is right sometimes, plugin off vs on.

Runs vLLM 0.26's CPU engine with the committed byte-level pair (``models/pystd-target`` and
``models/pystd-draft``, trained on the Python standard library by ``scripts/train_pair.py``) and
``draft_model`` speculative decoding, k=3, once per mode. It prints the completions as text,
vLLM's spec-decode stats, NWOR's counters and the throughput of each mode.

Each mode runs in its own engine, one after the other: vLLM's metrics live in one process-wide
registry. The first pass over the prompts warms the engine and gives the text and the stats;
the passes after it are timed.

Run it with ``make demo-pair`` (which builds the environment first).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM, SamplingParams  # noqa: E402

import vllm_nwor  # noqa: E402
from vllm_nwor.testing import shipped_pair  # noqa: E402

K = 3
MAX_TOKENS = 96
TIMED_PASSES = 3
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    '    STATUS_OK = 0\n    STATUS_ERROR = 1\n    STATUS_BUSY = 2\n    STATUS_LOCKED = 3\n',
    'def parse_header(line):\n    """Parse a Content-Type like header.\n\n    Return the main ',
    "    try:\n        with open(filename, 'rb') as f:\n            data = f.read()\n    except ",
    "# Copyright 2026. Naïve façade: ünïcödé in comments ✓\nλ = lambda ζ: ζ ** 2\n",
]
# The plugin's keys per mode, added to the speculative config; "off" is vLLM alone.
MODES: dict[str, dict] = {
    "off": {},
    "nwor": {"nwor": True},
}


@dataclass
class ModeRun:
    name: str
    texts: list[str]
    tokens: int
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_position: list[int]
    counters: vllm_nwor.NworCounters | None
    seconds: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds)


def spec_decode_snapshot(llm: LLM) -> dict:
    metrics = {m.name: m for m in llm.get_metrics()}
    return {
        "drafts": int(metrics["vllm:spec_decode_num_drafts"].value),
        "draft_tokens": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "accepted_per_position": list(
            metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    }


def run_mode(name: str, plugin_keys: dict, target: str, draft: str) -> ModeRun:
    speculative = {"method": "draft_model", "model": draft, "num_speculative_tokens": K,
                   **plugin_keys}
    # max_model_len defaults to the pair's context, 256 tokens (bytes).
    llm = LLM(model=target, dtype="float32", block_size=16, max_num_seqs=8,
              max_num_batched_tokens=256, enforce_eager=True, gpu_memory_utilization=0.3,
              disable_log_stats=False, seed=0, speculative_config=speculative)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = spec_decode_snapshot(llm)
        counters = vllm_nwor.get_counters(llm)
        seconds = []
        for _ in range(TIMED_PASSES):
            start = time.perf_counter()
            llm.generate(PROMPTS, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return ModeRun(name=name, texts=[o.outputs[0].text for o in outputs],
                   tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                   counters=counters, seconds=seconds, **stats)


def print_completions(run: ModeRun) -> None:
    for i, (prompt, text) in enumerate(zip(PROMPTS, run.texts, strict=True)):
        print(f"--- request {i}: prompt, then [completion] ---")
        print(f"{prompt}[{text}]\n")


def print_spec_decode(run: ModeRun) -> None:
    per_position = ", ".join(f"{a / run.drafts:.2f}" for a in run.accepted_per_position)
    print(f"vLLM spec decode ({run.name}):")
    print(f"  {run.drafts} drafts of {K} tokens; {run.accepted} of {run.draft_tokens} draft "
          f"tokens accepted ({run.accepted / run.draft_tokens:.2f})")
    print(f"  mean acceptance length {1 + run.accepted / run.drafts:.2f} tokens per draft "
          "(the target's own token included)")
    print(f"  acceptance by draft position: {per_position}")


def print_table(runs: list[ModeRun]) -> None:
    keys = [k for k in vllm_nwor.NworCounters().as_dict() if k != "fallbacks"]
    header = f"{'':22s}" + "".join(f"{run.name:>14s}" for run in runs)
    print(header)
    print("-" * len(header))
    for key in keys:
        cells = [run.counters.as_dict()[key] if run.counters else "-" for run in runs]
        print(f"{key:22s}" + "".join(f"{cell:>14}" for cell in cells))
    fallbacks = [str(run.counters.fallbacks or "none") if run.counters else "-" for run in runs]
    print(f"{'fallbacks':22s}" + "".join(f"{cell:>14s}" for cell in fallbacks))
    print(f"{'draft acceptance':22s}"
          + "".join(f"{run.accepted / run.draft_tokens:>14.2f}" for run in runs))
    print(f"{'tokens/s (median)':22s}" + "".join(f"{run.tokens_per_second:>14.1f}" for run in runs))
    base = runs[0].tokens_per_second
    print(f"{'vs ' + runs[0].name:22s}" + "".join(
        f"{run.tokens_per_second / base:>13.2f}x" for run in runs))


def main() -> None:
    target, draft = shipped_pair()
    print(f"vllm-nwor demo: shipped byte-level pair, draft_model speculation, k={K}, "
          f"{len(PROMPTS)} requests x {MAX_TOKENS} tokens, fp32 on the CPU\n")
    runs = [run_mode(name, keys, target, draft) for name, keys in MODES.items()]
    nwor = next(run for run in runs if run.name == "nwor")

    print_completions(nwor)
    print_spec_decode(nwor)
    print(f"\nNWOR counters and throughput ({TIMED_PASSES} timed passes per mode; on the CPU "
          "NWOR's staged steps use the PyTorch reference attention):\n")
    print_table(runs)

    same_text = all(run.texts == runs[0].texts for run in runs)
    print(f"\ngreedy completions identical in every mode: {same_text}")
    counters = nwor.counters
    if (not same_text or counters is None or counters.fallbacks
            or counters.tokens_staged != nwor.draft_tokens
            or counters.tokens_committed != nwor.accepted):
        raise SystemExit("demo check failed: outputs differ or counters disagree with vLLM")


if __name__ == "__main__":
    main()
