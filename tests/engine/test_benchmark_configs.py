"""The GPU benchmarks' engine settings pass the plugin's config layer, here on the CPU.

The benchmarks run only on the GPU machine, where device time is scarce. Their speculative
configs mix vLLM's keys (``synthetic_acceptance_length``, ``num_speculative_tokens_per_batch_size``)
with the plugin's; this checks the plugin takes exactly its own keys from every one of them and
validates them, before a GPU session finds out.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs

from vllm_nwor.config import PLUGIN_KEYS
from vllm_nwor.patches.engine_args import take_plugin_keys

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
VLLM_KEYS = {f.name for f in dataclasses.fields(SpeculativeConfig)}


def benchmark_kwargs() -> list[tuple[str, dict]]:
    scv = importlib.import_module("scv_bench")
    overhead = importlib.import_module("nwor_overhead")
    window = importlib.import_module("draft_window_bench")
    cases = [(f"scv_bench:{p}", scv.engine_kwargs(p, "t", "d", 256)) for p in scv.POLICIES]
    cases += [(f"nwor_overhead:{m}:{nwor}", overhead.engine_kwargs("t", "d", m, 4, 1.5, nwor, 8))
              for m in ("draft_model", "ngram") for nwor in (False, True)]
    cases += [(f"draft_window_bench:{w}", window.engine_kwargs("t", "d", w, 4, 8))
              for w in (None, 256)]
    return cases


@pytest.mark.parametrize("name, kwargs", benchmark_kwargs(),
                         ids=[name for name, _ in benchmark_kwargs()])
def test_benchmark_config_is_split_between_vllm_and_the_plugin(name, kwargs):
    speculative = kwargs.get("speculative_config")
    args = EngineArgs(**kwargs)
    config = take_plugin_keys(args)
    if speculative is None:
        return
    ours = {k for k in speculative if k in PLUGIN_KEYS}
    left = set(args.speculative_config or {})
    assert left == set(speculative) - ours
    assert left <= VLLM_KEYS, f"{name}: keys neither vLLM's nor the plugin's: {left - VLLM_KEYS}"
    for key in ours:
        assert getattr(config, key) == speculative[key]
