"""EAGLE-3 through a real ``vllm serve``, as a user starts it: NWOR and adaptive SCV on, against
the same server with the plugin installed but not enabled.

The served model is the bigram target with its EAGLE-3 head (``write_bigram_eagle_pair``: the
head's first draft is right most of the time, its later drafts rarely, so steps accept and
reject), plus a byte tokenizer. On the CPU vLLM runs EAGLE-3 on its V1 runner; on a GPU it runs
it on the V2 runner, which ``tests/gpu/test_eagle_gpu.py`` covers. Greedy completions and chat:
the same responses apart from the plugin's fields, each request's acceptance lengths and NWOR's
counters against what vLLM's own spec-decode counters moved by for that request alone.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai_traffic import (
    OURS,
    VOLATILE,
    as_json,
    delta,
    request_totals_checked,
    run_traffic,
    spec_metrics,
    without,
)

from tests.support.served_model import write_byte_tokenizer
from tests.support.server_process import VllmServer

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 32, "timeout": 120, "extra_body": {"ignore_eos": True}}
PROMPTS = ["def main(argv):\n    return", "import os, sys\n", "a b c a b c"]
MESSAGES = [{"role": "user", "content": "x y z x y z x y z"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(off, on): EAGLE-3 k=3 without the plugin enabled, and with NWOR and adaptive SCV."""
    from vllm_nwor.testing import write_bigram_eagle_pair

    target, head = write_bigram_eagle_pair(tmp_path_factory.mktemp("bigram"), eagle3=True)
    write_byte_tokenizer(target, vocab_size=512)
    logs = tmp_path_factory.mktemp("eagle3-server-logs")
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    configs = {"off": eagle3, "on": {**eagle3, "nwor": True, "scv": "adaptive"}}
    started = {}
    try:
        for name, config in configs.items():  # one at a time: two engines race for a port
            started[name] = VllmServer(target, config, logs / f"{name}.log")
            started[name].wait_ready(time.monotonic() + 300)
        yield started["off"], started["on"]
    finally:
        for server in started.values():
            server.stop()


def requests(client: openai.OpenAI, model: str) -> dict:
    return {
        # One prompt a request: vLLM reports per-request metrics for one sequence only.
        "completion": lambda: client.completions.create(model=model, prompt=PROMPTS[0],
                                                        **GREEDY),
        "completion_2": lambda: client.completions.create(model=model, prompt=PROMPTS[1],
                                                          **GREEDY),
        "chat": lambda: client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY),
    }


@pytest.fixture(scope="module")
def traffic(servers):
    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(lambda server: run_traffic(server, requests), servers))


def test_nwor_and_scv_change_no_greedy_response(traffic):
    off, on = traffic
    for name in off:
        on_json, off_json = as_json(on[name]["response"]), as_json(off[name]["response"])
        assert spec_metrics(on[name]["response"]) is not None, name
        assert spec_metrics(off[name]["response"]) is None, name
        assert without(on_json, OURS + VOLATILE) == without(off_json, OURS + VOLATILE), name


def test_acceptance_lengths_and_counters_agree_with_vllms_request_by_request(traffic):
    _, on = traffic
    totals = {"drafted": 0, "accepted": 0}
    for name, result in on.items():
        before, after = result["before"], result["after"]
        _, steps, accepted, drafted = request_totals_checked(result, name)  # vLLM's counters

        def d(metric: str, before=before, after=after) -> float:
            return delta(before, after, metric)

        assert d("vllm:nwor_tokens_staged_total") == drafted, name
        assert d("vllm:nwor_tokens_committed_total") == accepted, name
        assert d("vllm:scv_chunk_size_sum") == drafted, name
        assert not any(k[0] == "vllm:nwor_fallbacks_total" and after[k] for k in after), name
        totals["drafted"] += drafted
        totals["accepted"] += accepted
    # The head must be right sometimes and wrong sometimes, or the checks above are empty.
    assert 0 < totals["accepted"] < totals["drafted"], totals
