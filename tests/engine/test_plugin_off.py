"""Installed but not enabled, the plugin leaves vLLM exactly as it is without the package.

Two fresh processes run the same speculative (ngram) workload: one loads the plugin (it is
installed, registers and patches, but nothing enables it), one keeps vLLM from loading any
plugin (``VLLM_PLUGINS=""``). Tokens, logprobs (exact floats), vLLM's spec-decode counters and
the engine config hash must be identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _run(target: str, load_plugins: bool) -> dict:
    env = dict(os.environ)
    if load_plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    proc = subprocess.run(
        [sys.executable, str(HERE / "plugin_off_probe.py"), target],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("SUMMARY "))


@pytest.fixture(scope="module")
def summaries(tiny_models):
    target, _ = tiny_models
    return {load: _run(target, load) for load in (True, False)}


def test_the_plugin_was_loaded_in_one_process_and_not_the_other(summaries):
    from vllm_nwor.patches import all_patches

    assert summaries[True]["patches_applied"] == len(all_patches())
    assert summaries[False]["patches_applied"] == 0
    assert summaries[True]["interceptor"] == "None"  # bound nothing: not enabled
    assert summaries[False]["interceptor"] == "'absent'"


def test_installed_but_not_enabled_changes_nothing(summaries):
    with_plugin, without = summaries[True], summaries[False]
    assert with_plugin["spec_stats"][0] > 0, "the workload must speculate"
    for key in ("tokens", "logprobs", "spec_stats", "config_hash", "additional_config",
                "output_types", "plugin_metrics"):
        assert with_plugin[key] == without[key], key
    # Telemetry follows the plugin's other keys: off here, so vLLM's own output type and no
    # plugin metrics.
    assert with_plugin["output_types"] == ["CompletionOutput"]
    assert with_plugin["plugin_metrics"] == []
