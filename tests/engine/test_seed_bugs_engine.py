"""Seed 003's six integration bugs, checked on the real engine (the unit tests check the core).

One run with NWOR on, instrumented at the interceptor and its staged layers.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import engine, generate, runner_of, spec_config, target_layers

import vllm_nwor
from vllm_nwor.inspect import interceptor_of, layer_binding


@pytest.fixture(scope="module")
def run(tiny_models):
    target, _ = tiny_models
    with engine(target, spec_config("ngram", nwor=True)) as llm:
        runner = runner_of(llm)
        interceptor = interceptor_of(runner)
        staged = interceptor.staged
        record = {"begun": 0, "resets": 0, "commits": [], "bindings": []}
        record["bindings"] = [
            (layer.layer_name, layer_binding(layer).layer_idx)
            for layer in target_layers(llm)
        ]
        begin, reset, commit = interceptor.begin, staged.reset, interceptor.commit

        def counting_begin(step):
            began = begin(step)
            record["begun"] += began
            return began

        def counting_reset(n):
            record["resets"] += 1
            return reset(n)

        # What each layer's stage kept for the commit: the CPU backend's copy of its rows.
        kept = layer_binding(target_layers(llm)[0]).backend_state.kept

        def inspecting_commit(accepted):
            record["commits"].append({
                "complete": staged.is_complete(),
                "layers_distinct": all(
                    not torch.equal(kept[i][0], kept[i + 1][0]) for i in range(len(kept) - 1)
                ),
            })
            return commit(accepted)

        interceptor.begin, staged.reset, interceptor.commit = (
            counting_begin, counting_reset, inspecting_commit
        )
        record["tokens"] = generate(llm)
        record["counters"] = vllm_nwor.get_counters(llm)
        record["caches"] = [layer.kv_cache for layer in target_layers(llm)]
    return record


def test_bug1_every_layer_stages_every_step(run):
    assert run["commits"] and all(c["complete"] for c in run["commits"])
    assert run["counters"].fallbacks == {}


def test_bug2_layers_are_bound_at_their_own_indices(run):
    names = [name for name, _ in run["bindings"]]
    assert [idx for _, idx in run["bindings"]] == list(range(3))
    assert names == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert all(c["layers_distinct"] for c in run["commits"])


def test_bug3_every_staged_step_is_committed(run):
    assert len(run["commits"]) == run["begun"] == run["counters"].verify_steps_staged > 0
    assert run["counters"].tokens_committed > 0


def test_bug4_steps_without_drafts_and_nwor_off_run(run):
    # Prefill-only steps ran through the same patched code (begin(None)); the plugin-off and
    # NWOR-off runs are covered by test_plugin_off and test_equivalence.
    assert all(len(tokens) == 40 for tokens in run["tokens"])


def test_bug5_each_layer_has_its_own_cache(run):
    caches = run["caches"]
    assert len({c.data_ptr() for c in caches}) == len(caches)
    assert not torch.equal(caches[0], caches[1])


def test_bug6_the_staged_layers_are_reset_once_per_step_only(run):
    assert run["resets"] == run["begun"]


def test_draft_model_layers_are_left_alone(tiny_models):
    target, draft = tiny_models
    with engine(target, spec_config("draft_model", draft, nwor=True)) as llm:
        runner = runner_of(llm)
        drafter_layers = [
            m for m in runner.drafter.model.modules() if hasattr(m, "kv_sharing_target_layer_name")
        ]
        bound_target = [layer for layer in target_layers(llm) if layer_binding(layer) is not None]
        assert drafter_layers and not [m for m in drafter_layers if layer_binding(m) is not None]
        assert len(bound_target) == 3
