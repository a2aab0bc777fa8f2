"""NWOR's KV-cache traffic on the GPU, read from the hardware's counters with Nsight Compute.

The target is Llama-3-8B-shaped (32 layers, dummy bf16 weights) with a one-layer EAGLE-3 head on
vLLM's V2 model runner, FULL CUDA graphs as vLLM serves them, k drafts. Acceptance is vLLM's
synthetic rejection sampling at per-position rates ``a, a**2, ..., a**k`` whose mean, the
acceptance rate (accepted drafts over drafts), is each ``--acceptance``. For each acceptance and
side (NWOR off, NWOR on) one engine runs in its own process under ``ncu``; for each batch size
it fills the batch with requests, steps past their prefill, and opens a window of steps to the
profiler (``cudaProfilerStart``/``Stop``; a ``spin_kernel`` launch marks each window's start).
Three passes, each an engine per (acceptance, side):

- ``kv``: only the KV-cache kernels are profiled: vLLM's ``reshape_and_cache_flash`` (the
  target's 32 layers and the head's one), NWOR's plan (``_plan_scratch_kernel``, which also
  copies the committed tokens that share a request's first scratch block) and commit
  (``_commit_kv_kernel``), each kernel node inside the graphs on its own, with the caches
  flushed before it (ncu's default). A kernel's L2 sectors requested by the SMs
  (``srcunit_tex``) are the bytes it wrote and read; all of L2's requests (``l2_all_*``) also
  count the traffic between L2's two halves, so they read high. Its DRAM bytes are what reached
  memory while it ran: its dirty lines are written back later, to no kernel's account, so DRAM
  writes undercount.
- ``step``: every launch of the window is profiled, each CUDA graph as one workload, without
  flushes: the window's sums are the steps' traffic as served, DRAM write-backs counted in the
  launch that evicts them. Its times are of launches run one at a time under ncu, not a
  served step's time (``benchmarks/nwor_overhead.py`` measures that).
- ``nodes``: every kernel of the window on its own, graph nodes included, without flushes,
  summed per kernel name: where a step's GPU time goes, and which kernels NWOR adds or slows
  (``kernels_differing_most`` in the summary).

Per (acceptance, side, batch) the record holds the window's steps, generated tokens, drafts and
accepted drafts (vLLM's counters, read around the window), and per kernel family the launches,
GPU time and bytes (L2 read/write, DRAM read/write). ``kv_bytes_written_per_token`` is the KV
kernels' L2 write bytes over the tokens the window generated.

    python -m benchmarks.nwor_kv_traffic --pass kv --jsonl $OUT/kv.jsonl      # GPU machine
    python -m benchmarks.nwor_kv_traffic --pass step --jsonl $OUT/step.jsonl
    python -m benchmarks.nwor_kv_traffic --merge $OUT/kv.jsonl --result <json>  # here
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness.engines import (
    LLAMA3_8B,
    PROMPT_LEN,
    prompts,
    rate_for_length,
    write_eagle3_head,
    write_models,
)
from benchmarks.harness.results import (
    append_jsonl,
    parse_or_merge,
    recorded_environment,
    write_json,
)

METRICS = {  # ncu metric -> (field, bytes per unit)
    "gpu__time_duration.sum": ("ns", 1),
    "lts__t_sectors_srcunit_tex_op_read.sum": ("l2_read_bytes", 32),
    "lts__t_sectors_srcunit_tex_op_write.sum": ("l2_write_bytes", 32),
    "lts__t_sectors_op_read.sum": ("l2_all_read_bytes", 32),
    "lts__t_sectors_op_write.sum": ("l2_all_write_bytes", 32),
    "dram__bytes_read.sum": ("dram_read_bytes", 1),
    "dram__bytes_write.sum": ("dram_write_bytes", 1),
}
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: a window's first launch
FAMILIES = (  # kernel name pattern -> family
    (r"reshape_and_cache", "vllm_kv_write"),
    (r"_plan_scratch", "nwor_plan"),
    (r"_commit_kv", "nwor_commit"),
)
KV_FAMILIES = {family for _, family in FAMILIES}
KV_KERNELS = "|".join(pattern for pattern, _ in FAMILIES) + "|" + MARKER
PASSES = {
    "kv": ["--graph-profiling", "node", "--cache-control", "all",
           "--kernel-name", f"regex:{KV_KERNELS}"],
    "step": ["--graph-profiling", "graph", "--cache-control", "none"],
    "nodes": ["--graph-profiling", "node", "--cache-control", "none"],
}
STEPS = {"kv": 8, "step": 4, "nodes": 2}
"""Steps a window, per pass (``--steps``)."""
KV_BYTES_PER_TOKEN_TARGET = (LLAMA3_8B["num_hidden_layers"] * 2 * LLAMA3_8B["num_key_value_heads"]
                             * LLAMA3_8B["head_dim"] * 2)
"""K and V of one token in all the target's layers, bf16: what vLLM's write stores per row."""


def family(name: str) -> str:
    for pattern, label in FAMILIES:
        if re.search(pattern, name):
            return label
    return "other"


def rates(acceptance: float, k: int) -> list[float]:
    """Per-position unconditional acceptance rates ``a**j`` whose mean is ``acceptance``."""
    a = rate_for_length(1 + acceptance * k, k)
    return [round(a**j, 6) for j in range(1, k + 1)]


def engine_kwargs(target: str, head: str, k: int, acceptance: float, nwor: bool,
                  batches: list[int], output_len: int) -> dict:
    speculative = {"method": "eagle3", "model": head, "num_speculative_tokens": k,
                   "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_rates": rates(acceptance, k)}
    if nwor:
        speculative["nwor"] = True
    return dict(
        model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=PROMPT_LEN + output_len + 64, max_num_seqs=max(batches),
        gpu_memory_utilization=0.35, seed=0, disable_log_stats=False,
        enable_prefix_caching=False, speculative_config=speculative,
        # Only the sizes the windows run are captured, the verify steps' and the head's (vLLM's
        # default captures them among ~70 others): start-up under ncu, which intercepts every
        # capture, stays short.
        compilation_config={"cudagraph_capture_sizes": sorted(
            {b * (k + 1) for b in batches} | set(batches))},
    )


def child(config: dict) -> None:
    """One engine under ncu: per batch, a window of ``steps`` steps open to the profiler."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the kernels launch in this process
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(**config["kwargs"])
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=config["output_len"], temperature=0.0, ignore_eos=True)

    def counters() -> dict:
        metrics = {m.name: m for m in llm.get_metrics()}
        return {"drafted": metrics["vllm:spec_decode_num_draft_tokens"].value,
                "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value}

    windows = []
    for batch in config["batches"]:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, prompts(batch, seed=batch), strict=True):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        generated: dict[str, int] = {}

        def step(generated: dict[str, int] = generated) -> None:
            for output in engine.step():
                generated[output.request_id] = len(output.outputs[0].token_ids)

        while len(generated) < batch or min(generated.values()) < 2:  # past every prefill
            step()
        for _ in range(config["warm_steps"]):
            step()
        torch.cuda.synchronize()
        before, tokens_before = counters(), sum(generated.values())
        torch.cuda.profiler.start()
        torch.cuda._sleep(1000)
        for _ in range(config["steps"]):
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        after = counters()
        windows.append({"batch": batch, "steps": config["steps"],
                        "tokens": sum(generated.values()) - tokens_before,
                        "drafted": after["drafted"] - before["drafted"],
                        "accepted": after["accepted"] - before["accepted"],
                        "min_generated": min(generated.values())})
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    Path(config["out"]).write_text(json.dumps(windows))


def ncu_binary() -> str:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))[-1:]
    if not found:
        raise SystemExit("ncu (Nsight Compute) is not on this machine")
    return found if isinstance(found, str) else found[0]


def read_report(ncu: str, report: Path) -> list[dict]:
    """The report's launches in order: name and the METRICS' values in base units."""
    text = subprocess.run(
        [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base",
         "--metrics", ",".join(METRICS)],
        capture_output=True, text=True, check=True).stdout
    rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    header, body = rows[0], rows[2:]  # the second row holds the units
    name = header.index("Kernel Name")
    columns = [(header.index(metric), field, scale) for metric, (field, scale) in METRICS.items()]
    launches = []
    for row in body:
        if len(row) != len(header):
            continue
        launch = {"name": row[name]}
        for column, field, scale in columns:
            value = row[column].replace(",", "")
            launch[field] = float(value) * scale if value not in ("", "n/a") else None
        launches.append(launch)
    return launches


def kernel_name(name: str) -> str:
    """A launch's kernel without namespaces, template arguments and parameters."""
    base = re.sub(r"<.*", "", name.replace("<unnamed>", "anonymous")).split("(")[0]
    return base.replace("void ", "").split("::")[-1].strip()


def summarize(launches: list[dict], key=family) -> dict:
    """Per ``key`` (the kernel family): launches, and the sum of each field (None where ncu
    gave no value)."""
    families: dict[str, dict] = {}
    for launch in launches:
        entry = families.setdefault(key(launch["name"]), {"launches": 0})
        entry["launches"] += 1
        for field, _ in METRICS.values():
            if launch[field] is not None:
                entry[field] = entry.get(field, 0) + launch[field]
    return families


def kv_total(families: dict, field: str) -> float:
    """The KV kernels' (:data:`KV_FAMILIES`) sum of ``field``."""
    return sum(f.get(field, 0) for name, f in families.items() if name in KV_FAMILIES)


def split_windows(launches: list[dict], count: int) -> list[list[dict]]:
    """The launches of each window, each starting at its marker."""
    starts = [i for i, launch in enumerate(launches) if MARKER in launch["name"]]
    if len(starts) != count:
        raise RuntimeError(f"{len(starts)} window markers in the report, {count} windows run")
    return [launches[s + 1:e] for s, e in zip(starts, starts[1:] + [len(launches)], strict=True)]


def cell(window: dict, launches: list[dict], pass_: str) -> dict:
    families = summarize(launches)
    cell = {**window, "families": families}
    tokens = window["tokens"]
    if window["drafted"]:
        cell["acceptance_measured"] = round(window["accepted"] / window["drafted"], 4)
    if pass_ == "kv" and tokens:
        cell["kv_bytes_written_per_token"] = round(kv_total(families, "l2_write_bytes") / tokens)
        cell["kv_kernels_ns_per_step"] = round(kv_total(families, "ns") / window["steps"])
    if pass_ == "nodes":
        cell["kernels"] = summarize(launches, key=kernel_name)
    if pass_ in ("step", "nodes"):
        total = {field: sum(f.get(field, 0) for f in families.values())
                 for field, _ in METRICS.values()}
        cell["per_step"] = {field: round(value / window["steps"]) for field, value in total.items()}
        if tokens:
            cell["per_token"] = {field: round(value / tokens)
                                 for field, value in total.items() if field != "ns"}
    return cell


def run(args) -> None:
    ncu = ncu_binary()
    root = Path(tempfile.mkdtemp(prefix="nwor_kv_traffic_"))
    target, _ = write_models(root)
    head = write_eagle3_head(root)
    steps = args.steps or STEPS[args.pass_]
    for acceptance in args.acceptance:
        for nwor in (False, True):
            side = "on" if nwor else "off"
            config = {"kwargs": engine_kwargs(target, head, args.k, acceptance, nwor,
                                              args.batches, args.output_len),
                      "batches": args.batches, "steps": steps, "warm_steps": args.warm_steps,
                      "output_len": args.output_len,
                      "out": str(root / f"windows-{acceptance}-{side}.json")}
            report = root / f"{args.pass_}-{acceptance}-{side}.ncu-rep"
            command = [ncu, "--clock-control", "none", "--profile-from-start", "off",
                       "--target-processes", "all", "--metrics", ",".join(METRICS),
                       *PASSES[args.pass_], "-f", "-o", str(report.with_suffix("")),
                       sys.executable, "-m", "benchmarks.nwor_kv_traffic",
                       "--child", json.dumps(config)]
            print(f"=== {args.pass_} acceptance {acceptance} nwor {side}", flush=True)
            subprocess.run(command, check=True)
            windows = json.loads(Path(config["out"]).read_text())
            launches = read_report(ncu, report)
            for window, part in zip(windows, split_windows(launches, len(windows)), strict=True):
                record = {"pass": args.pass_, "acceptance": acceptance, "side": side,
                          "k": args.k, **cell(window, part, args.pass_)}
                print(json.dumps(record), flush=True)
                append_jsonl(args.jsonl, record)
            if args.keep_reports:
                shutil.copy(report, args.keep_reports)


def ratio(on, off):
    return round(on / off, 3) if on is not None and off else None


def kv_sum(cell: dict, field: str) -> int:
    """A kv cell's KV kernels' ``field`` per step."""
    return round(kv_total(cell["families"], field) / cell["steps"])


def nodes_difference(off: dict, on: dict, top: int = 12) -> dict:
    """GPU time a step, off and on, and the kernels whose time a step differs most."""
    def per_step(cell, name):
        kernel = cell["kernels"].get(name, {})
        return {"launches": round(kernel.get("launches", 0) / cell["steps"], 2),
                "ns": round(kernel.get("ns", 0) / cell["steps"])}

    names = set(off["kernels"]) | set(on["kernels"])
    rows = sorted(({"kernel": name, "off": per_step(off, name), "on": per_step(on, name)}
                   for name in names),
                  key=lambda r: -abs(r["on"]["ns"] - r["off"]["ns"]))
    return {"ns_per_step": {"off": off["per_step"]["ns"], "on": on["per_step"]["ns"],
                            "on_over_off": ratio(on["per_step"]["ns"], off["per_step"]["ns"])},
            "kernels_differing_most": rows[:top]}


def summary(cells: list[dict]) -> list[dict]:
    """Per (acceptance, batch): NWOR on against off, from both passes where present."""
    rows = []
    for acceptance, batch in sorted({(c["acceptance"], c["batch"]) for c in cells}):
        row = {"acceptance": acceptance, "batch": batch}
        for pass_ in ("kv", "step", "nodes"):
            side = {c["side"]: c for c in cells if c["pass"] == pass_
                    and (c["acceptance"], c["batch"]) == (acceptance, batch)}
            if set(side) != {"off", "on"}:
                continue
            off, on = side["off"], side["on"]
            if pass_ == "kv":
                row["kv_kernels_per_step"] = {
                    field: {"off": kv_sum(off, field), "on": kv_sum(on, field),
                            "on_over_off": ratio(kv_sum(on, field), kv_sum(off, field))}
                    for field in ("l2_write_bytes", "dram_write_bytes", "l2_read_bytes", "ns")}
                written = {"off": off.get("kv_bytes_written_per_token"),
                           "on": on.get("kv_bytes_written_per_token")}
                written["on_over_off"] = ratio(written["on"], written["off"])
                row["kv_bytes_written_per_token"] = written
                row["on_families_per_step"] = {
                    name: {field: round(value / on["steps"]) for field, value in family.items()
                           if field != "launches"}
                    for name, family in on["families"].items()}
            elif pass_ == "nodes":
                row["nodes"] = nodes_difference(off, on)
            else:
                row["step"] = {field: {"off": off["per_step"][field], "on": on["per_step"][field],
                                       "on_over_off": ratio(on["per_step"][field],
                                                            off["per_step"][field])}
                               for field in ("l2_write_bytes", "dram_write_bytes",
                                             "l2_read_bytes", "dram_read_bytes", "ns")}
            row[f"acceptance_measured_{pass_}"] = on.get("acceptance_measured")
        rows.append(row)
    return rows


def merge(jsonl: Path, result: Path) -> None:
    """Every ``*.jsonl`` beside ``jsonl`` that holds this benchmark's records (both passes)."""
    cells = []
    for path in sorted(jsonl.parent.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        cells += [r for r in records if r.get("pass") in PASSES]
    write_json(result, {
        **recorded_environment(jsonl), "benchmark": "nwor_kv_traffic",
        "workload": {"model": "Llama-3-8B shape (32 layers), dummy weights, bf16",
                     "draft": "one-layer EAGLE-3 head, dummy weights, vLLM's V2 model runner",
                     "acceptance": "vLLM synthetic rejection sampling, per-position rates a, "
                                   "a^2, ..., a^k whose mean is the cell's acceptance",
                     "prompt_len": PROMPT_LEN,
                     "target_kv_bytes_per_row": KV_BYTES_PER_TOKEN_TARGET,
                     "ncu": {"metrics": METRICS, "passes": PASSES, "clock_control": "none"}},
        "summary": summary(cells), "cells": cells})


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pass", dest="pass_", choices=sorted(PASSES), default="kv")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.3, 0.7])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, help=f"steps a window (default {STEPS})")
    parser.add_argument("--warm-steps", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--keep-reports", type=Path, help="copy the ncu reports here")
    args = parse_or_merge(parser, merge)
    if args is not None:
        run(args)


if __name__ == "__main__":
    main()
