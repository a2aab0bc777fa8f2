"""`make demo`: NWOR and SCV on the shipped model pair, against the plugin off.

Runs vLLM's CPU engine with the committed byte-level pair (``models/pystd-target`` and
``models/pystd-draft``, trained on the Python standard library by ``scripts/train_pair.py``; see
docs/model_pair.md) and ``draft_model`` speculative decoding, k=3, in two modes:

- ``off``: vLLM alone (the plugin is installed but off), every request verifies 3 drafts a step;
- ``nwor``: NWOR on (draft K/V staged, only accepted prefixes written to the cache);
- ``scv``: SCV adaptive alone;
- ``nwor+scv``: NWOR and SCV adaptive (each request's verify chunk sized every step from its
  own acceptance and the engine's step cost).

SCV runs with a pinned step-cost model (``scv_cost_model``, :data:`PINNED_COST`): a
compute-bound step, where each scheduled token costs 5% of the step's fixed cost, as on a GPU
serving a large batch. With its own online fit on this CPU, SCV finds that drafting never pays
and holds every request at chunk 0, which shows only speculation switched off.

It prints the completions as text, each request's acceptance lengths (drafts accepted in each of
its speculative steps) and chunk sizes, and a table of NWOR's and SCV's counters and throughput,
and draws every request's steps to a PNG. It exits non-zero if the greedy text differs between
the modes or a counter disagrees with vLLM's own spec-decode stats.

Each mode runs in its own engine, one after the other: vLLM's metrics live in one process-wide
registry. The first pass over the prompts warms the engine up (SCV explores chunk sizes for its
first 32 steps to fit its step-cost model) and gives the text; the pass after it gives the
per-request numbers and the counters' check.

Then NWOR's throughput: an off and a nwor engine and a second off engine (the A/A control) at
once, taking turns step by step for :data:`ROUNDS` rounds
(:func:`vllm_nwor.testing.pair_demo_throughput`, as ``benchmarks/nwor_cpu.py``); each over off,
with its 95% interval.

Per-request acceptance lengths: with a plugin feature on, each output's
``spec_decode_metrics.per_step_accepted`` (vLLM's per-request metrics, which the plugin's
telemetry asks for); with the plugin off, the in-process scheduler's
counts (``vllm_nwor.testing.SpecStepRecorder``), the ones vLLM adds to
``vllm:spec_decode_num_accepted_tokens``. The demo checks that the two agree request by request
and that the scheduler's add up to vLLM's stats; chunk sizes come from the scheduler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler is in-process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from vllm import LLM, SamplingParams  # noqa: E402

import vllm_nwor  # noqa: E402
from vllm_nwor.testing import (  # noqa: E402
    PAIR_DEMO_K,
    PAIR_DEMO_MAX_TOKENS,
    PAIR_DEMO_PROMPTS,
    RequestSteps,
    SpecStepRecorder,
    pair_demo_engine_args,
    pair_demo_throughput,
    shipped_pair,
)

REPO = Path(__file__).resolve().parent.parent
K = PAIR_DEMO_K
MAX_TOKENS = PAIR_DEMO_MAX_TOKENS
ROUNDS = 12
PROMPTS = PAIR_DEMO_PROMPTS
PINNED_COST = [0.01, 5e-4, 5e-5]
"""SCV's step cost in seconds: 10 ms a step, 0.5 ms a scheduled token, 0.05 ms a draft."""
# The plugin's keys per mode, added to the speculative config; "off" is vLLM alone.
MODES: dict[str, dict] = {
    "off": {},
    "nwor": {"nwor": True},
    "scv": {"scv": "adaptive", "scv_cost_model": PINNED_COST},
    "nwor+scv": {"nwor": True, "scv": "adaptive", "scv_cost_model": PINNED_COST},
}


def mean_acceptance_length(accepted: list[int]) -> float:
    """Tokens per speculative step, the bonus token included: telemetry's and vLLM's meaning."""
    return 1.0 + statistics.fmean(accepted) if accepted else 1.0


@dataclass
class ModeRun:
    name: str
    texts: list[str]
    tokens: int
    draft_tokens: int
    accepted: int
    counters: vllm_nwor.NworCounters | None
    seconds: float
    requests: list[RequestSteps]
    lengths_from: str
    """Where the acceptance lengths were read."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def spec_decode_totals(llm: LLM) -> tuple[int, int]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return (int(metrics["vllm:spec_decode_num_draft_tokens"].value),
            int(metrics["vllm:spec_decode_num_accepted_tokens"].value))


def run_mode(name: str, plugin_keys: dict, target: str, draft: str) -> ModeRun:
    llm = LLM(**pair_demo_engine_args(target, draft, plugin_keys))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    recorder = SpecStepRecorder(llm)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # warm-up; the text
        recorder.take()
        before = spec_decode_totals(llm)
        start = time.perf_counter()
        timed = llm.generate(PROMPTS, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        requests = recorder.take(timed)
        after = spec_decode_totals(llm)
        recorded = (sum(sum(s.chunks) for s in requests),
                    sum(sum(s.accepted) for s in requests))
        if recorded != (after[0] - before[0], after[1] - before[1]):
            raise SystemExit(f"{name}: per-request steps {recorded} do not add up to vLLM's "
                             f"spec-decode stats {after} - {before}")
        # With any plugin feature on, telemetry has vLLM put each request's acceptance
        # lengths on its CompletionOutput; with the plugin off only the scheduler has them.
        fields = [getattr(o.outputs[0].spec_decode_metrics, "per_step_accepted", None)
                  for o in timed]
        for lengths, steps in zip(fields, requests, strict=True):
            if lengths is not None and list(lengths) != steps.accepted:
                raise SystemExit(f"{name}: per_step_accepted {lengths} != the scheduler's "
                                 f"{steps.accepted}")
        source = ("CompletionOutput.spec_decode_metrics, = the scheduler's counts"
                  if all(f is not None for f in fields) else "the scheduler's counts")
        draft_tokens, accepted = spec_decode_totals(llm)
        counters = vllm_nwor.get_counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return ModeRun(name=name, texts=[o.outputs[0].text for o in outputs],
                   tokens=sum(len(o.outputs[0].token_ids) for o in timed),
                   draft_tokens=draft_tokens, accepted=accepted, counters=counters,
                   seconds=seconds, requests=requests,
                   lengths_from=source)


def print_completions(run: ModeRun) -> None:
    for i, (prompt, text) in enumerate(zip(PROMPTS, run.texts, strict=True)):
        print(f"--- request {i}: prompt, then [completion] ---")
        print(f"{prompt}[{text}]\n")


def _runs_of(values: list[int]) -> str:
    """``0 0 0 1 0 0`` as ``0x3 1 0x2``."""
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(str(values[i]) if j - i == 1 else f"{values[i]}x{j - i}")
        i = j
    return " ".join(parts)


def print_requests(runs: list[ModeRun]) -> None:
    off, scv = runs[0], runs[-1]
    print(f"Per request, second pass. A speculative step verifies a chunk of drafts (off and "
          f"nwor: always {K};\nSCV: 0..{K} per request and step, 0 = plain decoding); its "
          "acceptance length is how many of them were accepted,\nand mean_acceptance_length "
          "is tokens per speculative step, 1 + the mean acceptance length (as in telemetry).\n")
    print(f"{'':8s}{off.name + ': spec steps':>18s}{'mean_acceptance_length':>24s}"
          f"{scv.name + ': decode steps':>26s}{'chunk 0':>9s}{'accepted/drafted':>18s}")
    for i, (a, b) in enumerate(zip(off.requests, scv.requests, strict=True)):
        print(f"{'req ' + str(i):8s}{len(a.accepted):>18d}"
              f"{mean_acceptance_length(a.accepted):>24.2f}{len(b.chunks):>26d}"
              f"{b.chunks.count(0):>9d}{f'{sum(b.accepted)}/{sum(b.chunks)}':>18s}")
    for run in runs:
        if run is not off and [r.accepted for r in run.requests] == [
                r.accepted for r in off.requests]:
            print(f"\nacceptance lengths, {run.name}: the same as {off.name}'s, step for step")
            continue
        if run is not off and run is not scv:
            continue
        print(f"\nacceptance lengths, {run.name} ({run.lengths_from}):")
        for i, steps in enumerate(run.requests):
            print(f"  req {i}: {' '.join(map(str, steps.accepted)) or '-'}")
    print(f"\nchunk sizes, {scv.name} (NxM = N for M steps in a row):")
    for i, steps in enumerate(scv.requests):
        print(f"  req {i}: {_runs_of(steps.chunks)}")
    print(f"\nSCV's step cost is pinned (scv_cost_model = {PINNED_COST}: seconds a step, a "
          "scheduled token, a draft):\na compute-bound step, where verifying a draft the target "
          "rejects costs real time. Each request's\nchunk follows its own acceptance: requests "
          "whose drafts fail drop to small chunks or to 0, with probes.\n")


def print_table(runs: list[ModeRun]) -> None:
    rows: list[tuple[str, list[str]]] = []
    keys = [k for k in vllm_nwor.NworCounters().as_dict() if k != "fallbacks"]
    for key in keys:
        rows.append((key, [str(r.counters.as_dict()[key]) if r.counters else "-" for r in runs]))
    rows.append(("fallbacks", [str(r.counters.fallbacks or "none") if r.counters else "-"
                               for r in runs]))
    rows.append(("vLLM draft tokens", [str(r.draft_tokens) for r in runs]))
    rows.append(("vLLM accepted", [str(r.accepted) for r in runs]))
    rows.append(("draft acceptance", [f"{r.accepted / r.draft_tokens:.2f}" for r in runs]))
    for size in range(K + 1):
        rows.append((f"steps at chunk {size} (last)",
                     [str(sum(s.chunks.count(size) for s in r.requests)) for r in runs]))
    rows.append(("tokens/s (a pass alone)", [f"{r.tokens_per_second:.1f}" for r in runs]))
    header = f"{'':26s}" + "".join(f"{run.name:>14s}" for run in runs)
    print(header)
    print("-" * len(header))
    for label, cells in rows:
        print(f"{label:26s}" + "".join(f"{cell:>14s}" for cell in cells))


def print_throughput() -> None:
    modes = {"off": MODES["off"], "nwor": MODES["nwor"], "off again": MODES["off"]}
    run = pair_demo_throughput(modes, ROUNDS)
    if not run["greedy_tokens_equal"]:
        raise SystemExit("demo check failed: greedy tokens differ between the timed engines")
    print(f"\nThroughput, three engines taking turns step by step ({ROUNDS} rounds), each over "
          "off: the geometric mean\nover the rounds and its 95% interval. 'off again' is vLLM "
          "alone once more (the A/A control).")
    for name, ratio in run["over_first"].items():  # over "off"
        low, high = ratio["interval_95"]
        print(f"  {name:10s} {ratio['geomean']:.3f}x  ({low:.3f}-{high:.3f})")


def draw(runs: list[ModeRun], path: Path) -> None:
    """One strip per request, for vLLM alone and for NWOR + SCV: a column per decode step
    (x axis), as tall as the drafts it verified (y, 0..K), accepted green, rejected red, plain
    decoding grey; at the right each strip's numbers; a legend and each mode's throughput."""
    from PIL import Image, ImageDraw

    cell, label_width, gap, numbers_width = 4, 110, 8, 250
    shown = [runs[0], runs[-1]]  # nwor's steps are off's
    strips = [(f"{run.name} req {i}", steps) for run in shown
              for i, steps in enumerate(run.requests)]
    steps_max = max(len(s.chunks) for _, s in strips)
    height_one = cell * K + 2
    plot_width = (cell + 1) * steps_max
    width = label_width + plot_width + numbers_width
    top = 72
    height = top + len(strips) * (height_one + gap) + 40
    image = Image.new("RGB", (width, height), "white")
    ink = ImageDraw.Draw(image)
    green, red, grey = (60, 170, 75), (215, 60, 50), (170, 170, 170)
    ink.text((10, 6), f"Each request's decode steps, second pass (greedy, k={K}). "
             + "  ".join(f"{r.name}: {r.tokens_per_second:.0f} tokens/s" for r in runs),
             fill="black")
    legend = [(green, "accepted draft"), (red, "rejected draft"), (grey, "no drafts (chunk 0)")]
    x = 10
    for colour, text in legend:
        ink.rectangle([x, 26, x + 9, 35], fill=colour)
        ink.text((x + 14, 25), text, fill="black")
        x += 14 + 7 * len(text) + 20
    ink.text((10, 44), f"y: drafts verified in the step (0..{K}); right: accepted/drafted, "
             "mean_acceptance_length, steps at chunk 0", fill="black")
    for row, (label, steps) in enumerate(strips):
        y0 = top + row * (height_one + gap)
        bottom = y0 + height_one
        ink.text((10, y0 + 2), label, fill="black")
        ink.line([label_width - 2, y0, label_width - 2, bottom], fill="black")  # y axis
        accepted = iter(steps.accepted)
        for col, chunk in enumerate(steps.chunks):
            x = label_width + col * (cell + 1)
            if chunk == 0:
                ink.rectangle([x, bottom - 2, x + cell - 1, bottom], fill=grey)
                continue
            good = next(accepted, 0)
            for j in range(chunk):
                y = bottom - (j + 1) * cell
                ink.rectangle([x, y, x + cell - 1, y + cell - 2], fill=green if j < good else red)
        numbers = (f"{sum(steps.accepted)}/{sum(steps.chunks)}  "
                   f"{mean_acceptance_length(steps.accepted):.2f}  {steps.chunks.count(0)}")
        ink.text((label_width + plot_width + 10, y0 + 2), numbers, fill="black")
    axis_y = top + len(strips) * (height_one + gap)
    ink.line([label_width, axis_y, label_width + plot_width, axis_y], fill="black")  # x axis
    for step in range(0, steps_max + 1, 10):
        x = label_width + step * (cell + 1)
        ink.line([x, axis_y, x, axis_y + 4], fill="black")
        ink.text((x - 4, axis_y + 6), str(step), fill="black")
    ink.text((label_width + plot_width // 2 - 40, axis_y + 20), "decode step", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", type=Path, default=REPO / "build" / "demo_pair.png",
                        help="where the picture goes (default: build/demo_pair.png)")
    args = parser.parse_args()
    target, draft = shipped_pair()
    print(f"vllm-nwor demo: the shipped byte-level pair (models/), draft_model speculation, "
          f"k={K}, {len(PROMPTS)} requests x {MAX_TOKENS} tokens, fp32 on the CPU; modes: "
          f"{', '.join(MODES)}\n")
    started = time.perf_counter()
    runs = [run_mode(name, keys, target, draft) for name, keys in MODES.items()]
    scv = runs[-1]

    print_completions(scv)
    print_requests(runs)
    print("\nCounters over both passes, steps at each chunk size over the second, throughput of "
          "the second pass,\none engine after another (compare modes below, not here).\n")
    print_table(runs)
    print_throughput()
    draw(runs, args.png)
    print(f"\npicture: {os.path.relpath(args.png)}")

    same_text = all(run.texts == runs[0].texts for run in runs)
    print(f"greedy completions identical in every mode: {same_text}  "
          f"({time.perf_counter() - started:.0f} s)")
    failures = [] if same_text else ["greedy text differs between modes"]
    for run in runs:
        counters = run.counters
        if MODES[run.name].get("nwor") and (counters is None or counters.fallbacks
                                  or counters.tokens_staged != run.draft_tokens
                                  or counters.tokens_committed != run.accepted):
            failures.append(f"{run.name}: NWOR counters disagree with vLLM's spec-decode stats")
    if failures:
        raise SystemExit("demo check failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
