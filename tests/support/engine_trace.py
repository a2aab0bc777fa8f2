"""A per-step trace of a real engine, and the diff that names the first step where two traces
part: the tool for "NWOR on and off gave different tokens: where did they part?".

The trace rides in with vLLM's plugin mechanism (a test-only general plugin, as
:mod:`soak_audit` does), so it records any engine the way users run it, in-process or in its
own processes, at any tensor-parallel size. :func:`install` writes the plugin's metadata and
returns the ``PYTHONPATH`` for the engine's processes; ``$NWOR_TRACE_DIR`` switches it on.

- In the engine core, every ``Scheduler.schedule``: each scheduled request's tokens this step,
  its ``num_computed_tokens`` (a new or resumed request's are its prefix-cache hits), its drafts,
  the block ids it was given, whether it is new, resumed or running; the requests preempted and
  finished. Every ``update_from_output``: the tokens sampled for each request. File
  ``sched-<pid>.jsonl``, one line per call.
- In each worker of tensor-parallel rank 0, every ``_sample`` of the V1 runner: the batch's
  request order, and a fingerprint of each request's logits rows (their float32 bit patterns
  times fixed random weights, summed in int64: one flipped bit changes it). Logits part before
  tokens do, so this finds the first step whose forward differed even when its tokens agree.
  File ``worker-<pid>.jsonl``.

Request ids are recorded without the random suffix vLLM adds (``"3-1a2b3c4d"`` -> ``"3"``), so
two engines' traces name the same requests alike.

    python -m tests.support.engine_trace diff DIR_A DIR_B    # the first step where they part
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

ENV_DIR = "NWOR_TRACE_DIR"
_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def install(site: Path) -> str:
    """Makes ``site`` hold the plugin's metadata; returns the ``PYTHONPATH`` for the engine."""
    from tests.support.soak_audit import install_plugin

    return install_plugin(site, "engine_trace")


def request_key(req_id: str) -> str:
    return _SUFFIX.sub("", req_id)


class _Writer:
    def __init__(self, kind: str) -> None:
        self.path = Path(os.environ[ENV_DIR]) / f"{kind}-{os.getpid()}.jsonl"
        self.file = open(self.path, "a")  # noqa: SIM115 - open for the process's life

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.file.flush()


def register() -> None:
    if not os.environ.get(ENV_DIR):
        return
    _register_scheduler()
    _register_worker()


def _register_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_nwor_trace", False):  # vLLM may register plugins twice
        return
    schedule, update = Scheduler.schedule, Scheduler.update_from_output
    state = {"writer": None, "steps": 0}

    def writer() -> _Writer:
        if state["writer"] is None:
            state["writer"] = _Writer("sched")
        return state["writer"]

    def tracing_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        step = state["steps"]
        state["steps"] += 1
        out._nwor_trace_step = step
        writer().write({"kind": "schedule", "step": step, **schedule_record(out)})
        return out

    def tracing_update(self, scheduler_output, model_runner_output):
        sampled = {request_key(r): list(map(int, t)) for r, t in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=False)}
        writer().write({"kind": "update",
                        "step": getattr(scheduler_output, "_nwor_trace_step", None),
                        "sampled": sampled})
        return update(self, scheduler_output, model_runner_output)

    Scheduler.schedule = tracing_schedule
    Scheduler.update_from_output = tracing_update
    Scheduler._nwor_trace = True


def schedule_record(out) -> dict:
    """What one ``SchedulerOutput`` scheduled, request by request, in the scheduler's order."""
    spec = out.scheduled_spec_decode_tokens
    reqs = []
    for new in out.scheduled_new_reqs:
        reqs.append([request_key(new.req_id), "new", out.num_scheduled_tokens[new.req_id],
                     new.num_computed_tokens, len(spec.get(new.req_id, ())),
                     [list(g) for g in new.block_ids]])
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        reqs.append([request_key(req_id),
                     "resumed" if req_id in cached.resumed_req_ids else "running",
                     out.num_scheduled_tokens[req_id], cached.num_computed_tokens[i],
                     len(spec.get(req_id, ())),
                     None if blocks is None else [list(g) for g in blocks]])
    return {"reqs": reqs,
            "preempted": sorted(map(request_key, out.preempted_req_ids or ())),
            "finished": sorted(map(request_key, out.finished_req_ids))}


def _register_worker() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_nwor_trace", False):
        return
    sample = GPUModelRunner._sample
    state = {"writer": None, "steps": 0, "weights": None}

    def tracing_sample(self, logits, spec_decode_metadata):
        out = sample(self, logits, spec_decode_metadata)
        if _tp_rank() == 0 and logits is not None:
            if state["writer"] is None:
                state["writer"] = _Writer("worker")
            num_reqs = self.input_batch.num_reqs
            req_ids = [request_key(r) for r in self.input_batch.req_ids[:num_reqs]]
            rows = ([1] * num_reqs if spec_decode_metadata is None
                    else [n + 1 for n in spec_decode_metadata.num_draft_tokens])
            state["writer"].write({"step": state["steps"], "reqs": req_ids,
                                   "logits": logits_fingerprints(logits, rows, state)})
            state["steps"] += 1
        return out

    GPUModelRunner._sample = tracing_sample
    GPUModelRunner._nwor_trace = True


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError):
        return 0


def logits_fingerprints(logits, rows: list[int], state: dict) -> list[str]:
    """One fingerprint per request (its ``rows`` consecutive logits rows), as hex."""
    import torch

    bits = logits.float().contiguous().view(torch.int32).long()
    weights = state["weights"]
    if weights is None or weights.shape[0] < bits.shape[1] or weights.device != bits.device:
        generator = torch.Generator().manual_seed(0)
        weights = torch.randint(1, 2**31 - 1, (bits.shape[1],), generator=generator)
        weights = state["weights"] = weights.to(bits.device)
    per_row = (bits * weights[: bits.shape[1]]).sum(-1).tolist()
    prints, start = [], 0
    for n in rows:
        prints.append(format(hash(tuple(per_row[start:start + n])) & (2**64 - 1), "016x"))
        start += n
    return prints


# -- reading and comparing two traces ---------------------------------------------------------


def read(directory: Path) -> dict:
    """A traced engine's records: ``schedule`` and ``update`` by step, ``worker`` in order."""
    directory = Path(directory)
    sched = [json.loads(line) for p in sorted(directory.glob("sched-*.jsonl"))
             for line in p.read_text().splitlines()]
    worker = [json.loads(line) for p in sorted(directory.glob("worker-*.jsonl"))
              for line in p.read_text().splitlines()]
    return {"schedule": [r for r in sched if r["kind"] == "schedule"],
            "update": {r["step"]: r["sampled"] for r in sched if r["kind"] == "update"},
            "worker": worker}


def first_difference(a: dict, b: dict, logits: bool = True) -> dict | None:
    """The first step at which two traces part, and how; None if they never do.

    At each step, in this order: what was scheduled (requests, tokens, computed tokens, drafts,
    blocks, preemptions), then each request's logits fingerprint (the forward), then its
    sampled tokens. So a difference is named at its cause: a schedule that differs before any
    forward did points at the scheduler (capacity, timing), a forward that differs under the
    same schedule points at what the forward read (the KV cache). ``logits=False`` leaves the
    fingerprints out (where the two forwards are not meant to be bit for bit equal)."""
    # The worker samples once per step that scheduled anything.
    worker_a, worker_b = _by_step(a), _by_step(b)
    steps = max(len(a["schedule"]), len(b["schedule"]))
    for step in range(steps):
        if step >= len(a["schedule"]) or step >= len(b["schedule"]):
            return {"step": step, "what": "trace length",
                    "a": len(a["schedule"]), "b": len(b["schedule"])}
        sa, sb = a["schedule"][step], b["schedule"][step]
        for field in ("reqs", "preempted", "finished"):
            if sa[field] != sb[field]:
                return {"step": step, "what": f"schedule.{field}",
                        **_schedule_difference(sa[field], sb[field])}
        wa, wb = worker_a.get(step), worker_b.get(step)
        if logits and wa is not None and wb is not None:
            if wa["reqs"] != wb["reqs"]:
                return {"step": step, "what": "batch order", "a": wa["reqs"], "b": wb["reqs"]}
            for req, fa, fb in zip(wa["reqs"], wa["logits"], wb["logits"], strict=True):
                if fa != fb:
                    return {"step": step, "what": "logits", "request": req,
                            "scheduled": _scheduled(sa, req), "batch": len(wa["reqs"])}
        ua, ub = a["update"].get(step), b["update"].get(step)
        if ua != ub:
            req = next((r for r in sorted(set(ua or {}) | set(ub or {}))
                        if (ua or {}).get(r) != (ub or {}).get(r)), None)
            return {"step": step, "what": "sampled", "request": req,
                    "a": (ua or {}).get(req), "b": (ub or {}).get(req)}
    return None


def _by_step(trace: dict) -> dict[int, dict]:
    busy = [s["step"] for s in trace["schedule"] if s["reqs"]]
    return dict(zip(busy, trace["worker"], strict=False))


def _scheduled(step: dict, req: str) -> list | None:
    return next((r for r in step["reqs"] if r[0] == req), None)


def _schedule_difference(a: list, b: list) -> dict:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return {"index": i, "a": x, "b": y}
    return {"index": min(len(a), len(b)), "a": a[len(b):], "b": b[len(a):]}


def summary(trace: dict) -> dict:
    """Counts a reader wants beside a difference: steps, preemptions, prefix-hit tokens."""
    sched = trace["schedule"]
    return {"steps": len(sched),
            "preemptions": sum(len(s["preempted"]) for s in sched),
            "hit_tokens": sum(r[3] for s in sched for r in s["reqs"] if r[1] == "new"),
            "worker_steps": len(trace["worker"])}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "diff":
        sys.exit("usage: python -m tests.support.engine_trace diff DIR_A DIR_B")
    ta, tb = read(Path(sys.argv[2])), read(Path(sys.argv[3]))
    print(json.dumps({"a": summary(ta), "b": summary(tb),
                      "first_difference": first_difference(ta, tb)}, indent=1))
