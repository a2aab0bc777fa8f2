"""The per-step audit inside a real ``vllm serve``: a test-only vLLM general plugin.

A soak run (``python -m benchmarks.soak``) cannot reach into the server's engine, so the audit rides
in with vLLM's own plugin mechanism: :func:`install` writes the metadata of a distribution
``nwor-soak-audit`` whose ``vllm.general_plugins`` entry point is :func:`register`, and returns
the ``PYTHONPATH`` that makes the server's processes find it. In the worker, once the KV cache
exists, every step of the target model is checked after rejection sampling and the commit:

- the cache audit of :mod:`cache_audit` (committed positions written, nothing beyond them);
- NWOR's counters moved by exactly what vLLM's sampler decided this step: staged == drafted,
  committed == accepted, rejected == drafted - accepted (the per-step form of "committed ==
  vLLM's accepted tokens");
- the process's resident memory and, on CUDA, the allocator's bytes, sampled once a second;
- what the worker ran (``step_record.WorkerRecord``: its tensor-parallel rank and device, graph
  mode of each target step by batch shape, custom all-reduce, NWOR's FULL-graph steps), so that
  a test can check every rank of a tensor-parallel engine.

The state goes to ``$NWOR_SOAK_AUDIT_DIR/audit-<pid>.json`` after every step (written whole,
then renamed), where the soak driver reads it. Without that variable the plugin does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.support import pythonpath

ENV_DIR = "NWOR_SOAK_AUDIT_DIR"
MAX_LISTED = 20  # violations kept verbatim; all are counted
MAX_MEMORY_SAMPLES = 1000  # memory samples kept, thinned to half when there are more


def install(site: Path) -> str:
    """Makes ``site`` hold the plugin's metadata; returns the ``PYTHONPATH`` for the server."""
    return install_plugin(site, "soak_audit")


def install_plugin(site: Path, module: str) -> str:
    """Makes ``site`` hold the metadata of a distribution ``nwor-<module>`` whose
    ``vllm.general_plugins`` entry point is ``tests.support.<module>:register``; returns the
    ``PYTHONPATH`` that lets an engine's processes find both (``site`` and the repository
    root)."""
    dist = Path(site) / f"nwor_{module}-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    name = "nwor-" + module.replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\nnwor_{module} = tests.support.{module}:register\n")
    return pythonpath(site, env={})


def register() -> None:
    if not os.environ.get(ENV_DIR):
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_soak_audit", False):  # vLLM may register plugins twice
        return
    initialize_kv_cache = GPUModelRunner.initialize_kv_cache

    def wrapper(self, kv_cache_config, is_profiling: bool = False, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling=is_profiling, **kwargs)
        if not is_profiling:
            StepAudit.attach(self)

    GPUModelRunner.initialize_kv_cache = wrapper
    GPUModelRunner._soak_audit = True
    _register_v2()


def _register_v2() -> None:
    """The same on vLLM's V2 model runner (its profiling KV cache left alone). Its start-up
    warm-up steps are audited too; NWOR zeroes its counters after them (``_after_step`` sees
    it)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    except ImportError:
        return
    if getattr(GPUModelRunnerV2, "_soak_audit", False):
        return
    initialize_kv_cache = GPUModelRunnerV2.initialize_kv_cache

    def wrapper(self, kv_cache_config, is_profiling: bool = False, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling=is_profiling, **kwargs)
        if not is_profiling:
            StepAudit.attach(self)

    GPUModelRunnerV2.initialize_kv_cache = wrapper
    GPUModelRunnerV2._soak_audit = True


def read_status(directory: Path) -> list[dict]:
    """Every audited engine's last state (one per worker process)."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob("audit-*.json"))]


class StepAudit:
    @classmethod
    def attach(cls, runner) -> None:
        import vllm_nwor
        from tests.support.cache_audit import (
            CacheAudit,
            read_cpu_attn_tokens,
            read_flash_attn_tokens,
        )
        from tests.support.step_record import WorkerRecord
        from vllm_nwor.patches.nwor.model_runner import attention_layers

        layers = attention_layers(runner.get_model())
        read = read_flash_attn_tokens if runner.device.type == "cuda" else read_cpu_attn_tokens
        audit = CacheAudit(runner, layers, read, runner.cache_config.block_size)
        worker = WorkerRecord(runner, layers)
        cls(runner, audit, lambda: vllm_nwor.runner_counters(runner), worker.as_dict)

    def __init__(self, runner, audit, counters, worker=lambda: None) -> None:
        import torch

        self.runner, self.audit, self.counters, self.worker = runner, audit, counters, worker
        self.path = Path(os.environ[ENV_DIR]) / f"audit-{os.getpid()}.json"
        self.on_cuda = runner.device.type == "cuda" and torch.cuda.is_available()
        self.steps = self.verify_steps = 0
        self.counter_violations: list[str] = []
        self.num_counter_violations = 0
        self.fallbacks: dict[str, int] = {}
        self.memory: list[dict] = []
        self.last_sample = 0.0
        self.last = self._counts()
        # The audit's totals before NWOR's counters start (their binding, or V2's warm-up
        # steps, after which NWOR zeroes them): vLLM's stats leave the warm-up out too.
        self.base = (0, 0, 0)
        sample_tokens = runner.sample_tokens  # the audit's wrapper

        def step(*args, **kwargs):
            totals = (audit.drafted, audit.accepted, audit.rejected_drafts)
            output = sample_tokens(*args, **kwargs)
            self._after_step(*(now - then for now, then in zip(
                (audit.drafted, audit.accepted, audit.rejected_drafts), totals, strict=True)))
            return output

        runner.sample_tokens = step
        self._write()

    def _counts(self) -> dict | None:
        counters = self.counters()
        return None if counters is None else counters.as_dict()

    def _after_step(self, drafted: int, accepted: int, rejected: int) -> None:
        self.steps += 1
        self.verify_steps += bool(drafted)
        now = self._counts()
        if now is not None:  # NWOR binds its runner after this audit attaches: start from 0
            zero = {**{k: 0 for k in now}, "fallbacks": {}}
            before = self.last or zero
            if now["tokens_staged"] < before["tokens_staged"]:  # zeroed after V2's warm-up
                before = zero
            if before is zero:  # the run's totals count from here, as NWOR's counters do
                audit = self.audit
                self.base = (audit.drafted - drafted, audit.accepted - accepted,
                             audit.rejected_drafts - rejected)
            moved = {k: now[k] - before[k] for k in
                     ("tokens_staged", "tokens_committed", "tokens_rejected")}
            fallback_moved = sum(now["fallbacks"].values()) - sum(before["fallbacks"].values())
            expected = {"tokens_staged": drafted, "tokens_committed": accepted,
                        "tokens_rejected": rejected}
            # A step that fell back wrote its rows the plain way: its drafts are not staged.
            if moved != expected and not fallback_moved:
                self.num_counter_violations += 1
                if len(self.counter_violations) < MAX_LISTED:
                    self.counter_violations.append(
                        f"step {self.steps}: counters moved {moved}, the sampler: {expected}")
            self.fallbacks = dict(now["fallbacks"])
            self.last = now
        if time.monotonic() - self.last_sample >= 1.0:
            self._sample_memory()
        self._write()

    def _sample_memory(self) -> None:
        import torch

        self.last_sample = time.monotonic()
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        sample = {"t": round(self.last_sample, 3), "step": self.steps, "rss": rss}
        if self.on_cuda:
            sample["cuda_allocated"] = torch.cuda.memory_allocated()
        self.memory.append(sample)
        if len(self.memory) > MAX_MEMORY_SAMPLES:  # a long soak: keep every other one
            self.memory = self.memory[::2]

    def _write(self) -> None:
        audit = self.audit
        state = {
            "pid": os.getpid(), "steps": self.steps, "verify_steps": self.verify_steps,
            "drafted": audit.drafted - self.base[0], "accepted": audit.accepted - self.base[1],
            "rejected": audit.rejected_drafts - self.base[2],
            "before_counters": dict(zip(("drafted", "accepted", "rejected"), self.base,
                                        strict=True)),
            "checked_tokens": audit.checked_tokens,
            "cache_violations": len(audit.violations),
            "cache_violation_samples": audit.violations[:MAX_LISTED],
            "counter_violations": self.num_counter_violations,
            "counter_violation_samples": self.counter_violations,
            "counters": self.last, "fallbacks": self.fallbacks, "memory": self.memory,
            "worker": self.worker(),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.path)
