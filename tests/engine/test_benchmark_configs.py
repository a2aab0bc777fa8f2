"""The GPU benchmarks' engine settings pass the plugin's config layer, here on the CPU.

The benchmarks run only on the GPU machine, where device time is scarce. Their speculative
configs mix vLLM's keys (``synthetic_acceptance_length``, ``num_speculative_tokens_per_batch_size``)
with the plugin's; this checks the plugin takes exactly its own keys from every one of them and
validates them, before a GPU session finds out.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs

import vllm_nwor.inspect
from vllm_nwor.config import PLUGIN_KEYS
from vllm_nwor.patches.engine_args import take_plugin_keys

VLLM_KEYS = {f.name for f in dataclasses.fields(SpeculativeConfig)}


def benchmark_kwargs() -> list[tuple[str, dict]]:
    scv = importlib.import_module("benchmarks.scv_bench")
    overhead = importlib.import_module("benchmarks.nwor_overhead")
    window = importlib.import_module("benchmarks.draft_window_bench")
    cases = [(f"scv_bench:{p}", scv.engine_kwargs(p, "t", "d", 256, 0.3))
             for p in scv.POLICIES]
    cases += [(f"scv_bench:ngram_gpu:{p}", scv.engine_kwargs(p, "t", "d", 256, 0.3, "ngram_gpu"))
              for p in scv.POLICIES if p not in ("vllm_batch_schedule", "vllm_av")]
    cases += [(f"scv_bench:eagle3:k5:{p}", scv.engine_kwargs(p, "t", "d", 256, 0.3, "eagle3", 5))
              for p in ("no_spec", "fixed_k1", "fixed_k5", "vllm_av", "scv")]
    cases += [(f"nwor_overhead:{m}:{nwor}", overhead.engine_kwargs("t", "d", m, 4, nwor, 8))
              for m in ("draft_model", "ngram") for nwor in (False, True)]
    cases += [(f"nwor_overhead:tp2:{nwor}", overhead.engine_kwargs(
        "t", "d", "draft_model", 4, nwor, 8, memory=0.3, tensor_parallel_size=2))
        for nwor in (False, True)]
    cases += [(f"nwor_overhead:eagle3:{nwor}", overhead.engine_kwargs(
        "t", "d", "eagle3", 4, nwor, 8, memory=0.3, length=2.5)) for nwor in (False, True)]
    cases += [(f"nwor_overhead:{m}:own_length:{nwor}", overhead.engine_kwargs(
        "t", "d", m, 4, nwor, 8, length=2.5))  # on vLLM's V2 runner (a GPU)
        for m in ("draft_model", "ngram") for nwor in (False, True)]
    traffic = importlib.import_module("benchmarks.nwor_kv_traffic")
    cases += [(f"nwor_kv_traffic:{nwor}", traffic.engine_kwargs(
        "t", "d", 4, 0.3, nwor, [1, 32, 128], 512)) for nwor in (False, True)]
    cases += [(f"draft_window_bench:{w}", window.engine_kwargs("t", "d", w, 4, 8))
              for w in (None, 256)]
    profile = importlib.import_module("benchmarks.tools.scv_step_profile")
    cases += [(f"scv_step_profile:{name}", kwargs)
              for name, kwargs in profile.configs("t", "d", 128, 0.22).items()]
    cases += [(f"scv_step_profile:ngram_gpu:{name}", kwargs) for name, kwargs in profile.configs(
        "t", "d", 128, 0.22, ("fixed_k2", "scv", "scv_fixed2"), "ngram_gpu").items()]
    # What the engine process hands to LLM (it sets the environment and ablations itself).
    split = importlib.import_module("benchmarks.harness.engines").split_engine_kwargs
    return [(name, split(kwargs)[0]) for name, kwargs in cases]


@pytest.mark.parametrize("name, kwargs", benchmark_kwargs(),
                         ids=[name for name, _ in benchmark_kwargs()])
def test_benchmark_config_is_split_between_vllm_and_the_plugin(name, kwargs):
    speculative = kwargs.get("speculative_config")
    args = EngineArgs(**kwargs)
    config = take_plugin_keys(args)
    if speculative is None:
        return
    ours = {k for k in speculative if k in PLUGIN_KEYS}
    left = set(args.speculative_config or {})
    assert left == set(speculative) - ours
    assert left <= VLLM_KEYS, f"{name}: keys neither vLLM's nor the plugin's: {left - VLLM_KEYS}"
    for key in ours:
        assert getattr(config, key) == speculative[key]


def test_scv_merge_compares_scv_with_its_own_group_only(tmp_path):
    """Groups run on different GPUs: SCV's ratio is taken within each group, the smallest kept."""
    scv = importlib.import_module("benchmarks.scv_bench")
    rows = lambda tok_s: [  # noqa: E731
        {"policy": p, "batch": 128, "workload": "w", "tok_s": v} for p, v in tok_s.items()]
    records = [
        {"policies": ["no_spec", "fixed_k4", "scv"], "gpu_memory_share": 0.3, "reps": 2,
         "prompt_len": 128, "startup_seconds": {}, "rows": rows(
             {"no_spec": 100.0, "fixed_k4": 90.0, "scv": 110.0})},
        {"policies": ["fixed_k8", "scv"], "gpu_memory_share": 0.45, "reps": 2,
         "prompt_len": 128, "startup_seconds": {}, "rows": rows({"fixed_k8": 120.0, "scv": 114.0})},
    ]
    records[0]["rows"][2]["agreement_with_no_spec"] = 0.999
    records[0]["rows"][0]["gc_pauses_by_rep"] = [[[2, 150.0]], []]
    records[1]["rows"][1]["agreement_with_no_spec"] = 1.0
    jsonl = tmp_path / "scv.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    scv.merge(jsonl, tmp_path / "scv.json")
    (cell,) = json.loads((tmp_path / "scv.json").read_text())["cells"]
    assert cell["scv_over_best_other_by_group"] == [1.1, 0.95]
    assert cell["scv_over_best_other"] == 0.95
    assert cell["tok_s"] == {"no_spec": 100.0, "fixed_k4": 90.0, "fixed_k8": 120.0, "scv": 112.0}
    assert cell["agreement_with_no_spec"] == {"scv": 0.999}  # the lowest over groups
    assert cell["gc_pauses"] == {"no_spec": [[[[2, 150.0]], []]]}  # by policy, group, rep
    assert json.loads((tmp_path / "scv.json").read_text())["device"] == "NVIDIA H200"


def test_scv_merge_takes_the_steady_window_where_every_policy_of_a_group_has_one(tmp_path):
    """The headline is the steady window's throughput (``tok_s_steady``) where every row of
    a group's cell has one, the whole run's otherwise; the whole run's ratio is kept."""
    scv = importlib.import_module("benchmarks.scv_bench")
    whole = {"no_spec": 100.0, "fixed_k4": 90.0, "scv": 95.0}
    steady = {"no_spec": 110.0, "fixed_k4": 99.0, "scv": 121.0}
    rows = [{"policy": p, "batch": b, "workload": "w", "tok_s": whole[p],
             **({"tok_s_steady": steady[p]} if b == 128 or p != "scv" else {})}
            for b in (1, 128) for p in whole]
    record = {"policies": list(whole), "gpu_memory_share": 0.3, "reps": 2, "prompt_len": 128,
              "startup_seconds": {}, "rows": rows}
    jsonl = tmp_path / "scv.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    scv.merge(jsonl, tmp_path / "scv.json")
    result = json.loads((tmp_path / "scv.json").read_text())
    at_1, at_128 = result["cells"]
    assert at_128["tok_s"] == steady and at_128["scv_over_best_other"] == 1.1
    assert at_128["tok_s_whole_run"] == whole and at_128["scv_over_best_other_whole_run"] == 0.95
    assert at_1["tok_s"] == whole and at_1["scv_over_best_other"] == 0.95  # SCV had no window
    assert result["measure"] == ["steady window", "whole run"]


def test_scv_merge_takes_the_hosts_speed_out_beside_the_headline(tmp_path):
    """Two policies equally fast at the same host speed; SCV's runs met a host twice as slow
    (``host.probe_ms``). The headline says SCV lost; the host-adjusted ratio says it did not."""
    scv = importlib.import_module("benchmarks.scv_bench")

    def runs(probes: list[float]) -> list[dict]:  # throughput in inverse proportion to probe
        return [{"seconds": 1.0, "steady": {"seconds": probe / 4, "tokens": 100},
                 "host": {"probe_ms": [probe, probe]}} for probe in probes]

    by_policy = {"no_spec": runs([4.0, 4.4]), "scv": runs([8.0, 7.0])}
    rows = [{"policy": p, "batch": 128, "workload": "w", "tok_s": 1.0,
             "tok_s_steady": statistics.median(100 / r["steady"]["seconds"] for r in rs),
             "runs_by_rep": rs} for p, rs in by_policy.items()]
    record = {"policies": list(by_policy), "gpu_memory_share": 0.3, "reps": 2,
              "prompt_len": 128, "startup_seconds": {}, "rows": rows}
    jsonl = tmp_path / "scv.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    scv.merge(jsonl, tmp_path / "scv.json")
    (cell,) = json.loads((tmp_path / "scv.json").read_text())["cells"]
    assert cell["scv_over_best_other"] < 0.6
    assert cell["scv_over_best_other_host_adjusted"] == 1.0
    (group,) = cell["host_adjusted_by_group"]
    assert group["slope"] == -1.0 and group["r2"] == 1.0
    # too few runs to fit a slope beside the levels: no adjusted ratio, not a guess
    assert scv.host_adjusted({p: rs[:1] for p, rs in by_policy.items()}) is None


def test_scv_merge_pairs_each_repetitions_runs(tmp_path):
    """Repetition by repetition, each compared row over the group's best other policy (the
    best by the headline): the second repetition met a host twice as slow, for every policy
    alike (as interleaved runs meet it), and the paired ratios do not see it; the A/A
    control's are 1."""
    scv = importlib.import_module("benchmarks.scv_bench")

    def runs(tok_s: list[float]) -> list[dict]:
        return [{"seconds": 1.0, "steady": {"seconds": 100 / v, "tokens": 100}} for v in tok_s]

    by_policy = {"no_spec": runs([100.0, 50.0]), "fixed_k2": runs([80.0, 40.0]),
                 "no_spec_aa": runs([100.0, 50.0]), "scv": runs([110.0, 55.0])}
    rows = [{"policy": p, "batch": 128, "workload": "w", "tok_s": 1.0,
             "tok_s_steady": statistics.median(100 / r["steady"]["seconds"] for r in rs),
             "runs_by_rep": rs} for p, rs in by_policy.items()]
    record = {"policies": list(by_policy), "gpu_memory_share": 0.2, "reps": 2,
              "prompt_len": 128, "startup_seconds": {}, "rows": rows, "slice_seconds": 0.5}
    jsonl = tmp_path / "scv.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    scv.merge(jsonl, tmp_path / "scv.json")
    merged = json.loads((tmp_path / "scv.json").read_text())
    (cell,) = merged["cells"]
    (paired,) = cell["paired_by_group"]
    assert paired["best"] == "no_spec"
    assert paired["by_rep"] == {"scv": [1.1, 1.1], "no_spec_aa": [1.0, 1.0]}
    assert paired["median"] == {"scv": 1.1, "no_spec_aa": 1.0}
    assert merged["groups"][0]["slice_seconds"] == 0.5
    del by_policy["scv"][1]["steady"]  # a run without a steady window: no pairing for it
    assert scv.paired_by_rep(by_policy, {"no_spec": 75.0, "scv": 82.5})["by_rep"] == {
        "no_spec_aa": [1.0, 1.0]}


def test_result_files_keep_their_structure_a_line_an_item_and_the_rest_compact():
    """Result files lay out their structure one item a line and what lies deeper compact
    (``harness.results.result_json``): every device call carries the working tree, and indented
    result files had grown to 48 MB of it, pushing the devkit into eleven parts. Every file under
    ``benchmarks/results/`` is written that way, so that the tree stays small."""
    written = importlib.import_module("benchmarks.harness.results")
    payload = {"cells": [{"batch": 128, "steps": [[1, 2.5], [3, None]], "tok_s": {"a": 1.0}}],
               "rows": [], "empty": {}}
    text = written.result_json(payload)
    assert json.loads(text) == payload
    lines = text.splitlines()
    assert '   "batch": 128,' in lines and '    "a": 1.0' in lines  # one item a line
    assert '   "steps": [' in lines and '    [1,2.5],' in lines
    deep = written.result_json({"a": {"b": {"c": {"d": {"e": [1, {"f": 2}]}}}}})
    assert '    "d": {"e":[1,{"f":2}]}' in deep.splitlines()  # below RESULT_DEPTH: compact
    results = Path(__file__).parents[2] / "benchmarks" / "results"
    loose = [path.name for path in sorted(results.glob("*.json"))
             if path.read_text() != written.result_json(json.loads(path.read_text())) + "\n"]
    assert not loose, f"result files not written with harness.results.write_json: {loose}"


def test_commit_times_are_read_from_their_event_pairs_and_forgotten():
    engines = importlib.import_module("benchmarks.harness.engines")

    class Event:  # torch.cuda.Event's elapsed_time, in ms
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, end: Event) -> float:
            return end.ms - self.ms

    pairs = [(Event(0.0), Event(ms)) for ms in (0.004, 0.005, 0.25, 0.006)]
    assert engines.commit_gpu_us(pairs) == {"count": 4, "median": 5.5, "p90": 6.0}
    assert pairs == [] and engines.commit_gpu_us(pairs) is None


def test_gc_pauses_are_recorded_from_then_on():
    import gc

    pauses = importlib.import_module("benchmarks.harness.engines").record_gc_pauses(at_least_ms=0.0)
    try:
        gc.collect()
        assert [generation for generation, _ in pauses] == [2]
    finally:
        gc.callbacks.pop()


def test_slow_steps_show_where_the_host_was():
    import time
    from types import SimpleNamespace

    def held_on_purpose():
        time.sleep(0.12)

    def step(slow):
        if slow:
            held_on_purpose()

    llm = SimpleNamespace(llm_engine=SimpleNamespace(step=step))
    engines = importlib.import_module("benchmarks.harness.engines")
    slow = engines.sample_slow_steps(llm, threshold=0.03)
    for slow_step in (False, True, False):
        llm.llm_engine.step(slow_step)
    assert len(slow) == 1 and slow[0]["ms"] >= 120
    # Every thread is sampled: idle threads earlier tests left in this process may outnumber
    # the stepping one, so its stack need not be the most common.
    held = [count for count, stack in slow[0]["stacks"]
            if stack.split(" < ")[0].endswith("held_on_purpose")]
    assert held and held[0] >= 5, slow[0]["stacks"]


def test_scv_merge_keeps_the_aa_control_out_of_the_others(tmp_path):
    """``no_spec_aa`` (a second plain engine) is compared with the best other, never one."""
    scv = importlib.import_module("benchmarks.scv_bench")
    assert scv.engine_kwargs("no_spec_aa", "t", "d", 8, 0.3) == scv.engine_kwargs(
        "no_spec", "t", "d", 8, 0.3)
    record = {"policies": ["no_spec", "no_spec_aa", "scv"], "gpu_memory_share": 0.3, "reps": 2,
              "prompt_len": 128, "startup_seconds": {}, "rows": [
                  {"policy": p, "batch": 128, "workload": "w", "tok_s": v} for p, v in
                  {"no_spec": 100.0, "no_spec_aa": 104.0, "scv": 98.0}.items()]}
    jsonl = tmp_path / "scv.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    scv.merge(jsonl, tmp_path / "scv.json")
    (cell,) = json.loads((tmp_path / "scv.json").read_text())["cells"]
    assert cell["scv_over_best_other"] == 0.98  # over no_spec, not over the control
    assert cell["no_spec_aa_over_best_other_by_group"] == [1.04]


def test_scv_bench_refuses_a_fixed_k_above_its_k(monkeypatch, capsys, tmp_path):
    """The comparison is against fixed k = 1..k: a fixed k past ``--k`` is a mistake."""
    scv = importlib.import_module("benchmarks.scv_bench")
    monkeypatch.setattr(sys, "argv", ["scv_bench.py", "--k", "3", "--policies", "fixed_k3",
                                      "fixed_k5", "--jsonl", str(tmp_path / "x.jsonl")])
    with pytest.raises(SystemExit):
        scv.main()
    assert "--policies fixed_k5: more drafts than --k 3" in capsys.readouterr().err


def test_scv_bench_runs_vllms_adaptive_verification_at_its_k():
    scv = importlib.import_module("benchmarks.scv_bench")
    spec = scv.engine_kwargs("vllm_av", "t", "d", 8, 0.3, "eagle3", 5)["speculative_config"]
    assert spec["enable_adaptive_verification"] and spec["num_speculative_tokens"] == 5
    assert spec["method"] == "eagle3" and "scv" not in spec
    assert scv.engine_kwargs("fixed_k2", "t", "d", 8, 0.3, "eagle3", 5)[
        "speculative_config"]["num_speculative_tokens"] == 2
    with pytest.raises(SystemExit, match="ngram_gpu"):
        scv.engine_kwargs("vllm_av", "t", "d", 8, 0.3, "ngram_gpu")


def test_overhead_lengths_per_k():
    overhead = importlib.import_module("benchmarks.nwor_overhead")
    assert overhead.lengths_for(2, ["1.5", "3.0", "k+1"]) == [1.5, 3.0]
    assert overhead.lengths_for(8, ["1.5", "3.0", "k+1"]) == [1.5, 3.0, 9.0]
    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    rate = gpu_engines.rate_for_length(3.0, 4)
    assert abs(1 + rate + rate**2 + rate**3 + rate**4 - 3.0) < 1e-9
    assert gpu_engines.rate_for_length(5.0, 4) > 0.999999


def test_overhead_cell_keeps_every_repetition():
    overhead = importlib.import_module("benchmarks.nwor_overhead")

    def run(seconds: float) -> dict:
        return {"tokens": [[1, 2, 3, 4]] * 2, "seconds": seconds, "itl_median": seconds / 10,
                "drafted": 8, "accepted": 4, "rejected_by_nwor": 4, "fallbacks": {},
                "prompts": [[7] * 5] * 2}

    cell = overhead.summarise("draft_model", 4, 3.0, 2, {
        "off": [run(1.0), run(2.0), run(1.0)], "on": [run(1.0), run(2.0), run(4.0)]})
    assert cell["tok_s_reps"] == {"off": [8.0, 4.0, 8.0], "on": [8.0, 4.0, 2.0]}
    assert cell["throughput_ratio"] == 0.5  # medians: 4 on over 8 off
    assert cell["throughput_ratio_paired"] == 1.0  # median of 1, 1 and 0.25
    assert cell["token_agreement"] == 1.0 and cell["reps"] == 3
    assert "aa_throughput_ratio" not in cell  # no second plugin-off engine
    cell = overhead.summarise("draft_model", 4, 3.0, 2, {
        "off": [run(1.0), run(2.0)], "on": [run(1.0), run(2.0)],
        "off_b": [run(2.0), run(2.0)]})
    assert cell["aa_throughput_ratio"] == 0.6667  # medians: 4 over 6
    assert cell["aa_throughput_ratio_paired"] == 0.75  # median of 0.5 and 1
    assert cell["tok_s_reps_off_b"] == [4.0, 4.0] and cell["aa_token_agreement"] == 1.0
    assert cell["throughput_ratio_over_both_off_paired"] == 1.1667  # median of 8/6 and 4/4


def test_overhead_cell_compares_each_repetitions_median_step():
    overhead = importlib.import_module("benchmarks.nwor_overhead")
    summary = importlib.import_module("benchmarks.harness.engines").step_summary
    assert summary([]) is None
    # 10 steps: the trimmed mean leaves out the slowest and the fastest
    assert summary([0.1] + [0.001] * 8 + [0.0005]) == {
        "steps": 10, "median": 1.0, "trimmed_mean": 1.0, "total": 108.5,
        "first": [100.0, 1.0, 1.0, 1.0, 1.0, 1.0], "all": [100.0] + [1.0] * 8 + [0.5]}

    def run(step_ms: list[float]) -> dict:
        return {"tokens": [[1, 2, 3, 4]] * 2, "seconds": 1.0, "itl_median": 0.1,
                "drafted": 8, "accepted": 4, "rejected_by_nwor": 4, "fallbacks": {},
                "prompts": [[7] * 5] * 2, "step_ms": summary([ms / 1e3 for ms in step_ms])}

    cell = overhead.summarise("draft_model", 4, 3.0, 2, {
        "off": [run([10, 10, 90]), run([20, 20, 20])],
        "on": [run([11, 11, 11]), run([20, 20, 500])],
        "off_b": [run([10, 10, 10]), run([30, 30, 30])]})
    assert cell["step_ratio"] == 1.05  # median of 11/10 and 20/20: a slow step leaves it
    assert cell["aa_step_ratio"] == 1.25  # median of 10/10 and 30/20
    assert cell["step_ratio_over_both_off"] == 0.95  # median of 11/10 and 20/25
    assert cell["host_reps"]["on"] == [{"seconds": 1.0}, {"seconds": 1.0}]


def test_overhead_pools_each_ratio_over_the_cells_with_an_aa_control():
    pooled = importlib.import_module("benchmarks.nwor_overhead").pooled

    def cell(batch: int, on_off: float, aa: float | None) -> dict:
        c = {"method": "ngram", "batch": batch, "throughput_ratio_paired": on_off,
             "step_ratio": 1 / on_off, "itl_ratio": 1 / on_off}
        return c if aa is None else {**c, "aa_throughput_ratio_paired": aa, "aa_step_ratio": aa}

    cells = [cell(8, 0.98, 1.02), cell(32, 0.99, 0.98), cell(128, 1.0, 1.0), cell(8, 0.5, None),
             cell(1, 1.0, 1.0)]
    out = pooled(cells)
    # one batch-1 cell is too few; a cell without A/A is not pooled
    assert set(out) == {"batch_8_and_up", "batch_8_and_up_ngram"}
    assert out["batch_8_and_up_ngram"] == out["batch_8_and_up"]
    group = out["batch_8_and_up"]
    assert group["cells"] == 3
    on_off = group["throughput_ratio_paired"]
    assert on_off["geomean"] == round((0.98 * 0.99 * 1.0) ** (1 / 3), 4)
    low, high = on_off["interval_95"]  # t(2) = 4.30 times the standard error of the logs
    logs = [math.log(r) for r in (0.98, 0.99, 1.0)]
    half = 4.30 * statistics.stdev(logs) / math.sqrt(3)
    assert (low, high) == (round(math.exp(statistics.mean(logs) - half), 4),
                           round(math.exp(statistics.mean(logs) + half), 4))
    assert group["aa_throughput_ratio_paired"]["geomean"] == round(
        (1.02 * 0.98) ** (1 / 3), 4)
    assert group["itl_ratio"]["geomean"] == round((0.98 * 0.99 * 1.0) ** (-1 / 3), 4)


def test_pool_takes_a_cell_measured_again_from_the_later_file(tmp_path):
    overhead = importlib.import_module("benchmarks.nwor_overhead")

    def cell(batch: int, on_off: float) -> dict:
        return {"method": "draft_model", "batch": batch, "k": 4, "L": 1.5,
                "throughput_ratio_paired": on_off, "aa_throughput_ratio_paired": 1.0}

    old, new, out = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "pool.json"
    old.write_text(json.dumps({"cells": [cell(8, 0.5), cell(32, 0.98), cell(128, 0.99)]}))
    new.write_text(json.dumps({"cells": [cell(8, 1.0), cell(8, 0.99)]}))  # batch 8, twice
    overhead.write_pooled([old, new], out)
    pool = json.loads(out.read_text())
    assert [(s["cells_with_aa"], s["cells_replaced"]) for s in pool["sources"]] == [(2, 1),
                                                                                     (2, 0)]
    group = pool["pooled"]["batch_8_and_up"]
    assert group["cells"] == 4
    assert group["throughput_ratio_paired"]["geomean"] == round(
        (0.98 * 0.99 * 1.0 * 0.99) ** (1 / 4), 4)


def test_overhead_at_two_gpus_records_its_size_and_merges_one_size_at_a_time(tmp_path):
    """``--tensor-parallel-size 2``: every engine at that size, recorded in its cells and the
    result's workload; runs of two sizes are not merged or pooled into one figure; a run cut
    short at its last cells merges from its partial record, said so in the result."""
    overhead = importlib.import_module("benchmarks.nwor_overhead")
    assert overhead.engine_kwargs("t", "d", "ngram", 4, True, 8)["speculative_config"][
        "nwor"] and "tensor_parallel_size" not in overhead.engine_kwargs(
        "t", "d", "ngram", 4, True, 8)
    assert overhead.engine_kwargs("t", "d", "ngram", 4, True, 8,
                                  tensor_parallel_size=2)["tensor_parallel_size"] == 2
    cell = {"method": "draft_model", "batch": 8, "k": 4, "L": 3.0, "tensor_parallel_size": 2,
            "throughput_ratio_paired": 1.0, "aa_throughput_ratio_paired": 1.0}
    record = {"startup_seconds": {"off": 80.0}, "tensor_parallel_size": 2, "cells": [cell],
              "profiles": []}
    (tmp_path / "environment.json").write_text(json.dumps({"device": "NVIDIA H100",
                                                           "gpus": ["NVIDIA H100"] * 2}))
    jsonl = tmp_path / "cells.partial.jsonl"
    jsonl.write_text(json.dumps(record | {"partial": True}) + "\n")
    overhead.merge(jsonl, tmp_path / "tp2.json")
    merged = json.loads((tmp_path / "tp2.json").read_text())
    assert merged["workload"]["tensor_parallel_size"] == 2 and "partial" in merged
    assert merged["gpus"] == ["NVIDIA H100"] * 2
    one = {**record, "tensor_parallel_size": 1,
           "cells": [{**cell, "tensor_parallel_size": 1}]}
    jsonl.write_text(json.dumps(record) + "\n" + json.dumps(one) + "\n")
    with pytest.raises(SystemExit, match=r"tensor_parallel_size \[1, 2\]"):
        overhead.merge(jsonl, tmp_path / "mixed.json")
    (tmp_path / "tp1.json").write_text(json.dumps({"cells": one["cells"]}))
    with pytest.raises(SystemExit, match="pool one size at a time"):
        overhead.write_pooled([tmp_path / "tp1.json", tmp_path / "tp2.json"], tmp_path / "p.json")
    assert overhead.cell_key(cell) != overhead.cell_key(one["cells"][0])


@pytest.mark.parametrize("flags", [["--time-nwor-host"], ["--profile-batches", "8"]])
def test_overhead_refuses_in_process_diagnostics_at_two_gpus(monkeypatch, capsys, flags):
    overhead = importlib.import_module("benchmarks.nwor_overhead")
    monkeypatch.setattr(sys, "argv", ["nwor_overhead.py", "--tensor-parallel-size", "2", *flags])
    with pytest.raises(SystemExit):
        overhead.main()
    assert "at --tensor-parallel-size 2 it runs in the workers" in capsys.readouterr().err


def test_clock_sampler_samples_every_gpu_of_a_tensor_parallel_engine(monkeypatch):
    """NVML handles by CUDA index (no CUDA context in the sampling process), one per GPU; the
    summary covers all of their samples, each GPU's beside it. A stand-in NVML: GPU 1 runs
    slower and hotter."""
    import types

    import torch

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    clocks, power = {0: 1980, 1: 1500}, {0: 500_000, 1: 700_000}
    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=0, nvmlDeviceGetClockInfo=lambda handle, _: clocks[handle],
        nvmlDeviceGetPowerUsage=lambda handle: power[handle])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    asked = []
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler",
                        lambda device=None: asked.append(device) or device)
    summary = gpu_engines.ClockSampler(interval=60, devices=(0, 1)).stop()
    assert asked == [0, 1]
    assert summary["sm_mhz_min"] == 1500 and summary["samples"] == 2
    assert [d["sm_mhz_median"] for d in summary["devices"]] == [1980, 1500]
    assert [d["power_w_median"] for d in summary["devices"]] == [500.0, 700.0]
    one = gpu_engines.ClockSampler(interval=60).stop()  # one GPU: as before, no "devices"
    assert asked[-1] == 0 and one == {"samples": 1, "sm_mhz_median": 1980, "sm_mhz_min": 1980,
                                      "power_w_median": 500.0}


def test_run_diagnostics_on_a_machine_without_a_gpu():
    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    assert gpu_engines.ClockSampler().stop() is None  # no NVML here: nothing reported
    before = gpu_engines.host_usage()
    sum(i * i for i in range(200_000))
    after = gpu_engines.host_usage()
    assert after["cpu_seconds"] > before["cpu_seconds"]
    assert set(after) == {"cpu_seconds", "involuntary_switches", "voluntary_switches"}


def test_serving_at_fixed_concurrency_matches_generate(tiny_models):
    """The GPU benchmarks' steady-load driver, on the real CPU engine: with at most two
    requests in flight out of five, every request gets LLM.generate's greedy tokens."""
    from engine_utils import PROMPTS, engine, spec_config
    from vllm import SamplingParams

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, _ = tiny_models
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 5
    prompts = PROMPTS[:5]
    with engine(target, spec_config("ngram")) as llm:
        steps = gpu_engines.time_engine_steps(llm)  # both drivers' steps are timed
        expected = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
        assert len(steps) >= 12 and min(steps) > 0  # 12 tokens: at least 12 steps
        steps.clear()
        served = gpu_engines.generate_at_concurrency(llm, prompts, params, concurrency=2)
        assert len(steps) >= 12
        served_again = gpu_engines.generate_at_concurrency(llm, prompts, params, concurrency=2)
    tokens = [list(o.outputs[0].token_ids) for o in expected]
    assert [list(o.outputs[0].token_ids) for o in served] == tokens
    assert [list(o.outputs[0].token_ids) for o in served_again] == tokens


def test_interleaved_run_counts_its_own_slices_and_not_the_pauses(tiny_models):
    """A run served in slices with pauses between them (what ``interleave`` does with several
    engines on one GPU) gives the tokens of the run served whole, and its clock counts its
    slices only. Under async scheduling on the GPU a step is in flight across each pause;
    ``shift_scv_clock`` moves SCV's step timer past the pause, and this checks it reaches the
    timer's real fields (a renamed field would make it do nothing). The CPU engine keeps no
    batch queue, so here no step is in flight across a pause: the GPU runs' traced SCV steps
    show the rest (docs/scv_results.md, forty-fourth session)."""
    import functools
    import time

    from engine_utils import PROMPTS, engine, spec_config
    from vllm import SamplingParams

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, draft = tiny_models
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 3
    prompts, pause = PROMPTS[:3], 0.3
    with engine(target, spec_config("draft_model", draft, scv="adaptive"),
                async_scheduling=True) as llm:
        whole = gpu_engines.generate_at_concurrency(llm, prompts, params, concurrency=2)
        run = gpu_engines.ConcurrentRun(
            llm, prompts, params, 2, on_resume=functools.partial(gpu_engines.shift_scv_clock,
                                                                 llm))
        start, paused = time.perf_counter(), 0.0
        while not run.advance(0.0):  # one step a slice
            time.sleep(pause)
            paused += pause
        wall = time.perf_counter() - start
        clock = vllm_nwor.inspect.scv_step_clock(llm)
        clock.scheduled_at["step"] = (1.0, False, 0, 0)
        last = clock.last_output_at
        gpu_engines.shift_scv_clock(llm, 2.0)
        assert clock.scheduled_at.pop("step") == (3.0, False, 0, 0)
        assert clock.last_output_at == last + 2.0
    assert [o.outputs[0].token_ids for o in run.outputs()] == [
        o.outputs[0].token_ids for o in whole]
    assert run.slices >= 6 and run.seconds <= wall - paused + 0.05


def test_interleave_drives_the_benchmarks_engine_processes(tiny_models):
    """The GPU benchmarks' engine processes (``harness.engines.Engine``) serve a batch both ways,
    whole runs and interleaved in slices ("start", then "advance" until done; an engine done
    first serves a filler run, "abort"-ed when the last is done), then both ways again in the
    other order: the same tokens from both engines, every way and time, and the interleaved
    runs took several slices each. The GPU sessions would otherwise find a broken protocol on
    device time."""
    aa = importlib.import_module("benchmarks.tools.interleave_aa_cpu")
    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, _ = tiny_models
    prompts = [[3 + i, 7, 11, 13, 17, 19, 23, 29] for i in range(6)]
    extra = [{gpu_engines.OUTPUT_LEN_KEY: 16}] * len(prompts)
    engines = gpu_engines.start_engines(aa.engine_configs(target, 2))
    try:
        reps = [aa.serve_both_ways(engines, prompts, rep, 2, 0.01, extra) for rep in (0, 1)]
    finally:
        gpu_engines.stop_engines(engines)
    tokens = reps[0]["whole"]["a"]["tokens"]
    assert [len(t) for t in tokens] == [16] * len(prompts)
    assert all(run["tokens"] == tokens for ways in reps for runs in ways.values()
               for run in runs.values())
    assert all(run["slices"] == 1 for ways in reps for run in ways["whole"].values())
    assert min(run["slices"] for ways in reps for run in ways["interleaved"].values()) > 2


def test_steady_window_runs_from_the_first_finish_to_the_last_admission(tiny_models):
    """Without speculation every request in flight gets one token a step (its first at its
    prefill). Two in flight, lengths 3, 7, 5, 5: r0 finishes at step 3 (6 tokens made: r0's 3,
    r1's 3) and r2 takes its slot; r1 finishes at step 7 and r3, the last, is admitted (14
    made: r0's 3, r1's 7, r2's 4). The window holds 8 tokens: 7 if the requests in flight were
    not counted. It is empty where every request is admitted at once."""
    from engine_utils import engine
    from vllm import SamplingParams

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, _ = tiny_models
    lengths = [3, 7, 5, 5]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    prompts = [[3 + i, 7, 11, 13, 17, 19, 23, 29] for i in range(len(lengths))]
    with engine(target, None) as llm:
        steady: dict = {}
        served = gpu_engines.generate_at_concurrency(llm, prompts, params, 2, steady)
        assert [len(o.outputs[0].token_ids) for o in served] == lengths
        assert steady["tokens"] == 8 and steady["seconds"] > 0
        at_once: dict = {}
        gpu_engines.generate_at_concurrency(llm, prompts[:2], params[:2], 2, at_once)
        assert at_once == {"seconds": None, "tokens": None}
    run = {"tokens": [[1] * n for n in lengths], "seconds": 2.0, "steady": steady}
    assert gpu_engines.steady_tokens_per_second(run) == steady["tokens"] / steady["seconds"]
    assert gpu_engines.steady_tokens_per_second({**run, "steady": at_once}) is None


def test_gpu_busy_is_the_union_of_device_intervals_over_their_span():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    gpu_engines = importlib.import_module("benchmarks.harness.engines")

    def event(start, end, device=DeviceType.CUDA):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    # GPU: 0-4000 and 3000-5000 overlap (5 ms busy), idle to 8000, busy 8000-9000; host ignored.
    events = [event(8000, 9000), event(0, 4000), event(3000, 5000),
              event(100, 20000, DeviceType.CPU)]
    assert gpu_engines.gpu_busy(events) == {"span_ms": 9.0, "busy_ms": 6.0,
                                            "busy_fraction": 0.6667, "device_events": 3}
    assert gpu_engines.gpu_busy([event(0, 5, DeviceType.CPU)]) is None


def test_counters_are_differenced_and_totalled_key_by_key_and_element_by_element():
    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    before = {"counts": [1, 2], "seconds": [[1, 0.5], [0, 0.0]], "plans": 3}
    after = {"counts": [4, 2], "seconds": [[2, 1.5], [1, 0.25]], "plans": 5}
    assert gpu_engines.difference(after, before) == {
        "counts": [3, 0], "seconds": [[1, 1.0], [1, 0.25]], "plans": 2}
    assert gpu_engines.total([before, after]) == {
        "counts": [5, 4], "seconds": [[3, 2.0], [1, 0.25]], "plans": 8}


def test_pinned_engines_get_cores_of_their_own(monkeypatch):
    import os

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    env, cores = gpu_engines.ENV_KEY, gpu_engines.ENGINE_CORES
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    configs = {"a": {"model": "m"}, "b": {"model": "m", env: {"X": "1"}}, "c": {"model": "m"}}
    pinned = gpu_engines.pinned(configs)
    assert [pinned[n][env][cores] for n in "abc"] == ["0,1", "2,3", "4,5"]
    assert pinned["b"][env]["X"] == "1" and configs["a"] == {"model": "m"}
    with pytest.raises(SystemExit, match="8 engines, 7 cores"):
        gpu_engines.pinned({str(i): {} for i in range(8)})


def test_engine_core_in_its_own_process_keeps_each_engines_environment():
    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    env, ablate = gpu_engines.ENV_KEY, gpu_engines.ABLATE_KEY
    configs = {"a": {"model": "m"}, "b": {"model": "m", env: {"VLLM_USE_V2_MODEL_RUNNER": "0"}}}
    own = gpu_engines.engine_core_in_own_process(configs)
    assert own["a"] == {"model": "m", env: {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    assert own["b"][env] == {"VLLM_USE_V2_MODEL_RUNNER": "0",
                             "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert configs["a"] == {"model": "m"}  # the caller's configs are left as they were
    kwargs, environment, _ = gpu_engines.split_engine_kwargs(own["b"])
    assert kwargs == {"model": "m"} and environment == own["b"][env]
    with pytest.raises(SystemExit, match="ablations need the engine core in-process"):
        gpu_engines.engine_core_in_own_process({"c": {"model": "m", ablate: ["plan"]}})


def test_warm_up_verifies_every_chunk_size_and_gives_the_policy_back(tiny_models):
    """The GPU benchmarks' warm-up, on the real CPU engine: SCV verifies every chunk size, 0
    included (so vLLM's speculative kernels meet every draft budget before a measured run, and
    the cost model sees plain steps), at the whole batch and for one request alone, then runs
    adaptive again; an engine without SCV just
    runs. The benchmark's trace records the budget changes and every step observed."""
    from engine_utils import PROMPTS, engine, spec_config
    from vllm import SamplingParams

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, draft = tiny_models
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 2
    held = {"scv": "adaptive", "scv_cost_model": [0.001, 1.0, 1.0], "scv_probe_interval": 10**6}
    with engine(target, spec_config("draft_model", draft, **held)) as llm:  # would never draft
        policy = gpu_engines.scv_policy(llm)
        settings, before = policy.settings, list(policy.budget_counts)
        changes, steps = gpu_engines.trace_scv(llm)
        chunks = gpu_engines.warm_every_chunk(llm, PROMPTS[:2], params)
        planned = [after - was for after, was in zip(policy.budget_counts, before, strict=True)]
        assert chunks == [0, 1, 2, 3] and all(planned[chunk] > 0 for chunk in chunks), planned
        assert {change[1] for change in changes} >= {1, 2, 3}  # the budgets it moved to
        assert {len(step) for step in steps} == {8} and {s[2] for s in steps} >= {0, 1, 2, 3}
        # every budget drafted for a request alone too (harness.engines.SMALL_WARM_BATCHES)
        assert {s[2] for s in steps if s[0] == 1} >= {1, 2, 3}
        # every budget met after plain steps, as a probe meets it: a catch-up comes first
        for size in (1, 2):
            assert {s[2] for s in steps if s[0] == size and s[7] > 0} >= {1, 2, 3}
        # drafts verified: some, and within the step's tokens beyond one per request
        assert max(s[6] for s in steps) > 0 and all(0 <= s[6] <= s[1] - s[0] for s in steps)
        assert policy.settings is settings and settings.mode == "adaptive"
    with engine(target, spec_config("ngram")) as llm:
        assert gpu_engines.warm_every_chunk(llm, PROMPTS[:2], params) == []


def test_benchmark_engine_reports_what_scv_did_in_a_run(tiny_models):
    """The GPU benchmarks' engine process (``harness.engines.Engine``), on the real CPU engine:
    the warm-up covers every chunk size, and a run comes back with SCV's counters for that run
    alone, its budget changes, every step its cost model observed and the policy's host time per
    step."""
    from engine_utils import PROMPTS, engine_options, spec_config

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, draft = tiny_models
    kwargs = engine_options(target, spec_config("draft_model", draft, scv="adaptive"))
    engines = gpu_engines.start_engines({"scv": kwargs})
    try:
        warm = engines["scv"].warm(PROMPTS[:2])
        runs = [engines["scv"].run(PROMPTS[:2]) for _ in range(2)]
        key = gpu_engines.OUTPUT_LEN_KEY  # a request's own output length (scv_bench)
        short = engines["scv"].run(PROMPTS[:2], [{key: 3}, {key: 5}])
    finally:
        gpu_engines.stop_engines(engines)
    assert [len(tokens) for tokens in short["tokens"]] == [3, 5]
    assert warm["chunks_warmed"] == [0, 1, 2, 3]
    assert {step[2] for step in warm["steps"]} == {0, 1, 2, 3}  # budgets of the warm-up's steps
    assert len(warm["coefficients"]) == len(runs[0]["scv"]["coefficients"])
    for run in runs:
        scv = run["scv"]
        assert set(scv) == {"counters", "budget_changes", "steps", "coefficients", "graphs"}
        assert scv["graphs"] == [None, False]  # the CPU engine has no FULL graphs
        counters = scv["counters"]
        assert set(counters) == {"budget_counts", "budget_seconds", "uniform_plans",
                                 "learning_excess", "unpriced_plans"}
        planned = sum(counters["budget_counts"])
        observed = sum(c for c, _ in counters["budget_seconds"])
        # this run's steps only: 2 requests of OUTPUT_LEN tokens take at most that many steps
        assert 0 < observed <= len(scv["steps"]) <= planned <= gpu_engines.OUTPUT_LEN + 2
        assert all(len(step) == 8 for step in scv["steps"])
        assert len(run["tokens"]) == 2
        assert run["scv_policy_us_per_step"] > 0  # the policy's host time, timed


def test_nwor_host_timer_counts_the_steps_work_only_with_nwor_on(tiny_models):
    """``--time-nwor-host``'s timer, on the real CPU engine: with NWOR on it times each verify
    step's indices, begin and commit (at least three calls a verify step); with NWOR off
    there is nothing to time."""
    from engine_utils import PROMPTS, engine, spec_config
    from vllm import SamplingParams

    import vllm_nwor

    gpu_engines = importlib.import_module("benchmarks.harness.engines")
    target, draft = tiny_models
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with engine(target, spec_config("draft_model", draft, nwor=True)) as llm:
        totals = gpu_engines.time_nwor_host(llm)
        assert totals == {"seconds": 0.0, "calls": 0}
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
        staged = vllm_nwor.get_counters(llm).verify_steps_staged
        assert staged > 0
        assert totals["calls"] >= 3 * staged and totals["seconds"] > 0
    with engine(target, spec_config("draft_model", draft)) as llm:
        assert gpu_engines.time_nwor_host(llm) is None


def test_host_noise_summary_names_where_the_main_thread_ran_and_who_was_busy():
    """tools/host_noise.py: a run's window of samples gives the main thread's CPU, how busy that CPU
    and its siblings were, and the threads and processes over 5% of a CPU."""
    noise = importlib.import_module("benchmarks.tools.host_noise")
    tick = os.sysconf("SC_CLK_TCK")
    # 1 s apart; main thread 10 on CPU 3 all along, thread 11 idle; CPU 3 and its sibling 7
    # busy; another engine's process 99 at a fifth of a CPU.
    samples = [(100.0 + t, {3: t * tick, 7: t * tick // 2, 0: 0},
                {10: (3, t * tick), 11: (0, 0)}, {99: t * tick // 5}) for t in range(3)]
    summary = noise.summarize(samples, 100.0, 102.0, 10, {3: [7], 7: [3], 0: []})
    assert summary["main_cpu"] == 3 and summary["main_cpu_changes"] == 0
    assert summary["main_cpu_busy"] == 1.0 and summary["sibling_busy"] == [0.5]
    assert summary["cpus_busy_over_half"] == [3]
    assert summary["busy_threads"] == {"main": 1.0}
    assert summary["busy_processes"] == {"99": 0.2}
    assert noise.summarize(samples, 200.0, 201.0, 10, {}) == {}  # no samples in the window
    assert noise.one_per_core({0: [4], 4: [0], 1: [], 2: [6], 6: [2]}) == [0, 1, 2]


def test_fit_replay_prices_steady_plans_at_their_own_requests():
    """tools/scv_fit_replay.py: steps that cost exactly 4 ms plus 1 ms a draft pass plus 0.1 ms a
    verified token are priced at what they took, at each plan's own number of requests (a
    batch draining to 3 requests among them), and the steady plans are found."""
    replay = importlib.import_module("benchmarks.tools.scv_fit_replay")

    def step(requests: int, budget: int) -> list:
        tokens = requests * (1 + budget)
        ms = 4.0 + 1.0 * budget + 0.1 * tokens
        return [requests, tokens, budget, ms, 1, 0, requests * budget, 0]

    warm = [step(r, b) for b in (0, 1, 2, 4) for r in (8, 3) for _ in range(40)]
    rep = [step(8, b) for b in (0, 2, 4, 1) for _ in range(30)] + [step(3, 2)] * 30
    result = {"groups": [{"warm": {"scv": {"8": {"steps": warm}}}}],
              "cells": [{"batch": 8, "scv_choices_by_group": [
                  {"graphs": [None, False], "steps_by_rep": [rep]}]}]}
    assert set(replay.steady_times(rep)) == {(8, 0), (8, 2), (8, 4), (8, 1), (3, 2)}
    errors = replay.replay(result, replay.StepCostModel())
    assert sorted(budget for _, budget, _ in errors) == [1, 2, 4]  # the second half's plans
    assert max(abs(e) for _, _, e in errors) < 0.02
    aged = replay.replay(result, replay.AgedStepCostModel(64))
    assert max(abs(e) for _, _, e in aged) < 0.02
