"""A bounded soak through real ``vllm serve`` processes (benchmarks/soak.py is the long one).

Two servers with vLLM's defaults and the shipped pair, NWOR and NWOR + adaptive SCV, take
mixed traffic at the same time: completions and chat, streamed and not, greedy and sampled,
``n=2``, stops, client aborts mid-stream. Every engine step is audited inside the server
(tests/support/soak_audit.py): the paged cache holds no rejected draft, NWOR's counters moved by
exactly the sampler's verdict; /metrics counters never go down, and the run ends with NWOR's
counters equal to vLLM's stats (up to the drafts of requests that ended mid-step) and memory
flat. The same soak with NWOR off (docs/equivalence.md, the soak's negative control) finds the
rejected drafts vLLM's plain write path puts in the cache.
"""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks import soak

pytestmark = pytest.mark.engine

SECONDS = 30  # traffic per server; the script's default is 300
MIN_REQUESTS = 20  # and on until this many ended (a slow, shared CI machine), for at most 8x


def test_soak_nwor_then_scv_through_vllm_serve(tmp_path):
    setup = soak.cpu_setup(tmp_path)
    started = time.monotonic()
    servers = {name: soak.start(setup, name, tmp_path) for name in ("nwor", "nwor+scv")}
    rows: dict[str, dict] = {}
    failures: dict[str, BaseException] = {}

    def drive(name: str) -> None:
        server, audit_dir = servers[name]
        try:
            rows[name] = soak.traffic_on(setup, name, server, audit_dir, started,
                                         seconds=SECONDS, max_requests=10**6, clients=3,
                                         min_requests=MIN_REQUESTS)
        except BaseException as error:  # re-raised below, after both servers stop
            failures[name] = error

    threads = [threading.Thread(target=drive, args=(name,)) for name in servers]
    try:
        # Both up before either's traffic starts: a start-up (torch.compile) beside the other
        # server's traffic would take most of this 2-core machine.
        for server, _ in servers.values():
            server.wait_ready(started + 600)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for server, _ in servers.values():
            server.stop()
    for error in failures.values():
        raise error
    for name, row in rows.items():
        summary = {k: row[k] for k in ("startup_seconds", "traffic_seconds", "requests",
                                       "aborted", "errors", "slow_scrapes", "violations",
                                       "checks_failed", "error_samples")}
        print(name, summary, row["vllm_stats"], row["scv"] if "scv" in row else "")
        assert row["violations"] == 0 and row["errors"] == 0, (name, summary)
        assert row["requests"] >= MIN_REQUESTS and row["aborted"] > 0, (name, summary)
        assert row["rejected"] > 0 and row["vllm_stats"]["accepted"] > 0, (name, row)
        assert row["vllm_stats"]["prefix_cache_hits"] > 0, (name, row)
        assert not row["fallbacks"], (name, row["fallbacks"])
