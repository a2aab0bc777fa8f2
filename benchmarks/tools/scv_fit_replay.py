"""Does SCV's step-cost fit price the plans a GPU run held at what their steps took?

SCV's step-cost fit replayed over GPU runs' recorded steps, on the CPU: a diagnostic.

``scv_bench.py`` keeps every step SCV's cost model saw, in the warm-up (``groups[].warm``) and
in each measured repetition (``scv_choices_by_group[].steps_by_rep``). This feeds them, in the
order one engine served them (each batch size's warm-up, then its cells), to a fresh
:class:`StepCostModel`. Halfway through each repetition it prices the steady plans the rest of
that repetition ran: every number of requests and budget it held for at least 8 steps in a
row, uniform, with nothing caught up. It then compares the price with those steps' median time,
and reports the log of price over time: its mean and its mean absolute value, by batch size.

``--half-life N`` also replays a variant of the fit that weighs each kept step by its age
(halved every N steps observed), so that the fit follows a host whose speed changes in spells
(``host_noise_b1_2026-11-24_h200.json``). That variant lives here, not in the policy.

    .venv/bin/python -m benchmarks.tools.scv_fit_replay \\
        benchmarks/results/scv_b1_k8_2026-11-24_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from benchmarks.harness.results import git_commit, write_json
from vllm_nwor.scv import StepCostModel, on_full_graph

MIN_STEADY_STEPS = 8


class AgedStepCostModel(StepCostModel):
    """:class:`StepCostModel` whose fit weighs each kept step by ``0.5 ** (age / half_life)``,
    age in steps observed since (an experiment for this replay)."""

    def __init__(self, half_life: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.half_life = half_life
        self._clock = 0
        self._born: dict = {}

    def observe(self, *args, **kwargs) -> None:
        before = dict(self._counts)
        super().observe(*args, **kwargs)
        self._clock += 1
        for key, count in self._counts.items():
            if before.get(key) != count:  # the row this step completed
                born = self._born.setdefault(key, np.zeros(self.window))
                born[(count - 1) % self.window] = self._clock

    def _row_weights(self, kept) -> np.ndarray:
        ages = [self._clock - self._born[key][:n] for key, n in kept.items()]
        return 0.5 ** (np.concatenate(ages) / self.half_life)


def steady_times(steps: list) -> dict[tuple[int, int], list[float]]:
    """By requests and budget, the times (ms) of uniform steps that follow a step of the same
    requests and budget, verify that budget's drafts for every request and catch nothing up."""
    out: dict[tuple[int, int], list[float]] = {}
    for previous, step in zip(steps, steps[1:], strict=False):
        requests, tokens, budget, ms, uniform, _, verified, caught_up = step
        if (budget == previous[2] and requests == previous[0] and uniform and not caught_up
                and verified == budget * requests and tokens == requests * (1 + budget)):
            out.setdefault((requests, budget), []).append(ms)
    return out


def replay(result: dict, model: StepCostModel) -> list[tuple[int, int, float]]:
    """(cell's batch, budget, log of price over median time) for each steady plan (requests
    and budget) of each repetition's second half, priced by the fit at its middle."""
    cells = result["cells"]
    graphs = cells[0]["scv_choices_by_group"][0]["graphs"]
    warm = result["groups"][0]["warm"]["scv"]

    def feed(steps: list) -> None:
        model.interrupt()
        for requests, tokens, budget, ms, uniform, _, _, caught_up in steps:
            on_graph = on_full_graph(bool(uniform), tokens, graphs[0], graphs[1])
            model.observe(requests, tokens, budget, ms / 1e3, off_graph=not on_graph,
                          caught_up=caught_up)

    errors = []
    for batch in sorted({c["batch"] for c in cells}):
        feed(warm[str(batch)]["steps"])
        for cell in (c for c in cells if c["batch"] == batch):
            for steps in cell["scv_choices_by_group"][0]["steps_by_rep"]:
                half = len(steps) // 2
                feed(steps[:half])
                cost = model.coefficients
                for (requests, budget), times in steady_times(steps[half:]).items():
                    if len(times) >= MIN_STEADY_STEPS:
                        tokens = requests * (1 + budget)
                        off = not on_full_graph(True, tokens, graphs[0], graphs[1])
                        price = 1e3 * float(cost.seconds(requests, tokens, budget, off))
                        errors.append((batch, budget, float(np.log(price / statistics.median(
                            times)))))
                feed(steps[half:])
    return errors


def summary(errors: list[tuple[int, int, float]]) -> dict:
    def of(values: list[float]) -> dict:
        return {"n": len(values), "mean_log_error": round(float(np.mean(values)), 3),
                "mean_abs_log_error": round(float(np.mean(np.abs(values))), 3)}

    by_batch: dict[int, list[float]] = {}
    for batch, _, error in errors:
        by_batch.setdefault(batch, []).append(error)
    return {"all": of([e for _, _, e in errors]) if errors else None,
            "by_batch": {str(b): of(v) for b, v in sorted(by_batch.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--half-life", type=float, nargs="*", default=[],
                        help="also replay the fit weighing steps by age, with these half-lives")
    parser.add_argument("--result", help="write the summaries here (JSON)")
    args = parser.parse_args()
    variants = {"current": StepCostModel,
                **{f"aged_{h:g}": (lambda h=h: AgedStepCostModel(h)) for h in args.half_life}}
    out = {}
    for name, make in variants.items():
        errors = []
        for path in args.results:
            with open(path) as f:
                result = json.load(f)
            if "warm" not in result["groups"][0] or "scv" not in result["groups"][0]["warm"]:
                print(f"{path}: no warm-up steps recorded, left out", file=sys.stderr)
                continue
            try:
                errors += replay(result, make())
            except KeyError as missing:  # a batch size whose warm-up was not kept
                print(f"{path}: no warm-up steps at batch {missing}, left out", file=sys.stderr)
        out[name] = summary(errors)
        print(name, json.dumps(out[name]))
    if args.result:
        write_json(args.result, {"commit": git_commit(), "benchmark": "scv_fit_replay",
                                 "results": [os.path.basename(p) for p in args.results],
                                 "variants": out})


if __name__ == "__main__":
    main()
