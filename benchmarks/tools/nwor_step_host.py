"""What does each part of NWOR's host work per verify step (indices, begin, commit) cost?

NWOR's host work per verify step, by part, in one engine on the GPU (a diagnostic).

NWOR's cost at batch 8-32 with draft_model (about 1% in the pooled matrix) is host time: those
steps replay FULL CUDA graphs and wait on the host, and NWOR adds its per-step work there, the
verify step's indices (``VerifyStep.from_batch``), its ``begin`` and its ``commit``.
``nwor_overhead.py --time-nwor-host`` times their sum beside the on/off comparison; this times
each part, and within the commit the verdict, the scratch commit and the kernel launch, in one
NWOR-on engine (draft_model, k = 4, batch 8, L = 1.5, 8B-shaped dummy model), after two
unrecorded passes. Each timed call costs about 0.2 µs more, nested calls counted in each.

The plugin is whatever ``vllm_nwor`` imports (``PYTHONPATH`` chooses a checkout): two versions
are compared by running this once per version, alternating, each run with its ``--label``.

    python -m benchmarks.tools.nwor_step_host --label after --jsonl $OUT/step_host.jsonl
    python -m benchmarks.tools.nwor_step_host --merge step_host.jsonl --result <json>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness.engines import (
    prompts,
    rate_for_length,
    time_engine_steps,
    write_models,
)
from benchmarks.harness.results import append_jsonl, parse_or_merge, write_json
from benchmarks.nwor_overhead import engine_kwargs

PARTS = {  # name: (module, class, attribute); a part the plugin's version lacks is skipped
    "from_batch": ("vllm_nwor.nwor.verify_step", "VerifyStep", "from_batch"),
    "begin": ("vllm_nwor.nwor.interceptor", "NworInterceptor", "begin"),
    "commit": ("vllm_nwor.nwor.interceptor", "NworInterceptor", "commit"),
    "verdict": ("vllm_nwor.nwor.verify_step", "VerifyStep", "verdict"),
    "scratch_commit": ("vllm_nwor.nwor.kv_staging", "ScratchStaging", "commit"),
    "launch": ("vllm_nwor.nwor.kernels._common", "Launcher", "__call__"),
}


def time_parts(times: dict[str, list[float]]) -> None:
    import importlib

    for name, (module, owner, attribute) in PARTS.items():
        cls = getattr(importlib.import_module(module), owner)
        raw = cls.__dict__.get(attribute)
        if raw is None:
            continue
        fn = raw.__func__ if isinstance(raw, classmethod) else raw

        def timed(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                times.setdefault(_name, []).append(time.perf_counter() - start)

        setattr(cls, attribute, classmethod(timed) if isinstance(raw, classmethod) else timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", help="the plugin version this run times")
    parser.add_argument("--runs", type=int, default=3)
    args = parse_or_merge(parser, merge)
    if args is None:
        return
    if args.label is None or args.jsonl is None:
        parser.error("a run needs --label and --jsonl")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    times: dict[str, list[float]] = {}
    time_parts(times)
    from vllm import LLM, SamplingParams

    import vllm_nwor

    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        llm = LLM(**engine_kwargs(target, draft, "draft_model", 4, True, 8, memory=0.5))
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, extra_args={
            "synthetic_acceptance_rate": rate_for_length(1.5, 4)})
        batch = [{"prompt_token_ids": p} for p in prompts(8, seed=1)]
        for _ in range(2):
            llm.generate(batch, [params] * len(batch), use_tqdm=False)
        times.clear()
        steps = time_engine_steps(llm)
        for _ in range(args.runs):
            llm.generate(batch, [params] * len(batch), use_tqdm=False)
        record = {"label": args.label, "plugin": os.path.dirname(vllm_nwor.__file__),
                  "steps": len(steps), "step_ms_median": round(1e3 * statistics.median(steps), 3),
                  "parts": {name: {"calls": len(v),
                                   "median_us": round(1e6 * statistics.median(v), 2),
                                   "mean_us": round(1e6 * statistics.mean(v), 2)}
                            for name, v in times.items()}}
    print(json.dumps(record), flush=True)
    append_jsonl(args.jsonl, record)


def merge(jsonl: Path, result: Path) -> None:
    """The runs, and each part's median over a label's runs with its after/before ratio."""
    from benchmarks.harness.results import recorded_environment

    runs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    by_label: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        parts = by_label.setdefault(run["label"], {})
        parts.setdefault("step_ms_median", []).append(run["step_ms_median"])
        for name, part in run["parts"].items():
            parts.setdefault(name, []).append(part["median_us"])
    medians = {label: {name: round(statistics.median(v), 2) for name, v in parts.items()}
               for label, parts in by_label.items()}
    payload = {**recorded_environment(jsonl), "benchmark": "nwor_step_host",
               "workload": "draft_model, k = 4, batch 8, L = 1.5, 8B-shaped dummy target, "
                           "2-layer draft; one NWOR-on engine per run",
               "medians_us": medians, "runs": runs}
    if {"before", "after"} <= set(medians):
        payload["after_over_before"] = {
            name: round(medians["after"][name] / medians["before"][name], 4)
            for name in medians["after"] if medians["before"].get(name)}
    write_json(result, payload)
    print(result)


if __name__ == "__main__":
    main()
