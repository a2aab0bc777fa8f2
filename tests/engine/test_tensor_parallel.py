"""NWOR at tensor_parallel_size 2 on vLLM's CPU engine: two worker processes, each holding half
the KV heads and staging and committing its own.

Each engine runs in a fresh process (``tp_probe.py``) with the soak's per-step audit plugin
(``tests/common/soak_audit.py``) loaded into both workers of the NWOR-on engine: after every
step, on every rank, the cache holds the committed tokens and nothing past them, and NWOR's
counters moved by exactly that step's verdict. Then: NWOR on vs off gives the same greedy tokens
and logprobs, both ranks' counters are equal, and they equal vLLM's spec-decode stats.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "common"))

import soak_audit  # noqa: E402
from engine_utils import run_probe  # noqa: E402


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


pytestmark = pytest.mark.skipif(len(_cpus()) < 2, reason="two worker processes need two CPUs")


def _run(models: tuple[str, str], nwor: str, site: Path, audit_dir: Path | None) -> dict:
    env = dict(os.environ)
    # One core per worker: vLLM's automatic binding wants a NUMA node per worker.
    first, second = _cpus()[:2]
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (soak_audit.install(site), env.get("PYTHONPATH")) if p)
    env.pop(soak_audit.ENV_DIR, None)
    if audit_dir is not None:
        env[soak_audit.ENV_DIR] = str(audit_dir)
    return run_probe("tp_probe.py", [*models, nwor], env, timeout=900)


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
    # NWOR's staged attention on the CPU is a PyTorch reference (no log-sum-exp from vLLM's
    # kernel), so logprobs agree to rounding, as in the one-rank matrix.
    for a, b in zip(on["logprobs"], off["logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-3)


def test_both_ranks_counted_the_same_and_as_vllm(runs):
    on = runs["on"]
    ranks = on["rank_counters"]
    assert len(ranks) == 2 and all(r is not None for r in ranks)
    tokens = [{k: v for k, v in r.items() if k != "kv_bytes_not_written"} for r in ranks]
    assert tokens[0] == tokens[1]
    drafted, accepted = on["spec_stats"]
    combined = on["counters"]
    assert combined["fallbacks"] == {}
    assert (combined["tokens_staged"], combined["tokens_committed"]) == (drafted, accepted)
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert combined["kv_bytes_not_written"] == sum(r["kv_bytes_not_written"] for r in ranks)


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
