"""Why does a host-bound engine's step time move by up to 2x between runs of one cell?

Why a host-bound engine's step time moves by up to 2x between runs: a diagnostic, one GPU.

At batch 1 the speculative engines' steps are bound by the host, and their median step moved
by up to 2x between repetitions of the same engine and workload, in both directions, while plain
decoding's (GPU-bound) did not move; within one run SCV's budget-2 steps went from about 6 ms
to about 11 ms and stayed there (``scv_b1_k8_2026-11-24_h200.json``). That is the noise every
batch-1 comparison of SCV with fixed k carries.

This runs one fixed-k engine in this process (the engine core in-process, as the benchmarks
do) on one request at a time, many short runs, and a sampler process beside it that reads,
every 20 ms, which CPU each of the engine's threads last ran on and its CPU time
(``/proc/<pid>/task/*/stat``), and every CPU's busy time (``/proc/stat``). For each run it
reports the step time, the CPU the main thread sat on most, how busy that CPU's SMT siblings
were, and the engine's threads and the other engines' processes that used more than 5% of a
CPU. ``--idle-engines`` starts other engines first, each in a process of its own, and leaves
them idle, as the benchmarks' engines wait while another runs; the runs then alternate between
those processes awake and stopped (SIGSTOP: their CUDA contexts stay). Without other engines,
runs alternate between the process free to run on any CPU and the process pinned to one CPU per
physical core whose siblings it leaves out, or to the CPUs given (``--pin``), so that the two
can be compared run by run.

    python -m benchmarks.tools.host_noise --jsonl $OUT/host_noise.jsonl
    python -m benchmarks.tools.host_noise --merge A.jsonl B.jsonl ... --result <json>

A merge keeps each run whole, with the environment recorded beside its jsonl (runs on different
machines stay apart).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness.engines import count_engine_steps, prompts, rate_for_length, write_models
from benchmarks.harness.results import (
    append_jsonl,
    recorded_environment,
    write_json,
)
from benchmarks.scv_bench import engine_kwargs

SAMPLE_SECONDS = 0.02


def siblings() -> dict[int, list[int]]:
    """Each CPU's SMT siblings (itself left out); empty lists where the kernel says none."""
    out = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        text = path.read_text().strip() if path.exists() else str(cpu)
        members = set()
        for part in text.split(","):
            low, _, high = part.partition("-")
            members.update(range(int(low), int(high or low) + 1))
        out[cpu] = sorted(members - {cpu})
    return out


def one_per_core(topology: dict[int, list[int]]) -> list[int]:
    """One CPU of each physical core (the lowest-numbered)."""
    return sorted({min([cpu, *others]) for cpu, others in topology.items()})


def _cpu_busy() -> dict[int, float]:
    busy = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *fields = line.split()
                values = list(map(int, fields))
                busy[int(name[3:])] = sum(values) - values[3] - values[4]  # less idle, iowait
    return busy


def _stat(path: str) -> tuple[int, int] | None:
    """A task's ``/proc/.../stat``: (the CPU it last ran on, utime + stime in ticks); None
    where it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[36]), int(fields[11]) + int(fields[12])


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread: (CPU it last ran on, utime + stime in ticks)."""
    stats = {int(tid): _stat(f"/proc/{pid}/task/{tid}/stat")
             for tid in os.listdir(f"/proc/{pid}/task")}
    return {tid: stat for tid, stat in stats.items() if stat is not None}


def _processes(pids: list[int]) -> dict[int, int]:
    """Each process's utime + stime in ticks, with all its threads'."""
    stats = {pid: _stat(f"/proc/{pid}/stat") for pid in pids}
    return {pid: stat[1] for pid, stat in stats.items() if stat is not None}


def sampler(pid: int, others: list[int], conn) -> None:
    """Samples until told to stop; then sends the samples: (time, CPU busy ticks, the engine's
    threads, the other engines' processes)."""
    samples = []
    while not conn.poll(SAMPLE_SECONDS):
        samples.append((time.time(), _cpu_busy(), _threads(pid), _processes(others)))
    conn.send(samples)


def idle_engine(kwargs: dict, conn) -> None:
    """Another engine in a process of its own, built and then left idle (as the benchmarks'
    engines wait while another runs)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(**kwargs)
    conn.send("ready")
    conn.recv()
    del llm


def summarize(samples: list, start: float, end: float, main_tid: int,
              topology: dict[int, list[int]]) -> dict:
    window = [s for s in samples if start <= s[0] <= end]
    if len(window) < 2:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    seconds = window[-1][0] - window[0][0]
    main_cpus = [s[2][main_tid][0] for s in window if main_tid in s[2]]
    main_cpu = statistics.mode(main_cpus) if main_cpus else -1
    first, last = window[0][1], window[-1][1]
    busy = {cpu: (last[cpu] - first.get(cpu, 0)) / tick / seconds for cpu in last}
    threads = {tid: (window[-1][2][tid][1] - window[0][2].get(tid, (0, 0))[1]) / tick / seconds
               for tid in window[-1][2]}
    processes = {pid: (window[-1][3][pid] - window[0][3].get(pid, 0)) / tick / seconds
                 for pid in window[-1][3]}
    return {"main_cpu": main_cpu, "main_cpu_changes": sum(
                a != b for a, b in zip(main_cpus, main_cpus[1:], strict=False)),
            "main_cpu_busy": round(busy.get(main_cpu, 0.0), 2),
            "sibling_busy": [round(busy.get(c, 0.0), 2) for c in topology.get(main_cpu, [])],
            "cpus_busy_over_half": sorted(c for c, b in busy.items() if b > 0.5),
            "busy_threads": {("main" if tid == main_tid else str(tid)): round(share, 2)
                             for tid, share in threads.items() if share > 0.05},
            "busy_processes": {str(pid): round(share, 2) for pid, share in processes.items()
                               if share > 0.05}}


def merge(jsonls: list[Path], result: Path) -> None:
    runs = []
    for jsonl in jsonls:
        records = [json.loads(line) for line in jsonl.read_text().splitlines()]
        runs.append({"step": jsonl.stem, **recorded_environment(jsonl),
                     "setup": records[0], "summary": records[-1].get("summary"),
                     "runs": [r for r in records[1:] if "run" in r]})
    write_json(result, {"benchmark": "host_noise", "steps": runs})
    print(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--merge", type=Path, nargs="+")
    parser.add_argument("--result", type=Path)
    parser.add_argument("--pin", type=int, nargs="*",
                        help="the CPUs of the pinned runs (default: one per physical core)")
    parser.add_argument("--policy", default="fixed_k4")
    parser.add_argument("--length", type=float, default=3.0,
                        help="mean acceptance length at k=4 (synthetic)")
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--idle-engines", nargs="*", default=[],
                        help="policies of other engines, each in its own process, left idle")
    parser.add_argument("--output-len", type=int, default=192)
    args = parser.parse_args()
    if args.merge:
        if args.result is None:
            parser.error("--merge needs --result")
        return merge(args.merge, args.result)
    if args.jsonl is None:
        parser.error("--jsonl or --merge is needed")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    topology = siblings()
    pinned = args.pin or one_per_core(topology)
    free = sorted(os.sched_getaffinity(0))
    header = {"topology": {str(c): s for c, s in topology.items()}, "pinned_cpus": pinned,
              "os_cpu_count": os.cpu_count(), "policy": args.policy, "length": args.length,
              "idle_engines": args.idle_engines, "engine_pid": os.getpid()}
    print(json.dumps(header), flush=True)
    append_jsonl(args.jsonl, header)
    with tempfile.TemporaryDirectory() as root:
        target, draft = write_models(Path(root))
        context = mp.get_context("spawn")
        share = round(0.8 / (1 + len(args.idle_engines)), 3)
        others = []
        for policy in args.idle_engines:
            conn, child = context.Pipe()
            process = context.Process(target=idle_engine, args=(
                engine_kwargs(policy, target, draft, 4, share), child), daemon=True)
            process.start()
            conn.recv()
            others.append((conn, process))
        llm = LLM(**engine_kwargs(args.policy, target, draft, 4, share))
        rate = rate_for_length(args.length, 4)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                                extra_args={"synthetic_acceptance_rate": rate})
        steps = count_engine_steps(llm)
        for seed in range(3):  # warm-up
            llm.generate([{"prompt_token_ids": prompts(1, seed)[0]}], params, use_tqdm=False)
        conn, child = context.Pipe()
        process = context.Process(target=sampler, args=(
            os.getpid(), [p.pid for _, p in others], child), daemon=True)
        process.start()
        marks = []
        try:
            for run in range(args.runs):
                # With other engines: awake and stopped (SIGSTOP) in turn; else free and pinned.
                mode = (("awake", "stopped") if others else ("free", "pinned"))[run % 2]
                for _, other in others:
                    os.kill(other.pid, signal.SIGSTOP if mode == "stopped" else signal.SIGCONT)
                cpus = pinned if mode == "pinned" else free
                os.sched_setaffinity(0, cpus)
                for tid in map(int, os.listdir("/proc/self/task")):
                    try:
                        os.sched_setaffinity(tid, cpus)
                    except OSError:
                        pass
                steps[0] = 0
                start = time.time()
                out = llm.generate([{"prompt_token_ids": prompts(1, 100 + run)[0]}], params,
                                   use_tqdm=False)
                end = time.time()
                marks.append((run, mode, start, end, steps[0],
                              len(out[0].outputs[0].token_ids)))
        finally:  # never leave an engine stopped: it would not act on the SIGTERM that ends it
            for _, other in others:
                os.kill(other.pid, signal.SIGCONT)
        conn.send("stop")
        samples = conn.recv()
        process.join(timeout=10)
        main_tid = os.getpid()
        by_mode = {}
        for run, mode, start, end, n, tokens in marks:
            row = {"run": run, "mode": mode, "ms_per_step": round(1e3 * (end - start) / n, 3),
                   "steps": n, "tok_s": round(tokens / (end - start), 1),
                   **summarize(samples, start, end, main_tid, topology)}
            by_mode.setdefault(mode, []).append(row["ms_per_step"])
            print(json.dumps(row), flush=True)
            append_jsonl(args.jsonl, row)
        summary = {"summary": {mode: {"median_ms": statistics.median(v), "min_ms": min(v),
                                      "max_ms": max(v)} for mode, v in by_mode.items()}}
        print(json.dumps(summary), flush=True)
        append_jsonl(args.jsonl, summary)
        for other, _ in others:
            other.send("stop")


if __name__ == "__main__":
    main()
