"""The plugin's keys stay out of vLLM's config hash, which keys vLLM's torch.compile cache: an
engine with the plugin on loads the kernels an engine with it off compiled (and the reverse).

On two H200s at tensor parallelism 2, an engine with NWOR on and one with it off, each
compiling on its own, gave different logits from the first step, a prefill NWOR takes no part
in; without compilation (``enforce_eager``) the two were bit for bit equal
(docs/equivalence.md, ``tp2_wide_prompts_8b_ngram``)."""

from __future__ import annotations

import pytest
from engine_utils import spec_config

from vllm_nwor.patches.engine_args import PATCHES


def config_hash(model: str, additional: dict | None = None, **speculative) -> tuple[str, dict]:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, speculative_config=spec_config("ngram", **speculative),
                      skip_tokenizer_init=True, max_model_len=256,
                      additional_config=additional or {})
    config = args.create_engine_config()
    return config.compute_hash(), config.additional_config


@pytest.fixture
def without_the_patch():
    patch = next(p for p in PATCHES if p.name == "compute_hash")
    patch.revert()
    yield
    patch.apply()


def test_plugin_keys_leave_the_config_hash_as_vllm_makes_it(tiny_models):
    target, _ = tiny_models
    off, additional_off = config_hash(target)
    on, additional_on = config_hash(target, nwor=True, scv="adaptive")
    assert additional_off == {} and additional_on["nwor"] is True  # kept for other processes
    assert on == off
    # Other additional_config entries are vLLM's (or another plugin's): still hashed.
    other, _ = config_hash(target, nwor=True, additional={"other_plugin": 1})
    assert other != off


def test_without_the_patch_the_keys_change_the_hash(tiny_models, without_the_patch):
    """The negative control: vLLM hashes every additional_config entry."""
    target, _ = tiny_models
    assert config_hash(target, nwor=True)[0] != config_hash(target)[0]
