"""The README's `vllm serve` and chat request, run as written: the shipped pair served with
vLLM's defaults and the README's speculative config, a chat completion through the pair's chat
template, vLLM's per-request spec-decode metrics in the response and the plugin's counters on
``/metrics``. The commands are read from the README, so the test fails when they stop working.
"""

from __future__ import annotations

import json
import re
import shlex
import time
import urllib.request
from pathlib import Path

from tests.support.server_process import VllmServer

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600


def readme_commands() -> tuple[dict, str, dict, dict]:
    """(env, model, speculative config) of the README's ``vllm serve`` block, and the JSON
    body of its ``curl`` chat request."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    serve = next(b for b in blocks if "vllm serve models/" in b)
    curl = next(b for b in blocks if "/v1/chat/completions" in b)
    words = shlex.split(serve.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words[: words.index(next(w for w in words
                                                                  if w.endswith("vllm")))])
    model = words[words.index("serve") + 1]
    assert words[words.index("serve") + 2:][0] == "--speculative-config", words
    speculative = json.loads(words[words.index("--speculative-config") + 1])
    curl_words = shlex.split(curl.replace("\\\n", " "))
    body = json.loads(curl_words[curl_words.index("-d") + 1])
    return env, model, speculative, body


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_the_readmes_serve_command_answers_a_chat_with_speculation_metrics(tmp_path):
    env, model, speculative, body = readme_commands()
    assert speculative.get("nwor") is True and body["model"] == model
    # As written, from the checkout's root: vLLM's defaults (args=()), the README's variable.
    server = VllmServer(model, speculative, tmp_path / "serve.log", args=(), env=env, cwd=REPO)
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        reply = post(f"{server.url}/v1/chat/completions", body)
        choice = reply["choices"][0]
        assert choice["message"]["content"], reply
        spec = reply["metrics"]["speculative_decoding"]
        assert spec["num_draft_tokens"] > 0 and len(spec["per_step_accepted"]) == spec[
            "num_spec_steps"], spec
        staged = re.search(r"^vllm:nwor_tokens_staged_total\{[^}]*\} (\S+)$",
                           server.metrics_text(), re.M)
        assert staged and float(staged.group(1)) == spec["num_draft_tokens"], staged
    finally:
        server.stop()
