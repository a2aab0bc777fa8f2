"""Installed but not enabled, the plugin leaves vLLM exactly as it is without the package.

Two fresh processes run the same speculative (ngram) workload: one loads the plugin (it is
installed, registers and patches, but nothing enables it), one keeps vLLM from loading any
plugin (``VLLM_PLUGINS=""``). Tokens, logprobs (exact floats), vLLM's spec-decode counters and
the engine config hash must be identical.
"""

from __future__ import annotations

import os

import pytest
from engine_utils import run_probe


def _run(target: str, load_plugins: bool) -> dict:
    env = dict(os.environ)
    if load_plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    return run_probe("plugin_off_probe.py", [target], env, timeout=600)


@pytest.fixture(scope="module")
def summaries(tiny_models):
    target, _ = tiny_models
    return {load: _run(target, load) for load in (True, False)}


def test_the_plugin_was_loaded_in_one_process_and_not_the_other(summaries):
    from vllm_nwor.patches import all_patches

    assert summaries[True]["patches_applied"] == len(all_patches())
    assert summaries[False]["patches_applied"] == 0
    assert summaries[False]["plugin_attributes"] == []
    # loaded but not enabled: it bound nothing
    assert summaries[True]["plugin_attributes"] and summaries[True]["interceptor"] == "None"


def test_installed_but_not_enabled_changes_nothing(summaries):
    with_plugin, without = summaries[True], summaries[False]
    assert with_plugin["spec_stats"][0] > 0, "the workload must speculate"
    for key in ("tokens", "logprobs", "spec_stats", "config_hash", "additional_config",
                "output_types", "spec_decode_metrics", "plugin_metrics"):
        assert with_plugin[key] == without[key], key
    # Telemetry follows the plugin's other keys: off here, so vLLM's own output type and no
    # plugin metrics.
    assert with_plugin["output_types"] == ["CompletionOutput"]
    assert with_plugin["spec_decode_metrics"] == ["None"]
    assert with_plugin["plugin_metrics"] == []
