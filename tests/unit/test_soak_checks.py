"""The soak's own checks can fail: each is fed a run that breaks it (no vLLM here).

The end-to-end negative control, the soak with NWOR off finding the rejected drafts vLLM's
plain write puts in the cache, is recorded in benchmarks/results/soak_2026-11-28_cpu.json.
"""

from __future__ import annotations

import json
import urllib.error
from types import SimpleNamespace

import pytest

from benchmarks import soak
from tests.support.soak_audit import ENV_DIR, StepAudit, read_status


class Verdicts:
    """A runner whose every step drafts 3 and accepts 1, and the NWOR counters beside it."""

    def __init__(self, committed_per_step: int) -> None:
        self.audit = SimpleNamespace(drafted=0, accepted=0, rejected_drafts=0, checked_tokens=0,
                                     violations=[])
        self.totals = {"tokens_staged": 0, "tokens_committed": 0, "tokens_rejected": 0,
                       "rejected_kv_bytes": 0, "fallbacks": {}}
        self.committed_per_step = committed_per_step
        self.runner = SimpleNamespace(device=SimpleNamespace(type="cpu"),
                                      sample_tokens=self.sample_tokens)

    def sample_tokens(self):
        self.audit.drafted += 3
        self.audit.accepted += 1
        self.audit.rejected_drafts += 2
        self.totals["tokens_staged"] += 3
        self.totals["tokens_committed"] += self.committed_per_step
        self.totals["tokens_rejected"] += 3 - self.committed_per_step

    def counters(self):
        return SimpleNamespace(as_dict=lambda: json.loads(json.dumps(self.totals)))


@pytest.mark.parametrize("committed_per_step, violations", [(1, 0), (2, 5)])
def test_counters_that_move_other_than_the_sampler_decided_are_violations(
        tmp_path, monkeypatch, committed_per_step, violations):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    run = Verdicts(committed_per_step)
    StepAudit(run.runner, run.audit, run.counters)
    for _ in range(5):
        run.runner.sample_tokens()
    (status,) = read_status(tmp_path)
    assert status["steps"] == 5 and status["counter_violations"] == violations


def test_the_audit_counts_from_where_nwors_counters_start(tmp_path, monkeypatch):
    """vLLM 0.32's V2 runner drafts in its warm-up steps, after which NWOR zeroes its counters
    (and vLLM's stats never count them): the audit's totals then count from there too."""
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    run = Verdicts(1)
    StepAudit(run.runner, run.audit, run.counters)
    for _ in range(2):
        run.runner.sample_tokens()
    run.totals.update(tokens_staged=0, tokens_committed=0, tokens_rejected=0)  # the warm-up's end
    for _ in range(3):
        run.runner.sample_tokens()
    (status,) = read_status(tmp_path)
    assert status["counter_violations"] == 0
    assert (status["drafted"], status["accepted"], status["rejected"]) == (9, 3, 6)
    assert status["before_counters"] == {"drafted": 6, "accepted": 2, "rejected": 4}


def metrics(value: float) -> str:
    """/metrics text with one counter at ``value``, as prometheus_client exposes it."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("vllm:nwor_tokens_committed", "", registry=registry)
    counter.inc(value)
    return prometheus_client.generate_latest(registry).decode()


def test_a_counter_that_goes_down_is_a_violation():
    texts = iter([metrics(5), metrics(7), metrics(6)])
    monitor = soak.Monitor(SimpleNamespace(metrics_text=lambda: next(texts)))
    for _ in range(3):
        monitor.check()
    assert monitor.num_violations == 1


def final_scrape(drafted: float, accepted: float, committed: float) -> dict:
    counter = "counter"
    return {("vllm:spec_decode_num_draft_tokens_total", ()): (counter, drafted),
            ("vllm:spec_decode_num_accepted_tokens_total", ()): (counter, accepted),
            ("vllm:nwor_tokens_staged_total", ()): (counter, 90.0),
            ("vllm:nwor_tokens_committed_total", ()): (counter, committed)}


def judged(drafted: float, accepted: float, committed: float, aborted: int,
           finished: int = 0) -> dict:
    tally = soak.Tally()
    for _ in range(aborted):
        tally.add("completion_stream", "aborted")
    for _ in range(finished):
        tally.add("completion", "length")
    status = {"drafted": 90, "accepted": 30, "rejected": 60,
              "counters": {"tokens_staged": 90, "tokens_committed": 30},
              "cache_violations": 0, "counter_violations": 0, "memory": []}
    monitor = soak.Monitor(SimpleNamespace())
    return soak.judge(tally, monitor, final_scrape(drafted, accepted, committed), [status],
                      traffic_seconds=1.0, k=3)


def test_the_end_of_run_checks():
    assert judged(90, 30, 30, aborted=0)["violations"] == 0
    # vLLM leaves out the drafts of a request that ended mid-step: up to 2 x k per such request.
    assert judged(84, 28, 30, aborted=1)["violations"] == 0
    assert judged(84, 28, 30, aborted=0)["violations"] == 2
    assert judged(90, 30, 29, aborted=0)["violations"] == 1  # /metrics != the worker's count
    # Under async scheduling the step after a request's last is verified, and not counted by
    # vLLM: up to k drafts per request finished by its length.
    assert judged(84, 28, 30, aborted=0, finished=2)["violations"] == 0
    assert judged(84, 28, 30, aborted=0, finished=1)["violations"] == 1


@pytest.mark.parametrize("failure, slow", [
    (TimeoutError("timed out"), True),
    (urllib.error.URLError(TimeoutError("timed out")), True),
    (ConnectionRefusedError(111, "Connection refused"), False),
])
def test_monitor_counts_a_refused_scrape_as_an_error_and_a_timeout_as_slow(failure, slow):
    class Server:
        def metrics_text(self):
            raise failure

        def group_rss(self):
            return 0

    monitor = soak.Monitor(Server())
    stops = iter([False, True])  # one scrape, then stop
    monitor.stop.wait = lambda _seconds: next(stops)
    monitor.run()
    assert (monitor.slow_scrapes, monitor.errors) == ((1, 0) if slow else (0, 1))
    assert monitor.error_samples and "/metrics" in monitor.error_samples[0]


def rank_status(rank: int, committed: int = 30, cache_violations: int = 0) -> dict:
    return {"drafted": 90, "accepted": 30, "rejected": 60,
            "counters": {"tokens_staged": 90, "tokens_committed": committed,
                         "rejected_kv_bytes": 60 * 64},  # each rank: its own heads' bytes
            "cache_violations": cache_violations, "counter_violations": 0,
            "cache_violation_samples": ["a rejected row in a request's block"],
            "memory": [], "worker": {"tp_rank": rank}}


def judged_ranks(statuses: list[dict], ranks: int = 2, preemptions: float = 3.0) -> dict:
    final = final_scrape(90, 30, 30)
    final[("vllm:num_preemptions_total", ())] = ("counter", preemptions)
    monitor = soak.Monitor(SimpleNamespace())
    return soak.judge(soak.Tally(), monitor, final, statuses, traffic_seconds=1.0, k=3,
                      ranks=ranks, pressure=True)


def test_every_rank_is_audited_and_counts_what_the_first_did():
    assert judged_ranks([rank_status(1), rank_status(0)])["violations"] == 0
    assert judged_ranks([rank_status(0)])["violations"] == 1  # a rank's audit is missing
    assert judged_ranks([rank_status(0), rank_status(1, cache_violations=2)])["violations"] == 2
    assert judged_ranks([rank_status(0), rank_status(1, committed=29)])["violations"] == 1


def test_a_pressure_run_must_preempt():
    result = judged_ranks([rank_status(0), rank_status(1)], preemptions=0.0)
    assert result["checks_failed"] == ["no preemption under KV pressure"]
