"""Engine processes for the GPU benchmarks: one vLLM engine per process, driven over a pipe.

Several engines can be alive in one run (started one after the other), so a benchmark can
alternate batches between them, whole runs or slices of runs (:func:`interleave`). Each reply
carries the batch's tokens, wall time, median inter-token latency and the spec-decode and NWOR
counter deltas. Beside them: the 8B-shaped dummy checkpoints and prompts the GPU benchmarks
share, the CPU benchmarks' engine settings, and the timers and samplers a run may switch on.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
)
PROMPT_LEN, OUTPUT_LEN = 512, 128
OUTPUT_LEN_KEY = "output_len"
"""In a request's extra args as the benchmarks send them: its own output length (the
engine process takes it out and sets ``max_tokens``); ``OUTPUT_LEN`` without it."""


# The CPU benchmarks' engine (scv_cpu.py, tools/interleave_aa_cpu.py): a tiny model in fp32,
# eager, every batch in one step's token budget; add model, speculative_config and max_num_seqs.
CPU_ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=512, block_size=32,
                  max_num_batched_tokens=2048, enforce_eager=True, gpu_memory_utilization=0.3,
                  disable_log_stats=False, enable_prefix_caching=False, seed=0)

PINNED_AT_ZERO = {"scv_cost_model": [0.001, 1.0, 1.0], "scv_probe_interval": 1000000}
"""SCV's speculative keys that hold every request at chunk 0: verification priced out, no
probes. An engine with them runs SCV's machinery and vLLM's speculative runner, drafting nothing."""


def count_engine_steps(llm) -> list[int]:
    """A counter of the engine core's steps (the core in this process), as a one-item list the
    caller may read and reset: ``steps = count_engine_steps(llm); steps[0] = 0; ...``."""
    core = llm.llm_engine.engine_core.engine_core
    steps = [0]
    step = core.step_fn

    def counted(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    core.step_fn = counted
    return steps


def write_models(root: Path, draft_max_positions: int | None = None) -> tuple[str, str]:
    """Config-only checkpoints (weights come from ``load_format="dummy"``): target, draft."""
    target, draft = root / "llama3-8b-shape", root / "draft-2layer"
    for path, layers in ((target, 32), (draft, 2)):
        config = {**LLAMA3_8B, "num_hidden_layers": layers}
        if path == draft and draft_max_positions:
            config["max_position_embeddings"] = draft_max_positions
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
    return str(target), str(draft)


def write_eagle3_head(root: Path) -> str:
    """A config-only EAGLE-3 head for the 8B-shaped target (one layer, the target's attention
    dims, its vocabulary; weights from ``load_format="dummy"``): vLLM runs it on its V2
    model runner."""
    head = root / "eagle3-head"
    head.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA3_8B, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": LLAMA3_8B["vocab_size"]}
    (head / "config.json").write_text(json.dumps(config))
    return str(head)


def prompts(batch: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    # A repeated motif gives ngram something to match; the rest is random.
    return [[rng.randrange(1000, 120000) for _ in range(16)] * 8
            + [rng.randrange(1000, 120000) for _ in range(length - 128)]
            for _ in range(batch)]


_CALLS = itertools.count()  # request ids stay unique across calls in one engine process


def generate_at_concurrency(llm, batch_prompts, params, concurrency: int,
                            steady: dict | None = None) -> list:
    """Serves the prompts keeping ``concurrency`` requests in flight: a new one is added as
    soon as one finishes (what a server sees under steady load), outputs in prompt order.

    ``steady``, if given, gets the run's steady window: ``seconds`` and ``tokens`` (output
    tokens made in it) from the step where a request first finishes to the step that admits
    the last one; None for both where that window is empty (every request admitted before
    one finished). Throughout the window ``concurrency`` requests are in flight; before it
    the first requests start together, after it the batch drains. Whole-run throughput counts
    that ramp and drain, which weigh more the fewer requests a slot serves: with equal lengths
    plain decoding serves them in waves that start and finish together, while a policy whose
    requests advance at different speeds staggers them and ends on a tail of a shrinking
    batch."""
    run = ConcurrentRun(llm, batch_prompts, params, concurrency)
    run.advance()
    if steady is not None:
        steady.update(run.steady())
    return run.outputs()


class ConcurrentRun:
    """:func:`generate_at_concurrency` in slices: :meth:`advance` steps the engine for a
    given time of its own and returns, so that several engines on one GPU can take turns
    every fraction of a second (:func:`interleave`). The run's clock (``seconds``, the steady
    window) counts only the time inside its slices.

    Why: at batch 128 the GPU machine's host changes speed in spells of seconds
    (``benchmarks/results/host_noise_b1_2026-11-24_h200.json``), and whole runs alternated one
    after the other met different spells: two identical engines differed run by run by
    0.80-1.30 (``benchmarks/results/scv_aa_b128_2026-11-24_h200.json``). Slices put every
    engine under the same spells.

    A slice ends with the GPU synchronized, so the work it launched is its own, and a
    paused engine's in-flight step does not count the pause: ``on_resume`` gets the pause's
    length before the next slice (:func:`shift_scv_clock` keeps SCV's step timer off it)."""

    def __init__(self, llm, batch_prompts, params, concurrency: int, on_resume=None) -> None:
        self.engine, self.call, self.params = llm.llm_engine, next(_CALLS), params
        self.batch_prompts, self.on_resume = batch_prompts, on_resume
        self.pending = list(range(len(batch_prompts)))[::-1]
        self.index: dict[str, int] = {}
        self.finished: dict[int, object] = {}
        self.marks: list[tuple[float, int]] = []  # (run clock, output tokens made so far)
        self.seconds, self.slices, self.paused_at = 0.0, 0, None
        for _ in range(min(concurrency, len(self.pending))):
            self._add()

    def _add(self) -> None:
        from vllm.sampling_params import RequestOutputKind

        i = self.pending.pop()
        request_id = f"c{self.call}-{i}"
        sampling = self.params[i].clone()
        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        self.index[request_id] = i
        self.index[self.engine.add_request(
            request_id, {"prompt_token_ids": self.batch_prompts[i]}, sampling)] = i

    def _made(self) -> int:
        """Output tokens so far: the finished requests' and the ones in flight."""
        in_flight = self.engine.output_processor.request_states.values()
        return (sum(len(o.outputs[0].token_ids) for o in self.finished.values())
                + sum(state.detokenizer.num_output_tokens() for state in in_flight))

    def advance(self, seconds: float = math.inf) -> bool:
        """Steps until the run is done or ``seconds`` of this slice have passed; True when
        done."""
        start = time.perf_counter()
        if self.paused_at is not None and self.on_resume is not None:
            self.on_resume(start - self.paused_at)
        self.slices += 1
        engine = self.engine
        while engine.has_unfinished_requests():
            queued, finished = bool(self.pending), False
            for output in engine.step():
                if output.finished:
                    finished = True
                    self.finished[self.index[output.request_id]] = output
                    if self.pending:
                        self._add()
            now = time.perf_counter()
            # The window opens at the first finish and closes where the last request is
            # admitted.
            if finished and (not self.marks or (queued and not self.pending)):
                self.marks.append((self.seconds + now - start, self._made()))
            if now - start >= seconds and engine.has_unfinished_requests():
                synchronize_device()
                break
        self.paused_at = time.perf_counter()
        self.seconds += self.paused_at - start
        return not engine.has_unfinished_requests()

    def abort(self) -> None:
        """Drops the requests not yet done and steps until the engine holds none."""
        admitted = set(self.index.values()) - self.finished.keys()
        self.pending.clear()
        self.engine.abort_request([f"c{self.call}-{i}" for i in admitted])
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def steady(self) -> dict:
        marks = self.marks
        window = len(marks) == 2 and marks[1][0] > marks[0][0]
        return {"seconds": marks[1][0] - marks[0][0] if window else None,
                "tokens": marks[1][1] - marks[0][1] if window else None}

    def outputs(self) -> list:
        return [self.finished[i] for i in range(len(self.batch_prompts))]


def synchronize_device() -> None:
    """Waits for the GPU's queued work, where there is a GPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shift_scv_clock(llm, seconds: float) -> None:
    """Moves SCV's step timer (``patches/scv/scheduler.py``: when each step in flight was
    scheduled, when the last output came) on by a pause of ``seconds``, so that the step in
    flight across the pause is timed as if the pause had not been. Without it, each of an
    interleaved run's pauses entered SCV's cost fit as one step as long as the pause."""
    from vllm_nwor.inspect import scv_step_clock

    scheduler = scheduler_of(llm)
    clock = None if scheduler is None else scv_step_clock(scheduler)
    if clock is not None:
        clock.shift(seconds)


ENV_KEY = "_env"
"""In an engine's kwargs: environment variables its process sets before building the LLM."""


ABLATE_KEY = "_ablate"
"""In an engine's kwargs: plugin work its process leaves out or replaces (:func:`ablate`,
:data:`ORACLE`), a diagnostic."""

ORACLE = "oracle_acceptance"
"""An ablation: SCV plans with every request's true acceptance rate (:func:`use_oracle`)
instead of its estimate, to tell what the estimates lose from what the choices lose."""


def engine_core_in_own_process(configs: dict[str, dict]) -> dict[str, dict]:
    """The engines with their engine core in a process of its own, as vLLM's ``LLM`` runs by
    default. The benchmarks otherwise keep it in the engine's process (to read the scheduler
    and profile the runner), where the front end's work (output processing, the plugin's
    front-end telemetry) runs in the step loop's thread instead of beside it. Profiles and
    ablations need the engine core in-process."""
    own = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    for name, kwargs in configs.items():
        if kwargs.get(ABLATE_KEY):
            raise SystemExit(f"engine {name}: ablations need the engine core in-process")
    return {name: {**kwargs, ENV_KEY: {**kwargs.get(ENV_KEY, {}), **own}}
            for name, kwargs in configs.items()}


def ablate(names: list[str]) -> None:
    """Leaves plugin work out, to measure what it costs. Only for SCV held at chunk 0, where
    the result stays right: ``plan`` plans chunk 0 for every request without the policy;
    ``record`` skips the lazy draft sync's record of skipped steps (no catch-up ever needs
    it); ``trim_wait`` keeps vLLM's wait for ngram_gpu's valid-draft counts on steps without
    drafts (``patches/scv/ngram_gpu.py`` left out)."""
    from vllm_nwor.patches.scv import ngram_gpu
    from vllm_nwor.patches.scv.draft_sync import LazyDraftSync
    from vllm_nwor.scv import ChunkPolicy

    def plan_zero(self, req_ids, **kwargs):
        return self.plan_chunk_zero(req_ids)

    patches = {"plan": (ChunkPolicy, "plan", plan_zero),
               "record": (LazyDraftSync, "record_skipped_step", lambda self, runner: None),
               "trim_wait": (ngram_gpu, "configure", lambda runner: None)}
    for name in names:
        if name == ORACLE:
            continue  # installed on the engine's policy once it exists (use_oracle)
        owner, attribute, replacement = patches[name]
        setattr(owner, attribute, replacement)


def split_engine_kwargs(kwargs: dict) -> tuple[dict, dict, list[str]]:
    """An engine's kwargs as ``LLM``'s, its process environment, and its ablations."""
    kwargs = dict(kwargs)
    return kwargs, kwargs.pop(ENV_KEY, {}), kwargs.pop(ABLATE_KEY, [])


def engine_main(conn, kwargs: dict) -> None:
    """Engine process: builds one LLM, then serves ("run", prompts, extra_args, concurrency)
    until stop; concurrency None sends the whole batch to ``LLM.generate`` at once. ("start",
    ...) begins the same run in slices, and each ("advance", seconds) steps it for one slice
    (:class:`ConcurrentRun`), answering None until the run is done and its result then. The engine
    core runs in this process unless the kwargs' environment says otherwise
    (:func:`engine_core_in_own_process`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs, environment, ablations = split_engine_kwargs(kwargs)
    os.environ.update(environment)
    if os.environ.get(ENGINE_CORES):  # before torch sizes its thread pools
        os.sched_setaffinity(0, [int(c) for c in os.environ[ENGINE_CORES].split(",")])
    ablate(ablations)
    from vllm import LLM, SamplingParams

    import vllm_nwor

    llm = LLM(**kwargs)
    gpus = tuple(range(kwargs.get("tensor_parallel_size", 1)))  # the ranks' CUDA devices
    spec = kwargs.get("speculative_config") is not None
    oracle = ORACLE in ablations
    if oracle:
        use_oracle(llm)
    scv_host = time_scv_policy(llm)
    budget_changes, steps = trace_scv(llm)
    gc_pauses = record_gc_pauses()
    step_seconds = time_engine_steps(llm)
    nwor_host = time_nwor_host(llm) if os.environ.get(TIME_NWOR_HOST) == "1" else None
    commits = time_nwor_commit(llm) if os.environ.get(TIME_NWOR_COMMIT) == "1" else None
    slow_ms = float(os.environ.get(SAMPLE_SLOW_STEPS_MS, "0"))
    slow_steps = sample_slow_steps(llm, slow_ms / 1e3) if slow_ms > 0 else None

    def snapshot() -> dict:
        if not spec:
            return {"drafted": 0, "accepted": 0, "rejected_by_nwor": 0, "fallbacks": {}}
        metrics = {m.name: m for m in llm.get_metrics()}
        counters = vllm_nwor.get_counters(llm)
        return {
            "drafted": metrics["vllm:spec_decode_num_draft_tokens"].value,
            "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value,
            "rejected_by_nwor": counters.tokens_rejected if counters else 0,
            "fallbacks": counters.fallbacks if counters else {},
        }

    def scv_state() -> dict | None:
        """SCV's choices so far (benchmark diagnostics): its counters (steps and seconds by
        draft budget, uniform plans, learning steps, unpriced plans), how long its traces are,
        the cost model's current coefficients, and which batches SCV takes to replay FULL
        graphs (the largest graph's tokens; whether mixed batches do too)."""
        policy = scv_policy(llm)
        if policy is None:
            return None
        return {"counters": {
                    "budget_counts": list(policy.budget_counts),
                    "budget_seconds": [list(x) for x in policy.budget_seconds],
                    "uniform_plans": policy.uniform_plans,
                    "learning_excess": list(policy.learning_excess),
                    "unpriced_plans": policy.unpriced_plans},
                "traced": (len(budget_changes), len(steps)),
                "coefficients": [float(c) for c in policy.cost.coefficients],
                "graphs": [policy.settings.max_graph_tokens, policy.settings.mixed_graphs]}

    conn.send("ready")
    sliced = None  # an interleaved run between its slices ("start", then "advance")
    clocks = None  # the run's ClockSampler, from its start
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        if message[0] == "abort":  # a filler run (interleave) is not needed any more
            sliced.abort()
            clocks.stop()  # (its start began sampling the clocks, as every run's does)
            sliced = None
            conn.send(None)
            continue
        if message[0] == "advance":  # the next slice of the run "start" began
            if not sliced.advance(message[1]):
                conn.send(None)
                continue
            outputs, steady, seconds = sliced.outputs(), sliced.steady(), sliced.seconds
            slices, sliced = sliced.slices, None
        else:
            kind, batch_prompts, extra_args, concurrency = message[:4]
            params = [SamplingParams(
                max_tokens=(extra or {}).get(OUTPUT_LEN_KEY, OUTPUT_LEN), temperature=0.0,
                ignore_eos=True, extra_args={k: v for k, v in (extra or {}).items()
                                             if k != OUTPUT_LEN_KEY} or None)
                for extra in extra_args]
            if slow_steps is not None:
                slow_steps.clear()
            if kind == "warm":
                steps_from = len(steps)
                chunks = warm_every_chunk(llm, batch_prompts, params)
                if oracle:  # the warm-up leaves SCV fresh estimates
                    use_oracle(llm)
                state = scv_state()  # the steps SCV's cost model starts the measured runs from
                conn.send({"chunks_warmed": chunks, "steps": steps[steps_from:],
                           "coefficients": state["coefficients"] if state else None,
                           "slow_steps": list(slow_steps or [])})
                continue
            profiler = python_profiler = busy = None
            if kind == "profile":  # torch profiler and cProfile around the run: tables return
                import cProfile

                import torch

                profiler = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                profiler.__enter__()
                python_profiler = cProfile.Profile()
                python_profiler.enable()
            before, scv_before = snapshot(), scv_state()
            gc_pauses.clear()
            step_seconds.clear()
            if commits:
                commits.clear()
            nwor_host_before = dict(nwor_host) if nwor_host is not None else None
            scv_host_before = dict(scv_host) if scv_host is not None else None
            clocks = ClockSampler(devices=gpus)
            probe_before = host_probe_ms()
            host_before = host_usage()
            if kind == "start":  # slices follow (interleave)
                sliced = ConcurrentRun(llm, batch_prompts, params, concurrency,
                                       on_resume=functools.partial(shift_scv_clock, llm))
                conn.send(None)
                continue
            start = time.perf_counter()
            steady: dict = {"seconds": None, "tokens": None}
            if concurrency is None:
                outputs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts],
                                       params, use_tqdm=False)
            else:
                outputs = generate_at_concurrency(llm, batch_prompts, params, concurrency,
                                                  steady)
            seconds, slices = time.perf_counter() - start, 1
        gpu_clocks = clocks.stop()
        host = {key: round(value - host_before[key], 4) for key, value in host_usage().items()}
        host["probe_ms"] = [probe_before, host_probe_ms()]  # before and after the run
        tables = {}
        if profiler is not None:
            python_profiler.disable()
            profiler.__exit__(None, None, None)
            averages = profiler.key_averages()
            tables = {key: averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
                      for key in ("self_cpu_time_total", "self_cuda_time_total")}
            tables.update(python_tables(python_profiler))
            busy = gpu_busy(profiler.events())
        after, scv_after = snapshot(), scv_state()
        scv = None
        if scv_after is not None:  # what this run added
            (changes_from, steps_from), (changes_to, steps_to) = (scv_before["traced"],
                                                                  scv_after["traced"])
            scv = {"counters": difference(scv_after["counters"], scv_before["counters"]),
                   "budget_changes": budget_changes[changes_from:changes_to],
                   "steps": steps[steps_from:steps_to],
                   "coefficients": scv_after["coefficients"], "graphs": scv_after["graphs"]}
        itls = []
        for o in outputs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
                itls.append((m.last_token_ts - m.first_token_ts) / (n - 1))
        conn.send({
            "seconds": seconds,  # interleaved: the run's own slices only (ConcurrentRun)
            "slices": slices,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "steady": steady,  # the window at full concurrency (generate_at_concurrency)
            # wall clock: interleaved runs' would count the other engines' turns
            "itl_median": statistics.median(itls) if itls and slices == 1 else None,
            "drafted": after["drafted"] - before["drafted"],
            "accepted": after["accepted"] - before["accepted"],
            "rejected_by_nwor": after["rejected_by_nwor"] - before["rejected_by_nwor"],
            "fallbacks": after["fallbacks"],
            "profile": tables,
            "gpu_busy": busy,
            "scv": scv,
            "gc_pauses": list(gc_pauses),
            "slow_steps": list(slow_steps or []),  # sample_slow_steps, where switched on
            "step_ms": step_summary(step_seconds),
            "gpu_clocks": gpu_clocks,
            "host": host,
            # SCV's policy's host time per step (time_scv_policy), in microseconds
            "scv_policy_us_per_step": None if scv_host is None or not step_seconds else round(
                1e6 * (scv_host["seconds"] - scv_host_before["seconds"]) / len(step_seconds),
                2),
            # NWOR's commit on the GPU, as served (time_nwor_commit)
            "nwor_commit_gpu_us": None if commits is None else commit_gpu_us(commits),
            # NWOR's host work per step outside the layers (time_nwor_host), in microseconds
            "nwor_host_us_per_step": None if nwor_host is None or not step_seconds else round(
                1e6 * (nwor_host["seconds"] - nwor_host_before["seconds"]) / len(step_seconds),
                2),
        })


class ClockSampler:
    """Samples the SM clock (MHz) and power (W) of the GPUs ``devices`` (CUDA indices, as the
    engine's ranks use them: 0 alone for one GPU, ``range(tensor_parallel_size)`` for a
    tensor-parallel engine) through NVML every ``interval`` seconds in a thread, from
    construction to :meth:`stop`. Benchmark diagnostics: where whole runs of one engine differ,
    a run's clocks tell a slowed card from a slowed host. None where NVML does not
    answer (no GPU, no nvidia-ml-py). The handles are found by index, so the sampling process
    (an engine's, whose workers hold the GPUs under tensor parallelism) opens no CUDA context."""

    def __init__(self, interval: float = 0.25, devices: tuple[int, ...] = (0,)) -> None:
        import threading

        self._samples: list[list[tuple[int, float]]] = [[] for _ in devices]
        self._done = threading.Event()
        self._thread = None
        self._handles: list = []
        try:  # torch's NVML handles (NVML's index under CUDA_VISIBLE_DEVICES)
            import torch

            self._handles = [torch.cuda._get_pynvml_handler(i) for i in devices]
        except Exception:  # no GPU, no NVML: nothing to report
            return
        if self._sample():
            self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True)
            self._thread.start()

    def _sample(self) -> bool:
        try:
            import pynvml

            samples = [(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
                       for handle in self._handles]
        except Exception:
            return False
        for device, sample in zip(self._samples, samples, strict=True):
            device.append(sample)
        return True

    def _loop(self, interval: float) -> None:
        while not self._done.wait(interval) and self._sample():
            pass

    @staticmethod
    def _summary(samples: list[tuple[int, float]]) -> dict:
        mhz = [m for m, _ in samples]
        return {"samples": len(mhz), "sm_mhz_median": statistics.median(mhz),
                "sm_mhz_min": min(mhz),
                "power_w_median": round(statistics.median(w for _, w in samples), 1)}

    def stop(self) -> dict | None:
        """The run's samples: how many, SM clock median and minimum, power median; with
        several GPUs over all of their samples, and each GPU's under ``devices``."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if not self._handles or not self._samples[0]:
            return None
        summary = self._summary([s for device in self._samples for s in device])
        if len(self._samples) > 1:
            summary["devices"] = [self._summary(device) for device in self._samples]
        return summary


def host_probe_ms(repeat: int = 5) -> float:
    """The fastest of ``repeat`` timings of a fixed pure-Python loop, in ms: how fast this
    process's host runs Python just now (benchmark diagnostics: at batch 128 identical engines'
    runs differed by up to 30%, the slow ones with more CPU seconds and less GPU power)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i & 7
        best = min(best, time.perf_counter() - start)
    return round(1e3 * best, 3)


def host_usage() -> dict:
    """This process's CPU seconds and context switches so far (``getrusage``). Over a run, CPU
    seconds well under the wall time of a host-bound loop, or many involuntary switches, say the
    host was taken from it (benchmark diagnostics, beside :class:`ClockSampler`)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_seconds": usage.ru_utime + usage.ru_stime,
            "involuntary_switches": usage.ru_nivcsw, "voluntary_switches": usage.ru_nvcsw}


def time_engine_steps(llm) -> list[float]:
    """Times every ``LLMEngine.step`` call of this engine (the list fills as they come, in
    seconds). Benchmark diagnostics: a run's wall time carries its pauses and its tail, while
    the median step is what a request waits for one step in steady state."""
    engine, durations = llm.llm_engine, []
    step = engine.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - start)

    engine.step = timed_step  # an instance attribute: LLM and the benchmark's loop call it
    return durations


SAMPLE_SLOW_STEPS_MS = "NWOR_BENCH_SLOW_STEP_MS"
"""In the benchmark's environment, a number of ms: sample where the host is during every engine
step that runs longer (:func:`sample_slow_steps`)."""


def sample_slow_steps(llm, threshold: float, interval: float = 0.004, limit: int = 40,
                      depth: int = 40) -> list[dict]:
    """Where every thread of this process is while an ``LLMEngine.step`` call has run longer
    than ``threshold`` seconds, sampled every ``interval`` seconds by a daemon thread (benchmark
    diagnostics: it found that the one-time stall before SCV's first probe, with no compile
    warning, was Triton compiling a kernel of vLLM's drafter,
    ``benchmarks/results/scv_stall_stacks_2026-11-24_h200.json``; :func:`warm_every_chunk`).
    The list fills with ``{"ms", "stacks"}`` for at most ``limit``
    such steps: ``stacks``, each distinct stack (its innermost ``depth`` frames, innermost
    first) with how many samples it was seen in, most first. A thread that waits for the GPU
    shows where it waits; one that compiles shows the compiler (at 14 frames an Inductor
    compile hid its caller)."""
    import collections
    import threading
    import traceback

    engine, slow = llm.llm_engine, []
    step, started = engine.step, [None]
    counts: collections.Counter = collections.Counter()
    me = [None]

    def sampler() -> None:
        me[0] = threading.get_ident()
        while True:
            time.sleep(interval)
            begun = started[0]
            if begun is None or time.perf_counter() - begun < threshold:
                continue
            for ident, frame in sys._current_frames().items():
                if ident == me[0]:
                    continue
                frames = traceback.extract_stack(frame)[::-1][:depth]
                counts[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                  for f in frames)] += 1

    def sampled_step(*args, **kwargs):
        counts.clear()
        started[0] = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            seconds, started[0] = time.perf_counter() - started[0], None
            if seconds >= threshold and len(slow) < limit:
                slow.append({"ms": round(1e3 * seconds, 2),
                             "stacks": [[n, text] for text, n in counts.most_common(8)]})

    engine.step = sampled_step
    threading.Thread(target=sampler, daemon=True).start()
    return slow


TIME_NWOR_HOST = "NWOR_BENCH_TIME_HOST"
"""In an engine's environment (``ENV_KEY``), ``"1"``: time NWOR's host work per step
(:func:`time_nwor_host`)."""


def time_nwor_host(llm) -> dict | None:
    """Times the host work NWOR adds once per step, outside the layers (benchmark
    diagnostics): the verify step's indices (``VerifyStep.from_batch``), its begin, its commit
    (the verdict and the commit launch) and ``unstage_rows``. In a step that replays a FULL
    graph that is all of it (the layers run inside the graph). Returns the running totals,
    ``seconds`` and ``calls``, or None where NWOR is off or the engine core runs in its own
    process. Each timed call costs about 0.2 us more."""
    totals = {"seconds": 0.0, "calls": 0}
    timed = functools.partial(timed_into, totals)

    def install(worker) -> bool:
        from vllm_nwor.inspect import interceptor_of
        from vllm_nwor.nwor.verify_step import VerifyStep

        interceptor = interceptor_of(worker.model_runner)
        if interceptor is None:
            return False
        for name in ("begin", "commit", "unstage_rows"):
            setattr(interceptor, name, timed(getattr(interceptor, name)))
        VerifyStep.from_batch = classmethod(timed(VerifyStep.from_batch.__func__))
        return True

    if scheduler_of(llm) is None:  # the engine core is in its own process
        return None
    return totals if any(llm.collective_rpc(install)) else None


TIME_NWOR_COMMIT = "NWOR_BENCH_TIME_COMMIT"
"""In an engine's environment, "1": time NWOR's commit on the GPU in every staged step
(:func:`time_nwor_commit`)."""


def time_nwor_commit(llm) -> list | None:
    """Times NWOR's commit on the GPU in every staged step, between CUDA events recorded on the
    stream before and after its launch (benchmark diagnostics: under ncu the commit kernel took
    4.6 µs alone with the caches flushed, and 180-280 µs a step among a whole step's launches;
    the events time it as served). Returns the list the event pairs fill (read by
    :func:`commit_gpu_us`), or None where NWOR is off or the engine core runs in its own
    process."""
    pairs: list = []

    def install(worker) -> bool:
        import torch

        from vllm_nwor.inspect import interceptor_of

        interceptor = interceptor_of(worker.model_runner)
        if interceptor is None:
            return False
        commit = interceptor.commit_fn

        def timed(verdict):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                commit(verdict)
            finally:
                end.record()
                pairs.append((start, end))

        interceptor.commit_fn = timed
        return True

    if scheduler_of(llm) is None:  # the engine core is in its own process
        return None
    return pairs if any(llm.collective_rpc(install)) else None


def commit_gpu_us(pairs: list) -> dict | None:
    """The commits timed since the last call (:func:`time_nwor_commit`), in µs: how many, their
    median and 90th percentile. Waits for the GPU, then forgets them."""
    if not pairs:
        return None
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    us = sorted(1e3 * start.elapsed_time(end) for start, end in pairs)
    pairs.clear()
    return {"count": len(us), "median": round(statistics.median(us), 2),
            "p90": round(us[int(0.9 * (len(us) - 1))], 2)}


def timed_into(totals: dict, fn):
    """``fn``, adding each call's seconds and count to ``totals`` (``seconds``, ``calls``)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals["seconds"] += time.perf_counter() - start
            totals["calls"] += 1
    return wrapper


def time_scv_policy(llm) -> dict | None:
    """Times SCV's policy on the engine core's thread (benchmark diagnostics): its calls from
    the scheduler patch, ``plan``, ``observe``, ``observe_step`` and ``forget``, as running
    totals ``seconds`` and ``calls``; None where SCV is off or its engine core runs in its own
    process. Installed before :func:`trace_scv`, so that the tracing is not counted. At batch
    128 a plain step is bound by the host (about 7 ms on the H200), so what the policy takes of
    it counts."""
    policy, totals = scv_policy(llm), {"seconds": 0.0, "calls": 0}
    if policy is None:
        return None
    for name in ("plan", "observe", "observe_step", "forget"):
        setattr(policy, name, timed_into(totals, getattr(policy, name)))
    return totals


FIRST_STEPS = 6
"""How many of a run's first steps :func:`step_summary` lists one by one (a batch's prefill)."""


def step_summary(durations: list[float]) -> dict | None:
    """A run's engine steps: how many, their median and their 10%-trimmed mean, their total,
    the first :data:`FIRST_STEPS` (the prefill, which the median leaves out), and all of them in
    order, in ms. The total beside the run's wall time says how much of it was spent outside the
    steps; the list says in which steps a side's extra time is."""
    if not durations:
        return None
    ordered = sorted(durations)
    cut = len(ordered) // 10
    kept = ordered[cut:len(ordered) - cut] or ordered
    return {"steps": len(ordered), "median": round(1e3 * statistics.median(ordered), 4),
            "trimmed_mean": round(1e3 * statistics.fmean(kept), 4),
            "total": round(1e3 * sum(durations), 3),
            "first": [round(1e3 * d, 3) for d in durations[:FIRST_STEPS]],
            "all": [round(1e3 * d, 3) for d in durations]}


def record_gc_pauses(at_least_ms: float = 1.0) -> list:
    """Python's garbage collections in this process from now on that took ``at_least_ms`` or
    more, as ``[generation, ms]`` (the list fills as they come). Benchmark diagnostics: steps of
    70-270 ms came now and then in plain steps of every policy's engine, not explained yet."""
    pauses: list = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (ms := 1e3 * (time.perf_counter() - started[0])) >= at_least_ms:
            pauses.append([info["generation"], round(ms, 2)])

    gc.callbacks.append(callback)
    return pauses


def difference(after, before):
    """``after - before`` for numbers, and key by key or element by element for dicts and lists
    of them (counters read before and after a run)."""
    if isinstance(after, dict):
        return {key: difference(value, before[key]) for key, value in after.items()}
    if isinstance(after, list):
        return [difference(a, b) for a, b in zip(after, before, strict=True)]
    return after - before


def total(values: list):
    """The sum of several runs' counters (each as :func:`difference` gives it): key by key or
    element by element for dicts and lists of numbers."""
    first = values[0]
    if isinstance(first, dict):
        return {key: total([value[key] for value in values]) for key in first}
    if isinstance(first, list):
        return [total(list(column)) for column in zip(*values, strict=True)]
    return sum(values)


def use_oracle(llm) -> None:
    """Gives the engine's SCV policy every request's true acceptance (:data:`ORACLE`): its
    ``synthetic_acceptance_rate``, read from the scheduler's request, in place of SCV's estimate
    (a real engine cannot know it). Verdicts are still counted."""
    import numpy as np

    from vllm_nwor.scv import AcceptanceEstimator
    from vllm_nwor.synthetic import EXTRA_ARGS_KEY, rate_at

    policy = scv_policy(llm)
    if policy is None:
        raise SystemExit(f"{ORACLE} needs SCV with the engine core in-process")
    requests = scheduler_of(llm).requests

    class OracleAcceptance(AcceptanceEstimator):
        def rates(self, req_ids):
            return np.array([rate_at((requests[r].sampling_params.extra_args or {}).get(
                EXTRA_ARGS_KEY), requests[r].num_output_tokens) for r in req_ids])

        def rate_bound(self, req_ids):  # the rates above are not the estimate's
            return 1.0

    policy.acceptance = OracleAcceptance(policy.settings.acceptance_window)


def trace_scv(llm, limit: int = 100_000) -> tuple[list, list]:
    """SCV's choices and what they came from (benchmark diagnostics), as two lists it appends
    to (at most ``limit`` entries each; empty where no SCV policy is in reach):

    - each time the planned draft budget changes, ``[step, budget, requests, mean acceptance
      estimate, the cost model's coefficients]``;
    - each step the policy observes, ``[requests, tokens, budget, ms, uniform, learning,
      verified, caught_up]``: what the cost model is fitted to, so that other cost models can
      be fitted to it offline.
    """
    policy, changes, steps = scv_policy(llm), [], []
    if policy is None:
        return changes, steps
    plan, observe_step, last = policy.plan, policy.observe_step, [0]

    def traced_plan(req_ids, **kwargs):
        result = plan(req_ids, **kwargs)
        budget = policy.draft_budget()
        if budget != last[0] and len(changes) < limit:
            rates = policy.acceptance.rates(list(req_ids)) if len(req_ids) else [0.0]
            changes.append([policy.steps, budget, len(req_ids),
                            round(float(sum(rates) / len(rates)), 4),
                            [float(f"{c:.4g}") for c in policy.cost.coefficients]])
        last[0] = budget
        return result

    def traced_observe_step(requests, tokens, budget, seconds, uniform=True, learning=False,
                            *, verified, caught_up=0):
        if len(steps) < limit:
            steps.append([requests, tokens, budget, round(1e3 * seconds, 3), int(uniform),
                          int(learning), verified, caught_up])
        observe_step(requests, tokens, budget, seconds, uniform, learning, verified=verified,
                     caught_up=caught_up)

    policy.plan, policy.observe_step = traced_plan, traced_observe_step
    return changes, steps


def scheduler_of(llm):
    """The engine's scheduler, or None where the engine core runs in its own process."""
    from vllm_nwor.inspect import scheduler_of as in_process

    try:
        return in_process(llm)
    except RuntimeError:
        return None


def scv_policy(llm):
    """The engine's SCV policy, or None (SCV off, or the engine core in its own process)."""
    from vllm_nwor.inspect import scv_policy

    scheduler = scheduler_of(llm)
    return None if scheduler is None else scv_policy(scheduler)


SMALL_WARM_BATCHES = (1, 3)
"""Batch sizes :func:`warm_every_chunk` also runs at every chunk size."""


def warm_every_chunk(llm, batch_prompts: list[list[int]], params: list) -> list[int]:
    """A warm-up run of ``batch_prompts``, first with SCV fixed at every chunk size in turn,
    0 included.

    vLLM's speculative step compiles Triton kernels the first time it meets a draft budget
    (and a batch size) it has not seen, seconds each. A fixed-k engine meets its only budget in
    its first steps; SCV drafts rarely where speculation does not pay, so without this it met
    new budgets inside measured runs (the logs' "JIT compilation during inference"). Chunk 0
    gives SCV's cost model plain steps: without them nearly every warm-up step drafted, a
    drafting step's own cost could not be told from the fixed cost, and the fit SCV started
    from priced drafting at nothing. The warm-up's verdicts are not the workload's (its drafts
    are all accepted): SCV's acceptance
    estimates start afresh after it, or the first measured steps drafted the whole budget.
    Each chunk size also runs one request alone and three together
    (:data:`SMALL_WARM_BATCHES`): Triton specializes a kernel's integer arguments on being 1
    or a multiple of 16, and the full batch, every request finishing in the same step, never
    drafted for so few requests. On the H200 SCV's first drafting steps at a handful of
    requests took 0.3-0.7 s (the step before them, under async scheduling, 0.1-0.7 s), up to
    30% of a measured run.
    Then, at each of those batch sizes, each chunk size is met after a few plain steps, as a
    probe meets it: the draft's first pass after a step that verified nothing launches vLLM's
    input kernel (``copy_and_expand_eagle_inputs_kernel``) with a block of 2 tokens, which no
    step at a fixed chunk does. On the H200 the first such pass compiled it inside a measured
    run: 0.12-0.45 s (``benchmarks/results/scv_stall_stacks_2026-11-24_h200.json``,
    :func:`sample_slow_steps`).
    Returns the chunk sizes warmed: none where no SCV policy is in reach."""
    from dataclasses import replace

    from vllm_nwor.scv import AcceptanceEstimator

    inputs = [{"prompt_token_ids": p} for p in batch_prompts]
    policy, chunks = scv_policy(llm), []
    if policy is not None:
        settings = policy.settings
        chunks = list(range(settings.max_chunk + 1))
        try:
            for chunk in chunks:
                policy.settings = replace(settings, mode="fixed", max_chunk=chunk)
                llm.generate(inputs, params, use_tqdm=False)
                for small in SMALL_WARM_BATCHES:
                    llm.generate(inputs[:small], params[:small], use_tqdm=False)
            for chunk in chunks[1:]:
                for size in (*SMALL_WARM_BATCHES, len(inputs)):
                    generate_switching(llm, batch_prompts[:size], params[:size],
                                       replace(settings, mode="fixed", max_chunk=0),
                                       replace(settings, mode="fixed", max_chunk=chunk))
        finally:
            policy.settings = settings
    llm.generate(inputs, params, use_tqdm=False)
    if policy is not None:
        policy.acceptance = AcceptanceEstimator(policy.settings.acceptance_window)
    return chunks


def generate_switching(llm, batch_prompts, params, before, after, steps_before: int = 4,
                       output_len: int = 12) -> None:
    """The prompts (``output_len`` tokens each at most) with SCV's settings ``before`` for
    their first ``steps_before`` engine steps and ``after`` from then on (a warm-up)."""
    policy, engine = scv_policy(llm), llm.llm_engine
    call = next(_CALLS)
    policy.settings = before
    for i, (prompt, sampling) in enumerate(zip(batch_prompts, params, strict=True)):
        sampling = sampling.clone()
        sampling.max_tokens = min(sampling.max_tokens or output_len, output_len)
        engine.add_request(f"s{call}-{i}", {"prompt_token_ids": prompt}, sampling)
    taken = 0
    while engine.has_unfinished_requests():
        if taken == steps_before:
            policy.settings = after
        engine.step()
        taken += 1


def gpu_busy(events) -> dict | None:
    """How much of a profiled run the GPU was doing anything (kernels, copies, also inside CUDA
    graphs): the union of the device events' intervals over their span. A step loop whose GPU
    sits idle between steps is bound by the host."""
    from torch.autograd import DeviceType

    intervals = sorted((e.time_range.start, e.time_range.end) for e in events
                       if e.device_type == DeviceType.CUDA)
    if not intervals:
        return None
    busy, (start, end) = 0.0, intervals[0]
    for lo, hi in intervals[1:]:
        if lo > end:  # a gap: close the busy stretch
            busy, start = busy + end - start, lo
        end = max(end, hi)
    busy += end - start
    span = end - intervals[0][0]
    return {"span_ms": round(span / 1000, 3), "busy_ms": round(busy / 1000, 3),
            "busy_fraction": round(busy / span, 4) if span else None,
            "device_events": len(intervals)}


def python_tables(python_profiler) -> dict[str, str]:
    """cProfile's top functions by own time and by cumulative time, the plugin's own functions,
    and who waits for the GPU (``Tensor.item``, ``synchronize``), as text tables."""
    import io
    import pstats

    def table(show) -> str:
        text = io.StringIO()
        show(pstats.Stats(python_profiler, stream=text))
        return text.getvalue()

    tables = {f"python_{key}": table(lambda s, key=key: s.sort_stats(key).print_stats(40))
              for key in ("tottime", "cumulative")}
    tables["python_plugin"] = table(
        lambda s: s.sort_stats("cumulative").print_stats("vllm_nwor", 40))
    tables["python_sync_callers"] = "".join(  # host syncs: Tensor.item, Event.synchronize
        table(lambda s, name=name: s.sort_stats("tottime").print_callers(name))
        for name in ("method 'item'", "synchronize"))
    return tables


class Engine:
    """A vLLM engine in its own process; fails at once if that process dies."""

    def __init__(self, name: str, kwargs: dict) -> None:
        self.name = name
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, kwargs))
        start = time.perf_counter()
        self.process.start()
        if self._receive() != "ready":
            raise RuntimeError(f"engine {name} did not start")
        self.startup_seconds = time.perf_counter() - start

    def _receive(self):
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"engine {self.name} exited with code {self.process.exitcode}"
                )
        return self.conn.recv()

    def run(self, batch_prompts: list[list[int]], extra_args: list | None = None,
            concurrency: int | None = None) -> dict:
        self.conn.send(("run", batch_prompts, extra_args or [None] * len(batch_prompts),
                        concurrency))
        return self._receive()

    def profile(self, batch_prompts: list[list[int]], extra_args: list | None = None,
                concurrency: int | None = None) -> dict:
        self.conn.send(("profile", batch_prompts, extra_args or [None] * len(batch_prompts),
                        concurrency))
        return self._receive()

    def start(self, batch_prompts: list[list[int]], extra_args: list | None,
              concurrency: int) -> None:
        """Begins a run of slices (:class:`ConcurrentRun`): :meth:`advance` steps it."""
        self.conn.send(("start", batch_prompts, extra_args or [None] * len(batch_prompts),
                        concurrency))
        self._receive()

    def advance(self, seconds: float) -> dict | None:
        """The run's next slice of ``seconds``: None, or the run's result once it is done."""
        self.conn.send(("advance", seconds))
        return self._receive()

    def abort(self) -> None:
        """Ends the run :meth:`start` began, its requests not yet done dropped."""
        self.conn.send(("abort",))
        self._receive()

    def warm(self, batch_prompts: list[list[int]], extra_args: list | None = None) -> dict:
        """A warm-up run (:func:`warm_every_chunk`): ``chunks_warmed``, the chunk sizes warmed;
        ``steps``, SCV's traced steps of the warm-up; ``coefficients``, its cost fit after it
        (None without SCV)."""
        self.conn.send(("warm", batch_prompts, extra_args or [None] * len(batch_prompts), None))
        return self._receive()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop",))
        self.process.join(timeout=120)


def rate_for_length(length: float, k: int) -> float:
    """Per-draft acceptance ``a`` with ``1 + a + ... + a**k == length`` (bisection): the
    ``synthetic_acceptance_rate`` that gives mean acceptance length ``length`` at k drafts."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if 1 + sum(mid**j for j in range(1, k + 1)) < length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def start_engines(configs: dict[str, dict], engine_core_process: bool = False
                  ) -> dict[str, Engine]:
    """Starts one engine per config, one after the other (vLLM sizes its memory from what is
    free at start-up); stops those already started if one fails. ``engine_core_process``: each
    engine core in a process of its own (:func:`engine_core_in_own_process`)."""
    if engine_core_process:
        configs = engine_core_in_own_process(configs)
    if os.environ.get(PIN_CORES) == "1":
        configs = pinned(configs)
    engines: dict[str, Engine] = {}
    try:
        for name, kwargs in configs.items():
            engines[name] = Engine(name, kwargs)
    except BaseException:
        stop_engines(engines)
        raise
    return engines


PIN_CORES = "NWOR_BENCH_PIN_CORES"
"""In the benchmark's environment, ``"1"``: each engine process on CPU cores of its own
(:func:`pinned`)."""
ENGINE_CORES = "NWOR_BENCH_ENGINE_CORES"
"""In an engine's environment: the CPU cores its process runs on, comma-separated."""


def pinned(configs: dict[str, dict]) -> dict[str, dict]:
    """The engines, each on an equal share of this process's CPU cores, contiguous, none
    shared. Benchmark diagnostics: whether engines sharing CPU cores explain how far two
    identical engines differ at batch 128, where the step loop is bound by the host."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(configs)
    if share < 1:
        raise SystemExit(f"{PIN_CORES}=1: {len(configs)} engines, {len(cores)} cores")
    return {name: {**kwargs, ENV_KEY: {**kwargs.get(ENV_KEY, {}), ENGINE_CORES: ",".join(
                map(str, cores[i * share:(i + 1) * share]))}}
            for i, (name, kwargs) in enumerate(configs.items())}


def stop_engines(engines: dict[str, Engine]) -> None:
    for engine in engines.values():
        engine.stop()


def alternate(engines: dict[str, Engine], batch_prompts: list[list[int]], rep: int,
              extra_args: list | None = None, concurrency: int | None = None,
              slice_seconds: float | None = None) -> dict[str, dict]:
    """One batch on every engine, in order on even reps and in reverse on odd ones (A B, B A):
    whole runs one after the other, or with ``slice_seconds`` interleaved (:func:`interleave`)."""
    names = list(engines) if rep % 2 == 0 else list(engines)[::-1]
    if slice_seconds is not None:
        if concurrency is None:
            raise SystemExit("interleaved runs keep a number of requests in flight: they "
                             "cannot send the whole batch at once (closed batch)")
        return interleave({name: engines[name] for name in names}, batch_prompts,
                          extra_args, concurrency, slice_seconds)
    return {name: engines[name].run(batch_prompts, extra_args, concurrency) for name in names}


def interleave(engines: dict[str, Engine], batch_prompts: list[list[int]],
               extra_args: list | None, concurrency: int, slice_seconds: float
               ) -> dict[str, dict]:
    """The same batch on every engine at once, each taking ``slice_seconds`` turns in order
    until all are done (:class:`ConcurrentRun`): every engine meets the host's slow and fast
    spells alike. Each run's clock counts its own slices only.

    An engine whose run is done serves the batch again, unmeasured, and keeps its turns until
    every run is done: a run left alone would meet neither the others' load nor the cost of
    handing over a turn. On the CPU engine, with a target twice as deep in one engine, the
    faster engine's lead came out 2-3% short that way."""
    for engine in engines.values():
        engine.start(batch_prompts, extra_args, concurrency)
    results: dict[str, dict] = {}
    running = set(engines)  # a run started and not yet done, measured or filler
    while len(results) < len(engines):
        for name, engine in engines.items():
            if name not in running:
                continue
            result = engine.advance(slice_seconds)
            if result is None:
                continue
            running.discard(name)
            results.setdefault(name, result)
            if len(results) == len(engines):
                break
            engine.start(batch_prompts, extra_args, concurrency)  # a filler run
            running.add(name)
    for name in running:
        engines[name].abort()
    return {name: results[name] for name in engines}


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int]]:
    """Share of identical tokens, and each diverging request's first differing position."""
    same = total = 0
    divergences = []
    for ra, rb in zip(a, b, strict=True):
        pairs = list(zip(ra, rb, strict=True))
        same += sum(x == y for x, y in pairs)
        total += len(pairs)
        first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        if first is not None:
            divergences.append(first)
    return same / total, divergences


def tokens_per_second(run: dict) -> float:
    return sum(len(t) for t in run["tokens"]) / run["seconds"]


def steady_tokens_per_second(run: dict) -> float | None:
    """Output throughput in the run's steady window (:func:`generate_at_concurrency`), or None
    where it has none."""
    steady = run.get("steady") or {}
    return steady["tokens"] / steady["seconds"] if steady.get("seconds") else None
