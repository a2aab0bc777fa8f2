"""A soak through a real ``vllm serve``: mixed traffic, client aborts, every step audited.

One server per configuration (NWOR, then NWOR + adaptive SCV), on loopback, with vLLM's
defaults except where a line below says why. Client threads send requests back to back until
the request count or the time runs out, each one drawn at random:

- completions or chat, streamed or not; prompts of random length, half of them starting with
  one of a few shared prefixes (prefix-cache hits beside verify steps);
- greedy or sampled (temperature, top-p, top-k; ``n=2``; a seed where vLLM supports it),
  logprobs sometimes; ``max_tokens`` at random; EOS live or ignored;
- stop strings and stop token ids;
- aborts: a streamed request is dropped after a few chunks, or a request given a client
  timeout shorter than its generation.

Inside the engine, ``tests/support/soak_audit.py`` checks every step (the cache audit, NWOR's
counters against the sampler's verdict, memory). Outside, ``/metrics`` is scraped every second
(every counter monotone) and the server's resident memory recorded. At the end, once the engine
is idle: NWOR's counters equal vLLM's spec-decode stats, and memory did not grow.

    python -m benchmarks.soak [--seconds 300] [--requests N] [--clients C] [--out JSON]

The result has ``requests``, ``aborted``, ``violations`` (failed invariant checks, all kinds)
and ``errors`` (requests that failed other than by the client's own abort, and ``/metrics``
scrapes refused or reset), per run and summed; ``slow_scrapes`` counts scrapes unanswered within
their 10 s timeout.

On the GPU the servers run draft_model on vLLM's default runner, V2, with vLLM's synthetic
rejection sampling at a mean acceptance length of 2.5 of k + 1 = 5 (random weights accept
nearly every draft; ``synthetic_acceptance_per_request`` is V1's and refused on V2).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent

CORPUS_MODULES = ("textwrap", "random", "json.decoder", "string", "fractions", "calendar")
"""Prompts are slices of Python's own standard library: code like the shipped pair's training
text, so its drafts are often right (on the GPU's random weights it is just text)."""


def corpus() -> str:
    import importlib
    import inspect

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in CORPUS_MODULES)
    return text.encode("ascii", "ignore").decode()  # a character is a token: lengths hold


MEMORY_GROWTH_ALLOWED = (0.05, 256 << 20)  # the larger of 5% and 256 MiB, resident memory
CUDA_GROWTH_ALLOWED = 64 << 20  # bytes the CUDA allocator may hold more at the end


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    error_samples: list = field(default_factory=list)
    finish_reasons: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            if outcome == "aborted":
                self.aborted += 1
            elif outcome == "error":
                self.errors += 1
                if len(self.error_samples) < 10:
                    self.error_samples.append(f"{kind}: {detail[:300]}")
            else:
                self.completed += 1
                self.finish_reasons[outcome] = self.finish_reasons.get(outcome, 0) + 1


class Traffic:
    """Draws requests. ``cuda`` False leaves out what vLLM 0.26's CPU build could not do with
    speculative decoding, plugin or not (not checked on 0.32): seeds ("CPU Generator does not use
    offset") and top-k (its rejection sampler expands per-request top-k with a Triton kernel that
    does not run on the CPU, then indexes with uninitialised values: "index -1273609552 is out of
    bounds")."""

    def __init__(self, rng: random.Random, max_model_len: int, cuda: bool,
                 synthetic: bool, text: str) -> None:
        self.rng, self.max_model_len, self.cuda, self.synthetic = rng, max_model_len, cuda, \
            synthetic
        self.corpus = text
        shared = random.Random(0)  # every client shares the same prefixes
        self.prefixes = [self.text(int(max_model_len * 0.55), shared) for _ in range(4)]

    def text(self, length: int, rng: random.Random | None = None) -> str:
        start = (rng or self.rng).randrange(len(self.corpus) - length)
        return self.corpus[start:start + length]

    def draw(self) -> dict:
        rng = self.rng
        length = rng.randint(1, int(self.max_model_len * 0.75))
        prompt = self.text(length)
        if rng.random() < 0.5:  # a shared prefix, then the request's own text
            prompt = (rng.choice(self.prefixes) + prompt)[:max(length, int(self.max_model_len
                                                                           * 0.6))]
        chat = rng.random() < 0.3
        # Byte tokenizer: a character is a token; the chat template adds about 20.
        room = self.max_model_len - len(prompt) - (32 if chat else 8)
        body: dict = {"max_tokens": rng.randint(1, max(1, min(96, room)))}
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body["temperature"] = round(rng.uniform(0.3, 1.0), 2)
            body["top_p"] = rng.choice([1.0, 0.9])
            if self.cuda:
                body["top_k"] = rng.choice([-1, 50])
            if rng.random() < 0.3:
                body["n"] = 2
            if self.cuda and rng.random() < 0.3:
                body["seed"] = rng.randrange(1 << 30)
        body["ignore_eos"] = rng.random() < 0.5  # vLLM's own fields beside OpenAI's
        if rng.random() < 0.2:
            body["stop"] = [self.text(rng.randint(1, 2))]
        if rng.random() < 0.2:
            body["stop_token_ids"] = [rng.randrange(0, 256) for _ in range(4)]  # bytes
        if self.synthetic and rng.random() < 0.7:
            body["vllm_xargs"] = {"synthetic_acceptance_rate": round(rng.random(), 2)}
        stream = rng.random() < 0.5
        abort = None
        if stream and rng.random() < 0.3:
            abort = ("stream", rng.randint(1, 8))  # drop the stream after this many chunks
        elif not stream and rng.random() < 0.05:
            abort = ("timeout", rng.uniform(0.05, 0.5))
        if body.get("n", 1) == 1 and not chat and rng.random() < 0.2:
            body["logprobs"] = 2
        return {"prompt": prompt, "body": body, "chat": chat, "stream": stream, "abort": abort}


def send(server, model: str, request: dict, tally: Tally) -> None:
    """One request over plain HTTP (the OpenAI API's JSON and server-sent events), so the soak
    needs no client library; an abort closes the connection, as a client that goes away."""
    import http.client

    body, abort = dict(request["body"]), request["abort"]
    kind = ("chat" if request["chat"] else "completion") + ("_stream" if request["stream"]
                                                            else "")
    if request["chat"]:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user",
                                                           "content": request["prompt"]}]
    else:
        path, body["prompt"] = "/v1/completions", request["prompt"]
    body |= {"model": model, "stream": request["stream"]}
    timeout = abort[1] if abort and abort[0] == "timeout" else 300
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            tally.add(kind, "error", f"HTTP {response.status}: {response.read()[:300]!r}")
            return
        if not request["stream"]:
            choices = json.loads(response.read())["choices"]
            tally.add(kind, choices[0]["finish_reason"] or "none")
            return
        finish, chunks = None, 0
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunks += 1
            if abort and chunks >= abort[1]:
                tally.add(kind, "aborted")
                return
            event = json.loads(line[6:])
            if "error" in event:
                tally.add(kind, "error", str(event["error"]))
                return
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
        tally.add(kind, finish or "none")
    except TimeoutError as error:
        tally.add(kind, "aborted" if abort else "error", repr(error))
    except Exception as error:  # every other failure is counted and kept
        tally.add(kind, "error", repr(error))
    finally:
        connection.close()


PROCESS_METRICS = ("process_", "python_gc_")
"""prometheus_client's samples of the server process (CPU seconds, memory, garbage collections):
they move with every scrape, traffic or not; memory is sampled on its own (``group_rss``)."""


def scrape(server) -> dict[tuple, tuple[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name.startswith(PROCESS_METRICS):
                continue
            labels = tuple(sorted(sample.labels.items()))
            values[(sample.name, labels)] = (family.type, sample.value)
    return values


def total(values: dict, name: str) -> float:
    return sum(v for (n, _), (_, v) in values.items() if n == name)


class Monitor(threading.Thread):
    """Scrapes /metrics and the server's memory every second; counters must never go down."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = threading.Event()
        self.last: dict = {}
        self.violations: list[str] = []
        self.num_violations = self.scrapes = 0
        self.memory: list[dict] = []
        # A scrape that got no answer in its timeout is a slow scrape (two servers on a 2-core
        # CI machine), counted and reported; a refused or reset connection is an error.
        self.errors = self.slow_scrapes = 0
        self.error_samples: list[str] = []

    def check(self) -> dict:
        now = scrape(self.server)
        for key, (kind, value) in now.items():
            before = self.last.get(key)
            monotone = kind in ("counter", "histogram", "summary") and not key[0].endswith(
                "_created")
            if monotone and before is not None and value < before[1]:
                self.num_violations += 1
                if len(self.violations) < 10:
                    self.violations.append(f"{key}: {before[1]} -> {value}")
        self.last = now
        self.scrapes += 1
        return now

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(1.0):
            try:
                self.check()
            except OSError as error:
                slow = isinstance(error, TimeoutError) or isinstance(
                    getattr(error, "reason", None), TimeoutError)
                if slow:
                    self.slow_scrapes += 1
                else:
                    self.errors += 1
                if len(self.error_samples) < 10:
                    self.error_samples.append(
                        f"/metrics at {time.monotonic() - start:.0f} s: {error!r}"[:300])
            self.memory.append({"t": round(time.monotonic() - start, 1),
                                "rss": self.server.group_rss()})


def grew(samples: list[dict], key: str, allowed_fraction: float, allowed_bytes: int) -> dict:
    """Median of the last quarter against the median of the second quarter (the first is
    warm-up: caches, compiled kernels, allocator pools)."""
    values = [s[key] for s in samples if key in s]
    if len(values) < 8:
        return {"samples": len(values), "grew": False}
    quarter = len(values) // 4
    early = statistics.median(values[quarter:2 * quarter])
    late = statistics.median(values[-quarter:])
    allowed = max(allowed_fraction * early, allowed_bytes)
    return {"samples": len(values), "early": early, "late": late, "allowed": allowed,
            "grew": late - early > allowed}


def wait_idle(server, timeout_s: float = 120.0) -> dict:
    """The final scrape: no request running or waiting, and two scrapes in a row equal."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        now = scrape(server)
        busy = total(now, "vllm:num_requests_running") + total(now, "vllm:num_requests_waiting")
        if not busy and now == last:
            return now
        last = now
        time.sleep(0.5)
    raise TimeoutError("the server did not go idle after the traffic stopped")


MIN_REQUESTS_WAIT = 8
"""How many times its ``seconds`` a soak waits for its ``min_requests``."""


def soak(server, model: str, audit_dir: Path, *, seconds: float, max_requests: int,
         clients: int, max_model_len: int, cuda: bool, synthetic: bool, k: int,
         seed: int = 0, min_requests: int = 0, ranks: int = 1, pressure: bool = False) -> dict:
    """Runs the traffic against a ready server for ``seconds``, and on until ``min_requests``
    have ended (a slow or shared machine) but at most ``MIN_REQUESTS_WAIT`` times
    ``seconds``; returns the run's tally and checks."""
    from tests.support.soak_audit import read_status

    tally = Tally()
    monitor = Monitor(server)
    monitor.check()
    monitor.start()
    text = corpus()
    deadline = time.monotonic() + seconds
    last_call = time.monotonic() + MIN_REQUESTS_WAIT * seconds

    def more() -> bool:
        now = time.monotonic()
        return now < deadline or (tally.requests < min_requests and now < last_call)
    issued = iter(range(max_requests))
    issue_lock = threading.Lock()

    def worker(index: int) -> None:
        traffic = Traffic(random.Random(seed * 1000 + index), max_model_len, cuda, synthetic,
                          text)
        while more():
            with issue_lock:
                if next(issued, None) is None:
                    return
            send(server, model, traffic.draw(), tally)

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    traffic_seconds = time.monotonic() - start
    final = wait_idle(server)
    monitor.stop.set()
    monitor.join()
    monitor.check()  # the final state against the last periodic scrape
    statuses = read_status(audit_dir)
    return judge(tally, monitor, final, statuses, traffic_seconds, k, ranks, pressure)


TOKEN_COUNTERS = ("verify_steps_staged", "tokens_staged", "tokens_committed", "tokens_rejected",
                  "fallbacks")


def judge(tally: Tally, monitor: Monitor, final: dict, statuses: list[dict],
          traffic_seconds: float, k: int, ranks: int = 1, pressure: bool = False) -> dict:
    """The run's tally and checks. ``statuses``: every audited worker's, one per
    tensor-parallel rank (``ranks``); each rank's cache and counters are checked, and every
    rank must have counted what the first did. ``pressure``: the run must have preempted."""
    failed: list[str] = []
    violations = monitor.num_violations
    if monitor.num_violations:
        failed.append(f"counters went down: {monitor.violations[:3]}")
    if len(statuses) != ranks:
        failed.append(f"expected {ranks} audited worker(s), found {len(statuses)}")
        violations += 1
    statuses = sorted(statuses, key=lambda s: s.get("worker", {}).get("tp_rank", 0))
    audit = statuses[0] if statuses else {}
    for other in statuses[1:]:
        rank = other.get("worker", {}).get("tp_rank")
        for kind in ("cache", "counter"):
            if other.get(f"{kind}_violations"):
                violations += other[f"{kind}_violations"]
                failed.append(f"rank {rank}'s {kind} audit: "
                              f"{other[f'{kind}_violation_samples'][:3]}")
        for key in ("drafted", "accepted", "counters"):
            ours, first = other.get(key), audit.get(key)
            if key == "counters" and ours and first:  # tokens; each rank has its heads' bytes
                ours, first = ({name: c.get(name) for name in TOKEN_COUNTERS}
                               for c in (ours, first))
            if ours != first:
                violations += 1
                failed.append(f"rank {rank}'s {key} {ours} != rank 0's {first}")
    vllm_stats = {"drafted": total(final, "vllm:spec_decode_num_draft_tokens_total"),
                  "accepted": total(final, "vllm:spec_decode_num_accepted_tokens_total"),
                  "prefix_cache_hits": total(final, "vllm:prefix_cache_hits_total"),
                  "preemptions": total(final, "vllm:num_preemptions_total")}
    nwor = {name: total(final, f"vllm:nwor_{name}_total")
            for name in ("tokens_staged", "tokens_committed", "tokens_rejected")}
    for kind in ("cache", "counter"):
        if audit.get(f"{kind}_violations"):
            violations += audit[f"{kind}_violations"]
            failed.append(f"{kind} audit: {audit[f'{kind}_violation_samples'][:3]}")
    # The worker's counters equal what its sampler decided, over the whole run.
    exact = {}
    if audit.get("counters") is not None:
        exact = {"NWOR staged (worker) vs the audit's drafted":
                 (audit["counters"]["tokens_staged"], audit["drafted"]),
                 "NWOR committed (worker) vs the audit's accepted":
                 (audit["counters"]["tokens_committed"], audit["accepted"]),
                 "NWOR committed (/metrics) vs the worker's":
                 (nwor["tokens_committed"], audit["counters"]["tokens_committed"])}
    for what, (ours, theirs) in exact.items():
        if ours != theirs:
            violations += 1
            failed.append(f"{what}: {ours} != {theirs}")
    # vLLM's stats leave out the drafts of a request that ended while its step ran (a client
    # abort, or a stop string found by the front end): at most 2 x k drafts per sequence so
    # ended. Under async scheduling (vLLM 0.32's default with speculation) the step after the
    # one that reached a request's max_tokens is already scheduled: its k drafts are verified
    # and left out of vLLM's stats too.
    ended = ((tally.aborted + tally.finish_reasons.get("stop", 0)) * 2 * k
             + tally.finish_reasons.get("length", 0) * k)
    for what, ours, theirs in (("drafted", audit.get("drafted", 0), vllm_stats["drafted"]),
                               ("accepted", audit.get("accepted", 0), vllm_stats["accepted"])):
        if not 0 <= ours - theirs <= ended:
            violations += 1
            failed.append(f"{what}: the worker's {ours} vs vLLM's {theirs}, beyond the {ended} "
                          f"that requests ending mid-step explain")
    if pressure and not vllm_stats["preemptions"]:
        violations += 1
        failed.append("no preemption under KV pressure")
    memory = {"resident": grew(monitor.memory, "rss", *MEMORY_GROWTH_ALLOWED),
              "cuda_allocated": grew(audit.get("memory", []), "cuda_allocated", 0.0,
                                     CUDA_GROWTH_ALLOWED)}
    for what, growth in memory.items():
        if growth["grew"]:
            violations += 1
            failed.append(f"{what} memory grew: {growth}")
    return {
        "requests": tally.requests, "completed": tally.completed, "aborted": tally.aborted,
        "errors": tally.errors + monitor.errors, "violations": violations,
        "checks_failed": failed, "error_samples": tally.error_samples + monitor.error_samples,
        "slow_scrapes": monitor.slow_scrapes,
        "traffic_seconds": round(traffic_seconds, 1), "kinds": tally.kinds,
        "finish_reasons": tally.finish_reasons, "vllm_stats": vllm_stats,
        "nwor_metrics": nwor, "fallbacks": audit.get("fallbacks"),
        "steps": audit.get("steps"), "verify_steps": audit.get("verify_steps"),
        "rejected": audit.get("rejected"), "checked_tokens": audit.get("checked_tokens"),
        "scrapes": monitor.scrapes, "memory": memory,
        "ranks": [{key: st.get(key) for key in ("drafted", "accepted", "checked_tokens",
                                                  "cache_violations", "counter_violations")}
                  | {"tp_rank": st.get("worker", {}).get("tp_rank")} for st in statuses],
    }


@dataclass(frozen=True)
class Setup:
    """Where the soak runs: the served model and vLLM's options."""

    model: str
    draft: str
    args: tuple[str, ...]
    env: dict
    max_model_len: int
    cuda: bool
    synthetic: bool
    scv: dict
    k: int = 3
    speculative: dict = field(default_factory=dict)  # vLLM's own speculative keys beside k
    ranks: int = 1  # tensor_parallel_size
    pressure: bool = False  # a KV cache small enough to preempt


def cpu_setup(root: Path) -> Setup:
    """The shipped byte-level pair: its draft agrees with its target often on repetitive code
    and rarely elsewhere, so verify steps accept and reject (docs/model_pair.md)."""
    from tests.support.served_model import CHAT_TEMPLATE
    from vllm_nwor.testing import shipped_pair

    target, draft = shipped_pair()
    # The pair's 256 positions; 8 sequences fit this 2-core machine; steps of 64 tokens so that
    # long prompts are prefilled in chunks beside verify steps. The pair ships no chat template.
    args = ("--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--seed", "0", "--chat-template", CHAT_TEMPLATE)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # torch.compile stays on: vLLM's default
    # SCV's online cost fit finds on this CPU that drafting never pays and holds every request
    # at chunk 0 (no verify step for NWOR); a pinned model that prices drafts cheap, as a GPU's
    # memory-bound step does, gives requests chunks from 0 to k.
    scv = {"scv_cost_model": [0.01, 5e-4, 5e-5]}
    return Setup(target, draft, args, env, 256, cuda=False, synthetic=False, scv=scv)


def gpu_setup(root: Path, tensor_parallel_size: int = 1, pressure: bool = False) -> Setup:
    """The Llama-3-8B shape with a two-layer draft, vLLM's defaults but for what a run is
    about: ``tensor_parallel_size``; ``pressure``, a KV cache that preempts and a token budget
    that prefills long prompts in chunks beside verify steps."""
    from benchmarks.harness.engines import LLAMA3_8B
    from tests.support.served_model import CHAT_TEMPLATE, write_byte_tokenizer

    paths = []
    for name, layers in (("llama3-8b-shape", 32), ("draft-2layer", 2)):
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        config = {**LLAMA3_8B, "num_hidden_layers": layers, "bos_token_id": 0,
                  "eos_token_id": 1}
        (path / "config.json").write_text(json.dumps(config))
        write_byte_tokenizer(path, vocab_size=LLAMA3_8B["vocab_size"])
        paths.append(str(path))
    # Random weights accept nearly every draft: vLLM's synthetic rejection sampling makes the
    # verify steps reject. A context of 2048 keeps prompts of up to 1.5k tokens; the byte
    # tokenizer has no template.
    args = ("--load-format", "dummy", "--max-model-len", "2048", "--seed", "0",
            "--chat-template", CHAT_TEMPLATE)
    if tensor_parallel_size > 1:
        args += ("--tensor-parallel-size", str(tensor_parallel_size))
    if pressure:
        # 64 sequences keep NWOR's scratch blocks few (64 x 2); 640 blocks leave 512 (8,192
        # tokens) to 48 clients' prompts of up to 1.5k tokens, so requests are preempted; a
        # 1,024-token budget prefills longer prompts in chunks beside verify steps.
        args += ("--max-num-seqs", "64", "--num-gpu-blocks-override", "640",
                 "--max-num-batched-tokens", "1024")
    synthetic = {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}
    return Setup(*paths, args, {}, 2048, cuda=True, synthetic=False, scv={}, k=4,
                 speculative=synthetic, ranks=tensor_parallel_size, pressure=pressure)


def plugin_config(setup: Setup, name: str) -> dict:
    """The plugin's keys for a run: ``nwor``, ``nwor+scv``, or ``nwor_off`` (the negative
    control: telemetry only, so vLLM's plain write path runs under the same audit)."""
    return {"nwor": {"nwor": True}, "nwor+scv": {"nwor": True, "scv": "adaptive", **setup.scv},
            "nwor_off": {"nwor_telemetry": True}}[name]


def start(setup: Setup, name: str, logs: Path):
    """A server for run ``name`` with the audit plugin loaded: (server, audit directory)."""
    from tests.support import pythonpath
    from tests.support.server_process import VllmServer
    from tests.support.soak_audit import ENV_DIR, install

    plugin = plugin_config(setup, name)
    audit_dir = Path(tempfile.mkdtemp(prefix=f"soak-{name}-", dir=logs))
    env = {**setup.env, ENV_DIR: str(audit_dir),
           "PYTHONPATH": pythonpath(install(audit_dir / "site"))}
    if setup.synthetic:
        plugin = {**plugin, "synthetic_acceptance_per_request": True}
    config = {"method": "draft_model", "model": setup.draft,
              "num_speculative_tokens": setup.k, **setup.speculative, **plugin}
    server = VllmServer(setup.model, config, logs / f"{name}.log", args=setup.args, env=env)
    server.config = config
    return server, audit_dir


def traffic_on(setup: Setup, name: str, server, audit_dir: Path, started: float,
               **traffic) -> dict:
    """Waits for the server, runs the soak, checks the server survived; the run's row."""
    try:
        server.wait_ready(started + 600)
        startup = time.monotonic() - started
        result = soak(server, setup.model, audit_dir, max_model_len=setup.max_model_len,
                      cuda=setup.cuda, k=setup.k, synthetic=setup.synthetic,
                      ranks=setup.ranks, pressure=setup.pressure, **traffic)
        if server.process.poll() is not None:
            result["errors"] += 1
            result["checks_failed"].append(f"server exited: {server.tail()}")
    except Exception:
        print(server.tail(), file=sys.stderr)
        raise
    return {"name": name, "speculative_config": server.config, "args": list(setup.args),
            "startup_seconds": round(startup, 1), **result}


def run(setup: Setup, name: str, logs: Path, **traffic) -> dict:
    """One server, its soak, then stopped."""
    started = time.monotonic()
    server, audit_dir = start(setup, name, logs)
    try:
        return traffic_on(setup, name, server, audit_dir, started, **traffic)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", default="300",
                        help="traffic per server; a comma list gives each config its own")
    parser.add_argument("--requests", type=int, default=1_000_000, help="at most, per server")
    parser.add_argument("--clients", type=int, help="concurrent clients (CPU 6, GPU 48)")
    parser.add_argument("--configs", default="nwor,nwor+scv")
    parser.add_argument("--negative-control", action="store_true",
                        help="also one server with the plugin's NWOR off: the audit must fail")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPU only")
    parser.add_argument("--pressure", action="store_true",
                        help="GPU only: KV pressure (preemptions) and chunked prefill")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from benchmarks.harness.results import environment, write_json

    on_cuda = torch.cuda.is_available()
    root = Path(tempfile.mkdtemp(prefix="nwor-soak-"))
    setup = gpu_setup(root, args.tensor_parallel_size, args.pressure) if on_cuda else \
        cpu_setup(root)
    clients = args.clients or (48 if on_cuda else 6)
    env = environment()
    where = "gpu" if on_cuda else "cpu"
    gpus = f"x{setup.ranks}" if setup.ranks > 1 else ""
    out = args.out or HERE / "results" / f"soak_{env['date']}_{where}{gpus}.json"
    names = args.configs.split(",")
    seconds = [float(x) for x in args.seconds.split(",")]
    seconds += seconds[-1:] * (len(names) - len(seconds))
    payload = {**env, "clients": clients, "runs": []}
    for name, duration in zip(names, seconds, strict=False):
        row = run(setup, name, root, seconds=duration,
                  max_requests=args.requests, clients=clients)
        payload["runs"].append(row)
        for key in ("requests", "aborted", "violations", "errors"):
            payload[key] = sum(r[key] for r in payload["runs"])
        print(json.dumps({k: row[k] for k in ("name", "requests", "aborted", "violations",
                                               "errors", "checks_failed")}), flush=True)
        write_json(out, payload)
    if args.negative_control:
        row = run(setup, "nwor_off", root, seconds=min(seconds[0], 60),
                  max_requests=args.requests, clients=clients)
        payload["negative_control"] = row
        print(json.dumps({k: row[k] for k in ("name", "violations", "checks_failed")}))
        write_json(out, payload)


if __name__ == "__main__":
    main()
