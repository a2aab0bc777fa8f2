"""NWOR at tensor_parallel_size 2 on vLLM's CPU engine: two worker processes, each holding half
the KV heads and staging and committing its own.

Each engine runs in a fresh process (``tp_probe.py``) with the soak's per-step audit plugin
(``tests/support/soak_audit.py``) loaded into both workers of the NWOR-on engine: after every
step, on every rank, the cache holds the committed tokens and nothing past them, and NWOR's
counters moved by exactly that step's verdict. Then: NWOR on vs off gives the same greedy tokens
and logprobs, both ranks' counters are equal, and they equal vLLM's spec-decode stats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from engine_utils import run_probe

from tests.support import pythonpath, soak_audit


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


pytestmark = pytest.mark.skipif(len(_cpus()) < 2, reason="two worker processes need two CPUs")


def _run(models: tuple[str, str], nwor: str, site: Path, audit_dir: Path | None,
         keys: dict | None = None) -> dict:
    env = dict(os.environ)
    # One core per worker: vLLM's automatic binding wants a NUMA node per worker.
    first, second = _cpus()[:2]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    env["PYTHONPATH"] = pythonpath(soak_audit.install(site), env=env)
    env.pop(soak_audit.ENV_DIR, None)
    if audit_dir is not None:
        env[soak_audit.ENV_DIR] = str(audit_dir)
    return run_probe("tp_probe.py", [*models, nwor, json.dumps(keys or {})], env, timeout=900)


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    audit_dir = tmp / "audit"
    audit_dir.mkdir()
    return {
        "off": _run(tiny_models, "off", tmp / "site", None),
        "on": _run(tiny_models, "on", tmp / "site", audit_dir),
        "audit": soak_audit.read_status(audit_dir),
    }


def test_greedy_tokens_and_logprobs_equal_nwor_off(runs):
    off, on = runs["off"], runs["on"]
    assert on["tokens"] == off["tokens"]
    assert on["greedy_spec_stats"] == off["greedy_spec_stats"]
    assert on["logprobs"] == off["logprobs"]  # vLLM's own attention kernel on both sides


def test_both_ranks_counted_the_same_and_as_vllm(runs):
    on = runs["on"]
    ranks = on["rank_counters"]
    assert len(ranks) == 2 and all(r is not None for r in ranks)
    tokens = [{k: v for k, v in r.items() if k != "rejected_kv_bytes"} for r in ranks]
    assert tokens[0] == tokens[1]
    drafted, accepted = on["spec_stats"]
    combined = on["counters"]
    assert combined["fallbacks"] == {}
    assert (combined["tokens_staged"], combined["tokens_committed"]) == (drafted, accepted)
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert combined["rejected_kv_bytes"] == sum(r["rejected_kv_bytes"] for r in ranks)


def test_every_rank_audited_every_step(runs):
    audits = runs["audit"]
    assert len(audits) == 2  # one per worker process
    for audit in audits:
        assert audit["verify_steps"] > 0 and audit["rejected"] > 0
        assert audit["cache_violations"] == 0, audit["cache_violation_samples"]
        assert audit["counter_violations"] == 0, audit["counter_violation_samples"]
        assert audit["fallbacks"] == {}
    # The ranks saw the same verdicts.
    assert len({(a["drafted"], a["accepted"], a["steps"]) for a in audits}) == 1


# SCV and the draft context window: their choices are made once per engine (the scheduler's
# chunks, and the window from the config), so every rank must verify and commit the same.
SCV_KEYS = {"scv": "adaptive", "scv_probe_interval": 2, "draft_context_window": 32,
            # drafts priced cheap: the online fit would hold every request at chunk 0 on a CPU
            "scv_cost_model": [0.01, 5e-4, 5e-5]}


@pytest.fixture(scope="module")
def scv_run(tiny_models, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp-scv")
    audit_dir = tmp / "audit"
    audit_dir.mkdir()
    run = _run(tiny_models, "on", tmp / "site", audit_dir, SCV_KEYS)
    return run | {"audit": soak_audit.read_status(audit_dir)}


def test_scv_and_draft_window_make_the_same_choices_on_every_rank(runs, scv_run):
    # Greedy output is the target's: chunking and a windowed draft change only the drafts.
    assert scv_run["tokens"] == runs["off"]["tokens"]
    budgets = scv_run["scv_budgets"]
    # steps planned at each draft budget 0..k: several sizes were used
    assert budgets is not None and sum(1 for n in budgets if n) > 1, budgets
    ranks = scv_run["rank_counters"]
    tokens = [{k: v for k, v in r.items() if k != "rejected_kv_bytes"} for r in ranks]
    assert len(ranks) == 2 and tokens[0] == tokens[1]
    drafted, accepted = scv_run["greedy_spec_stats"]
    assert 0 < accepted < drafted
    audits = scv_run["audit"]
    assert len(audits) == 2
    for audit in audits:
        assert audit["cache_violations"] == 0, audit["cache_violation_samples"]
        assert audit["counter_violations"] == 0, audit["counter_violation_samples"]
    assert len({(a["drafted"], a["accepted"], a["steps"]) for a in audits}) == 1
